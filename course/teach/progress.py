"""Saved progress: quiz answers, self-assessments, interview cards seen, exercise self-checks.

Everything lives in one SQLite file, by default ``progress.sqlite`` in the user's data directory
(platformdirs: ~/.local/share/kvcourse on Linux); the environment variable KVCOURSE_PROGRESS names
another file (or a folder to put ``progress.sqlite`` in; a trailing slash always means a folder). It survives kernel restarts and JupyterLab
sessions because every write is committed at once.

Two notebooks writing at the same time lose nothing: the file is in WAL mode, every write is its own
``BEGIN IMMEDIATE`` transaction (the writer takes the lock up front instead of failing half-way), and a
connection waits up to ``timeout`` seconds for the lock instead of raising "database is locked".
Rows are only ever appended (answers, self-assessments, ...); "latest" is a query, never an update.

A database that is someone else's (tables the course does not make, or another user_version) is never
touched: it is read-only checked, left exactly as it is, and this session's progress goes to a temporary file,
with a warning that says so. A file that is really not a readable database (truncated, damaged pages) is never a
crash and never silently lost: it is renamed to ``<name>.corrupt-<timestamp>`` (with its -wal/-shm
side files) with a ProgressFileWarning naming both paths, and a fresh file is started. A healthy file is never
moved aside: when it (or its folder) cannot be written, the saved progress is read as it is, and this
session's new progress goes to a temporary copy, with a warning that says so and why; when another process
holds its lock longer than ``timeout``, the call raises ProgressFileBusy ("busy ...; try again"); when its disk
is full or failing, a write raises ProgressFileDiskError ("cannot write the progress file ... (disk full)"). Both are
ProgressFileError: nothing of that call was saved, everything saved before stays. A read on a full disk still
reads: the file is read as it is, with nothing made beside it (``disk_error`` and one note say so), so
``kvcourse progress`` and ``kvcourse review --list`` show what is saved.
Rows with values of the wrong type or out of range (a file edited by hand or by another tool: at='abc', passed > total,
a negative count) are skipped when read, with one note.
Commands print each warning as one "Note: ..." line (``notes_printed``, ``ProgressStore.notes``).

``kvcourse progress`` (course/cli/progress.py) prints a per-lesson summary; ``kvcourse progress --reset``
clears it after asking (``--yes`` skips the question).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import sqlite3
import stat
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from course.teach.questions import LEVELS, RENAMED, normalise_level  # noqa: F401  (re-exported)

ENV_VAR = "KVCOURSE_PROGRESS"
FILE_NAME = "progress.sqlite"
SCHEMA_VERSION = 1

def current_answer(row: dict) -> dict:
    """A saved answer under its question's current id and option letter (RENAMED); other rows unchanged."""
    if row["question_id"] not in RENAMED:
        return row
    new_id, letters = RENAMED[row["question_id"]]
    return dict(row, question_id=new_id, choice=letters.get(row["choice"], row["choice"]))


_SCHEMA = {
    "answers": "id INTEGER PRIMARY KEY, lesson TEXT NOT NULL, question_id TEXT NOT NULL, "
               "choice TEXT NOT NULL, correct INTEGER NOT NULL, at REAL NOT NULL",
    "self_assessments": "id INTEGER PRIMARY KEY, lesson TEXT NOT NULL, level TEXT NOT NULL, at REAL NOT NULL",
    "cards": "id INTEGER PRIMARY KEY, lesson TEXT NOT NULL, card_id TEXT NOT NULL, at REAL NOT NULL",
    "exercise_checks": "id INTEGER PRIMARY KEY, exercise TEXT NOT NULL, passed INTEGER NOT NULL, "
                       "total INTEGER NOT NULL, details TEXT, at REAL NOT NULL",
    "measurements": "id INTEGER PRIMARY KEY, lesson TEXT NOT NULL, key TEXT NOT NULL, "
                    "value TEXT NOT NULL, at REAL NOT NULL",
    # Review (course/teach/review.py): "knew it"/"missed it" after revealing an interview card, and the marks
    # of `kvcourse review --reset` (the schedule ignores answers before the latest one). Older files gain
    # these tables on first open.
    "card_ratings": "id INTEGER PRIMARY KEY, lesson TEXT NOT NULL, card_id TEXT NOT NULL, "
                    "knew INTEGER NOT NULL, at REAL NOT NULL",
    "review_resets": "id INTEGER PRIMARY KEY, at REAL NOT NULL",
}
# SQLite result codes (the low byte of sqlite_errorcode), by what they say about the progress file.
_CORRUPT_CODES = {11, 26}     # CORRUPT, NOTADB: not a readable database; the only ones that move a file aside
_NOT_WRITABLE_CODES = {3, 8, 14}  # PERM, READONLY, CANTOPEN: a file we may not write (or open): a session copy
_BUSY_CODES = {5, 6}          # BUSY, LOCKED: another process holds the lock past our timeout: "busy, try again"
_DISK_CODES = {10: "disk I/O error; is its disk full?", 13: "disk full"}  # IOERR, FULL: free space, try again
BUSY_MESSAGE = "the progress file is busy (another kernel or command is using it); try again"


class ProgressFileWarning(UserWarning):
    """The progress file was unusable and was moved aside (or could not be written)."""


