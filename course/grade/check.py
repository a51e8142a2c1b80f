"""`kvcourse check NOTEBOOK`: the learner's own check, with hints; `--full` adds the grader's hidden checks.

Plain `check` runs the notebook (released test cells put back, and said so) in a fresh kernel, prints every
visible test with its result and hint, and ends with `summary`'s one line ("k of n visible tests pass; first
failing: <test> — <hint>"), which JupyterLab's Validate shows too (`validate`); it exits 1 when a test fails. The
visible tests compare with course.grade.verdicts.expect, the grader's own comparison. `--full` grades the
notebook as `kvcourse grade` does and prints each test cell's verdict and the score, never a hidden input.
"""
from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import nbformat
from traitlets.config import Config

from course.grade import grader, sandbox
from course.grade.files import GradingError
from course.grade.nbgrader_api import assignments
from course.grade.submissions import grade_id, invalid_reason, nbgrader_meta, read_notebook, repair
from course.paths import EXERCISES, SOLUTIONS, jupyter_env

HIDDEN_BEGIN = "BEGIN HIDDEN TESTS"
LEARNER_WORDS = {"deleted answer cell(s) replaced by empty ones": "you deleted answer cell(s)",
                 "deleted test cell(s) put back": "you deleted test cell(s)",
                 "edited test cell(s) restored": "you edited test cell(s)",
                 "test cell metadata restored": "you changed the metadata of test cell(s)",
                 "cell metadata restored as released": "you changed the metadata of answer or other cell(s)",
                 "renamed answer cell id(s) put back": "you renamed answer cell id(s)",
                 "duplicate grade id(s), the later cells graded as ordinary code":
                     "you copied locked cells (the copies are checked as ordinary code)",
                 "cell(s) with a grade id the release does not have, graded as ordinary code":
                     "you added cells with grade ids the exercise does not have (checked as ordinary code)"}


@dataclass
class TestResult:
    grade_id: str
    points: float
    status: str  # pass | fail | hidden
    message: str = ""
    hint: str = ""
    source: str = ""


def exercise_of(path: Path) -> str | None:
    """Which exercise notebook `path` is (its stem, e.g. 'memory_formula'), or None.

    Jupyter's "Duplicate" and "Save As" give a copy another name (memory_formula-Copy1.ipynb, Untitled.ipynb),
    and it is still that exercise: the name decides first, then the copy's own content (the nbgrader grade ids
    of its cells, which the released notebook names and a learner cannot usefully change: the grader
    restores them), then the exercise folder it sits in when that folder holds one exercise. A notebook none of
    these tie to an exercise is None, and its checks are not recorded as a new exercise."""
    by_stem = {nb: a for a, nbs in assignments().items() for nb in nbs}
    path = Path(path)
    try:
        mine = {grade_id(c) for c in read_notebook(path).cells} - {None}
    except Exception:  # not a notebook nbformat can read: nothing in it to go by
        mine = set()
    if mine:
        overlap = {}
        for stem, assignment in by_stem.items():
            release = EXERCISES / assignment / f"{stem}.ipynb"
            if release.exists():
                overlap[stem] = len(mine & {grade_id(c) for c in nbformat.read(str(release), as_version=4).cells})
        best = sorted((n, stem) for stem, n in overlap.items() if n)
        if path.stem in by_stem and (overlap.get(path.stem) or not best):
            return path.stem
        if best and (len(best) == 1 or best[-1][0] > best[-2][0]):
            return best[-1][1]  # also under another exercise's name, when it holds none of that one's cells
    if path.stem in by_stem:
        return path.stem
    in_folder = [stem for stem, assignment in by_stem.items() if assignment == path.resolve().parent.name]
    return in_folder[0] if len(in_folder) == 1 else None


def restored(path: Path):
    """(the notebook with its released test cells back, what the learner had changed)."""
    path = Path(path)
    nb = read_notebook(path)  # its stored outputs dropped: they may be megabytes, and the run replaces them
    stem = exercise_of(path)
    by_stem = {name: a for a, names in assignments().items() for name in names}
    release = EXERCISES / by_stem[stem] / f"{stem}.ipynb" if stem is not None else None
    if release is None or not release.exists():
        return nb, []
    problems = repair(nb, nbformat.read(str(release), as_version=4))
    words = [LEARNER_WORDS[p.split(":")[0]] + p[p.index(":"):] for p in problems]
    if stem != path.stem and path.stem in by_stem:
        words.insert(0, f"this file is named {path.name} but holds the cells of {stem}.ipynb: it was checked "
                        f"as {stem} (save it as {stem}.ipynb)")
    return nb, words


def summary(results: list[TestResult]) -> str:
    """One line: how many visible tests pass, and the first failing one with its hint."""
    visible = [t for t in results if t.status != "hidden"]
    first = next((t for t in visible if t.status == "fail"), None)
    line = f"{sum(t.status == 'pass' for t in visible)} of {len(visible)} visible tests pass"
    if first is None:
        return line
    kind = re.search(r"\((your code (?:returned|gave) [^()]*)\)$", first.message)  # verdicts.mismatch's note
    note = "not written yet" if first.message.startswith("NotImplementedError") else kind and kind.group(1)
    return line + f"; first failing: {first.grade_id} — {first.hint or first.message}" + (
        f" ({note})" if note and first.hint else "")


