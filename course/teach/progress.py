"""Saved progress: quiz answers, cards, self-assessments, predictions, review answers, exercise self-checks.

One SQLite file, course.paths.progress_path() by default; rows are only appended. SQLite's own atomic commit does the
hard part: WAL mode, one ``BEGIN IMMEDIATE`` transaction per write and a busy timeout, so any number of kernels and
commands write at once and lose nothing (https://www.sqlite.org/wal.html, https://www.sqlite.org/lang_transaction.html).
A file that cannot be used is never overwritten: a damaged one is moved aside to ``<name>.corrupt-<time>-<pid>`` and a
fresh one started (a ProgressFileWarning, kept in ``notes``), or with ``keep_damaged`` left as it is. Anything else
(another program's database, not a file, unreadable or read-only, busy past ``timeout``, a full disk) is a
ProgressFileError, one line naming the file and what to do. On a full disk reads still read the file as it is.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
import stat
import time
import warnings
from collections import Counter
from contextlib import closing, suppress
from functools import lru_cache
from pathlib import Path

from course.paths import PROGRESS_VAR, progress_path
from course.teach.questions import normalise_level

_T, _I, _R = "TEXT NOT NULL", "INTEGER NOT NULL", "REAL NOT NULL"
_SCHEMA = {  # table -> its columns, between `id` and `at` (epoch seconds)
    "answers": {"lesson": _T, "question_id": _T, "choice": _T, "correct": _I},
    "self_assessments": {"lesson": _T, "level": _T},
    "cards": {"lesson": _T, "card_id": _T},
    "exercise_checks": {"exercise": _T, "passed": _I, "total": _I, "details": "TEXT"},
    "measurements": {"lesson": _T, "key": _T, "value": _T},
    "card_ratings": {"lesson": _T, "card_id": _T, "knew": _I},
    "review_resets": {},
    "predictions": {"lesson": _T, "key": _T, "prompt": _T, "predicted": _R, "measured": _R, "tolerance": _R,
                    "unit": _T, "correct": _I},
    "reviews": {"kind": _T, "item": _T, "lesson": _T, "answer": _T, "correct": _I},  # answers given in review
}
_CREATE = "".join(f"CREATE TABLE IF NOT EXISTS {table} (id INTEGER PRIMARY KEY, "
                  + "".join(f"{c} {kind}, " for c, kind in cols.items()) + "at REAL NOT NULL); "
                  for table, cols in _SCHEMA.items())
# True for a row as record() saves it; other rows (edited by hand or by another program) are skipped, with one note.
_TYPEOF = {_T: "'text'", _I: "'integer'", _R: "'integer', 'real'", "TEXT": "'text', 'null'"}
_VALID = {t: " AND ".join(f"typeof({c}) IN ({_TYPEOF[kind]})" for c, kind in [*cols.items(), ("at", _R)])
          + " AND at BETWEEN 0 AND 2.5e11" for t, cols in _SCHEMA.items()}
_VALID["exercise_checks"] += " AND passed BETWEEN 0 AND total"
_KINDS = {11: "damaged", 26: "damaged", 5: "busy", 6: "busy", 10: "disk", 13: "disk"}  # SQLite's primary result codes
BUSY_MESSAGE = "the progress file is busy (another kernel or command is using it); try again"


class ProgressFileWarning(UserWarning):
    """Something about the progress file the learner should know: moved aside, rows skipped, a full disk."""


class ProgressFileError(sqlite3.OperationalError):
    """The progress file cannot be used now (busy, a full disk, not ours...): nothing of the call was saved, everything
    saved before stays, and the message says what to do."""


def _kind(exc: sqlite3.Error) -> str | None:
    return _KINDS.get(getattr(exc, "sqlite_errorcode", 0) & 0xFF)


def _problem(path: Path) -> tuple[str, str] | None:
    """('damaged' | what else the file is, why), read without writing to it; None when it is ours, empty, or not
    there. A -wal beside it (which may hold its tables) is read read-only too; that may add a -shm."""
    try:
        wal = os.path.isfile(f"{path}-wal") and os.path.getsize(f"{path}-wal")
        uri = path.absolute().as_uri() + ("?mode=ro" if wal else "?immutable=1")
        with closing(sqlite3.connect(uri, uri=True)) as c:
            names = [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            tables = {n: [r[1] for r in c.execute(f'PRAGMA table_info("{n}")')] for n in names}
            check = c.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.Error as exc:  # not a database at all: ours only if its name says so
        if getattr(exc, "sqlite_errorcode", 0) == 26 and path.suffix not in (".sqlite", ".sqlite3", ".db"):
            return "not a progress file", str(exc)
        return ("damaged", str(exc)) if _kind(exc) == "damaged" else None
    if wrong := sorted(set(tables) - set(_SCHEMA)) or [t for t in tables if tables[t] != ["id", *_SCHEMA[t], "at"]]:
        return "another program's database", f"tables {', '.join(wrong[:5])}"
    return None if check == "ok" else ("damaged", f"integrity check failed: {check}")


def is_within(predicted: float, measured: float, tolerance: float) -> bool:
    """A prediction is right when |predicted - measured| <= tolerance * |measured|."""
    return abs(predicted - measured) <= tolerance * abs(measured)


class ProgressStore:
    """One progress file. Every call opens a short-lived connection, so any number of processes can share it."""

    def __init__(self, path: str | os.PathLike | None = None, timeout: float = 30.0, keep_damaged: bool = False):
        self.path = Path(path) if path is not None else progress_path()
        self.timeout, self.keep_damaged = float(timeout), keep_damaged
        self.notes: list[str] = []  # everything said about the file, one line each
        self.disk_error: ProgressFileError | None = None  # a read met a full disk (a call that works clears it)
        self._checked = self._skipped = False

    def _note(self, text: str) -> None:
        self.notes.append(text)
        warnings.warn(text[:1].upper() + text[1:], ProgressFileWarning, stacklevel=5)

    def _damaged(self, reason: str) -> None:
        if self.keep_damaged:
            raise ProgressFileError(f"{self.path} is damaged ({reason}); it was named on the command line, so it was "
                                    "left as it is. Restore it from a backup, or move it aside to start afresh")
        from filelock import FileLock, Timeout

        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            with FileLock(f"{self.path}.lock", timeout=self.timeout):  # one process moves it; the others then
                if (_problem(self.path) or ("",))[0] != "damaged":     # find the fresh file it left
                    return
                for suffix in ("", "-wal", "-shm"):
                    if os.path.lexists(f"{self.path}{suffix}"):
                        os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
        except Timeout:
            raise ProgressFileError(f"{BUSY_MESSAGE} ({self.path})") from None
        except OSError as exc:
            raise ProgressFileError(f"{self.path} is damaged ({reason}) and cannot be moved aside ({exc.strerror}): "
                                    f"move it aside yourself, or set {PROGRESS_VAR} to a file of its own") from None
        self._note(f"the progress file {self.path} could not be read ({reason}), so it was moved aside to {aside}; "
                   "your earlier progress is in that file. A fresh progress file was started.")

    def _check_file(self) -> None:
        """Before SQLite opens it: a file of ours that we may read and write; else one line saying what to do."""
        path, own = self.path, f"set {PROGRESS_VAR} to a file of its own"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            mode = os.stat(path).st_mode if os.path.lexists(path) else None
        except OSError as exc:
            where = exc.filename or path.parent
            raise ProgressFileError(f"cannot use {path} ({exc.strerror}: {where}); {own}") from None
        if mode is not None and not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else "a device"
            raise ProgressFileError(f"{path} is {what}, not a file; {own}")
        if mode is not None and not os.access(path, os.R_OK):
            raise ProgressFileError(f"cannot read the progress file {path} (Permission denied): make it yours with "
                                    f"`chmod u+rw {path}` (or `sudo chown $USER {path}`) and run again")
        if (problem := _problem(path)) and problem[0] == "damaged":
            self._damaged(problem[1])
        elif problem:
            raise ProgressFileError(f"{path} is {problem[0]} ({problem[1]}), so it was left untouched; {own}")
        for where, what in ([(path, "it")] if path.exists() else []) + [(path.parent, f"its folder {path.parent}")]:
            if not os.access(where, os.W_OK):
                raise ProgressFileError(f"progress cannot be saved in {path}: {what} is not writable "
                                        f"(`chmod u+w {where}` makes it so)")
        self._checked = True

    def _error(self, exc: sqlite3.Error) -> ProgressFileError:
        return ProgressFileError({
            "busy": f"{BUSY_MESSAGE} ({self.path})",
            "disk": f"cannot write the progress file {self.path} ({exc}; is its disk full?): free space on its disk "
                    f"and try again (or set {PROGRESS_VAR} to a file elsewhere)",
        }.get(_kind(exc), f"progress file {self.path}: {exc}; if it persists, set {PROGRESS_VAR} to another file"))

    def _run(self, fn, write: bool = False):
        """fn(connection), in a transaction if it writes: every read and write of the store comes through here."""
        for attempt in (0, 1):
            if not self._checked:
                self._check_file()
            try:
                # BEGIN IMMEDIATE before a write takes the write lock up front: a writer waits instead of failing
                with closing(sqlite3.connect(self.path, timeout=self.timeout, isolation_level="IMMEDIATE")) as conn:
                    conn.row_factory = sqlite3.Row
                    conn.execute("PRAGMA synchronous=NORMAL")  # in WAL mode still safe if a kernel crashes
                    if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] < len(_SCHEMA):  # new, older
                        with suppress(sqlite3.OperationalError):  # busy at once (no wait) while another process
                            conn.execute("PRAGMA journal_mode=WAL")  # sets up the new file, which it then makes WAL
                        conn.executescript(f"BEGIN IMMEDIATE; {_CREATE} COMMIT;")
                    with conn:  # COMMIT, or ROLLBACK when fn raises
                        out, self.disk_error = fn(conn), None
                    return out
            except sqlite3.Error as exc:
                if _kind(exc) == "damaged" and not attempt:
                    self._checked = False  # checked again (and so moved aside) before the second attempt
                    continue
                if write or _kind(exc) != "disk":
                    raise self._error(exc) from None
                if self.disk_error is None:  # a full disk: read the file as it is, with no lock and no -shm
                    self.disk_error = self._error(exc)
                    self._note(f"{self.disk_error}. Until then what is saved is shown as it is.")
                with closing(sqlite3.connect(self.path.absolute().as_uri() + "?immutable=1", uri=True)) as conn:
                    conn.row_factory = sqlite3.Row
                    return fn(conn)

    def record(self, table: str, *rows: dict) -> None:
        """Append rows to a table in one transaction, each value checked against its column first."""
        for column, value in ((c, v) for row in rows for c, v in row.items()):
            kind = _SCHEMA[table][column]
            if kind == _T and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"{column} must be a non-empty string, got {value!r}")
            number = isinstance(value, int if kind == _I else (int, float)) and not isinstance(value, bool)
            if kind in (_I, _R) and not (number and math.isfinite(value)):
                raise ValueError(f"{column} must be a finite {'whole ' if kind == _I else ''}number, got {value!r}")
        sql = f"INSERT INTO {table} ({', '.join([*rows[0], 'at'])}) VALUES ({', '.join('?' * (len(rows[0]) + 1))})"
        self._run(lambda c: c.executemany(sql, [(*r.values(), time.time()) for r in rows]), write=True)

    def record_answer(self, lesson: str, question_id: str, choice: str, correct: bool) -> None:
        self.record("answers", dict(lesson=lesson, question_id=question_id, choice=choice, correct=int(bool(correct))))

    def record_self_assessment(self, lesson: str, level) -> str:
        self.record("self_assessments", dict(lesson=lesson, level=(level := normalise_level(level))))
        return level

    def record_card_view(self, lesson: str, card_id: str) -> None:
        self.record("cards", dict(lesson=lesson, card_id=card_id))

    def record_card_rating(self, lesson: str, card_id: str, knew: bool) -> None:
        """"I knew it" / "I missed it" after turning an interview card over in a lesson's checkpoint."""
        self.record("card_ratings", dict(lesson=lesson, card_id=card_id, knew=int(bool(knew))))

    def record_exercise_check(self, exercise: str, passed: int, total: int, details=None) -> None:
        if not (isinstance(passed, int) and isinstance(total, int) and 0 <= passed <= total):
            raise ValueError(f"passed and total must be whole numbers, 0 <= passed <= total, got {passed!r}, {total!r}")
        self.record("exercise_checks", dict(exercise=exercise, passed=passed, total=total,
                                            details=None if details is None else json.dumps(details)))

    def record_measurements(self, lesson: str, values: dict) -> None:
        """Keep a lesson's numbers, so quiz text can cite them after a restart; what JSON cannot hold is left out."""
        rows = [dict(lesson=lesson, key=str(k), value=json.dumps(v, default=lambda _: None)) for k, v in values.items()]
        if rows:
            self.record("measurements", *rows)

    def record_prediction(self, lesson: str, key: str, prompt: str, predicted: float, measured: float,
                          tolerance: float, unit: str) -> bool:
        """A prediction and its measurement; returns whether it was within tolerance (is_within)."""
        if not (isinstance(tolerance, (int, float)) and tolerance > 0):
            raise ValueError(f"tolerance must be a number > 0 (0.3 means ±30 %), got {tolerance!r}")
        numbers = all(isinstance(v, (int, float)) for v in (predicted, measured))  # else record() says which is not
        correct = numbers and is_within(predicted, measured, tolerance)
        self.record("predictions", dict(lesson=lesson, key=key, prompt=prompt, predicted=predicted, measured=measured,
                                        tolerance=tolerance, unit=unit, correct=int(correct)))
        return correct

    def record_review(self, kind: str, item: str, lesson: str, answer, correct: bool) -> None:
        """An answer given in review (course/teach/review.py): a right one takes the item out of review."""
        self.record("reviews", dict(kind=kind, item=item, lesson=lesson, answer=str(answer),
                                    correct=int(bool(correct))))

    def reset(self) -> None:
        self._run(lambda c: [c.execute(f"DELETE FROM {t}") for t in _SCHEMA], write=True)

    def rows(self, table: str, lesson: str | None = None) -> list[dict]:
        """A table's rows (of one lesson), oldest first, `correct`/`knew` as bools; rows unlike record()'s skipped."""
        sql = f"SELECT *, ({_VALID[table]}) AS ok FROM {table}{' WHERE lesson = ?' if lesson else ''} ORDER BY at, id"
        rows = self._run(lambda c: [dict(r) for r in c.execute(sql, (lesson,) if lesson else ())])
        good = [r for r in rows if r.pop("ok")]
        self._skip(table, len(rows) - len(good))
        return [dict(r, **{k: bool(r[k]) for k in ("correct", "knew") if k in r}) for r in good]

    def _skip(self, table: str, n: int) -> None:
        if n and not self._skipped:
            self._skipped = True
            self._note(f"some saved rows in {self.path} have values of the wrong type or out of range (edited by hand "
                       f"or by another program) and were skipped ({n} in {table}); the rest is read as usual.")

    def _json(self, table: str, text: str | None):
        """A JSON column's value; None, with the one note, for one edited into something else."""
        try:
            return None if text is None else json.loads(text)
        except ValueError:
            return self._skip(table, 1)

    def answers(self, lesson: str | None = None) -> list[dict]:
        return self.rows("answers", lesson)

    def latest_answers(self, lesson: str | None = None) -> dict[str, dict]:
        return {a["question_id"]: a for a in self.answers(lesson)}

    def self_assessment(self, lesson: str) -> str | None:
        return next((r["level"] for r in reversed(self.rows("self_assessments", lesson))), None)

    def cards_seen(self, lesson: str | None = None) -> set[str]:
        return {r["card_id"] for r in self.rows("cards", lesson)}

    def exercise_checks(self) -> list[dict]:
        """The latest self-check of each exercise (its details decoded), with how many times it was checked."""
        rows = self.rows("exercise_checks")
        latest, runs = {r["exercise"]: r for r in rows}, Counter(r["exercise"] for r in rows)
        return [dict(r, details=self._json("exercise_checks", r["details"]), runs=runs[e])
                for e, r in sorted(latest.items())]

    def measurements(self, lesson: str | None = None) -> dict:
        """key -> latest saved value (of one lesson, or of all); one that is not JSON (edited by hand) is left out."""
        values = {r["key"]: self._json("measurements", r["value"]) for r in self.rows("measurements", lesson)}
        return {key: value for key, value in values.items() if value is not None}

    def counts(self) -> dict[str, int]:
        return self._run(lambda c: {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in _SCHEMA})


_stores = lru_cache(maxsize=None)(ProgressStore)  # one store per file, shared by every caller in this process


def default_store() -> ProgressStore:
    """The store for course.paths.progress_path(), looked up at each call (KVCOURSE_PROGRESS may change)."""
    return _stores(progress_path())
