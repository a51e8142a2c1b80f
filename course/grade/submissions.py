"""Finding submissions in a folder and repairing what a student changed in the locked cells.

Layouts: DIR/<student>/<assignment>/<notebook>.ipynb (nbgrader's) or DIR/<student>/<notebook>.ipynb; a browser's
re-download name (`name (1).ipynb`) is accepted with a note. A student without a notebook gets a "missing" row.
Refused with a reason on their row: a file over NOTEBOOK_FILE_LIMIT, a notebook over NOTEBOOK_SIZE_LIMIT once its
stored outputs are dropped, and a folder name holding * ? [ ], which nbgrader would read as a pattern.
"""
from __future__ import annotations

import copy
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell

from course.grade.files import GradingError, read_small

RENAMED = re.compile(r"^(?P<stem>.+?)(?: ?\(\d+\)| - Copy| copy)$")
# The largest notebook graded (bytes, without its stored outputs, which are dropped as it is read: the grader
# runs the code afresh). The released exercises are under 40 KB; reading, repairing and sanitising the feedback of
# a 120 MB one took the grader's own process (no sandbox limits there) 4.5 minutes and 3 GB of memory.
NOTEBOOK_SIZE_LIMIT = 20 * 2**20
NOTEBOOK_FILE_LIMIT = 256 * 2**20  # the file with its outputs (plots, long prints): checked before it is read
GLOB_CHARS = "*?[]"  # nbgrader globs student and assignment ids: `[A-Z]*` would match other students' folders


class TooLarge(GradingError):
    """A notebook over NOTEBOOK_SIZE_LIMIT once its outputs are dropped."""


@dataclass
class Submission:
    student: str
    assignment: str
    notebook: str
    path: Path | None
    problem: str = ""  # why it cannot be graded ("" = it can)
    problems: list[str] = field(default_factory=list)  # notes for the report (repairs, renames)
    digest: str = ""  # hash of the file and of its assignment's source: what the ledger remembers
    missing: bool = False

    @property
    def key(self) -> str:
        return f"{self.student}/{self.assignment}"


def nbgrader_meta(cell) -> dict | None:
    """The cell's nbgrader metadata when it is a dict; None otherwise (a submission's metadata is the student's
    to write: `"nbgrader": []` passes nbformat's schema)."""
    meta = cell.get("metadata")
    meta = meta.get("nbgrader") if isinstance(meta, dict) else None
    return meta if isinstance(meta, dict) else None


def grade_id(cell) -> str | None:
    """The cell's grade id, or None where there is none or it is not a string."""
    gid = (nbgrader_meta(cell) or {}).get("grade_id")
    return gid if isinstance(gid, str) else None


def _ignored(name: str) -> bool:
    """Not a student's: .ipynb_checkpoints and other hidden folders, and the AppleDouble copies of a macOS zip."""
    return name.startswith(".") or name == "__MACOSX"


