"""`kvcourse grade DIR`: grade a folder of submissions, each sealed off, into nbgrader's gradebook.

Writes in the course folder (--course, default autograde/): gradebook.db, autograded/, feedback/ (hidden tests
removed), grades.csv (nbgrader's export) and report.csv (one row per submission: status, score, seconds, sandbox,
every problem met). One grader per course folder (work/grade.lock). A run: find the submissions (invalid and
missing ones get a row; locked cells are put back as released); check the gradebook (a damaged one is moved aside
and rebuilt by regrading); compute the reference values (the checks on the solution, cached per version); run each
submission in its own sandbox, here or on Dask workers (course.grade.cluster), and judge the plain data it hands
back here (course.grade.verdicts); merge the verdicts into the gradebook as the test cells' outputs (nbgrader
executes nothing) and swap the feedback in whole; write the CSVs atomically. The submission time is the
timestamp.txt beside the notebook, used only when it is a small plain file holding a timestamp nbgrader accepts.
The ledger (work/ledger.json) holds the hash of what was graded: a killed run resumes where it stopped, a second
run regrades only what changed (everything with --force) or failed for the grader's own reasons.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import io
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
from nbformat.v4 import new_output

from course.grade import cluster as clusters, sandbox, verdicts
from course.grade.files import (DISK_FULL, GradingError, atomic_write, course_lock, disk_error, full_disk, read_json,
                               read_small, replace_dir)
from course.grade.harness import is_test_cell
from course.grade.nbgrader_api import (assignments, check_result, export_csv, failure, gradebook_problem, load_config,
                                       nbgrader_api, sha, source_hash)
from course.grade.plain import decode
from course.grade.submissions import Submission, discover, grade_id, invalid_reason, read_notebook, repair
from course.paths import AUTOGRADE, SOLUTIONS

UNSANDBOXED = "UNSANDBOXED: graded without the sandbox (--unsandboxed); not safe for a real class"
OUTPUT_LIMIT = 1_000_000  # characters of one output kept in feedback
NOTEBOOK_OUTPUT_LIMIT = 2_000_000  # characters of all outputs of one notebook kept in feedback
OUTPUTS_PER_CELL = 16  # outputs of one cell kept (the harness writes at most three: stdout, stderr, an error)
HARNESS_FILES = ("harness.py", "plain.py", "verdicts.py", "sandbox.py")
TIMESTAMP_LIMIT = 1024  # bytes of a submission's timestamp.txt read at most (nbgrader writes about 30)


@dataclass
class Row:
    student: str
    assignment: str
    notebook: str
    status: str  # graded | invalid | missing | failed
    score: float = 0.0
    max_score: float = 0.0
    seconds: float = 0.0
    sandbox: str = ""  # sealed | UNSANDBOXED
    problems: str = ""


class Ledger:
    """work/ledger.json: what has been graded, keyed by student/assignment; written atomically."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.data = read_json(self.path, "the grading ledger", {"sources": {}, "graded": {}})
        if not isinstance(self.data, dict) or not isinstance(self.data.get("graded"), dict):
            raise GradingError(f"{self.path} (the grading ledger) is corrupt: not the ledger's layout. Move it "
                               "aside (or delete it) and run again: every submission is then graded afresh.")
        if not isinstance(self.data.get("sources"), dict):
            self.data["sources"] = {}
        # an entry in another layout (edited by hand, another version) is only a cache: that notebook is regraded
        self.data["graded"] = {k: v for k, v in self.data["graded"].items()
                               if isinstance(v, dict) and isinstance(v.get("hash"), str) and isinstance(v.get("row"), dict)
                               and set(v["row"]) <= set(Row.__dataclass_fields__)}

    def save(self) -> None:
        try:
            atomic_write(self.path, json.dumps(self.data, indent=1, sort_keys=True))
        except OSError as exc:
            raise disk_error(exc, self.path) from None


