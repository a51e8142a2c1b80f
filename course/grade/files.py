"""Files the grader writes: atomically (temp file + rename, so a crash or a full disk leaves the previous
version intact), under a lock (one grader per course folder), and read back with a clear error."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


class GradingError(RuntimeError):
    """The pipeline itself could not run (not one student's problem); the message says what to do."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
KEPT = ("the grades written before are intact (the gradebook, grades.csv and the ledger are only ever replaced "
        "whole)")


def read_small(path: Path, limit: int, what: str, follow: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them, else GradingError naming it: never a named
    pipe (opening it would wait for a writer), a device (/dev/zero never ends) or a folder; `follow=False`: nor
    through a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError as exc:
        raise GradingError(f"cannot read {what} {path} ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GradingError(f"{what} {path} is not a plain file (a folder, named pipe or device): give a file")
        data = b""
        while st.st_size <= limit and len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if st.st_size > limit or len(data) > limit:
        raise GradingError(f"{what} {path} is {max(st.st_size, len(data)):,} bytes, over the {limit:,} it may "
                           "take: is it the right file?")
    return data


def full_disk(text: str, where: Path) -> GradingError | None:
    """The clear error for a failure (nbgrader's or SQLite's, as text) that was a full disk; None otherwise."""
    if not any(s in text for s in ("No space left on device", "[Errno 28]", "Disk quota exceeded",
                                   "database or disk is full")):
        return None
    return GradingError(f"the disk holding {where} is full; {KEPT}. Free some space and run the same command "
                        "again: it goes on where it stopped")


def _mode_for(path: Path) -> int:
    """The permissions a plain write would give `path`: the file's own where it exists, else 0o666 less the
    umask (mkstemp's temp files are 0o600: a grades.csv shared with teaching assistants became private)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0o022)  # read by setting it: set back at once
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write(path: Path, data: bytes | str, private: bool = False) -> None:
    with atomic_output(path, private) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_output(path: Path, private: bool = False):
    """Yield a temp path in `path`'s folder; on success it is fsynced and replaces `path` (with the file's
    permissions, or the umask's for a new one; `private`: readable by its owner only), on any error it goes.
    A device, pipe or socket at `path` is refused: the rename would replace it (`--to /dev/full`)."""
    path = Path(path)
    with contextlib.suppress(OSError):
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder: the rename refuses it
            raise GradingError(f"{path} is a device, named pipe or socket, not a file: nothing was written there; "
                               "give the path of a new file or of a plain file to replace")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as fh:
            os.fchmod(fh.fileno(), 0o600 if private else _mode_for(path))
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
    """What a failed write of `what` (made through a temp file and a rename: atomic_write, atomic_output) means, and
    what to do about it: by its errno, not always "free some space"."""
    what = Path(what)
    folder = what.parent
    intact = "; the previous version of the file is intact" if what.is_file() else "; nothing was written there"
    again = "run the same command again (graded submissions are kept)"
    elsewhere = "write elsewhere (`kvcourse grade --course DIR`, `kvcourse classroom export --to FILE`)"
    code = exc.errno
    if code in DISK_FULL:
        why = "the disk is full" if code == errno.ENOSPC else "your disk quota is used up"
        return GradingError(f"could not write {what}: {why}{intact}; {KEPT}. Free some space and {again}.")
    if code in (errno.EACCES, errno.EPERM):
        return GradingError(f"could not write {what}: permission denied in {folder}{intact}. Make it yours to write "
                            f"(`chmod u+rwx {folder}`, or fix its owner) or {elsewhere}, and {again}.")
    if code == errno.EROFS:
        return GradingError(f"could not write {what}: {folder} is on a read-only file system{intact}. "
                            f"Instead, {elsewhere} and {again}.")
    if code == errno.EISDIR or what.is_dir():
        return GradingError(f"could not write {what}: it is a folder, not a file; nothing was written. Move that "
                            f"folder away (or choose another path), and {again}.")
    if code in (errno.ENOTDIR, errno.ENOENT):
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        why = (f"{blocker} is a file, not a folder" if blocker is not None
               else f"its folder {folder} does not exist or cannot hold files")
        return GradingError(f"could not write {what}: {why}; nothing was written. Choose a path in a folder that "
                            f"exists (or create it), and {again}.")
    return GradingError(f"could not write {what}: {exc.strerror or exc}{intact}. Fix that and {again}.")


JSON_LIMIT = 256 * 2**20  # bytes of the ledger or a cache: 500 students x 5 assignments is about 2 MB


def read_json(path: Path, what: str, default=None):
    """JSON from `path` (default when missing); a corrupt file raises GradingError naming it."""
    path = Path(path)
    if not path.exists():
        return default
    try:
        return json.loads(read_small(path, JSON_LIMIT, what))
    except (ValueError, UnicodeDecodeError) as exc:
        raise GradingError(f"{path} ({what}) is corrupt: {exc}. Move it aside (or delete it) and run again: "
                           "every submission is then graded afresh.") from None


def _course_folder_error(course: Path, lock_path: Path, exc: OSError) -> GradingError:
    work = lock_path.parent
    blocker = next((p for p in (work, *work.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return GradingError(f"the course folder {course} cannot be used: {blocker} is a file, not a folder (the "
                            f"grader keeps its work in {work}). Move that file away, or give another folder with "
                            "--course DIR; nothing was graded")
    why = ("permission denied" if exc.errno in (errno.EACCES, errno.EPERM)
           else "read-only file system" if exc.errno == errno.EROFS else exc.strerror or str(exc))
    return GradingError(f"cannot write in the course folder {course} ({why}: {exc.filename or work}). Give a folder "
                        "you can write with --course DIR (the default is autograde/ in the course's own folder), or "
                        f"make this one yours (`chmod -R u+rwX {course}`); nothing was graded")


def _lock_left_by_a_dead_grader(fh, holder: str) -> bool:
    """True once the lock is ours, when the grader named in it has died (`kill -9`, then the same command again):
    a sandbox it was starting can hold the lock a moment longer, until the kernel has ended it too."""
    try:
        os.kill(int(holder.split(",")[0].removeprefix("pid ")), 0)
        return False  # alive: a second grader really is at work
    except ProcessLookupError:
        pass
    except (ValueError, OSError):
        return False
    for _ in range(100):
        time.sleep(0.1)
        with contextlib.suppress(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    return False


@contextmanager
def course_lock(course: Path):
    """One grader per course folder: a second one stops at once with a message naming the first."""
    lock_path = Path(course) / "work" / "grade.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock_path, "a+")
    except OSError as exc:  # before anything is graded: say which folder, and what to give instead
        raise _course_folder_error(Path(course), lock_path, exc) from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        if not _lock_left_by_a_dead_grader(fh, holder):
            fh.close()
            raise GradingError(f"another grader is already working on {course} ({holder}); wait for it to "
                               "finish, or give this run its own --course folder") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
    fh.flush()
    try:
        yield
    finally:
        fh.seek(0)
        fh.truncate()
        fcntl.flock(fh, fcntl.LOCK_UN)  # before close: a process forked meanwhile must not keep the lock alive
        fh.close()