class ProgressFileDiskWarning(ProgressFileWarning):
    """A read met a full or failing disk: what is saved is read as it is, and nothing new can be saved there now."""


class ProgressFileError(sqlite3.OperationalError):
    """The progress file cannot be used now (busy, or its disk full or failing). Nothing of the call was saved;
    everything saved before stays. The message says what to do."""


class ProgressFileDiskError(ProgressFileError):
    """The disk holding the progress file is full or failing (SQLite's FULL or IOERR)."""


class ProgressFileBusy(ProgressFileError):
    """Another process held the progress file's lock for longer than the store's timeout. Nothing was changed;
    the same call can simply be made again."""


def _remove_session_copy(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", ".lock"):
        try:
            os.unlink(str(path) + suffix)
        except OSError:
            pass
    try:
        path.parent.rmdir()  # its private folder (private_temp_folder), once empty
    except OSError:
        pass


_TEMP_ENTRY = re.compile(r"kvcourse-[a-z-]+?-(\d+)-")


def private_temp_folder(kind: str) -> Path:
    """A new folder only this user can read (0700), for temporary copies of a learner's or a grader's files.

    It is `<temp>/kvcourse-<uid>/<kind>-<pid>-XXXX` (`kind` starts with "kvcourse-"): one per-user folder, 0700
    too, so nothing in it is ever world-readable whatever the umask. A process killed before its clean-up (SIGKILL,
    or SIGTERM to a notebook kernel, which skips atexit) leaves its folder; the next call sweeps the folders whose
    process is gone, so they never pile up."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    base = Path(tempfile.gettempdir()) / f"kvcourse-{uid}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:  # another user's, or a link: not ours to use
            raise PermissionError(f"{base} is not this user's folder")
        if st.st_mode & 0o077:
            os.chmod(base, 0o700)
    except OSError:
        base = Path(tempfile.gettempdir())  # mkdtemp's own folder is 0700 all the same
    _sweep_dead(base, uid)
    return Path(tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-", dir=base))


def _sweep_dead(base: Path, uid: int) -> None:
    """Remove this user's kvcourse-<kind>-<pid>-* folders in `base` whose process no longer runs."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        match = _TEMP_ENTRY.match(entry.name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid or not entry.is_dir(follow_symlinks=False):
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except (OSError, OverflowError):  # alive (another user's process: EPERM), or not ours to judge
            continue


def _new_session_file() -> Path:
    """Where a session copy goes: progress.sqlite in a new private folder, removed at exit (and by a later
    process if this one is killed first)."""
    import atexit

    path = private_temp_folder("kvcourse-progress") / FILE_NAME
    atexit.register(_remove_session_copy, path)
    return path


class _Unusable(Exception):
    """Internal: the file is not a readable database, or not ours (moved aside)."""


class _Foreign(Exception):
    """Internal: a readable SQLite database that is another application's (its tables or user_version): untouched."""


class _NotWritable(Exception):
    """Internal: a healthy file that this process may not write (read-only file, file system or folder)."""


class _Unreadable(_NotWritable):
    """Internal: a file this process may not even read (permission denied): nothing of it can be shown or copied."""


def default_path() -> Path:
    """$KVCOURSE_PROGRESS (a file, or a folder for progress.sqlite), else the user data dir."""
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env).expanduser()
        # a trailing slash names a folder, made on the first write, even before it exists
        return path / FILE_NAME if path.is_dir() or env.endswith(("/", os.sep)) else path
    from platformdirs import user_data_dir

    return Path(user_data_dir("kvcourse", appauthor=False)) / FILE_NAME


def _kind_of_error(exc: sqlite3.Error) -> str | None:
    """'corrupt', 'not writable', 'busy', a _DISK_CODES value, or None (anything else: not about the file, so not
    handled here)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        code &= 0xFF
        return ("corrupt" if code in _CORRUPT_CODES else "not writable" if code in _NOT_WRITABLE_CODES
                else "busy" if code in _BUSY_CODES else _DISK_CODES.get(code))
    msg = str(exc).lower()  # Python < 3.11 has no error codes: the messages SQLite gives for the same codes
    if "disk is full" in msg:
        return _DISK_CODES[13]
    if "disk i/o error" in msg:
        return _DISK_CODES[10]
    if any(s in msg for s in ("not a database", "malformed", "corrupt")):
        return "corrupt"
    if any(s in msg for s in ("readonly", "read-only", "unable to open", "access permission")):
        return "not writable"
    return "busy" if "locked" in msg or "busy" in msg else None


@contextmanager
def notes_printed(file=None):
    """Inside: a ProgressFileWarning is printed as one line, "Note: <what happened and what to do>", on stderr
    (or `file`), instead of Python's warning format with a file and line number. For commands."""
    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.simplefilter("always", ProgressFileWarning)
        show = warnings.showwarning

        def show_note(message, category, filename, lineno, file_=None, line=None):
            if issubclass(category, ProgressFileWarning):
                print(f"Note: {message}", file=file or sys.stderr)
            else:
                show(message, category, filename, lineno, file_, line)

        warnings.showwarning = show_note
        yield


@dataclass
class LessonSummary:
    lesson: str
    title: str = ""
    questions: int = 0          # questions in the bank for this lesson
    answered: int = 0           # distinct questions checked at least once
    right: int = 0              # questions whose latest answer is right
    first_try: int = 0          # questions answered right at the first check
    cards: int = 0              # interview cards in the bank
    cards_seen: int = 0
    self_assessment: str | None = None
    last_activity: float | None = None