def _version(assignment: str) -> str:
    """What a grade depends on besides the file: the source notebook, its checks and the harness."""
    here = Path(__file__).parent
    if not verdicts.checks_path(assignment).exists():
        raise GradingError(f"{assignment} has no checks: write {verdicts.checks_path(assignment)} (one list of "
                           "Check per test cell; see course/grade/verdicts.py) before grading it")
    return sha(source_hash(assignment).encode(), verdicts.checks_path(assignment).read_bytes(),
               *((here / f).read_bytes() for f in HARNESS_FILES))


# ----------------------------------------------------------------------------- reference values

_REFERENCES: dict[tuple[str, str], dict] = {}  # (version, repr(limits)): what reference_values stored


def reference_values(assignment: str, work: Path, limits: sandbox.Limits) -> dict[str, list]:
    """The checks applied to the solution notebook, outside any sandbox; cached per version (in the course folder,
    and in this process for the next course folder)."""
    version = _version(assignment)
    cache = work / "reference" / f"{assignment}.json"
    stored = read_json(cache, "cached reference values", None) if cache.exists() else None
    key = (version, repr(limits))
    if not (isinstance(stored, dict) and stored.get("version") == version) and key in _REFERENCES:
        stored = _REFERENCES[key]  # this process ran it for another course folder: the same values
        atomic_write(cache, json.dumps(stored), private=True)
    if not (isinstance(stored, dict) and stored.get("version") == version):
        (source,) = sorted((SOLUTIONS / assignment).glob("*.ipynb"))
        run = work / f"reference-run-{os.getpid()}" / assignment
        outcome = sandbox.run_sealed(source, verdicts.checks_path(assignment), run, limits, sealed=False,
                                     threads=max(1, (os.cpu_count() or 1)))
        shutil.rmtree(run.parent, ignore_errors=True)
        errors = [o for e in outcome.events if e["ev"] == "cell_done" for o in e["outputs"]
                  if o.get("output_type") == "error"]
        small = (f" With --memory-mb {limits.memory_mb}, Python and torch may not even start: try 2048 or more "
                 "(the default is 4096)." if limits.memory_mb and limits.memory_mb < 2048 else "")
        if outcome.infrastructure or (small and (outcome.problems or errors)):  # not that the solution is broken
            why = outcome.infrastructure or "; ".join(outcome.problems + [e.get("ename", "") for e in errors])[:300]
            raise GradingError(f"the grader's sandbox could not start the solution notebook of {assignment}: "
                               f"{why}.{small}")
        if outcome.problems or errors:
            raise GradingError(f"the solution notebook of {assignment} does not run cleanly under the grader: "
                               f"{(outcome.problems + [outcome.infrastructure] + [str(e)[:300] for e in errors])}")
        stored = {"version": version,
                  "values": _values(outcome.events, verdicts.load_checks(verdicts.checks_path(assignment)))}
        atomic_write(cache, json.dumps(stored), private=True)  # the hidden checks' answers
        _REFERENCES[key] = stored
    return {gid: [decode(v) for v in values] for gid, values in stored["values"].items()}


def _values(events, checks: dict) -> dict[str, list]:
    """{grade_id: [encoded value of check 0, 1, ...]} for the declared checks only (the first value of each
    wins). Whatever else the sandbox wrote (an unknown grade_id, k = 10**8) is ignored: its size is the
    checks', never the submission's."""
    out = {gid: [None] * len(items) for gid, items in checks.items()}
    for e in events:
        gid, k = e.get("gid"), e.get("k")
        if (e.get("ev") == "check" and isinstance(gid, str) and gid in out and type(k) is int
                and 0 <= k < len(out[gid]) and out[gid][k] is None):
            out[gid][k] = e.get("value")
    return {gid: [{"t": "rejected", "why": "not run"} if v is None else v for v in values]
            for gid, values in out.items()}


# ----------------------------------------------------------------------------- the executed notebook

