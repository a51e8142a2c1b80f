"""Verdicts the student's process cannot fake: declared checks, run in the sandbox, judged outside it.

Each exercise declares its checks in autograde/checks/<assignment>.py (outside the installed package, so a
learner's kernel never sees the hidden inputs), as a dict from test-cell grade_id to a list of `Check`s:

    from course.grade.verdicts import Check, exact, close, raises

    CHECKS = {
        "test_kv_cache_bytes": [
            Check("Llama-2-7B, one token", lambda ns: ns["kv_cache_bytes"](32, 1, 1, 32, 128, 2), exact,
                  "hint: one K and one V per layer ..."),
        ],
    }

`run(ns)` receives the learner's namespace (every cell but the test cells has run) and returns what the
learner's code gives on fixed inputs; it should only call the learner's functions and return their results
(tensors included): the sandbox converts them to plain data (course.grade.plain) and hands back a file.
The same `run` is applied to the solution notebook outside the sandbox for the reference value. `compare(got,
reference)` then runs in the clean grader process, on decoded plain data only: patched torch functions,
`__eq__` tricks, printed "passed" lines or edited test cells change nothing there. A test cell earns its
points when every one of its checks passes; `hint` (start it with "hint:") is what feedback shows.

To add an exercise (say 05_paged_kv): write solutions/05_paged_kv/<nb>.ipynb with its test cells as usual,
then autograde/checks/05_paged_kv.py with one CHECKS entry per test cell (tests/test_exercises.py checks that
the grade ids and the points agree, and tests/test_grading.py that the reference scores full marks).
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from course.grade.plain import Array, Raised, Rejected


@dataclass
class Check:
    label: str
    run: Callable
    compare: Callable
    hint: str = "hint: check this part against the instructions"
    timeout: float | None = None  # seconds; default: the cell timeout


@dataclass
class CellVerdict:
    grade_id: str
    passed: bool
    failures: list[str] = field(default_factory=list)  # hints of the checks that failed (no inputs, no values)


# ----------------------------------------------------------------------------- comparisons (clean process)

def _is_number(x) -> bool:
    return type(x) in (int, float)


def exact(got, ref) -> bool:
    """Same value and the same exact types all the way down (an int must be an int, not a float)."""
    if isinstance(ref, Array):
        return (isinstance(got, Array) and got.kind == ref.kind and got.data.dtype == ref.data.dtype
                and got.data.shape == ref.data.shape and bool((got.data == ref.data).all()))
    if isinstance(ref, Raised):
        return raises(got, ref)
    if type(got) is not type(ref):
        return False
    if isinstance(ref, (list, tuple)):
        return len(got) == len(ref) and all(exact(g, r) for g, r in zip(got, ref))
    if isinstance(ref, dict):
        return set(got) == set(ref) and all(exact(got[k], ref[k]) for k in ref)
    if type(ref) is float and math.isnan(ref):
        return math.isnan(got)
    return got == ref


def close(atol: float = 1e-5, rtol: float = 0.0, same_dtype: bool = True) -> Callable:
    """Numbers or arrays within atol + rtol*|ref|; arrays: same shape (and dtype), -inf/inf where ref has them."""
    import numpy as np

    def compare(got, ref) -> bool:
        if isinstance(ref, Array):
            if not (isinstance(got, Array) and got.data.shape == ref.data.shape):
                return False
            if same_dtype and got.data.dtype != ref.data.dtype:
                return False
            if got.data.dtype.kind not in "fiub" or ref.data.dtype.kind not in "fiub":
                return False
            g, r = got.data.astype(np.float64), ref.data.astype(np.float64)
            finite = np.isfinite(r)
            if not np.array_equal(np.isfinite(g), finite) or not np.array_equal(g[~finite], r[~finite]):
                return False
            return bool(np.all(np.abs(g[finite] - r[finite]) <= atol + rtol * np.abs(r[finite])))
        if isinstance(ref, (list, tuple)):
            return (type(got) is type(ref) and len(got) == len(ref)
                    and all(compare(g, r) for g, r in zip(got, ref)))
        if isinstance(ref, Raised):
            return raises(got, ref)
        if _is_number(ref):
            return _is_number(got) and abs(got - ref) <= atol + rtol * abs(ref)
        return exact(got, ref)

    return compare


def raises(got, ref) -> bool:
    """The learner's code raised the same builtin exception class as the reference (a subclass counts)."""
    return isinstance(got, Raised) and isinstance(ref, Raised) and ref.name in got.bases