@dataclass
class Summary:
    path: Path
    note: str | None = None  # e.g. why new progress cannot be saved in `path`
    notes: list[str] = field(default_factory=list)  # everything to tell the learner (ProgressStore.notes)
    lessons: list[LessonSummary] = field(default_factory=list)
    exercises: list[dict] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.exercises and not any(
            s.answered or s.cards_seen or s.self_assessment for s in self.lessons)


class ProgressStore:
    """One progress file. Every method opens a short-lived connection, so any number of processes
    (notebook kernels, `kvcourse check`, tests) can share the file."""

    def __init__(self, path: str | os.PathLike | None = None, timeout: float = 30.0, keep_damaged: bool = False):
        """keep_damaged: a damaged file is reported and left where it is, never moved aside (a file the learner
        named, e.g. `kvcourse progress --file F`); this session's progress then goes to a temporary copy."""
        self.keep_damaged = keep_damaged
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.path = Path(path) if path is not None else default_path()
        self.saved_path = self.path  # the learner's file (self.path becomes a session copy if it cannot be written)
        self.not_saved: str | None = None  # why new progress cannot be saved in saved_path, when it cannot
        self.moved_aside: list[str] = []   # one sentence per file moved aside, naming where it is now
        self.skipped_rows: dict[str, int] = {}  # table → rows read and skipped (wrong type or out of range)
        # Set when a read met a full or failing disk: reads then come from the file as it is, writing nothing
        # (commands that only show progress still show it); writes still raise it, and one that succeeds clears it.
        self.disk_error: ProgressFileDiskError | None = None
        self.timeout = float(timeout)
        self._ready = False
        self._lock = threading.Lock()

    def __repr__(self):
        return f"ProgressStore({str(self.path)!r})"

    @property
    def notes(self) -> list[str]:
        """What a command must tell the learner about this file, one line each (each was also given as a
        ProgressFileWarning): the files moved aside and where they are, and why new progress is not saved."""
        return self.moved_aside + ([self.not_saved] if self.not_saved else []) + (
            [self._disk_note()] if self.disk_error else []) + ([self._skipped_note()] if self.skipped_rows else [])

    def _disk_note(self) -> str:
        return f"{self.disk_error}. What is saved in it is shown as it is; nothing new is saved until then."

    def _skipped_note(self) -> str:
        counts = ", ".join(f"{n} in {table}" for table, n in sorted(self.skipped_rows.items()))
        return (f"some saved rows in {self.saved_path} have values of the wrong type or out of range (edited by hand "
                f"or by another program) and were skipped ({counts}); the rest of your progress is read as usual.")

    def _valid(self, table: str, rows: list, ok) -> list:
        """The rows for which ok(row) is true; the others are counted in skipped_rows and told once (a
        ProgressFileWarning) instead of failing later with a TypeError far from the file."""
        good = [r for r in rows if ok(r)]
        if len(good) < len(rows):
            first = not self.skipped_rows
            self.skipped_rows[table] = max(self.skipped_rows.get(table, 0), len(rows) - len(good))
            if first:
                warnings.warn(_sentence(self._skipped_note()), ProgressFileWarning, stacklevel=3)
        return good

    def _busy(self) -> ProgressFileBusy:
        return ProgressFileBusy(f"{BUSY_MESSAGE} ({self.saved_path})")

    def _problem(self, exc: sqlite3.Error) -> Exception | None:
        """The exception that says what `exc` means for the file, or None when it is not about the file."""
        kind = _kind_of_error(exc)
        if kind == "busy":
            return self._busy()
        if kind == "corrupt":
            return _Unusable(str(exc))
        if kind == "not writable":
            return _NotWritable(f"{self.path} cannot be written ({exc})")
        if kind in _DISK_CODES.values():
            return ProgressFileDiskError(f"cannot write the progress file {self.saved_path} ({kind}): free space on "
                                         f"its disk and try again (or set {ENV_VAR} to a file on another disk)")
        return None

    # ------------------------------------------------------------------ connection and recovery
    def _open(self) -> sqlite3.Connection:
        if self.path.exists() and not self.path.is_file():
            raise _Unusable(f"{self.path} is {_what_it_is(self.path)}, not a file")
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        conn.row_factory = sqlite3.Row
        try:
            # In WAL mode NORMAL is still safe against a crashed kernel (only a power cut can lose the
            # last commit) and spares an fsync per click.
            conn.execute("PRAGMA synchronous=NORMAL")
        except BaseException:  # e.g. no room for the -shm: a connection left open would keep its lock
            conn.close()
            raise
        return conn

    def _initialise(self) -> None:
        """Check the file and its schema, and create what is missing. Raises _Unusable if the file cannot be our
        database, _NotWritable if it needs a write this process may not make, ProgressFileBusy if another process
        holds the lock past the timeout.

        A file whose schema is complete is only read here: reading needs no write lock, so a read works while a
        notebook is in the middle of a write, and a read-only file can be read."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = self._open()
            try:
                check = conn.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise _Unusable(f"integrity check failed: {check}")
                foreign = _foreign_reason(conn)
                if foreign:  # before any write: another application's file is never changed
                    raise _Foreign(foreign)
                if self._schema_is_complete(conn):
                    return
                if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for table, columns in _SCHEMA.items():
                        conn.execute(f"CREATE TABLE IF NOT EXISTS {table} ({columns})")
                    self._schema_is_complete(conn)  # raises if a table is someone else's
                    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            finally:
                conn.close()
        except sqlite3.Error as exc:
            problem = self._problem(exc)
            if problem is None:
                raise
            raise problem from exc

    def _foreign_database(self) -> str | None:
        """Why the file is another application's database, checked without writing anything where it lies (no lock
        file, no -shm, no checkpoint of its -wal); None when it is empty, ours, or not readable this way (the checks
        in _initialise then say what it is)."""
        try:
            if self.path.stat().st_size == 0:
                return None
        except OSError:
            return None
        # immutable: SQLite reads the main file only, takes no lock and makes no -shm beside it
        reason = _foreign_reason_read_only(self.path)
        wal = Path(str(self.path) + "-wal")
        if reason or not wal.is_file() or wal.stat().st_size == 0:
            return reason
        # A -wal not yet folded in (another program is using the file, or stopped without closing it) can hold its
        # tables. A write connection would fold it into the main file, so check a copy of the two in a folder of
        # our own. Our own file is small; another program's with its tables in the main file was found above.
        with tempfile.TemporaryDirectory(prefix="kvcourse-check-") as folder:
            copy = Path(folder) / "check.sqlite"
            try:
                shutil.copyfile(self.path, copy)
                shutil.copyfile(wal, str(copy) + "-wal")
            except OSError:  # no room for a copy: read-only in place (never folds the -wal in; may add a -shm)
                return _foreign_reason_read_only(self.path, immutable=False)
            return _foreign_reason_read_only(copy, immutable=False)

    @staticmethod
    def _schema_is_complete(conn: sqlite3.Connection) -> bool:
        """True if every table is there with our columns, in WAL mode, at SCHEMA_VERSION; False if something
        is missing (an older or new file); raises _Unusable if a table has other columns (not our file)."""
        complete = True
        for table, columns in _SCHEMA.items():
            have = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
            want = [c.strip().split()[0] for c in columns.split(",")]
            if not have:
                complete = False
            elif have != want:
                raise _Unusable(f"table {table} has columns {have}, expected {want}")
        return (complete and conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
                and conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal")

    def _looks_like_progress(self) -> bool:
        """Only a file that could be ours is ever moved aside: empty, SQLite, or named like a progress file.

        Anything else (a mistyped KVCOURSE_PROGRESS pointing at notes, a system file) is left exactly as it is."""
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):  # a named pipe would block the read below
                return False
            with open(self.path, "rb") as f:
                head = f.read(16)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return not head or head.startswith(b"SQLite format 3") or self.path.suffix in (".sqlite", ".sqlite3", ".db")

    def _move_aside(self, reason: str) -> None:
        if not self._looks_like_progress():
            self._leave_foreign_file(reason)
            return
        if self.keep_damaged:
            self._leave_damaged_file(reason)
            return
        self._rename_aside(reason)

    def _leave_foreign_file(self, reason: str) -> None:
        """The path holds something that is not ours: touch nothing there (no rename, no lock file)."""
        self._session_only(lambda name: (
            f"{self.path} is not a progress file ({reason}), so it was left untouched; this session's progress is "
            f"kept for this session only (in {name}). To keep it, set {ENV_VAR} (or --file) to a file of its own, "
            "e.g. progress.sqlite."))

    def _leave_damaged_file(self, reason: str) -> None:
        """A damaged file the learner named: reported, left exactly where it is (keep_damaged)."""
        self._session_only(lambda name: (
            f"{self.path} is damaged ({reason}); it was named on the command line, so it was left as it is. Restore "
            "it from a backup, or move it aside yourself to start afresh; this session's progress is kept for this "
            f"session only (in {name})."))

    def _session_only(self, say) -> None:
        """Keep this session's progress in a private copy of its own; `say(name)` tells the learner why."""
        name = _new_session_file()
        self.not_saved = say(name)
        warnings.warn(_sentence(self.not_saved), ProgressFileWarning, stacklevel=5)
        self.path = name

    def _rename_aside(self, reason: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        moved = False
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            try:
                os.replace(src, Path(str(aside) + suffix))
                moved = moved or suffix == ""
            except FileNotFoundError:
                continue  # another process moved it first, or there was no side file
        if moved:
            note = (f"The progress file {self.path} could not be read ({reason}), so it was moved aside to "
                    f"{aside}; your earlier progress is in that file. A fresh progress file was started.")
            self.moved_aside.append(note)
            warnings.warn(note, ProgressFileWarning, stacklevel=4)

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            try:
                self._ensure_ready_locked()
            except _NotWritable as exc:  # a read-only file: read it, keep new progress aside, and say so
                self._use_session_copy(str(exc), readable=not isinstance(exc, _Unreadable))
            except OSError as exc:  # the folder is not writable (or a file is where it would be): keep going, say so
                blocker = _file_in_the_way(self.path.parent)
                self._use_session_copy(_file_in_the_way_text(blocker) if blocker else
                                       f"{self.path.parent} is not writable ({exc.strerror or exc})")
            self._ready = True

    def _use_session_copy(self, why: str, readable: bool = True) -> None:
        """The progress file (or its folder) cannot be written (read-only, or not ours): read the saved progress as
        it is, and keep this session's new progress in a temporary copy (in a folder only this user can read),
        removed at exit. The reason is kept in `not_saved` (commands print it) and given as a ProgressFileWarning.
        `readable` False: the file cannot even be read (permission denied); `why` says how to fix that."""
        fallback = _new_session_file()  # SQLite creates the file
        copied = False
        if readable and self.path.is_file():
            try:  # the file and its write-ahead log, as they are: nothing is written where they lie
                for suffix in ("", "-wal"):
                    if Path(str(self.path) + suffix).exists():
                        shutil.copyfile(str(self.path) + suffix, str(fallback) + suffix)
                        os.chmod(str(fallback) + suffix, 0o600)
                copied = True
            except OSError as read_exc:
                why += f", and the file cannot be read either ({read_exc.strerror or read_exc})"
        if not readable:
            self.not_saved = (f"{why}. Your saved progress is not shown until then; this session's new progress is "
                              f"kept for this session only (in {fallback}).")
        else:
            self.not_saved = (f"new progress cannot be saved in {self.saved_path}: {why}. "
                              + ("Your saved progress was read from it; this" if copied else "This")
                              + f" session's new progress is kept for this session only (in {fallback}). "
                              f"Set {ENV_VAR} to a writable file to keep it.")
        warnings.warn(_sentence(self.not_saved), ProgressFileWarning, stacklevel=5)
        self.path = fallback
        try:
            self._ensure_ready_locked()
        except _Unusable:
            fallback.unlink(missing_ok=True)  # the saved copy is unusable too: start empty
            self._ensure_ready_locked()

    def _ensure_ready_locked(self) -> None:
        if self.path.is_file():
            self._check_readable()
        if self.path.is_file() and not self._looks_like_progress():
            self._leave_foreign_file("it is not an SQLite file")
        elif self.path.is_file() and (foreign := self._foreign_database()):
            self._leave_foreign_file(foreign)
        if self.path.is_file() and not os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK):
            # (a folder that cannot be written either is told as such when the lock file cannot be made there)
            raise _NotWritable(f"{self.path} is read-only (make it writable with `chmod u+w {self.path}`)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._set_up()

    def _check_readable(self) -> None:
        """Raise _Unreadable when this process may not read the file (e.g. it became root's after a `sudo` run):
        it is the learner's file all the same, never to be called another program's or moved aside."""
        try:
            with open(self.path, "rb"):
                pass
        except PermissionError as exc:
            fix = f"`chmod u+rw {self.path}`"
            try:
                owner = os.stat(self.path).st_uid
            except OSError:
                owner = None
            if owner is not None and hasattr(os, "getuid") and owner != os.getuid():
                fix = f"`sudo chown {os.getuid()} {self.path}` (another user owns it), then {fix}"
            raise _Unreadable(f"cannot read the progress file {self.path} ({exc.strerror or 'permission denied'}): "
                              f"make it yours to read and write with {fix}, and run again") from None

    def _set_up(self) -> None:
        """Initialise the file under its lock file (which serialises first-time set-up and recovery between
        processes): a damaged file is moved aside, another application's database is left as it is."""
        from filelock import FileLock, Timeout

        try:
            with FileLock(str(self.path) + ".lock", timeout=self.timeout):
                try:
                    self._initialise()  # another process may already have recovered
                except _Unusable as exc:
                    self._move_aside(str(exc))
                    self._initialise()
        except Timeout as exc:  # a TimeoutError, so an OSError: never to be taken for an unwritable folder
            raise self._busy() from exc
        except _Foreign as exc:  # found only under the lock (the read-only check could not open it)
            self._leave_foreign_file(str(exc))
            self._ensure_ready_locked()

    @contextmanager
    def _connection(self, write: bool):
        self._ensure_ready()
        conn = self._open()
        try:
            if write:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            else:
                yield conn
        finally:
            conn.close()

    def _run(self, fn, write: bool = False):
        """Run fn(conn). If the file turns out to be corrupt mid-session, recover once and retry; if it cannot be
        written, retry in a session copy (saying so); if it stays busy, raise ProgressFileBusy; on a full or failing
        disk, a write raises ProgressFileDiskError and a read reads the file as it is (_read_as_it_is)."""
        if not write and self.disk_error is not None:
            return self._read_as_it_is(fn)
        for attempt in (0, 1):
            try:
                with self._connection(write) as conn:
                    result = fn(conn)
                if write:
                    self.disk_error = None  # space was freed: reads open the file as usual again
                return result
            except ProgressFileDiskError as exc:  # found while setting the file up (_ensure_ready)
                if write:
                    raise
                return self._read_as_it_is(fn, exc)
            except ProgressFileError:
                raise
            except (sqlite3.Error, _Unusable, _NotWritable) as exc:
                problem = exc if isinstance(exc, (_Unusable, _NotWritable)) else self._problem(exc)
                if problem is None:
                    raise
                if isinstance(problem, ProgressFileDiskError) and not write:
                    return self._read_as_it_is(fn, problem)
                if isinstance(problem, ProgressFileError):
                    raise problem from exc
                if attempt:
                    raise
                self._ready = False
                with self._lock:
                    if isinstance(problem, _NotWritable):
                        self._use_session_copy(str(problem), readable=not isinstance(problem, _Unreadable))
                    else:
                        self._recover()
                    self._ready = True

    def check_writable(self) -> None:
        """Raise the disk error an earlier read met (ProgressFileDiskError), if any: for a command that is about to
        write and should stop before asking the learner anything, not after."""
        if self.disk_error is not None:
            raise self.disk_error

    def _read_as_it_is(self, fn, disk_error: ProgressFileDiskError | None = None):
        """fn(conn) on a connection that writes nothing: the disk is full or failing, and a read must still show
        what is saved (a normal connection needs a -shm file, a lock file, tables made). The first time, says so
        once (a ProgressFileWarning, and a line in notes). If even this read fails, raises the disk error."""
        if disk_error is not None and self.disk_error is None:
            self.disk_error = disk_error
            warnings.warn(_sentence(self._disk_note()), ProgressFileDiskWarning, stacklevel=4)
        try:
            conn = _connect_without_writing(self.path, self.timeout)
        except sqlite3.Error as exc:
            raise self.disk_error from exc
        try:
            return fn(conn)
        except sqlite3.Error as exc:
            problem = self._problem(exc)
            if problem is None:  # not about the file: a mistake here, not to be told as a full disk
                raise
            raise (problem if isinstance(problem, ProgressFileBusy) else self.disk_error) from exc
        finally:
            conn.close()

    def _recover(self) -> None:
        self._set_up()

    # ------------------------------------------------------------------ writes
    def record_answer(self, lesson: str, question_id: str, choice: str, correct: bool) -> None:
        _need_text(lesson=lesson, question_id=question_id, choice=choice)
        self._run(lambda c: c.execute(
            "INSERT INTO answers (lesson, question_id, choice, correct, at) VALUES (?, ?, ?, ?, ?)",
            (lesson, question_id, choice, int(bool(correct)), time.time())), write=True)

    def record_self_assessment(self, lesson: str, level: str) -> str:
        _need_text(lesson=lesson)
        level = normalise_level(level)
        self._run(lambda c: c.execute(
            "INSERT INTO self_assessments (lesson, level, at) VALUES (?, ?, ?)",
            (lesson, level, time.time())), write=True)
        return level

    def record_card_view(self, lesson: str, card_id: str) -> None:
        _need_text(lesson=lesson, card_id=card_id)
        self._run(lambda c: c.execute("INSERT INTO cards (lesson, card_id, at) VALUES (?, ?, ?)",
                                      (lesson, card_id, time.time())), write=True)

    def record_exercise_check(self, exercise: str, passed: int, total: int, details=None) -> None:
        """Save one `kvcourse check` run: `passed` of `total` visible tests passed."""
        _need_text(exercise=exercise)
        if not (isinstance(total, int) and total >= 0):
            raise ValueError(f"total must be an integer >= 0, got {total!r}")
        if not (isinstance(passed, int) and 0 <= passed <= total):
            raise ValueError(f"passed must be an integer in [0, total={total}], got {passed!r}")
        blob = json.dumps(details) if details is not None else None
        self._run(lambda c: c.execute(
            "INSERT INTO exercise_checks (exercise, passed, total, details, at) VALUES (?, ?, ?, ?, ?)",
            (exercise, passed, total, blob, time.time())), write=True)

    def record_measurements(self, lesson: str, values: dict) -> int:
        """Keep the numbers a lesson measured (JSON-serialisable ones), so quiz explanations can cite
        them after a kernel restart. Returns how many were saved."""
        _need_text(lesson=lesson)
        rows = []
        now = time.time()
        for key, value in values.items():
            try:
                rows.append((lesson, str(key), json.dumps(value), now))
            except (TypeError, ValueError):
                continue
        if rows:
            self._run(lambda c: c.executemany(
                "INSERT INTO measurements (lesson, key, value, at) VALUES (?, ?, ?, ?)", rows), write=True)
        return len(rows)

    def record_card_rating(self, lesson: str, card_id: str, knew: bool) -> None:
        """Save a self-rating of an interview card after revealing it (for the review schedule)."""
        _need_text(lesson=lesson, card_id=card_id)
        self._run(lambda c: c.execute("INSERT INTO card_ratings (lesson, card_id, knew, at) VALUES (?, ?, ?, ?)",
                                      (lesson, card_id, int(bool(knew)), time.time())), write=True)

    def record_review_reset(self) -> None:
        """Start the review schedule over; answers and ratings stay saved."""
        self._run(lambda c: c.execute("INSERT INTO review_resets (at) VALUES (?)", (time.time(),)), write=True)

    def reset(self) -> None:
        """Delete everything saved (in one transaction)."""
        def clear(conn):
            for table in _SCHEMA:
                conn.execute(f"DELETE FROM {table}")
        self._run(clear, write=True)

    # ------------------------------------------------------------------ reads
    def answers(self, lesson: str | None = None) -> list[dict]:
        """Every answer checked, oldest first."""
        sql = "SELECT lesson, question_id, choice, correct, at FROM answers"
        args: tuple = ()
        if lesson is not None:
            sql, args = sql + " WHERE lesson = ?", (lesson,)
        rows = self._valid("answers", self._run(lambda c: c.execute(sql + " ORDER BY id", args).fetchall()),
                           lambda r: _texts(r["lesson"], r["question_id"], r["choice"]) and _is_int(r["correct"])
                           and _is_time(r["at"]))
        rows.sort(key=lambda r: r["at"])  # stable: saved order among equal times, as ORDER BY at, id
        return [current_answer(dict(r, correct=bool(r["correct"]))) for r in rows]

    def latest_answers(self, lesson: str | None = None) -> dict[str, dict]:
        """question id → its most recent answer."""
        return {a["question_id"]: a for a in self.answers(lesson)}

    def self_assessment(self, lesson: str) -> str | None:
        rows = self._valid("self_assessments", self._run(lambda c: c.execute(
            "SELECT level, at FROM self_assessments WHERE lesson = ? ORDER BY id", (lesson,)).fetchall()),
            lambda r: _texts(r["level"]) and _is_time(r["at"]))
        return max(reversed(rows), key=lambda r: r["at"])["level"] if rows else None  # the latest; ties: last saved

    def cards_seen(self, lesson: str | None = None) -> set[str]:
        sql, args = "SELECT DISTINCT card_id FROM cards", ()
        if lesson is not None:
            sql, args = sql + " WHERE lesson = ?", (lesson,)
        return {r["card_id"] for r in self._valid("cards", self._run(lambda c: c.execute(sql, args).fetchall()),
                                                  lambda r: _texts(r["card_id"]))}

    def exercise_checks(self) -> list[dict]:
        """The latest self-check of each exercise, with how many times it was checked."""
        rows = self._valid("exercise_checks", self._run(lambda c: c.execute(
            "SELECT exercise, passed, total, details, at FROM exercise_checks ORDER BY id").fetchall()),
            lambda r: _texts(r["exercise"]) and _is_int(r["passed"]) and _is_int(r["total"])
            and 0 <= r["passed"] <= r["total"] and _is_time(r["at"])  # as record_exercise_check saves them
            and (r["details"] is None or isinstance(r["details"], str)))
        latest: dict[str, dict] = {}
        runs: dict[str, int] = {}
        for r in rows:
            runs[r["exercise"]] = runs.get(r["exercise"], 0) + 1
            if r["exercise"] not in latest or r["at"] >= latest[r["exercise"]]["at"]:
                latest[r["exercise"]] = dict(r)
        out = []
        for exercise in sorted(latest):
            r = latest[exercise]
            details = None
            if r["details"]:
                try:
                    details = json.loads(r["details"])
                except ValueError:  # shown without its details (they only add the names of the tests)
                    self._valid("exercise_checks.details", [r], lambda _r: False)
            out.append(dict(r, details=details, runs=runs[exercise]))
        return out

    def measurements(self, lesson: str | None = None) -> dict:
        """key → latest saved value (of one lesson, or of all lessons)."""
        sql, args = "SELECT key, value, at FROM measurements", ()
        if lesson is not None:
            sql, args = sql + " WHERE lesson = ?", (lesson,)
        rows = self._run(lambda c: c.execute(sql + " ORDER BY id", args).fetchall())
        values = {}
        for r in sorted(self._valid("measurements", rows, lambda r: _texts(r["key"]) and isinstance(r["value"], str)
                                    and _is_time(r["at"])), key=lambda r: r["at"]):
            try:
                values[r["key"]] = json.loads(r["value"])
            except ValueError:
                self._valid("measurements", [r], lambda _r: False)
        return values

    def card_ratings(self) -> list[dict]:
        """Every interview-card self-rating, oldest first."""
        rows = self._valid("card_ratings", self._run(lambda c: c.execute(
            "SELECT lesson, card_id, knew, at FROM card_ratings ORDER BY id").fetchall()),
            lambda r: _texts(r["lesson"], r["card_id"]) and _is_int(r["knew"]) and _is_time(r["at"]))
        rows.sort(key=lambda r: r["at"])
        return [dict(r, knew=bool(r["knew"])) for r in rows]

    def review_reset_at(self) -> float | None:
        rows = self._valid("review_resets", self._run(lambda c: c.execute("SELECT at FROM review_resets").fetchall()),
                           lambda r: _is_time(r["at"]))
        return max((r["at"] for r in rows), default=None)

    def lessons_started(self) -> dict[str, float]:
        """lesson → when anything was first saved for it (an answer, a card seen or rated, a self-assessment,
        a measurement)."""
        started: dict[str, float] = {}
        for table in ("answers", "cards", "card_ratings", "self_assessments", "measurements"):
            rows = self._valid(table, self._run(lambda c: c.execute(f"SELECT lesson, at FROM {table}").fetchall()),
                               lambda r: _texts(r["lesson"]) and _is_time(r["at"]))
            for r in rows:
                started[r["lesson"]] = min(started.get(r["lesson"], r["at"]), r["at"])
        return started

    def counts(self) -> dict[str, int]:
        def count(conn):
            return {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in _SCHEMA}
        return self._run(count)

    def summary(self, bank) -> Summary:
        """Per-lesson summary against a question bank (course.teach.questions.load_questions())."""
        answers = self.answers()
        lesson_ids = list(bank.lessons) + sorted({a["lesson"] for a in answers} - set(bank.lessons))
        out = Summary(path=self.saved_path)
        for lesson in lesson_ids:
            mine = [a for a in answers if a["lesson"] == lesson]
            first: dict[str, dict] = {}
            latest: dict[str, dict] = {}
            for a in mine:
                first.setdefault(a["question_id"], a)
                latest[a["question_id"]] = a
            info = bank.lessons.get(lesson)
            seen = self.cards_seen(lesson)
            out.lessons.append(LessonSummary(
                lesson=lesson,
                title=info.title if info else "",
                questions=len(bank.for_lesson(lesson)) if info else len(latest),
                answered=len(latest),
                right=sum(a["correct"] for a in latest.values()),
                first_try=sum(a["correct"] for a in first.values()),
                cards=len(bank.cards_for(lesson)) if info else len(seen),
                cards_seen=len(seen),
                self_assessment=self.self_assessment(lesson),
                last_activity=max((a["at"] for a in mine), default=None),
            ))
        out.exercises = self.exercise_checks()
        out.note, out.notes = self.not_saved, self.notes  # after every read: what they found is in them
        return out


def _foreign_reason(conn: sqlite3.Connection) -> str | None:
    """Why a readable database is another application's, or None: the course adopts only an empty database or one
    with nothing but its own tables (with its columns) and user_version 0 (never set) or SCHEMA_VERSION."""
    tables = {r[0] for r in conn.execute(
        "SELECT tbl_name FROM sqlite_master WHERE substr(name, 1, 7) != 'sqlite_'").fetchall()}
    others = sorted(tables - set(_SCHEMA))
    if others:
        return f"it is another program's database, with tables {', '.join(others[:5])}"
    for table in sorted(tables):
        have = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        want = [c.strip().split()[0] for c in _SCHEMA[table].split(",")]
        if have != want:
            return f"it is another program's database: its table {table} has columns {', '.join(have)}"
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version not in (0, SCHEMA_VERSION):
        return f"it is another program's database (user_version {version}, the course's is {SCHEMA_VERSION})"
    return None


def _file_in_the_way(folder: Path) -> Path | None:
    """The nearest existing path at or above `folder` when it is not a folder (so `folder` cannot be made), else None."""
    for path in (folder, *folder.parents):
        try:
            if path.exists():
                return None if path.is_dir() else path
        except OSError:
            return None
    return None


def _file_in_the_way_text(blocker: Path) -> str:
    env = os.environ.get(ENV_VAR, "")
    if env.endswith(("/", os.sep)) and Path(env).expanduser() == blocker:
        return (f"{blocker} is a file, not a folder ({ENV_VAR} ends with a slash, which names a folder): set "
                f"{ENV_VAR} to {blocker} without the slash to keep your progress in that file, or to a folder")
    return (f"{blocker} is a file, not a folder, so nothing can be saved under it: set {ENV_VAR} to a folder, or to "
            "a file in one")


def _connect_without_writing(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection that reads the progress file at `path` and writes nothing beside it (for a full disk). Tables an
    older file lacks are empty ones in memory; no file at all reads as nothing saved."""
    wal = Path(str(path) + "-wal")
    try:
        recent_rows_in_wal = wal.stat().st_size > 0
    except OSError:
        recent_rows_in_wal = False
    if not path.is_file():
        conn = sqlite3.connect(":memory:", isolation_level=None)
    elif recent_rows_in_wal:  # the newest rows are in the -wal: read them keeping its index in memory, not a -shm
        conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    else:  # everything is in the main file: read it as a file that does not change (no lock, no side file)
        conn = sqlite3.connect(path.absolute().as_uri() + "?mode=ro&immutable=1", uri=True, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("PRAGMA temp_store=MEMORY")
        have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table, columns in _SCHEMA.items():
            if table not in have:
                conn.execute(f"CREATE TEMP TABLE {table} ({columns})")
    except BaseException:
        conn.close()
        raise
    return conn


def _foreign_reason_read_only(path: Path, immutable: bool = True) -> str | None:
    """_foreign_reason of the database at `path`, opened read-only; None when it cannot be read this way."""
    try:
        conn = sqlite3.connect(path.absolute().as_uri() + ("?mode=ro&immutable=1" if immutable else "?mode=ro"),
                               uri=True)
    except sqlite3.Error:
        return None
    try:
        return _foreign_reason(conn)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def _what_it_is(path: Path) -> str:
    """'a folder', 'a named pipe', ... for a path that is not a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "not readable"
    return ("a folder" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _texts(*values) -> bool:
    return all(isinstance(v, str) for v in values)


def _is_int(value) -> bool:
    return isinstance(value, int)


def _is_time(value) -> bool:
    """Epoch seconds as saved (REAL, or INTEGER from another tool); text, NULL or a blob is not one."""
    return isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value < 2.5e11  # before year 9999


def _need_text(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")


_stores: dict[Path, ProgressStore] = {}


def default_store() -> ProgressStore:
    """The store for default_path() — re-read each call, so changing KVCOURSE_PROGRESS takes effect."""
    path = default_path()
    if path not in _stores:
        _stores[path] = ProgressStore(path)
    return _stores[path]


def record_exercise_check(exercise: str, passed: int, total: int, details=None) -> None:
    """For `kvcourse check`: save a self-check result in the learner's progress file. Anything to tell the
    learner about the file (moved aside, not saved) is printed as a "Note: ..." line."""
    with notes_printed():
        default_store().record_exercise_check(exercise, passed, total, details)