def _clean_outputs(outputs, budget: list[int]) -> list:
    """The sandbox's outputs for one cell, reduced to well-formed streams and errors of bounded size: at most
    OUTPUTS_PER_CELL of them, each stream at most OUTPUT_LIMIT characters, and all streams of the notebook
    together at most `budget[0]` (spent here; the notebook's feedback stays small whatever the cells print)."""
    clean = []
    for o in (outputs if isinstance(outputs, list) else [])[:OUTPUTS_PER_CELL]:
        if not isinstance(o, dict):
            continue
        if o.get("output_type") == "stream" and o.get("name") in ("stdout", "stderr"):
            text = str(o.get("text", ""))
            room = max(0, min(OUTPUT_LIMIT, budget[0]))
            if len(text) > room:
                why = "" if room == OUTPUT_LIMIT else " (the notebook's outputs reached their limit)"
                text = text[:room] + f"\n... (output truncated{why}: {len(text) - room:,} more characters)\n"
            budget[0] -= min(len(text), room)
            clean.append(new_output("stream", name=o["name"], text=text))
        elif o.get("output_type") == "error":
            tb = [str(x)[:2000] for x in o.get("traceback", [])][:40] if isinstance(o.get("traceback"), list) else []
            clean.append(new_output("error", ename=str(o.get("ename", "Error"))[:200],
                                    evalue=str(o.get("evalue", ""))[:2000], traceback=tb))
    return clean


def executed_notebook(nb, outcome: sandbox.Outcome, checks, verdict_map):
    """The notebook as graded: each test cell's output is its verdict (none where no check covers it: never the
    learner's), every other cell's the sandbox's cleaned outputs."""
    nb = copy.deepcopy(nb)
    done = {e["i"]: e for e in outcome.events if e.get("ev") == "cell_done" and type(e.get("i")) is int}
    budget = [NOTEBOOK_OUTPUT_LIMIT]
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.execution_count = None
        verdict = verdict_map.get(grade_id(cell))
        if not is_test_cell(cell):
            cell.outputs = _clean_outputs(done.get(i, {}).get("outputs", []), budget)
        elif verdict is None:
            cell.outputs = []
        elif verdict.passed:
            text = f"passed: {len(checks[verdict.grade_id])} check(s), judged by the grader\n"
            cell.outputs = [new_output("stream", name="stdout", text=text)]
        else:
            message = "; ".join(verdict.failures)
            cell.outputs = [new_output("error", ename="AssertionError", evalue=message,
                                       traceback=[f"AssertionError: {message}"])]
    return nb


def _held(cfg, course: Path) -> tuple[set[str], dict[tuple[str, str], tuple[float, bool]]]:
    """(the assignments, {(assignment, student): (score, whether an instructor graded a cell by hand)}) the
    gradebook holds; none when there is no gradebook (deleted, or a backup restored without it): the ledger's
    entries are then redone, not trusted."""
    if not (course / "gradebook.db").exists():
        return set(), {}
    from nbgrader.api import Gradebook

    with Gradebook(cfg.CourseDirectory.db_url, "kvcourse") as gb:
        return ({a.name for a in gb.assignments},
                {(a.name, s.student.id): (float(s.score), any(g.manual_score is not None for nb in s.notebooks
                                                              for g in nb.grades))
                 for a in gb.assignments for s in a.submissions})


def _reusable(done: dict, held: dict, sub, course: Path) -> bool:
    """The ledger's grade of this very file may stand: the gradebook holds it (the score the checks gave, or an
    instructor's hand grading on top; an older backup restored holds another score and no hand grade), and the
    graded notebook and its feedback page are still there."""
    row = done.get("row", {})
    key = (sub.assignment, sub.student)
    return (key in held and (held[key][0] == row.get("score") or held[key][1])
            and any((course / "autograded" / sub.key).glob("*.ipynb"))
            and any((course / "feedback" / sub.key).glob("*.html")))


