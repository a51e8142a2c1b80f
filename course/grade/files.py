"""Files the grader writes: atomically (temp file + rename, so a crash or a full disk leaves the previous
version intact), under a lock (one grader per course folder), and read back with a clear error."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


class GradingError(RuntimeError):
    """The pipeline itself could not run (not one student's problem); the message says what to do."""


def _mode_for(path: Path) -> int:
    """The permissions a plain write would give `path`: the file's own where it exists, else 0o666 less the
    umask (mkstemp's temp files are 0o600: a grades.csv shared with teaching assistants became private)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        pass
    umask = 0o022
    try:
        for line in open("/proc/self/status"):
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o666 & ~umask


def atomic_write(path: Path, data: bytes | str, private: bool = False) -> None:
    """Write `data` to `path` through a temp file in the same folder, fsync it, then rename over `path` (with the
    file's permissions, or the umask's for a new one; `private`: readable by its owner only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fchmod(fh.fileno(), 0o600 if private else _mode_for(path))
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_output(path: Path):
    """Yield a temp path in `path`'s folder; on success it replaces `path`, on any error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as fh:
            os.fchmod(fh.fileno(), _mode_for(path))
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(staged: Path, dest: Path) -> None:
    """Put the folder `staged` at `dest` (the old `dest`, if any, goes only once the new one is in place)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(staged, dest)
    shutil.rmtree(old, ignore_errors=True)


def disk_error(exc: OSError, what: Path) -> GradingError:
    why = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror or str(exc)
    return GradingError(f"could not write {what}: {why}; the previous version of the file is intact. "
                        "Free some space and run the same command again (graded submissions are kept).")


def read_json(path: Path, what: str, default=None):
    """JSON from `path` (default when missing); a corrupt file raises GradingError naming it."""
    path = Path(path)
    if not path.exists():
        return default
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise GradingError(f"{path} ({what}) is corrupt: {exc}. Move it aside (or delete it) and run again: "
                           "every submission is then graded afresh.") from None


@contextmanager
def course_lock(course: Path):
    """One grader per course folder: a second one stops at once with a message naming the first."""
    lock_path = Path(course) / "work" / "grade.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(lock_path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise GradingError(f"another grader is already working on {course} ({holder}); wait for it to finish, "
                           "or give this run its own --course folder") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
    fh.flush()
    try:
        yield
    finally:
        fh.seek(0)
        fh.truncate()
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()
