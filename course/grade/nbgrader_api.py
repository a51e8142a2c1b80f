"""nbgrader, driven from Python: the course's config re-rooted at a course folder, the API object, the
assignments of the source folder, the student versions (exercises/), the gradebook's health and CSV export."""
from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import os
import re
import shutil
import stat
import sqlite3
import tempfile
import warnings
from pathlib import Path

from traitlets.config.loader import PyFileConfigLoader

from course.grade.files import GradingError, atomic_output, disk_error, full_disk
from course.paths import AUTOGRADE, EXERCISES, SOLUTIONS


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


@functools.cache
def schema_version_here() -> None:
    """A new gradebook is stamped with the version of nbgrader's schema, which nbgrader asks of a subprocess
    (`alembic heads`: 0.5 s quiet, 3 s or more on a busy machine, per gradebook); alembic's Python API reads the
    same migration folder here, once per process (test_grading_faults compares the two), and the `alembic` command
    need not be on PATH."""
    import nbgrader.api
    from alembic.script import ScriptDirectory
    from nbgrader import dbutil

    head = ScriptDirectory(dbutil.ALEMBIC_DIR).get_current_head()
    nbgrader.api.get_alembic_version = lambda: head


@functools.cache
def templates_compiled_once() -> None:
    """nbconvert gives every feedback page a new Jinja environment that compiles the HTML templates again (0.2 s a
    submission); Jinja's bytecode cache (this user's 0700 temp folder, checksummed) gives later ones them compiled."""
    import jinja2
    from nbconvert.exporters.templateexporter import TemplateExporter

    cache, create = jinja2.FileSystemBytecodeCache(), TemplateExporter._create_environment

    def create_with_cache(exporter):
        environment = create(exporter)
        environment.bytecode_cache = cache
        return environment

    TemplateExporter._create_environment = create_with_cache


def nbgrader_api(cfg, log_level: str = "ERROR"):
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    schema_version_here()
    templates_compiled_once()
    Path(cfg.Exchange.root).mkdir(parents=True, exist_ok=True)
    api = NbGraderAPI(coursedir=CourseDirectory(config=cfg), config=cfg)
    api.log_level = log_level
    warnings.filterwarnings("ignore", module="nbgrader")  # SQLAlchemy chatter about its own sessions
    return api


def failure(result: dict) -> str:
    """What an nbgrader step that failed said, in one line: the error line its traceback ends in (not the
    traceback), then the last lines of its log."""
    lines = [line.strip() for line in f"{result.get('log') or ''}\n{result.get('error') or ''}".splitlines()
             if line.strip()]
    causes = [line for line in lines if re.match(r"\[?[\w.]*(Error|Exception)\b", line)
              and not line.startswith(("Traceback", "[ERROR]"))][-1:]
    detail = [line for line in lines if not line.startswith(("File ", "Traceback", "^", "~", "Please see"))][-6:]
    return "; ".join(dict.fromkeys(causes + detail))


def check_result(result: dict, what: str, where: Path = AUTOGRADE) -> str:
    """nbgrader's log of a step that worked; GradingError otherwise (a full disk said as such)."""
    if result.get("success"):
        return result.get("log") or ""
    raise (full_disk(f"{result.get('log')}\n{result.get('error')}", where)
           or GradingError(f"nbgrader {what} failed: {failure(result)}"))


def sha(*chunks: bytes) -> str:
    return hashlib.sha256(b"".join(chunks)).hexdigest()


def source_hash(assignment: str, source: Path = SOLUTIONS) -> str:
    return sha(*(p.read_bytes() for p in sorted((Path(source) / assignment).glob("*.ipynb"))))


def generate_exercises(dest: Path = EXERCISES, workdir: Path | None = None) -> list[Path]:
    """Run nbgrader generate_assignment on every assignment of solutions/ and copy the results to dest."""
    with tempfile.TemporaryDirectory(prefix="kvcourse-release-") as tmp:
        course = Path(workdir or tmp)
        api = nbgrader_api(load_config(course))
        written = []
        for assignment, notebooks in assignments().items():
            check_result(api.generate_assignment(assignment, force=True, create=True),
                         f"generate_assignment {assignment}")
            out = Path(dest) / assignment
            out.mkdir(parents=True, exist_ok=True)
            for nb in notebooks:
                shutil.copyfile(course / "release" / assignment / f"{nb}.ipynb", out / f"{nb}.ipynb")
                written.append(out / f"{nb}.ipynb")
        return written