def _not_graded(ledger, sub, status: str, why: str) -> Row:
    """The row of a submission that cannot be graded now; with a note when the gradebook (and so grades.csv) still
    holds an earlier grade of this student's notebook, so the CSV's number is not taken for this file's."""
    problems = [why] + sub.problems
    done = ledger.data["graded"].get(sub.key)
    if done and sub.student:
        row = done.get("row", {})
        problems.append(f"grades.csv still has the earlier grade of this notebook ({row.get('score', 0):g}/"
                        f"{row.get('max_score', 0):g}) from a file that could be graded; grade a readable notebook "
                        "to replace it")
    return Row(sub.student, sub.assignment, sub.notebook, status, problems="; ".join(problems))


def submitted_timestamp(folder: Path) -> tuple[str | None, str]:
    """(the timestamp in folder/timestamp.txt, why it is ignored): (None, "") when there is none.

    The file is the student's and the grader reads it outside any sandbox, so it is used only when it is a plain
    file (not a link: it could point at /dev/zero or any file the grader can read), at most TIMESTAMP_LIMIT bytes
    (read through a descriptor opened without following links, never more than that), UTF-8 text, and a timestamp
    nbgrader.utils.parse_utc accepts (no path in it: dateutil would open a time zone named by a path)."""
    path = Path(folder) / "timestamp.txt"
    if not os.path.lexists(path):
        return None, ""
    if path.is_symlink():
        return None, "it is a symbolic link, not a file"
    try:
        text = read_small(path, TIMESTAMP_LIMIT, "it", follow=False).decode("utf-8").strip()
    except GradingError as exc:  # not a plain file, too large, or swapped for a link since (ELOOP)
        return None, str(exc).replace(f"it {path}", "it")
    except UnicodeDecodeError:
        return None, "it is not UTF-8 text"
    if not text:
        return None, "it is empty"
    shown = text if len(text) <= 60 else text[:60] + "..."
    why = f"{shown!r} is not a timestamp such as 2026-01-31 23:59:00.000000 UTC"
    if not text.isprintable() or "/" in text or "\\" in text:
        return None, why
    from nbgrader.utils import parse_utc

    try:
        parse_utc(text)
    except Exception:  # dateutil raises ValueError, OverflowError, and more on odd text
        return None, why
    return text, ""


# ----------------------------------------------------------------------------- the grade command