def _readable(name: str) -> str:
    """A file name as text: names that are not UTF-8 (a zip made on Windows: b'Ren\\xe9') keep their bytes as
    surrogates, which no CSV, JSON or gradebook can store; they are shown with U+FFFD instead."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _not_utf8(parts) -> str:
    bad = [p for p in parts if _readable(p) != p]
    return (f"the name {_readable(bad[0])!r} is not UTF-8 text (a zip made on another system?): rename it and "
            "grade again") if bad else ""


def _glob_name(parts) -> str:
    bad = [p for p in parts if any(c in p for c in GLOB_CHARS)]
    return (f"the folder name {_readable(bad[0])!r} holds * ? [ or ], which nbgrader reads as a file pattern (it "
            "can match other students' notebooks): not graded; rename the folder without them and grade again"
            ) if bad else ""


def discover(folder: Path, known: dict[str, list[str]]) -> list[Submission]:
    """Every notebook under folder, with its student and assignment (problems noted, not raised).

    One submission is graded per student, assignment and notebook. Where a student has several candidates for it,
    the exact name in the assignment's own folder wins over a renamed copy ("name (1).ipynb"), and a copy in the
    assignment's folder over one elsewhere; a file that is not a readable notebook loses to one that is. The others
    are named on the graded row ("also found … : not graded"), never dropped in silence and never graded instead.
    A notebook of one assignment inside another assignment's folder (nbgrader collects every file of a
    submission folder) is reported on its own row and not graded as the other assignment's.
    """
    by_stem = {nb: a for a, nbs in known.items() for nb in nbs}
    folder = Path(folder)
    if not folder.is_dir():
        raise GradingError(f"{folder} is not a folder; give the folder that holds one sub-folder per student")
    if folder.name in known:
        raise GradingError(f"{folder} is one assignment's folder: give the folder that holds one folder per student "
                           f"(DIR/<student>/{folder.name}/)")
    inside = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name in known)
    if inside:
        raise GradingError(f"{folder} holds assignment folders ({', '.join(inside)}): it looks like one student's "
                           "folder. Give the folder that holds one folder per student (DIR/<student>/<assignment>/)")
    found: list[Submission] = []
    candidates: dict[tuple[str, str, str], list[tuple[tuple, Submission]]] = {}
    for path in sorted(folder.rglob("*.ipynb")):
        parts = path.relative_to(folder).parts
        if any(_ignored(p) for p in parts):
            continue
        stem, note, renamed = path.stem, "", RENAMED.match(path.stem)  # a browser's or a copy's new name
        if stem not in by_stem and renamed and renamed.group("stem") in by_stem:
            stem, note = renamed.group("stem"), f"file named {path.name!r}: graded as {renamed.group('stem')}.ipynb"
        student = _readable(parts[0]) if len(parts) > 1 else ""
        folder_assignment = parts[1] if len(parts) == 3 else ""
        assignment = by_stem.get(stem, folder_assignment)
        sub = Submission(student, _readable(assignment), _readable(stem), path, problems=[note] if note else [])
        links = [p for p in [path, *path.parents] if p != folder and folder in p.parents and p.is_symlink()]
        if _not_utf8(parts):
            sub.problem = _not_utf8(parts)
        elif _glob_name(parts[:-1]):
            sub.problem = _glob_name(parts[:-1])
        elif links:
            sub.problem = (f"{_readable(str(links[-1].relative_to(folder)))} is a symbolic link, not a file the "
                           "student handed in: not graded (ask for the notebook itself)")
        elif len(parts) == 1 or len(parts) > 3:
            sub.problem = "misplaced: put it at DIR/<student>/<assignment>/<notebook>.ipynb"
        elif stem not in by_stem:
            sub.problem = f"unknown notebook: expected one of {sorted(by_stem)}"
        elif folder_assignment in known and folder_assignment != assignment:
            sub.assignment = folder_assignment  # its own row, under the folder it was found in
            sub.problem = (f"misplaced: {path.name} belongs to {assignment}, but it is in {folder_assignment}/; "
                           f"not graded (hand it in as {assignment}/{stem}.ipynb)")
        else:
            sub.problem = too_large(path) or invalid_reason(path)
            rank = (bool(sub.problem), folder_assignment != assignment, bool(note), path.name)
            candidates.setdefault((student, assignment, stem), []).append((rank, sub))
            continue
        found.append(sub)
    for group in candidates.values():
        group.sort(key=lambda item: item[0])
        chosen = group[0][1]
        for _, other in group[1:]:
            why = f" ({other.problem})" if other.problem else ""
            chosen.problems.append(f"also found {other.path.relative_to(folder)}{why}: not graded, "
                                   f"{chosen.path.name} was")
        found.append(chosen)
    # students (or assignment folders) with no notebook at all: a "missing" row each, never silence
    graded = {s.assignment for s in found if s.assignment and not s.problem.startswith("misplaced")}
    have = {(s.student, s.assignment) for s in found if not s.problem.startswith("misplaced")}
    for student_dir in sorted(p for p in folder.iterdir() if p.is_dir() and not _ignored(p.name)):
        student = student_dir.name
        bad_name = _not_utf8([student]) or _glob_name([student])
        if bad_name:
            if not any(s.path and folder / student in s.path.parents for s in found):
                found.append(Submission(_readable(student), "", "", None, problem=bad_name))
            continue
        if student_dir.is_symlink():
            found.append(Submission(_readable(student), "", "", None, problem=f"{_readable(student)}/ is a symbolic "
                                    "link, not a folder the student handed in: not graded"))
            continue
        linked = sorted(d.name for d in student_dir.iterdir() if d.is_symlink() and d.name in known)
        for assignment in linked:
            found.append(Submission(_readable(student), assignment, known[assignment][0], None, problem=(
                f"{_readable(student)}/{assignment}/ is a symbolic link, not a folder the student handed in: "
                "not graded")))
        expected = {d.name for d in student_dir.iterdir() if d.is_dir() and d.name in known and d.name not in linked}
        if not any(s == student for s, _ in have):
            expected |= graded or set(known)
        for assignment in sorted(expected - set(linked)):
            if (student, assignment) not in have:
                for nb in known[assignment]:
                    found.append(Submission(student, assignment, nb, None, missing=True,
                                            problem=f"missing: no {nb}.ipynb in {student_dir.name}/"))
    return found


def too_large(path: Path) -> str:
    """Why the file cannot be a notebook to grade ("" when it can): not a plain file (a named pipe would hang the
    read, a device never end), or over NOTEBOOK_FILE_LIMIT; told from lstat, before anything reads it."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror}): not graded"
    if not stat.S_ISREG(st.st_mode):
        return "not a plain file (a named pipe, socket or device named .ipynb): not graded"
    if st.st_size <= NOTEBOOK_FILE_LIMIT:
        return ""
    return _size_problem(st.st_size, NOTEBOOK_FILE_LIMIT, "NOTEBOOK_FILE_LIMIT", "Ask the student to clear the "
                         "outputs (Edit > Clear Outputs of All Cells), save and hand it in again")