def check(notebook: Path, timeout: int = 60, memory_mb: int = 4096) -> tuple[list[TestResult], list[str]]:
    """Run a notebook (original tests restored) top to bottom in a fresh kernel.

    Returns (visible test results, answer-cell errors)."""
    from course.grade.nbgrader_ext import SafeExecute

    nb, _ = restored(Path(notebook))
    cfg = Config()
    cfg.GraderKernelManager.memory_limit_mb = memory_mb
    executor = SafeExecute(timeout=timeout, interrupt_on_timeout=True, config=cfg, kernel_name="python3",
                           extra_arguments=["--IPKernelApp.log_level=ERROR"])  # the course's kernel, whatever
    # kernel the notebook was last saved with (VS Code's or a conda env's name raised NoSuchKernel)
    env = dict(jupyter_env(), NBGRADER_EXECUTION="validate", MPLBACKEND="Agg")
    with mock.patch.dict(os.environ, env):  # the kernel inherits this process's environment, put back after
        executor.preprocess(nb, {"metadata": {"path": str(Path(notebook).resolve().parent)}})

    results, answer_errors = [], []
    for cell in nb.cells:
        meta = nbgrader_meta(cell) or {}
        if cell.cell_type != "code":
            continue
        error = next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)
        if meta.get("solution") and error is not None:
            answer_errors.append(f"answer cell '{meta.get('grade_id')}' raised {error.ename}: {error.evalue}".strip())
        if not meta.get("grade") or meta.get("solution"):
            continue
        hint = " ".join(ln.strip()[len("# Hint:"):].strip() for ln in cell.source.splitlines()
                        if ln.strip().startswith("# Hint:"))
        test = TestResult(meta.get("grade_id", "?"), float(meta.get("points", 0)), "pass", hint=hint,
                          source=cell.source)
        if not _visible(cell):
            test.status = "hidden"
        elif error is not None:  # not a warning on stderr: the grader judges values, and so does this
            test.status = "fail"
            test.message = f"{error.ename}: {error.evalue}".strip().rstrip(":")
        results.append(test)
    return results, answer_errors


def full_check(notebook: Path, timeout: int | None = None):
    """Grade one notebook as the instructor's grader would, into a throw-away course folder.

    Returns (row, {grade_id: (points, passed, hints, visible)}) -- verdicts only, no hidden code or inputs."""
    if not SOLUTIONS.is_dir():
        raise GradingError("a full check needs the course folder with solutions/ (a clone of the course); "
                           "in a class, submit the notebook and read the feedback instead")
    by_stem = {nb: a for a, nbs in assignments().items() for nb in nbs}
    stem = exercise_of(Path(notebook))  # a renamed copy is graded as the exercise it is a copy of
    assignment = by_stem.get(stem)
    if assignment is None:
        raise GradingError(f"{notebook} is not one of the exercise notebooks {sorted(by_stem)}")
    unsandboxed = bool(sandbox.sandbox_problem())  # your own notebook on your own machine: fine either way
    with tempfile.TemporaryDirectory(prefix="kvcourse-full-check-") as tmp:
        folder = Path(tmp) / "submissions" / "me" / assignment
        folder.mkdir(parents=True)
        shutil.copyfile(notebook, folder / f"{stem}.ipynb")
        (row,) = grader.grade(folder.parent.parent, Path(tmp) / "course", timeout=timeout, progress=False,
                              log=lambda *_: None, unsandboxed=unsandboxed)
        cells = {}
        graded = Path(tmp) / "course" / "autograded" / "me" / assignment / f"{stem}.ipynb"
        if graded.exists():
            for cell in nbformat.read(str(graded), as_version=4).cells:
                meta = cell.get("metadata", {}).get("nbgrader", {})
                if meta.get("grade") and not meta.get("solution"):
                    error = next((o for o in cell.outputs if o.output_type == "error"), None)
                    cells[meta["grade_id"]] = (float(meta.get("points", 0)), error is None,
                                               error.evalue if error is not None else "", _visible(cell))
        return row, cells


def add_arguments_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("notebook", type=Path, help="your exercise notebook, e.g. exercises/01_memory_formula/memory_formula.ipynb")
    p.add_argument("--timeout", type=int, default=60, help="seconds per cell before it is interrupted (default 60)")
    p.add_argument("--full", action="store_true",
                   help="also run the grader's hidden checks (sealed off, as when grading) and show the score")