def grade(folder: Path, course: Path = AUTOGRADE, jobs: int = 1, timeout: int | None = None,
          memory_mb: int | None = None, force: bool = False, progress: bool = True, log=print,
          unsandboxed: bool = False, on_sandbox_start=None, cluster: str | None = None,
          notes_for: dict[str, str] | None = None) -> list[Row]:
    """Grade every submission under `folder` into the course folder `course`. Returns one Row each.

    jobs > 1 or `cluster` (course.grade.cluster.parse): the sandboxes run on Dask workers; without, one at a time
    here. `notes_for` {"student/assignment": note}: added to that row of report.csv (a "missing" row if none)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    where = clusters.parse(cluster, jobs)
    if timeout is not None and timeout < 1:
        raise ValueError(f"timeout must be at least 1 second, got {timeout}")
    if memory_mb is not None and memory_mb < 256:
        raise ValueError(f"memory_mb must be at least 256, got {memory_mb}")
    course = Path(course).resolve()
    if course.is_relative_to(Path(folder).resolve()):
        raise GradingError(f"the course folder {course} is inside the submissions folder {Path(folder).resolve()}: "
                           "its copies of the notebooks would be graded as a student's. Give --course a folder "
                           "outside the submissions folder")
    if not unsandboxed and not where:  # a cluster's workers are asked the same by clusters.connect
        problem = sandbox.sandbox_problem()
        if problem:
            raise GradingError(f"{problem}. Grading stopped: nothing was graded. (`--unsandboxed` grades without "
                               "the sandbox, for your own tests only: submissions could then read the solutions "
                               "and change each other's grades.)")
    with course_lock(course), contextlib.ExitStack() as stack:
        pool = stack.enter_context(clusters.connect(where, sealed=not unsandboxed)) if where else None
        try:
            return _grade(Path(folder), course, pool, timeout, memory_mb, force, progress, log, unsandboxed,
                          on_sandbox_start, notes_for or {}, stack)
        except OSError as exc:  # a write this code did not expect to fail (a full disk, mostly): named, not raw
            raise disk_error(exc, Path(exc.filename or course)) from None


def _grade(folder, course, pool, timeout, memory_mb, force, progress, log, unsandboxed, on_sandbox_start,
           notes_for, stack):
    work = course / "work"
    known = assignments()
    subs = discover(folder, known)
    if not any(s.path for s in subs):
        raise GradingError(f"no notebooks under {folder}; expected {folder}/<student>/<assignment>/<notebook>.ipynb")
    ledger = Ledger(work / "ledger.json")
    notes: list[str] = []
    db = course / "gradebook.db"
    broken = gradebook_problem(db)
    if broken:
        aside = db.with_name(f"gradebook.db.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        for end in ("-journal", "-wal", "-shm"):  # SQLite's own files for it go with it, or they are lost
            if db.with_name(db.name + end).exists():
                os.replace(db.with_name(db.name + end), aside.with_name(aside.name + end))
        os.replace(db, aside)
        ledger.data = {"sources": {}, "graded": {}}
        ledger.save()
        notes.append(f"{db} was unusable ({broken}): moved to {aside.name}, the gradebook rebuilt by regrading")
        log(f"warning: {notes[-1]}")
    cfg = load_config(course, timeout, memory_mb)
    api = nbgrader_api(cfg)
    limits = sandbox.Limits(cell_timeout=float(cfg.Execute.timeout),
                            memory_mb=int(cfg.GraderKernelManager.memory_limit_mb))
    run_dir = work / f"run-{os.getpid()}"
    shutil.rmtree(run_dir, ignore_errors=True)
    for stale in [*work.glob("run-*"), *work.glob("reference-run-*")]:  # left by a grader that was killed
        shutil.rmtree(stale, ignore_errors=True)
    run_dir.mkdir(parents=True)
    stack.callback(shutil.rmtree, run_dir, ignore_errors=True)
    gradable = sorted({s.assignment for s in subs if not s.problem})
    checks, references = {}, {}
    in_gradebook, held = _held(cfg, course)  # the ledger is trusted only as far as the gradebook agrees
    for assignment in gradable:
        digest = _version(assignment)
        if (ledger.data["sources"].get(assignment) != digest or not (course / "release" / assignment).exists()
                or assignment not in in_gradebook):
            check_result(api.generate_assignment(assignment, force=True, create=True),
                         f"generate_assignment {assignment}", course)
            ledger.data["sources"][assignment] = digest
            ledger.save()
        checks[assignment] = verdicts.load_checks(verdicts.checks_path(assignment))
        references[assignment] = reference_values(assignment, course / "work", limits)

    rows: dict[str, Row] = {}
    pending: list[tuple[Submission, object]] = []
    box = UNSANDBOXED if unsandboxed else "sealed"
    for sub in subs:
        key = f"{sub.key}/{sub.notebook}"
        if sub.problem:
            rows[key] = _not_graded(ledger, sub, "missing" if sub.missing else "invalid", sub.problem)
            continue
        try:  # what discover saw may have been swapped since (for a pipe): read once, as a plain file
            nb = read_notebook(sub.path)  # without its stored outputs: what is graded, and what the ledger hashes
            sub.digest = sha(nbformat.writes(nb).encode(), ledger.data["sources"][sub.assignment].encode())
        except Exception as exc:
            why = invalid_reason(sub.path, exc)
            rows[key] = _not_graded(ledger, sub, "invalid", why if "not graded" in why else f"{why}: not graded")
            continue
        done = ledger.data["graded"].get(sub.key)
        if not force and done and done.get("hash") == sub.digest and _reusable(done, held, sub, course):
            rows[key] = Row(**done["row"])
            continue
        release_nb = nbformat.read(str(course / "release" / sub.assignment / f"{sub.notebook}.ipynb"), as_version=4)
        try:
            sub.problems += repair(nb, release_nb)
        except Exception as exc:  # the file is the student's: one that breaks the repair must not stop the class
            rows[key] = _not_graded(ledger, sub, "failed", f"could not be prepared for grading ({type(exc).__name__}: "
                                                           f"{str(exc)[:160]}): grade it by hand")
            continue
        pending.append((sub, nb))

    outsiders = [r for r in rows.values() if r.status in ("invalid", "missing", "failed") and r.student
                 and "\ufffd" not in r.student]  # a name that is not UTF-8 (shown with U+FFFD) gets no gradebook entry
    if outsiders:
        from nbgrader.api import Gradebook

        with Gradebook(cfg.CourseDirectory.db_url, "kvcourse") as gb:  # so the CSV export lists them (score 0)
            for r in outsiders:
                gb.update_or_create_student(r.student)
    for r in rows.values():  # graded earlier (_reusable): the score is the gradebook's, which an instructor may edit
        if r.status == "graded" and held[r.assignment, r.student][0] != r.score:
            r.problems = "; ".join(p for p in (r.problems, (
                f"score from the gradebook, which holds the instructor's manual grades (the checks gave "
                f"{r.score:g}/{r.max_score:g})")) if p)
            r.score = held[r.assignment, r.student][0]

    started = time.perf_counter()
    where = pool.where if pool else "one sandbox at a time"
    if pending:
        log(f"grading {len(pending)} submission(s) on {where}"
            f"{' WITHOUT the sandbox (--unsandboxed)' if unsandboxed else ''} "
            f"({len(subs) - len(pending)} already graded or not gradable)")
        for row in _run_all(pending, course, run_dir, cfg, limits, pool, progress, unsandboxed, checks, references,
                            on_sandbox_start):
            row.sandbox = box
            if unsandboxed:
                row.problems = "; ".join(p for p in (UNSANDBOXED, row.problems) if p)
            rows[f"{row.student}/{row.assignment}/{row.notebook}"] = row
            if row.status == "graded":
                ledger.data["graded"][f"{row.student}/{row.assignment}"] = {
                    "hash": next(s.digest for s, _ in pending if s.key == f"{row.student}/{row.assignment}"),
                    "row": asdict(row)}
                ledger.save()
    elapsed = time.perf_counter() - started

    for key, note in notes_for.items():  # e.g. the classroom's quarantine: a row for every student it names
        mine = [r for r in rows.values() if f"{r.student}/{r.assignment}" == key]
        for row in mine or [rows.setdefault(key, Row(*key.split("/", 1), "", "missing"))]:
            row.problems = "; ".join(p for p in (row.problems, note) if p)
    ordered = [rows[k] for k in sorted(rows)]
    if notes:
        for row in ordered:
            row.problems = "; ".join(p for p in [row.problems] + notes if p)
    export_csv(cfg, course / "grades.csv")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(Row.__dataclass_fields__))
    writer.writeheader()
    writer.writerows(asdict(row) for row in ordered)
    try:
        atomic_write(course / "report.csv", buf.getvalue())
    except OSError as exc:
        raise disk_error(exc, course / "report.csv") from None
    if pending:
        log(f"{len(pending)} submission(s) in {elapsed:.1f} s: {elapsed / len(pending):.1f} s per submission "
            f"on {where}")
    return ordered


def task(assignment: str, nb, limits: sandbox.Limits, pool, unsandboxed: bool, scratch: Path) -> dict:
    """One submission's task as plain data: the notebook and its checks travel in it, never a path (workers on
    other machines do not mount the class folder); a remote worker's scratch space is its own."""
    version = pool.version if pool else None  # None: this machine's own files, nothing to compare
    return {"notebook": nb, "assignment": assignment, "checks": verdicts.checks_path(assignment).read_text(),
            "limits": asdict(limits), "sealed": not unsandboxed, "version": version,
            "threads": pool.threads if pool else max(1, os.cpu_count() or 1),
            "scratch": None if version else str(scratch)}