def _size_problem(size: int, limit: int, name: str, fix: str, what: str = "") -> str:
    return (f"too large to grade: {size / 2**20:,.1f} MB{what}, over the grader's limit of {limit / 2**20:g} MB "
            f"({name} in course/grade/submissions.py); not graded. {fix}")


def read_notebook(path: Path):
    """The notebook at `path` without its stored outputs, which grading never uses: read through read_small (a
    plain file of at most NOTEBOOK_FILE_LIMIT bytes); TooLarge when what remains is over NOTEBOOK_SIZE_LIMIT."""
    nb = nbformat.reads(read_small(path, NOTEBOOK_FILE_LIMIT, "the notebook").decode("utf-8"), as_version=4)
    cells = nb.get("cells")
    for cell in cells if isinstance(cells, list) else []:
        if isinstance(cell, dict) and cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    size = len(nbformat.writes(nb).encode())
    if size > NOTEBOOK_SIZE_LIMIT:
        raise TooLarge(_size_problem(size, NOTEBOOK_SIZE_LIMIT, "NOTEBOOK_SIZE_LIMIT", "Its cells hold that much "
                                         "text or code: look at it by hand", " without its outputs"))
    return nb


def invalid_reason(path: Path, error: Exception | None = None) -> str:
    """Why the notebook at `path` (or the `error` reading it raised) cannot be graded; "" when it can."""
    try:
        if error is not None:
            raise error
        nbformat.validate(read_notebook(path))
    except TooLarge as exc:
        return str(exc)
    except Exception as exc:  # not JSON, not a notebook, wrong schema: report it, grade the others
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"invalid notebook ({type(exc).__name__}): {first[:160]}"
    return ""