def run_check(args) -> int:
    path = Path(args.notebook)
    if not path.is_file():  # a named pipe or a device: reading it would wait for a writer, forever
        what = ("does not exist" if not path.exists() else "is a folder" if path.is_dir()
                else "is not a regular file (a named pipe or a device?)")
        print(f"error: {path} {what}; give the path of your exercise notebook (.ipynb)", file=sys.stderr)
        return 2
    reason = invalid_reason(path)
    if reason:
        print(f"error: {path}: {reason}. Restore it from exercises/ or your last checkpoint.", file=sys.stderr)
        return 2
    changed = restored(path)[1]
    for problem in changed:
        print(f"  note: {problem}; the ORIGINAL tests were run instead (results below), as the grader does")
    if args.full:
        return _run_full(path, args.timeout)
    print(f"Running {path} in a fresh kernel ...", flush=True)
    results, answer_errors = check(path, timeout=args.timeout)
    visible = [t for t in results if t.status != "hidden"]
    if not visible:
        print("error: no visible tests found: is this an exercise notebook from exercises/?", file=sys.stderr)
        return 2
    for err in answer_errors:
        print(f"  note: {err}")
    for t in results:
        if t.status == "hidden":
            print(f"  [hidden] {t.grade_id} ({t.points:g} pt): run by the grader only (`kvcourse check --full`)")
            continue
        mark = "[pass]" if t.status == "pass" else "[FAIL]"
        print(f"  {mark} {t.grade_id} ({t.points:g} pt){' (original test)' if changed else ''}")
        if t.status == "fail":
            print(f"         {t.message}")
            if t.hint:
                print(f"         hint: {t.hint}")
    exercise = exercise_of(path)
    if exercise is None:  # recorded under its own name, it would show as an exercise the course does not have
        print(f"  note: {path.name} is not one of the exercise notebooks (nor a copy of one), so this check is "
              "not saved to your progress")
    elif exercise != path.stem:
        print(f"  note: {path.name} is a copy of the exercise {exercise}: saved to your progress as {exercise}")
    _save_progress(exercise, {t.grade_id: t.status for t in visible})
    print(summary(results))
    return 0 if all(t.status == "pass" for t in visible) else 1


def _visible(cell) -> bool:
    """A test cell the learner can run: some code that is not only comments, and no hidden tests."""
    return HIDDEN_BEGIN not in cell.source and any(ln.strip() and not ln.strip().startswith("#")
                                                   for ln in cell.source.splitlines())


def _save_progress(exercise: str | None, statuses: dict[str, str]) -> None:
    """Remember the visible tests' results ({grade_id: pass | fail}) in the learner's progress file, which
    `kvcourse progress` shows; a full check saves them too (it used to leave "tests 0/5" after they passed)."""
    try:
        from course.teach.progress import ProgressFileWarning, default_store

        if exercise is not None and statuses:
            with warnings.catch_warnings(record=True) as caught:  # what is said of the file: "Note: ..." lines
                warnings.simplefilter("always", ProgressFileWarning)
                passed = sum(v == "pass" for v in statuses.values())
                default_store().record_exercise_check(exercise, passed, len(statuses), statuses)
            for w in caught:
                print(f"Note: {w.message}", file=sys.stderr)
    except Exception as exc:  # progress is a convenience: never let it break the check itself
        print(f"  note: could not save this check to your progress file ({exc})")


def _run_full(path: Path, timeout: int) -> int:
    print(f"Grading {path} as the grader does (hidden checks included) ...", flush=True)
    try:
        row, cells = full_check(path, timeout=timeout)
    except GradingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for gid, (points, passed, hint, _) in cells.items():
        print(f"  {'[pass]' if passed else '[FAIL]'} {gid} ({points:g} pt)" + ("" if passed else f"\n         {hint}"))
    _save_progress(exercise_of(path), {gid: "pass" if c[1] else "fail" for gid, c in cells.items() if c[3]})
    # the grader's notes as a learner reads them: the instructor's UNSANDBOXED warning (one note, though it holds
    # a "; " itself) becomes the reason the sandbox could not start (a learner never passed --unsandboxed)
    marker = "\0unsandboxed\0"
    notes = [("your notebook ran without the grading sandbox, which cannot start here ("
              f"{sandbox.sandbox_problem() or 'unknown reason'}); the checks and the score are the same")
             if note == marker else note
             for note in (p.strip() for p in row.problems.replace(grader.UNSANDBOXED, marker).split("; ")) if note]
    if row.status != "graded":
        print(f"not graded: {'; '.join(notes) or row.problems}")
        return 1
    for note in notes:
        print(f"  note: {note}")
    print(f"score: {row.score:g}/{row.max_score:g}")
    return 0 if row.score == row.max_score else 1


def validate(self, filename: str) -> dict:
    """Validator.validate as `kvcourse check` runs the notebook (its released tests put back, its own kernel): {}
    when every visible test passes, else one "failed" entry, the first failing test's cell, whose error is the
    summary line `kvcourse check` ends with (nbgrader's dialog shows an entry as the cell, then its error)."""
    results, _ = check(Path(filename))
    failing = [t for t in results if t.status == "fail"]
    if not failing:
        return {}
    line = summary(results)
    return {"failed": [{"source": failing[0].source.strip(), "error": html.escape(line), "raw_error": line}]}


def use_check_for_validate() -> None:
    """Make nbgrader's Validator use `validate` (called by autograde/nbgrader_config.py, which the Validate
    button's handler loads at every press)."""
    from nbgrader.validator import Validator

    Validator.validate = validate