def _run_all(pending, course, run_dir, cfg, limits, pool, progress, unsandboxed, checks, references,
             on_sandbox_start):
    """Each submission's sandbox (here, or on the cluster's workers), then its merge here, as results arrive."""
    from tqdm.auto import tqdm

    merge_cfg = cfg.copy()
    merge_cfg.CourseDirectory.submitted_directory = str(run_dir / "executed")
    merge_cfg.CourseDirectory.feedback_directory = str(run_dir / "feedback")
    merge_cfg.Execute.enabled = False  # nothing executes here: the outputs are the grader's verdicts
    merge_cfg.ClearOutput.enabled = False
    merge_api = nbgrader_api(merge_cfg)
    (run_dir / "sandbox").mkdir()
    jobs = [task(sub.assignment, nb, limits, pool, unsandboxed, run_dir / "sandbox") for sub, nb in pending]
    with tqdm(total=len(pending), desc="grading", unit="submission", disable=not progress) as bar:
        for i, outcome in (pool.run(jobs, bar) if pool else clusters.serial(jobs, on_sandbox_start)):
            sub, nb = pending[i]
            try:
                row = _merge(sub, nb, outcome, course, run_dir, merge_cfg, merge_api, checks[sub.assignment],
                             references[sub.assignment])
            except GradingError:
                raise
            except Exception as exc:  # one submission must never stop the class; a full disk stops every merge
                if isinstance(exc, OSError) and exc.errno in DISK_FULL:
                    raise
                row = Row(sub.student, sub.assignment, sub.notebook, "failed",
                          problems=f"merging into the gradebook failed: {type(exc).__name__}: {exc}")
            bar.update(1)
            yield row