# ----------------------------------------------------------------------------- the gradebook file

NBGRADER_TABLES = {"assignment", "notebook", "student", "submitted_assignment", "submitted_notebook", "grade",
                   "grade_cells", "base_cell"}


def gradebook_busy(path: Path, retry: str = "grade again") -> str:
    """What to say when another program holds the gradebook; `retry` is what the user runs again."""
    return (f"the gradebook {path} is busy: another program (formgrader, or a grader in another course setup) is "
            f"using it. Close it and {retry}; nothing was changed")


def gradebook_unreachable(path: Path, exc: BaseException, retry: str) -> str:
    """What to say when the gradebook cannot be opened for a reason of this machine's, not of the file."""
    return (f"the gradebook {path} cannot be opened ({exc}): that says nothing of its contents (it was not moved "
            "or changed). Check that you may read and write it and its folder (owner and permissions, e.g. after a "
            f"run with sudo) and that the disk has room, then {retry}")


def gradebook_problem(path: Path, retry: str = "grade again") -> str:
    """Why the SQLite gradebook at `path` cannot be trusted ("" when it is sound or does not exist yet): only
    contents that are not a sound nbgrader gradebook. A gradebook in use, or one this user cannot open (no
    permission, a full disk: SQLite's OperationalError), raises GradingError instead: it is not broken, and
    calling it damaged would have it moved aside and its manual grades lost from the live gradebook."""
    path = Path(path)
    if not path.exists():
        return ""
    if not stat.S_ISREG(path.stat().st_mode):
        return "it is not a plain file (a folder, named pipe or device)"
    if path.stat().st_size == 0:
        return "it is empty, 0 bytes (cut short by a crash or a full disk?)"
    if not os.access(path, os.R_OK | os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
        raise GradingError(gradebook_unreachable(path, PermissionError("permission denied"), retry))
    try:
        if any(path.with_name(path.name + end).exists() for end in ("-journal", "-wal")):
            # a writer was killed mid-commit: only a read-write open rolls its journal back (read-only
            # SQLite reports "attempt to write a readonly database" for a sound gradebook)
            with contextlib.closing(sqlite3.connect(str(path), timeout=10)) as con:
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as con:
            if con.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                return "SQLite's integrity check failed"
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):  # in use, not broken: never moved aside (it holds grades)
            raise GradingError(gradebook_busy(path, retry)) from None
        # unable to open, read-only, disk I/O, disk full: the machine's doing, not the file's
        raise GradingError(gradebook_unreachable(path, exc, retry)) from None
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        return f"not a readable SQLite database ({exc})"
    missing = NBGRADER_TABLES - tables
    if missing:
        return f"nbgrader's tables are missing: {', '.join(sorted(missing))}" if tables else "it holds no tables"
    return ""


def export_csv(cfg, dest: Path) -> None:
    """nbgrader's CSV export of the gradebook, written atomically (the previous file survives a failure), its rows
    sorted by assignment and student: nbgrader lists students in the order they reached the gradebook, which
    differs between grading runs (on a cluster, results arrive in any order)."""
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    dest = Path(dest)
    try:
        with atomic_output(dest) as tmp, Gradebook(cfg.CourseDirectory.db_url, "kvcourse") as gb:
            CsvExportPlugin(to=str(tmp)).export(gb)
            header, *rows = tmp.read_text().splitlines(keepends=True)
            fields = [next(csv.reader([row])) for row in rows]  # assignment, duedate, timestamp, student_id, ...
            order = sorted(range(len(rows)), key=lambda i: (fields[i][0], fields[i][3]))
            tmp.write_text(header + "".join(rows[i] for i in order))
    except OSError as exc:
        raise disk_error(exc, dest) from None

