"""Verdicts the student's process cannot fake: declared checks, run in the sandbox, judged outside it.

autograde/checks/<assignment>.py declares, per test-cell grade_id, a list of `Check(label, run, compare, hint)`.
`run(ns)` gets the learner's namespace in the sandbox and returns what the learner's functions give on fixed
inputs (course.grade.plain carries it out as plain data); the same `run` on the solution notebook gives the
reference. `compare(got, reference)` runs in the grader's own process on decoded plain data: patched torch,
`__eq__` tricks, printed "passed" or edited test cells change nothing. A test cell earns its points when all its
checks pass; a failure shows the check's `hint` ("hint: ...") and, for a value of the wrong kind, its type.
A checks module may name the course modules the sandbox leaves out (ABSENT: course.grade.sandbox.course_tree).
"""
from __future__ import annotations

import math
import types
from fractions import Fraction
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from course.grade.files import GradingError
from course.grade.plain import Array, Number, Raised, Rejected, WHY, decode, encode
from course.paths import AUTOGRADE


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
# A right answer never loses a mark for the type that carries it: where an integer is asked, any exact integer
# passes (int, numpy integers, an integer 0-d tensor, a Fraction equal to a whole number); where a number is
# asked, any of those or a float, a numpy float, a float 0-d tensor or a Fraction. A float is not an integer
# even when it is whole (the exercises ask for whole bytes and tokens, and a float stops being exact past 2**53),
# and a bool is not a number (True where 1 is asked is almost always a comparison returned by mistake).

def number(x):
    """("int", value) for an exact integer, ("real", value) for any other number, None for anything else."""
    if isinstance(x, Number):
        x = x.value
    elif isinstance(x, Array) and x.data.shape == () and x.data.dtype.kind in "iuf":
        x = x.data.item()
    if type(x) is int or type(x) is Fraction and x.denominator == 1:
        return "int", int(x)
    return ("real", x) if type(x) in (float, Fraction) else None


def exact(got, ref) -> bool:
    """The same value: numbers by value (an integer where the reference gives one), arrays of the same kind,
    dtype, shape and elements, containers of the same type element by element."""
    if isinstance(ref, Array):
        return (isinstance(got, Array) and got.kind == ref.kind and got.data.dtype == ref.data.dtype
                and got.data.shape == ref.data.shape and bool((got.data == ref.data).all()))
    if isinstance(ref, Raised):
        return raises(got, ref)
    if number(ref) is not None:
        g, r = number(got), number(ref)
        if g is None or r[0] == "int" and g[0] != "int":
            return False
        return g[1] == r[1] or isinstance(g[1], float) and isinstance(r[1], float) and math.isnan(g[1]) and \
            math.isnan(r[1])
    if type(ref) is bool:
        return (got.value if isinstance(got, Number) else got) is ref
    if type(got) is not type(ref):
        return False
    if isinstance(ref, (list, tuple)):
        return len(got) == len(ref) and all(exact(g, r) for g, r in zip(got, ref))
    if isinstance(ref, dict):
        return set(got) == set(ref) and all(exact(got[k], ref[k]) for k in ref)
    return got == ref


def close(atol: float = 1e-5, rtol: float = 0.0, same_dtype: bool = True) -> Callable:
    """Numbers or arrays within atol + rtol*|ref|; arrays: same shape (and dtype), -inf/inf where ref has them."""
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
        if number(ref) is not None:
            g, r = number(got), number(ref)
            return g is not None and abs(g[1] - r[1]) <= atol + rtol * abs(r[1])
        return exact(got, ref)

    return compare


def raises(got, ref) -> bool:
    """The learner's code raised the reference's built-in exception class (or a subclass of it)."""
    return isinstance(got, Raised) and isinstance(ref, Raised) and bool(ref.bases) and ref.bases[0] in got.bases


def whole(x) -> int | None:
    """x as an int when it is an exact integer however carried (for a check's own compare), else None."""
    n = number(x)
    return n[1] if n and n[0] == "int" else None


def describe(x) -> str:
    """What a value is, in words a hint can show: its type, never its contents (no value, no shape)."""
    if isinstance(x, Rejected):
        return WHY[x.why]
    if isinstance(x, Raised):
        return f"an exception ({x.bases[0] if x.bases else 'of its own class'})"
    if isinstance(x, Array):
        return f"a {x.data.dtype} {'tensor' if x.kind == 'tensor' else 'numpy array'}"
    if isinstance(x, Number):
        return WHY["object"] if x.carrier == "object" else f"a {x.carrier}"
    return {int: "an int", float: "a float", bool: "a bool", str: "a str", list: "a list", tuple: "a tuple",
            dict: "a dict", Fraction: "a Fraction"}.get(type(x), "None" if x is None else "another value")