def _merge(sub, nb, outcome, course, run_dir, merge_cfg, merge_api, checks, reference) -> Row:
    """Judge one sandbox's values, merge the executed notebook into the gradebook, swap in its feedback."""
    from nbgrader.api import Gradebook

    row = Row(sub.student, sub.assignment, sub.notebook, "failed", seconds=round(outcome.seconds, 2))
    problems = sub.problems + outcome.problems
    if outcome.infrastructure:
        row.problems = "; ".join(problems + [f"{outcome.infrastructure}: not graded; run `kvcourse grade` again "
                                             "to regrade it"])
        return row
    got = {gid: [decode(v) for v in values] for gid, values in _values(outcome.events, checks).items()}
    verdict_map = verdicts.judge(checks, got, reference)
    if any(e.get("ev") == "cell_done" and e.get("timeout") for e in outcome.events):
        problems.append("a cell ran past the timeout and was interrupted")
    if any(isinstance(o, dict) and o.get("ename") == "MemoryError" for e in outcome.events
           for o in (e.get("outputs") if isinstance(e.get("outputs"), list) else [])):
        problems.append("an allocation failed under the memory cap (MemoryError)")
    executed = executed_notebook(nb, outcome, checks, verdict_map)
    dest = run_dir / "executed" / sub.student / sub.assignment
    dest.mkdir(parents=True, exist_ok=True)
    nbformat.write(executed, str(dest / f"{sub.notebook}.ipynb"))
    stamp, why = submitted_timestamp(sub.path.parent) if sub.path else (None, "")
    if stamp is not None:
        (dest / "timestamp.txt").write_text(stamp, encoding="utf-8")
    elif why:
        problems.append(f"timestamp.txt ignored: {why}; graded with no submission time from it (check its date by "
                        "hand if a due date applies)")
    result = merge_api.autograde(sub.assignment, sub.student, force=True, create=True)
    if not result.get("success"):
        error = result.get("error") or result.get("log") or ""
        if full_disk(error, course):
            raise full_disk(error, course)
        if "database is locked" in error:  # formgrader (or another tool) is writing the gradebook right now
            why = ("the gradebook is busy (formgrader or another program is writing to it): the previous grade is "
                   "kept; close it and grade again")
        else:
            why = "merging into the gradebook failed: " + failure(result)[-300:]
        row.problems = "; ".join(problems + [why])
        return row
    points = {grade_id(c): float(c.metadata["nbgrader"].get("points", 0)) for c in executed.cells if is_test_cell(c)}
    with Gradebook(merge_cfg.CourseDirectory.db_url, "kvcourse") as gb:
        for gid, verdict in verdict_map.items():
            if gid not in points:
                continue
            g = gb.find_grade(gid, sub.notebook, sub.assignment, sub.student)
            want = points[gid] if verdict.passed else 0.0
            if g.auto_score != want:  # the verdicts, never what the notebook's own run scored
                g.auto_score = want
            if g.manual_score is not None:  # only an instructor sets it (formgrader): theirs wins, and we say so
                problems.append(f"{gid}: the instructor's manual score {g.manual_score:g} kept "
                                f"(the checks give {want:g})")
        gb.db.commit()
        submission = gb.find_submission(sub.assignment, sub.student)
        row.score, row.max_score = float(submission.score), float(submission.max_score)
    result = merge_api.generate_feedback(sub.assignment, sub.student, force=True)
    staged = run_dir / "feedback" / sub.student / sub.assignment
    if not result.get("success") or not staged.is_dir():
        row.problems = "; ".join(problems + ["feedback failed: " + failure(result)[-300:]])
        return row
    replace_dir(staged, course / "feedback" / sub.student / sub.assignment)
    row.status = "graded"
    row.problems = "; ".join(problems)
    return row


