"""Autograding: `kvcourse grade DIR` for instructors, `kvcourse check NOTEBOOK` for learners.

`grade` runs nbgrader's whole pipeline on a folder of submissions laid out as
    DIR/<student>/<assignment>/<notebook>.ipynb   (nbgrader's own layout)  or   DIR/<student>/<notebook>.ipynb
and writes, in the course folder (--course, default autograde/): gradebook.db, autograded/, feedback/
(HTML, hidden tests removed), grades.csv (nbgrader export) and report.csv (one row per submission with
its status, score, seconds and any problem met: timeout, dead kernel, restored test cell, invalid file).

How one run goes:
  1. find the submissions; a file that is not a valid notebook is reported (score 0), never graded;
     a deleted answer cell gets an empty placeholder so nbgrader can put deleted test cells back;
  2. generate_assignment from solutions/ fills the gradebook with the tests (hidden ones included);
  3. workers (--jobs N) autograde and write feedback, each in a private copy of the course folder with
     its own SQLite gradebook (SQLite is not safe for concurrent writers);
  4. the main process merges each executed notebook into the course gradebook with a no-execute
     autograde (nbgrader computes the same scores from the outputs) and records it in a ledger.
The ledger (work/ledger.json) holds, per submission, the hash of what was graded: a run killed halfway
resumes where it stopped, and a second run regrades only what changed (everything with --force).

`check` executes a notebook in a fresh kernel and prints every visible test with its result and a hint.
It exits 1 when any test fails (nbgrader's own `validate` exits 0 either way).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course.paths import AUTOGRADE, EXERCISES, PROJECT_ROOT, SOLUTIONS, jupyter_env

HIDDEN_BEGIN = "BEGIN HIDDEN TESTS"
PROBLEM_ENAMES = {
    "CellTimeoutError": "a cell ran past the timeout and was interrupted",
    "DeadKernelError": "the kernel died (os._exit, a crash, or it ignored an interrupt)",
    "MemoryError": "an allocation failed under the kernel's memory cap (MemoryError)",
}


class GradingError(RuntimeError):
    """The pipeline itself could not run (not one student's problem)."""


# ----------------------------------------------------------------------------- assignments and config

def assignments(source: Path = SOLUTIONS) -> dict[str, list[str]]:
    """{assignment id: [notebook stems]} from the nbgrader source folder."""
    found = {}
    for folder in sorted(Path(source).iterdir()):
        notebooks = sorted(p.stem for p in folder.glob("*.ipynb")) if folder.is_dir() else []
        if notebooks:
            found[folder.name] = notebooks
    return found


def load_config(course: Path = AUTOGRADE, timeout: int | None = None, memory_mb: int | None = None):
    """autograde/nbgrader_config.py, re-rooted at `course` (every path of nbgrader state inside it)."""
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", str(AUTOGRADE)).load_config()
    root = Path(course).resolve()
    cfg.CourseDirectory.root = str(root)
    cfg.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
    cfg.Exchange.root = str(root / "exchange")
    cfg.Exchange.cache = str(root / "exchange" / ".cache")
    if timeout is not None:
        cfg.Execute.timeout = int(timeout)
    if memory_mb is not None:
        cfg.GraderKernelManager.memory_limit_mb = int(memory_mb)
    return cfg


def _venv_on_path(env: dict) -> dict:
    """nbgrader runs the `alembic` command when it creates a gradebook: it must be on PATH."""
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH")) if p)
    return env


def nbgrader_api(cfg, log_level: str = "ERROR"):
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    _venv_on_path(os.environ)

    Path(cfg.Exchange.root).mkdir(parents=True, exist_ok=True)
    api = NbGraderAPI(coursedir=CourseDirectory(config=cfg), config=cfg)
    api.log_level = log_level
    warnings.filterwarnings("ignore", module="nbgrader")  # SQLAlchemy chatter about its own sessions
    return api


def _check(result: dict, what: str) -> None:
    if not result.get("success"):
        detail = (result.get("error") or result.get("log") or "").strip().splitlines()[-12:]
        raise GradingError(f"{what} failed:\n" + "\n".join(detail))


def _sha(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def source_hash(assignment: str, source: Path = SOLUTIONS) -> str:
    return _sha(*(p.read_bytes() for p in sorted((Path(source) / assignment).glob("*.ipynb"))))


def generate_exercises(dest: Path = EXERCISES, workdir: Path | None = None) -> list[Path]:
    """Run nbgrader generate_assignment on every assignment of solutions/ and copy the results to dest."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvcourse-release-") as tmp:
        course = Path(workdir or tmp)
        api = nbgrader_api(load_config(course))
        written = []
        for assignment, notebooks in assignments().items():
            _check(api.generate_assignment(assignment, force=True, create=True), f"generate_assignment {assignment}")
            out = Path(dest) / assignment
            out.mkdir(parents=True, exist_ok=True)
            for nb in notebooks:
                shutil.copyfile(course / "release" / assignment / f"{nb}.ipynb", out / f"{nb}.ipynb")
                written.append(out / f"{nb}.ipynb")
        return written


# ----------------------------------------------------------------------------- submissions

@dataclass
class Submission:
    student: str
    assignment: str
    notebook: str
    path: Path
    problem: str = ""  # why it cannot be graded ("" = it can)
    problems: list[str] = field(default_factory=list)  # what repair() noticed
    digest: str = ""  # hash of the file and of its assignment's source: what the ledger remembers

    @property
    def key(self) -> str:
        return f"{self.student}/{self.assignment}"


def discover(folder: Path, known: dict[str, list[str]] | None = None) -> list[Submission]:
    """Every notebook under folder, with its student and assignment (problems noted, not raised)."""
    known = assignments() if known is None else known
    by_stem = {nb: a for a, nbs in known.items() for nb in nbs}
    folder = Path(folder)
    if not folder.is_dir():
        raise GradingError(f"{folder} is not a folder; give the folder that holds one sub-folder per student")
    found, seen = [], set()
    for path in sorted(folder.rglob("*.ipynb")):
        parts = path.relative_to(folder).parts
        if any(p.startswith(".") for p in parts):
            continue  # .ipynb_checkpoints and other hidden folders
        student = parts[0] if len(parts) > 1 else ""
        assignment = by_stem.get(path.stem, parts[1] if len(parts) == 3 else "")
        sub = Submission(student, assignment, path.stem, path)
        if len(parts) == 1 or len(parts) > 3:
            sub.problem = "misplaced: put it at DIR/<student>/<assignment>/<notebook>.ipynb"
        elif path.stem not in by_stem:
            sub.problem = f"unknown notebook: expected one of {sorted(by_stem)}"
        elif (sub.student, sub.assignment, sub.notebook) in seen:
            sub.problem = "duplicate: this student already has this notebook in the folder"
        else:
            sub.problem = _invalid_reason(path)
        seen.add((sub.student, sub.assignment, sub.notebook))
        found.append(sub)
    return found


def _invalid_reason(path: Path) -> str:
    import nbformat

    try:
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # not JSON, not a notebook, wrong schema: report it, grade the others
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"invalid notebook ({type(exc).__name__}): {first[:160]}"
    return ""


def _grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def repair(nb, release_nb) -> list[str]:
    """Note what the student changed in the locked cells, and give deleted answer cells a placeholder.

    Modifies nb in place; returns the problems for the report. nbgrader itself restores edited test cells
    (checksums) and deleted ones (OverwriteCells.add_missing_cells), but it anchors a restored test cell
    after the answer cell before it: without that cell the whole submission would fail, so a deleted
    answer cell comes back empty (the student's answer is gone either way).
    """
    from nbformat.v4 import new_code_cell

    cells = {_grade_id(c): c for c in nb.cells if _grade_id(c)}
    deleted, edited, tampered, restored = [], [], [], []
    for i, cell in enumerate(release_nb.cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        grade_id = meta.get("grade_id")
        if not grade_id:
            continue
        mine = cells.get(grade_id)
        if mine is None and meta.get("solution"):
            placeholder = new_code_cell("# (this answer cell was deleted from the submission)")
            placeholder.metadata["nbgrader"] = {k: v for k, v in meta.items() if k != "checksum"}
            anchor = next((_grade_id(c) for c in reversed(release_nb.cells[:i]) if _grade_id(c) in cells), None)
            index = 0 if anchor is None else 1 + max(j for j, c in enumerate(nb.cells) if _grade_id(c) == anchor)
            nb.cells.insert(index, placeholder)
            cells[grade_id] = placeholder
            restored.append(grade_id)
        elif mine is None and meta.get("grade"):
            deleted.append(grade_id)
        elif meta.get("grade") and not meta.get("solution"):
            mine_meta = mine.get("metadata", {}).get("nbgrader", {})
            if mine.source != cell.source:
                edited.append(grade_id)
            if (mine_meta.get("points"), mine_meta.get("grade"), mine_meta.get("locked")) != (
                    meta.get("points"), meta.get("grade"), meta.get("locked")):
                tampered.append(grade_id)
    problems = []
    for ids, what in ((restored, "deleted answer cell(s) replaced by empty ones"),
                      (deleted, "deleted test cell(s) put back"), (edited, "edited test cell(s) restored"),
                      (tampered, "test cell metadata restored")):
        if ids:
            problems.append(f"{what}: {', '.join(ids)}")
    return problems


# ----------------------------------------------------------------------------- the grade command

@dataclass
class Row:
    student: str
    assignment: str
    notebook: str
    status: str  # graded | invalid | failed
    score: float = 0.0
    max_score: float = 0.0
    seconds: float = 0.0
    problems: str = ""


class Ledger:
    """work/ledger.json: what has been graded, keyed by student/assignment; written atomically."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"sources": {}, "graded": {}}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def grade(folder: Path, course: Path = AUTOGRADE, jobs: int = 1, timeout: int | None = None,
          memory_mb: int | None = None, force: bool = False, progress: bool = True, log=print) -> list[Row]:
    """Grade every submission under `folder` into the course folder `course`. Returns one Row each."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if timeout is not None and timeout < 1:
        raise ValueError(f"timeout must be at least 1 second, got {timeout}")
    import nbformat

    course = Path(course).resolve()
    work = course / "work"
    work.mkdir(parents=True, exist_ok=True)
    known = assignments()
    subs = discover(folder, known)
    if not subs:
        raise GradingError(f"no notebooks under {folder}; expected {folder}/<student>/<assignment>/<notebook>.ipynb")
    cfg = load_config(course, timeout, memory_mb)
    api = nbgrader_api(cfg)
    ledger = Ledger(work / "ledger.json")

    # 2. the gradebook knows every assignment's tests (regenerated when solutions/ changed)
    for assignment in sorted({s.assignment for s in subs if not s.problem}):
        digest = source_hash(assignment)
        release = course / "release" / assignment
        if ledger.data["sources"].get(assignment) != digest or not release.exists():
            _check(api.generate_assignment(assignment, force=True, create=True), f"generate_assignment {assignment}")
            ledger.data["sources"][assignment] = digest
            ledger.save()

    # 1. copy (and repair) each valid submission into the course's submitted/ folder
    rows: dict[str, Row] = {}
    pending: list[Submission] = []
    for sub in subs:
        if sub.problem:
            rows[f"{sub.key}/{sub.notebook}"] = Row(sub.student, sub.assignment, sub.notebook, "invalid",
                                                    problems=sub.problem)
            continue
        digest = _sha(sub.path.read_bytes(), ledger.data["sources"][sub.assignment].encode())
        done = ledger.data["graded"].get(sub.key)
        if not force and done and done["hash"] == digest and (course / "autograded" / sub.key).exists():
            rows[f"{sub.key}/{sub.notebook}"] = Row(**done["row"])
            continue
        nb = nbformat.read(str(sub.path), as_version=4)
        release_nb = nbformat.read(str(course / "release" / sub.assignment / f"{sub.notebook}.ipynb"), as_version=4)
        sub.problems = repair(nb, release_nb)
        dest = course / "submitted" / sub.student / sub.assignment
        dest.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(dest / f"{sub.notebook}.ipynb"))
        timestamp = sub.path.parent / "timestamp.txt"
        if timestamp.exists():
            shutil.copyfile(timestamp, dest / "timestamp.txt")
        sub.digest = digest
        pending.append(sub)

    if any(r.status == "invalid" for r in rows.values()):
        from nbgrader.api import Gradebook

        with Gradebook(cfg.CourseDirectory.db_url, "kvcourse") as gb:  # so the CSV export lists them (score 0)
            for r in rows.values():
                if r.status == "invalid" and r.student:
                    gb.update_or_create_student(r.student)

    # 3 + 4. execute in workers, merge into the course gradebook as results arrive
    started = time.perf_counter()
    if pending:
        log(f"grading {len(pending)} submission(s) with {min(jobs, len(pending))} worker(s) "
            f"({len(subs) - len(pending)} already graded or not gradable)")
        for row in _run_workers(pending, course, cfg, jobs, timeout, memory_mb, ledger, progress):
            rows[f"{row.student}/{row.assignment}/{row.notebook}"] = row
    elapsed = time.perf_counter() - started

    # 5. exports
    _export_csv(cfg, course / "grades.csv")
    ordered = [rows[k] for k in sorted(rows)]
    with open(course / "report.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(asdict(Row("", "", "", "")).keys()))
        writer.writeheader()
        for row in ordered:
            writer.writerow(asdict(row))
    if pending:
        log(f"{len(pending)} submission(s) in {elapsed:.1f} s: {elapsed / len(pending):.1f} s per submission "
            f"with {min(jobs, len(pending))} worker(s)")
    return ordered


def _export_csv(cfg, dest: Path) -> None:
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    with Gradebook(cfg.CourseDirectory.db_url, "kvcourse") as gb:
        CsvExportPlugin(to=str(dest)).export(gb)


def _worker_env(course: Path, jobs: int) -> dict:
    env = _venv_on_path(jupyter_env(state=course / "work" / "jupyter"))
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1",
                "MPLBACKEND": "Agg", "MPLCONFIGDIR": str(course / "work" / "matplotlib"),
                "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)})
    return env


def _run_workers(pending, course, cfg, jobs, timeout, memory_mb, ledger, progress):
    from tqdm.auto import tqdm

    n = min(jobs, len(pending))
    shares = [pending[i::n] for i in range(n)]
    results: queue.Queue = queue.Queue()
    procs, merge_apis = [], {}
    by_key = {s.key: s for s in pending}
    for i, share in enumerate(shares):
        root = course / "work" / f"w{i}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        shutil.copyfile(course / "gradebook.db", root / "gradebook.db")
        for sub in share:
            shutil.copytree(course / "submitted" / sub.student / sub.assignment,
                            root / "submitted" / sub.student / sub.assignment)
        spec = {"root": str(root), "timeout": timeout, "memory_mb": memory_mb,
                "items": [[s.student, s.assignment] for s in share]}
        (root / "spec.json").write_text(json.dumps(spec))
        log_file = open(root / "worker.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "course.grade.grading", "_worker", str(root / "spec.json")],
                                stdout=subprocess.PIPE, stderr=log_file, text=True, env=_worker_env(course, n),
                                cwd=str(root))
        procs.append((proc, log_file, root))
        threading.Thread(target=_pump, args=(proc, results, i), daemon=True).start()

    finished_workers, remaining = 0, set(by_key)
    bar = tqdm(total=len(pending), desc="grading", unit="submission", disable=not progress)
    try:
        while finished_workers < n:
            worker, message = results.get()
            if message is None:
                finished_workers += 1
                continue
            sub = by_key[message["key"]]
            try:
                row = _merge(sub, message, procs[worker][2], cfg, merge_apis, course)
            except Exception as exc:  # one submission must never stop the class
                row = Row(sub.student, sub.assignment, sub.notebook, "failed",
                          problems=f"merging into the gradebook failed: {type(exc).__name__}: {exc}")
            remaining.discard(sub.key)
            if row.status == "graded":
                ledger.data["graded"][sub.key] = {"hash": sub.digest, "row": asdict(row)}
                ledger.save()
            bar.update(1)
            yield row
    finally:
        bar.close()
        for proc, log_file, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log_file.close()
    for key in sorted(remaining):  # a worker that crashed without reporting: say so, never drop the row
        sub = by_key[key]
        yield Row(sub.student, sub.assignment, sub.notebook, "failed",
                  problems="the grading worker stopped before this submission; see work/w*/worker.log")


def _pump(proc, results, worker):
    for line in proc.stdout:
        if line.startswith("{"):
            results.put((worker, json.loads(line)))
    results.put((worker, None))


def _merge(sub, message, worker_root, cfg, merge_apis, course) -> Row:
    """Score the worker's executed notebook into the course gradebook, copy its feedback."""
    problems = sub.problems + list(message.get("problems", []))
    row = Row(sub.student, sub.assignment, sub.notebook, "failed", seconds=round(message["seconds"], 2))
    if not message["ok"]:
        row.problems = "; ".join(problems + [f"grading failed: {message.get('error', '')[-300:]}"])
        return row
    if worker_root not in merge_apis:
        merge_cfg = cfg.copy()
        merge_cfg.CourseDirectory.submitted_directory = str(worker_root / "autograded")
        merge_cfg.Execute.enabled = False  # scores come from the worker's outputs: no second execution
        merge_cfg.ClearOutput.enabled = False
        merge_apis[worker_root] = nbgrader_api(merge_cfg)
    result = merge_apis[worker_root].autograde(sub.assignment, sub.student, force=True, create=True)
    if not result.get("success"):
        row.problems = "; ".join(problems + ["merging into the gradebook failed: "
                                             + (result.get("error") or "")[-300:]])
        return row
    feedback = course / "feedback" / sub.student / sub.assignment
    shutil.rmtree(feedback, ignore_errors=True)
    shutil.copytree(worker_root / "feedback" / sub.student / sub.assignment, feedback)
    from nbgrader.api import Gradebook

    with Gradebook(cfg.CourseDirectory.db_url, "kvcourse") as gb:
        submission = gb.find_submission(sub.assignment, sub.student)
        row.score, row.max_score = float(submission.score), float(submission.max_score)
    row.status = "graded"
    row.problems = "; ".join(problems)
    return row


def _worker(spec_path: str) -> int:
    """One grading worker: autograde + feedback in a private course folder, one JSON line per submission."""
    import nbformat

    spec = json.loads(Path(spec_path).read_text())
    root = Path(spec["root"])
    api = nbgrader_api(load_config(root, spec["timeout"], spec["memory_mb"]))
    for student, assignment in spec["items"]:
        started = time.perf_counter()
        message = {"key": f"{student}/{assignment}", "ok": False, "problems": []}
        try:
            result = api.autograde(assignment, student, force=True, create=True)
            if result.get("success"):
                result = api.generate_feedback(assignment, student, force=True)
            message["ok"] = bool(result.get("success"))
            if not message["ok"]:
                message["error"] = (result.get("error") or result.get("log") or "")[-2000:]
            for path in sorted((root / "autograded" / student / assignment).glob("*.ipynb")):
                message["problems"] += _output_problems(nbformat.read(str(path), as_version=4))
        except Exception as exc:  # keep going: one submission must never stop the class
            message["error"] = f"{type(exc).__name__}: {exc}"
        message["seconds"] = time.perf_counter() - started
        print(json.dumps(message), flush=True)
    return 0


def _output_problems(nb) -> list[str]:
    seen = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = PROBLEM_ENAMES.get(out.get("ename", "")) if out.get("output_type") == "error" else None
            if text and text not in seen:
                seen.append(text)
    return seen


def add_arguments_grade(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="submissions: FOLDER/<student>/<assignment>/<notebook>.ipynb "
                                             "or FOLDER/<student>/<notebook>.ipynb")
    p.add_argument("--course", type=Path, default=AUTOGRADE,
                   help="course folder for the gradebook, feedback and CSVs (default: autograde/)")
    p.add_argument("--jobs", "-j", type=int, default=1, help="grade this many submissions at once (default 1)")
    p.add_argument("--timeout", type=int, default=None, help="seconds per cell before the kernel is interrupted "
                                                             "(default: autograde/nbgrader_config.py, 30)")
    p.add_argument("--memory-mb", type=int, default=None, help="memory cap per kernel in MiB (default 4096)")
    p.add_argument("--force", action="store_true", help="regrade submissions that are already graded")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_grade(args) -> int:
    try:
        rows = grade(args.folder, args.course, jobs=args.jobs, timeout=args.timeout, memory_mb=args.memory_mb,
                     force=args.force, progress=not args.quiet)
    except (GradingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    width = max([len(f"{r.student}/{r.assignment}") for r in rows] + [10])
    for r in rows:
        score = f"{r.score:g}/{r.max_score:g}" if r.status == "graded" else r.status.upper()
        print(f"{r.student + '/' + r.assignment:<{width}}  {score:>9}  {r.problems}")
    course = Path(args.course)
    print(f"\ngrades: {course / 'grades.csv'}   report: {course / 'report.csv'}   feedback: {course / 'feedback'}/")
    bad = [r for r in rows if r.status != "graded"]
    if bad:
        print(f"{len(bad)} submission(s) need a look (see report.csv); every other one is graded.")
    return 1 if bad else 0


# ----------------------------------------------------------------------------- the check command

@dataclass
class TestResult:
    grade_id: str
    points: float
    status: str  # pass | fail | hidden
    message: str = ""
    hint: str = ""


def check(notebook: Path, timeout: int = 60, memory_mb: int = 4096) -> tuple[list[TestResult], list[str]]:
    """Run a notebook top to bottom in a fresh kernel. Returns (visible test results, answer-cell errors)."""
    import nbformat

    from course.grade.nbgrader_ext import SafeExecute

    nb = nbformat.read(str(notebook), as_version=4)
    env = jupyter_env()
    env.update({"NBGRADER_EXECUTION": "validate", "MPLBACKEND": "Agg"})
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        from traitlets.config import Config

        cfg = Config()
        cfg.GraderKernelManager.memory_limit_mb = memory_mb
        executor = SafeExecute(timeout=timeout, interrupt_on_timeout=True, config=cfg,
                               extra_arguments=["--IPKernelApp.log_level=ERROR"])
        executor.preprocess(nb, {"metadata": {"path": str(Path(notebook).resolve().parent)}})
    finally:
        os.environ.clear()
        os.environ.update(old)

    results, answer_errors = [], []
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code":
            continue
        error = next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)
        if meta.get("solution") and error is not None:
            answer_errors.append(f"answer cell '{meta.get('grade_id')}' raised {error.ename}: {error.evalue}".strip())
        if not meta.get("grade") or meta.get("solution"):
            continue
        code_lines = [ln for ln in cell.source.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        hint = " ".join(ln.strip()[len("# Hint:"):].strip() for ln in cell.source.splitlines()
                        if ln.strip().startswith("# Hint:"))
        test = TestResult(meta.get("grade_id", "?"), float(meta.get("points", 0)), "pass", hint=hint)
        if not code_lines or HIDDEN_BEGIN in cell.source:
            test.status = "hidden"
        elif error is not None:
            test.status = "fail"
            test.message = f"{error.ename}: {error.evalue}".strip().rstrip(":")
        elif any(o.output_type == "stream" and o.name == "stderr" for o in cell.get("outputs", [])):
            test.status = "fail"
            test.message = "the cell wrote to stderr (the grader counts that as a failure)"
        results.append(test)
    return results, answer_errors


def _changed_locked_cells(path: Path) -> list[str]:
    """What repair() would report against the released exercise of the same name (nothing if unknown)."""
    import nbformat

    by_stem = {nb: a for a, nbs in assignments().items() for nb in nbs}
    release = EXERCISES / by_stem.get(path.stem, "?") / f"{path.stem}.ipynb"
    if not release.exists():
        return []
    problems = repair(nbformat.read(str(path), as_version=4), nbformat.read(str(release), as_version=4))
    learner_words = {"deleted answer cell(s) replaced by empty ones": "you deleted answer cell(s)",
                     "deleted test cell(s) put back": "you deleted test cell(s)",
                     "edited test cell(s) restored": "you edited test cell(s)",
                     "test cell metadata restored": "you changed the metadata of test cell(s)"}
    return [learner_words[p.split(":")[0]] + p[p.index(":"):] for p in problems]


def add_arguments_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("notebook", type=Path, help="your exercise notebook, e.g. exercises/01_memory_formula/memory_formula.ipynb")
    p.add_argument("--timeout", type=int, default=60, help="seconds per cell before it is interrupted (default 60)")


def run_check(args) -> int:
    path = Path(args.notebook)
    if not path.exists():
        print(f"error: {path} does not exist; give the path of your exercise notebook", file=sys.stderr)
        return 2
    if args.timeout < 1:
        print(f"error: --timeout must be at least 1 second, got {args.timeout}", file=sys.stderr)
        return 2
    reason = _invalid_reason(path)
    if reason:
        print(f"error: {path}: {reason}. Restore it from exercises/ or your last checkpoint.", file=sys.stderr)
        return 2
    for problem in _changed_locked_cells(path):
        print(f"  note: {problem}; the grader uses the tests as released, so fix this before submitting")
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
            print(f"  [hidden] {t.grade_id} ({t.points:g} pt): run by the grader only")
            continue
        mark = "[pass]" if t.status == "pass" else "[FAIL]"
        print(f"  {mark} {t.grade_id} ({t.points:g} pt)")
        if t.status == "fail":
            print(f"         {t.message}")
            if t.hint:
                print(f"         hint: {t.hint}")
    passed = sum(t.status == "pass" for t in visible)
    try:  # the learner's progress file remembers each self-check (`kvcourse progress` shows it)
        from course.teach.progress import record_exercise_check

        record_exercise_check(path.stem, passed, len(visible),
                              {t.grade_id: t.status for t in visible})
    except Exception as exc:  # progress is a convenience: never let it break the check itself
        print(f"  note: could not save this check to your progress file ({exc})")
    print(f"{passed}/{len(visible)} visible tests pass"
          + ("" if passed == len(visible) else "; fix the failing ones and run kvcourse check again"))
    return 0 if passed == len(visible) else 1


# ----------------------------------------------------------------------------- entry point for workers

def _main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"] and len(argv) == 2:
        return _worker(argv[1])
    if argv[:1] == ["exercises"]:
        for path in generate_exercises():
            print(path.relative_to(PROJECT_ROOT))
        return 0
    print("usage: python -m course.grade.grading exercises   (regenerate exercises/ from solutions/)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