def repair(nb, release_nb) -> list[str]:
    """Note what the student changed in the locked cells and put the released cells back.

    Modifies nb in place; returns the problems for the report. Every cell's nbgrader metadata is the release's
    first (release_metadata: points, graded flags, unknown or renamed ids); then edited and deleted test cells
    come back as released, and a deleted answer cell comes back empty (the answer is gone either way). The
    grader never runs the test cells' code anyway (verdicts come from course.grade.verdicts), but feedback
    shows them, and nbgrader's gradebook keys scores by them.
    """
    metadata_notes = release_metadata(nb, release_nb)
    cells = {grade_id(c): c for c in nb.cells if grade_id(c)}
    deleted, edited, restored = [], [], []
    for i, cell in enumerate(release_nb.cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        gid = meta.get("grade_id")
        if not gid:
            continue
        mine = cells.get(gid)
        if mine is None:
            if meta.get("solution"):
                put_back = new_code_cell("# (this answer cell was deleted from the submission)")
                put_back.metadata["nbgrader"] = {k: v for k, v in meta.items() if k != "checksum"}
                restored.append(gid)
            elif meta.get("grade"):
                put_back = copy.deepcopy(cell)
                deleted.append(gid)
            else:
                continue
            anchor = next((grade_id(c) for c in reversed(release_nb.cells[:i]) if grade_id(c) in cells), None)
            index = 0 if anchor is None else 1 + max(j for j, c in enumerate(nb.cells) if grade_id(c) == anchor)
            nb.cells.insert(index, put_back)
            cells[gid] = put_back
        elif meta.get("grade") and not meta.get("solution") and mine.source != cell.source:
            edited.append(gid)
            mine.source = cell.source
    problems = []
    for ids, what in ((restored, "deleted answer cell(s) replaced by empty ones"),
                      (deleted, "deleted test cell(s) put back"), (edited, "edited test cell(s) restored")):
        if ids:
            problems.append(f"{what}: {', '.join(ids)}")
    return problems + metadata_notes


def release_metadata(nb, release_nb) -> list[str]:
    """Put the release notebook's nbgrader metadata back on the submission's cells; returns report notes.

    The release defines which cells are graded and how: a cell with a released grade_id gets the released
    metadata (an answer cell marked graded, or given points, is an answer cell again); a cell whose grade_id
    the release does not know is an ordinary cell (its nbgrader metadata dropped, its code still runs),
    except an answer cell whose id was renamed while the released answer cell is gone: it takes the released
    id back, so it is graded on its code. A second cell with the same id loses its metadata. `repair` runs it
    first, then puts back deleted cells and edited test cells."""
    released = {grade_id(c): c for c in release_nb.cells if grade_id(c)}
    present = {grade_id(c) for c in nb.cells if grade_id(c) in released}
    unclaimed = [gid for gid, c in released.items()
                 if gid not in present and c.metadata["nbgrader"].get("solution")]
    seen, unknown, restored, tests, renamed, duplicate = set(), [], [], [], [], []
    for cell in nb.cells:
        if "nbgrader" not in cell.get("metadata", {}):
            continue
        meta = cell.metadata["nbgrader"]  # the student's: a dict as released, or anything else (null, a string)
        gid = meta.get("grade_id") if isinstance(meta, dict) else None
        name = str(gid)[:60]
        if isinstance(gid, str) and gid in released and gid not in seen \
                and cell.cell_type == released[gid].cell_type:
            want = released[gid].metadata["nbgrader"]
            if {k: v for k, v in meta.items() if k != "checksum"} != {k: v for k, v in want.items() if k != "checksum"}:
                (tests if want.get("grade") and not want.get("solution") else restored).append(name)
            cell.metadata["nbgrader"] = copy.deepcopy(dict(want))
            seen.add(gid)
        elif (isinstance(meta, dict) and meta.get("solution") and cell.cell_type == "code" and unclaimed
              and not (isinstance(gid, str) and gid in released)):
            target = unclaimed.pop(0)
            cell.metadata["nbgrader"] = copy.deepcopy(dict(released[target].metadata["nbgrader"]))
            seen.add(target)
            renamed.append(f"{name} -> {target}")
        else:
            del cell.metadata["nbgrader"]
            (duplicate if isinstance(gid, str) and gid in released else unknown).append(name)
    problems = []
    for items, what in ((unknown, "cell(s) with a grade id the release does not have, graded as ordinary code"),
                        (duplicate, "duplicate grade id(s), the later cells graded as ordinary code"),
                        (renamed, "renamed answer cell id(s) put back"),
                        (tests, "test cell metadata restored"), (restored, "cell metadata restored as released")):
        if items:
            problems.append(f"{what}: {', '.join(items[:10])}{' ...' if len(items) > 10 else ''}")
    return problems