# ----------------------------------------------------------------------------- command line

def add_arguments_grade(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="submissions: FOLDER/<student>/<assignment>/<notebook>.ipynb or "
                   "FOLDER/<student>/<notebook>.ipynb; the submission time is the timestamp.txt beside a notebook")
    p.add_argument("--course", type=Path, default=AUTOGRADE,
                   help="course folder for the gradebook, feedback and CSVs (default: autograde/)")
    p.add_argument("--jobs", "-j", type=int, default=1,
                   help="grade this many submissions at once, on a local Dask cluster (default 1: one at a time)")
    p.add_argument("--cluster", default=None,
                   help="grade on the Dask cluster whose scheduler is at tcp://HOST:8786, or on local:N (N local "
                        "worker processes); this process alone writes the gradebook")
    p.add_argument("--timeout", type=int, default=None, help="seconds per cell before it is interrupted "
                                                             "(default: autograde/nbgrader_config.py, 30)")
    p.add_argument("--memory-mb", type=int, default=None, help="memory cap per submission in MiB (default 4096)")
    p.add_argument("--force", action="store_true", help="regrade submissions that are already graded")
    p.add_argument("--unsandboxed", action="store_true",
                   help="grade without the bubblewrap sandbox (only for your own tests; every report says so)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def print_rows(rows: list[Row]) -> int:
    """One line per row, then how many need a look; the exit status: 1 when some do."""
    width = max([len(f"{r.student}/{r.assignment}") for r in rows] + [10])
    for r in rows:
        score = f"{r.score:g}/{r.max_score:g}" if r.status == "graded" else r.status.upper()
        print(f"{r.student + '/' + r.assignment:<{width}}  {score:>9}  {r.problems}")
    bad = [r for r in rows if r.status != "graded"]
    if bad:
        print(f"{len(bad)} submission(s) need a look (see report.csv); every other one is graded.")
    return 1 if bad else 0


def run_grade(args) -> int:
    try:
        rows = grade(args.folder, args.course, jobs=args.jobs, timeout=args.timeout, memory_mb=args.memory_mb,
                     force=args.force, progress=not args.quiet, unsandboxed=args.unsandboxed, cluster=args.cluster)
    except (GradingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    course = Path(args.course)
    print(f"grades: {course / 'grades.csv'}   report: {course / 'report.csv'}   feedback: {course / 'feedback'}/\n"
          + (f"{UNSANDBOXED}\n" if args.unsandboxed else ""))
    return print_rows(rows)