def mismatch(got, ref) -> str:
    """"" when got is the kind of value ref is; else a phrase naming what got is (the hint's type note)."""
    if isinstance(got, Rejected) and got.why == "not run":
        return "this check did not run: the code before it stopped the kernel or ran too long"
    if isinstance(got, (Rejected, Raised)) and not isinstance(ref, Raised):
        return f"your code gave {describe(got)}" if isinstance(got, Raised) else f"the value was refused: {describe(got)}"
    if isinstance(ref, (Raised, Rejected)):
        return ""
    n, r = number(got), number(ref)
    if r is not None:
        ok = n is not None and (r[0] == "real" or n[0] == "int")
        asked = "an integer" if r[0] == "int" else "a number"
    elif isinstance(ref, Array):
        ok = isinstance(got, Array) and got.kind == ref.kind and got.data.dtype == ref.data.dtype
        asked = describe(ref)
    else:
        ok, asked = type(got) is type(ref), describe(ref)
        if ok and isinstance(ref, (list, tuple)) and len(got) == len(ref):
            return next((m for m in map(mismatch, got, ref) if m), "")
    return "" if ok else f"your code returned {describe(got)} where {asked} is asked"


def expect(got, want, message: str = "", tol: float | None = None) -> None:
    """A visible test's assert, judged as the grader judges a check: both values go through the same plain data
    and the same comparison (exact, or close(tol)), and a failure names what the code returned."""
    g, w = decode(encode(got)), decode(encode(want))
    if not (exact if tol is None else close(tol, same_dtype=False))(g, w):
        why = mismatch(g, w) or f"your code returned {got!r}"
        raise AssertionError(f"{message} ({why})" if message else why)


# ----------------------------------------------------------------------------- loading and judging

def checks_path(assignment: str) -> Path:
    return AUTOGRADE / "checks" / f"{assignment}.py"


def load_module(path: Path, source: str | None = None):
    """The checks module at `path`, run from its file (in the grader) or from `source`, its text (the sandbox gets
    the text on a pipe, after the cells ran)."""
    path = Path(path)
    module = types.ModuleType(f"kvcourse_checks_{path.stem.replace('-', '_')}")
    exec(compile(path.read_text() if source is None else source, str(path), "exec"), module.__dict__)
    checks = module.__dict__.get("CHECKS")
    if not isinstance(checks, dict):
        raise TypeError(f"{path}: CHECKS must be a dict from test-cell grade_id to a list of Check")
    for gid, items in checks.items():
        if not isinstance(gid, str) or not items or not all(isinstance(c, Check) for c in items):
            raise TypeError(f"{path}: CHECKS[{gid!r}] must be a non-empty list of Check")
    return module


def load_checks(path: Path, source: str | None = None) -> dict[str, list[Check]]:
    return load_module(path, source).CHECKS


def judge(checks: dict[str, list[Check]], got: dict[str, list], ref: dict[str, list]) -> dict[str, CellVerdict]:
    """One verdict per test cell: passed when every check's decoded value matches the reference's."""
    verdicts = {}
    for gid, items in checks.items():
        failures = []
        for i, check in enumerate(items):
            r = ref.get(gid, [])[i] if i < len(ref.get(gid, [])) else Rejected("not run")
            if isinstance(r, Rejected):
                raise GradingError(f"the reference solution gives no value for check {gid}[{i}] "
                                   f"({check.label}): {describe(r)}; fix autograde/checks or solutions/")
            g = got.get(gid, [])[i] if i < len(got.get(gid, [])) else Rejected("not run")
            try:
                ok = bool(check.compare(g, r))
            except Exception:  # a malformed value is a failed check, never a crash of the grader
                ok = False
            if not ok:
                hint = check.hint if check.hint.startswith("hint:") else f"hint: {check.hint}"
                note = mismatch(g, r)
                hint += f" ({note})" if note else ""
                if hint not in failures:
                    failures.append(hint)
        verdicts[gid] = CellVerdict(gid, not failures, failures)
    return verdicts