def frequencies(n: int, sigmas: float = 6.0) -> Callable:
    """Sampled frequencies (arrays) vs the reference's: zero where the reference is zero, else within
    `sigmas` standard deviations of the difference of two independent n-sample estimates."""
    import numpy as np

    def compare(got, ref) -> bool:
        if not (isinstance(got, Array) and isinstance(ref, Array) and got.data.shape == ref.data.shape):
            return False
        g, r = got.data.astype(np.float64), ref.data.astype(np.float64)
        if not np.all(np.isfinite(g)) or np.any(g[r == 0] != 0):
            return False
        tol = sigmas * np.sqrt(2 * np.clip(r, 1e-12, 1) * (1 - np.clip(r, 0, 1)) / n) + 1e-9
        return bool(np.all(np.abs(g - r) <= tol))

    return compare


def pair_equal(got, ref) -> bool:
    """The learner's value is a pair of equal arrays (a repeatable draw); the reference's pair is too."""
    return (isinstance(got, tuple) and len(got) == 2 and all(isinstance(x, Array) for x in got)
            and got[0].data.shape == got[1].data.shape and bool((got[0].data == got[1].data).all())
            and exact(got[0], got[1]) and got[0].data.shape == ref[0].data.shape)


# ----------------------------------------------------------------------------- loading and judging

def checks_path(assignment: str, folder: Path | None = None) -> Path:
    from course.paths import AUTOGRADE

    return Path(folder or AUTOGRADE / "checks") / f"{assignment}.py"


def load_checks(path: Path) -> dict[str, list[Check]]:
    """Import a checks module from its file (in the grader) and return CHECKS."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"kvcourse_checks_{path.stem.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _valid(module.CHECKS, str(path))


def load_checks_source(source: str, name: str, module_out: dict | None = None) -> dict[str, list[Check]]:
    """CHECKS from a checks module's source text (the sandbox gets the text, never a file it could reread);
    `module_out`, when given, receives the module's other names (its REFERENCE: see harness.guard_reference).

    The module is not put in sys.modules; the learner's code can still find it in memory (see harness.py)."""
    import types

    module = types.ModuleType(f"kvcourse_checks_{name.replace('-', '_')}")
    exec(compile(source, f"<checks {name}>", "exec"), module.__dict__)
    if module_out is not None:
        module_out.update(module.__dict__)
    return _valid(module.__dict__.get("CHECKS"), name)


def _valid(checks, where: str) -> dict[str, list[Check]]:
    if not isinstance(checks, dict):
        raise TypeError(f"{where}: CHECKS must be a dict from test-cell grade_id to a list of Check")
    for gid, items in checks.items():
        if not isinstance(gid, str) or not items or not all(isinstance(c, Check) for c in items):
            raise TypeError(f"{where}: CHECKS[{gid!r}] must be a non-empty list of Check")
    return checks


def judge(checks: dict[str, list[Check]], got: dict[str, list], ref: dict[str, list]) -> dict[str, CellVerdict]:
    """One verdict per test cell: passed when every check's decoded value matches the reference's."""
    verdicts = {}
    for gid, items in checks.items():
        failures = []
        for i, check in enumerate(items):
            r = ref.get(gid, [])[i] if i < len(ref.get(gid, [])) else Rejected("no reference value")
            if isinstance(r, Rejected):
                from course.grade.files import GradingError

                raise GradingError(f"the reference solution gives no value for check {gid}[{i}] "
                                   f"({check.label}): {r.why}; fix autograde/checks or solutions/")
            g = got.get(gid, [])[i] if i < len(got.get(gid, [])) else Rejected("not run")
            try:
                ok = bool(check.compare(g, r))
            except Exception:  # a malformed value is a failed check, never a crash of the grader
                ok = False
            if not ok:
                hint = check.hint if check.hint.startswith("hint:") else f"hint: {check.hint}"
                if isinstance(g, Raised) and not isinstance(r, Raised):
                    hint += f" (your code raised {g.name})"
                elif isinstance(g, Rejected) and g.why not in ("not run", "malformed"):
                    hint += f" (the value was refused: {g.why})"
                elif isinstance(g, Rejected) and g.why == "not run":
                    hint += " (this check did not run: the code before it stopped the kernel or ran too long)"
                if hint not in failures:
                    failures.append(hint)
        verdicts[gid] = CellVerdict(gid, not failures, failures)
    return verdicts
