"""`kvcourse classroom`: run the course for a class on JupyterHub with nbgrader's exchange.

The instructor's side of nbgrader's cycle, one subcommand per step (init, release, collect, grade, feedback,
export, cycle, status; autograde/classroom/README.md has the table), each a thin wrapper over nbgrader's own
command of the same job. The one copy made here is collect's, which opens no link (nbgrader's would follow a
student's link to the solutions with the instructor's rights) and never takes a submission made under another
student's name (it goes to quarantine/). grade is `kvcourse grade` (course/grade/grader.py): each submission
sealed off in a bubblewrap sandbox, here or on Dask workers, verdicts from plain data, one gradebook writer.

Where things are: $KVCOURSE_CLASS_DIR (default ~/kvcourse-class) and $KVCOURSE_EXCHANGE (default
/srv/nbgrader/exchange). On the course's JupyterHub (autograde/classroom/jupyterhub_config.py) the hub
sets both for each instructor, so the command typed in a JupyterLab terminal and the formgrader agree.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import pwd
import re
import shutil
import stat
import sys
from pathlib import Path

from . import files, grader, nbgrader_api
from .files import GradingError
from .nbgrader_api import gradebook_busy, gradebook_problem

COURSE_ID = "kvcourse"
DEFAULT_EXCHANGE = "/srv/nbgrader/exchange"
INBOX = "inbox"  # nbgrader collect writes here; `kvcourse grade` copies (and repairs) into submitted/
QUARANTINE = "quarantine"  # submissions made under another student's name, kept out of inbox/ (collect)
# the exchange root: everyone creates in it (nbgrader's `chmod ugo+rw`), and the sticky bit, as /tmp has, keeps
# anyone but the owner from renaming or deleting what is in it (the course's folder the instructor made)
EXCHANGE_MODE = 0o1777
EXCHANGE_OPTION = ("exchange", "--exchange", "KVCOURSE_EXCHANGE")  # folder_or_error's words for the exchange


# ----------------------------------------------------------------------------- where things are

def class_dir(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("KVCOURSE_CLASS_DIR") or Path.home() / "kvcourse-class").resolve()


def exchange_dir(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("KVCOURSE_EXCHANGE") or DEFAULT_EXCHANGE).resolve()


def config(course: Path, exchange: Path):
    """The course's nbgrader config (autograde/nbgrader_config.py) rooted in the class folder, with the
    shared exchange: what jupyter-config/instructor/nbgrader_config.py gives the formgrader."""
    cfg = nbgrader_api.load_config(course)
    cfg.CourseDirectory.course_id = COURSE_ID
    cfg.Exchange.root = str(exchange)
    return cfg


def make_exchange(exchange: Path) -> Path:
    """Create nbgrader's exchange root, mode 1777 (nbgrader makes the per-course folders in it with its own,
    narrower permissions: inbound is write-only for students, outbound read-only)."""
    exchange = folder_or_error(Path(exchange), *EXCHANGE_OPTION)
    try:
        exchange.mkdir(parents=True, exist_ok=True)
        if stat.S_IMODE(exchange.stat().st_mode) & EXCHANGE_MODE != EXCHANGE_MODE:
            os.chmod(exchange, stat.S_IMODE(exchange.stat().st_mode) | EXCHANGE_MODE)
    except PermissionError as exc:
        raise GradingError(f"cannot create the exchange {exchange} ({exc.strerror}); as root run: "
                           f"mkdir -p {exchange} && chmod 1777 {exchange}") from None
    return exchange


def folder_or_error(path: Path, what: str = "class folder", option: str = "--course",
                    env: str = "KVCOURSE_CLASS_DIR") -> Path:
    """`path`, unless it (or a folder above it) is a file: then GradingError saying which (mkdir would say only
    "[Errno 17] File exists")."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise GradingError(f"the {what} {path} cannot be used: {blocker} is a file, not a folder. Give a folder "
                           f"with {option} or ${env} (or move the file away)")
    return path


def existing_exchange(exchange: Path) -> Path:
    if not exchange.exists():
        raise GradingError(f"no exchange at {exchange}: run `kvcourse classroom init` to create it, or point at "
                           "the right one with --exchange or $KVCOURSE_EXCHANGE")
    if not exchange.is_dir():
        raise GradingError(f"the exchange {exchange} is a file, not a folder: give the exchange folder with "
                           "--exchange or $KVCOURSE_EXCHANGE")
    return exchange


# A student id becomes a folder name in the class folder and part of a submission's name in the exchange
# ("alice+02_kv_cache+<time>"): nbgrader refuses ids with a path separator or '+', and JupyterHub user names
# have no spaces. So: letters, digits and . _ @ -, starting with a letter or digit, never '..'.
STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]*")
ROSTER_LIMIT = 2**20  # bytes: 20,000 user names of 50 characters


def read_roster(path: Path) -> tuple[list[str], list[str]]:
    """(student ids in order, each once; notes on duplicates) from a file of one id per line ('#' comments).
    A line that is not a valid id raises ValueError naming the file, the line and what an id may be."""
    path = Path(path)
    try:
        text = files.read_small(path, ROSTER_LIMIT, "the roster").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"roster {path} is not UTF-8 text (byte offset {exc.start}): give a text file with one student "
                         "user name per line") from None
    first_line, notes, bad = {}, [], []  # first_line: {student: line}, in the roster's order
    for number, line in enumerate(text.splitlines(), 1):
        student = line.strip()
        if not student or student.startswith("#"):
            continue
        if not STUDENT_ID.fullmatch(student) or ".." in student:
            bad.append(f"line {number}: {student!r}")
        elif student in first_line:
            notes.append(f"{student!r} is listed twice (lines {first_line[student]} and {number}): added once")
        else:
            first_line[student] = number
    if bad:
        raise ValueError(f"roster {path} has invalid student ids ({'; '.join(bad)}): an id is a JupyterHub user "
                         "name, letters, digits and . _ @ - only (no spaces, '/', '+' or '..'); fix those lines, "
                         "nothing was added")
    return list(first_line), notes


# ----------------------------------------------------------------------------- the gradebook's health

def _damaged(course: Path, why: str) -> str:
    """What to do about a gradebook that cannot be read: the recovery depends on what was collected."""
    db = course / "gradebook.db"
    collected = sorted({p.name for p in (course / INBOX).glob("*/*") if p.is_dir()})
    if collected:
        fix = (f"otherwise {' and '.join(f'`kvcourse classroom grade {a}`' for a in collected)} moves it aside and "
               "rebuilds it by regrading the collected submissions; grades given by hand in the formgrader must be "
               "given again, and `kvcourse classroom init --roster FILE` adds the class list back")
    else:
        fix = (f"otherwise, as nothing was collected yet, delete it (rm {db}) and run `kvcourse classroom init "
               "--roster FILE` to add the class list again")
    return f"the gradebook {db} is damaged ({why}); nothing was changed. Put back a backup of it if you have one; {fix}"


def check_gradebook(course: Path) -> None:
    """GradingError before a step opens a gradebook that another program holds (formgrader saving) or that
    is damaged: nbgrader would end in a SQLAlchemy traceback. A missing gradebook is fine (nbgrader makes one)."""
    why = gradebook_problem(course / "gradebook.db", retry="run the command again")  # raises when it is busy
    if why:
        raise GradingError(_damaged(course, why))


def _gradebook_failure(course: Path, text: str) -> GradingError | None:
    """The clear error for a failure that came from the gradebook (taken, or damaged, after check_gradebook)."""
    if "database is locked" in text:
        return GradingError(gradebook_busy(course / "gradebook.db", "run the command again"))
    cause = re.search(r"\(sqlite3\.DatabaseError\) ([^\n\[]+)|(file is not a database|disk image is malformed)", text)
    if cause:
        return GradingError(_damaged(course, (cause.group(1) or cause.group(2)).strip()))
    return None


@contextlib.contextmanager
def _gradebook_errors(course: Path, what: str):
    """check_gradebook, then SQLAlchemy's errors inside the block said as the clear GradingError."""
    from sqlalchemy.exc import DatabaseError

    check_gradebook(course)
    try:
        yield
    except DatabaseError as exc:  # taken (or damaged) after the check; OperationalError is one of these
        raise (_gradebook_failure(course, str(exc))
               or GradingError(f"the gradebook could not be {what}: {exc.orig}")) from None


def _assignment(name: str) -> str:
    known = nbgrader_api.assignments()
    if name not in known:
        raise ValueError(f"assignment must be one of {sorted(known)}, got {name!r}")
    return name


def _api(course: Path, exchange: Path, log_level: str = "ERROR", **changes):
    cfg = config(course, exchange)
    for section, values in changes.items():
        for key, value in values.items():
            setattr(cfg[section], key, value)
    return nbgrader_api.nbgrader_api(cfg, log_level=log_level)


def _run(result: dict, what: str, course: Path) -> str:
    if not result.get("success"):
        failure = _gradebook_failure(course, f"{result.get('log') or ''}\n{result.get('error') or ''}")
        if failure:
            raise failure
    return nbgrader_api.check_result(result, what, course)


# ----------------------------------------------------------------------------- the steps

def init(course: Path, exchange: Path, roster: list[str] = ()) -> list[str]:
    """Class folder, exchange, and the roster in the gradebook (so the export lists who did not submit).
    Returns the students that were new to the gradebook."""
    folder_or_error(course)
    folder_or_error(Path(exchange), *EXCHANGE_OPTION)
    made = not course.exists()
    try:  # before the exchange, so that a class folder that cannot be made leaves nothing half done
        course.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GradingError(f"cannot create the class folder {course} ({exc.strerror or exc}): give a folder you can "
                           "write with --course or $KVCOURSE_CLASS_DIR; nothing was changed") from None
    try:
        make_exchange(exchange)
    except BaseException:
        if made:  # the empty class folder this call made goes too: nothing half done
            with contextlib.suppress(OSError):
                course.rmdir()
        raise
    known = set()
    if roster:
        from nbgrader.api import Gradebook

        nbgrader_api.schema_version_here()  # what a new gradebook is stamped with
        with _gradebook_errors(course, "written"), \
                Gradebook(config(course, exchange).CourseDirectory.db_url, COURSE_ID) as gb:
            known = {s.id for s in gb.students}
            for student in roster:
                gb.update_or_create_student(student)
    return [student for student in dict.fromkeys(roster) if student not in known]


def release(assignment: str, course: Path, exchange: Path, force: bool = False) -> Path:
    """nbgrader generate_assignment + release_assignment. Returns the assignment's folder in the exchange."""
    _assignment(assignment)
    existing_exchange(exchange)  # missing: run init; a file: say so (not "run init")
    outbound = exchange / COURSE_ID / "outbound" / assignment
    if outbound.exists() and not force:  # refuse before touching anything (the release/ folder included)
        raise GradingError(f"{assignment} is already released; add --force to release it again "
                           "(students who fetched it keep their copy)")
    check_gradebook(course)  # generate_assignment writes the tests into it
    course.mkdir(parents=True, exist_ok=True)
    api = _api(course, exchange, ExchangeReleaseAssignment={"force": force})
    _run(api.generate_assignment(assignment, force=True, create=True), f"generate_assignment {assignment}", course)
    _run(api.release_assignment(assignment), f"release_assignment {assignment}", course)
    return outbound


def impersonations(assignment: str, exchange: Path) -> list[tuple[str, str, str]]:
    """Submissions in the exchange whose folder is owned by someone other than the student it names:
    [(folder name, claimed student, real owner)]. nbgrader's exchange names a submission after the
    student id the submitter gave (`nbgrader submit --CourseDirectory.student_id=alice` works for anyone),
    but the folder belongs to whoever created it, and only root can change that. (Where students have no
    Unix accounts of their own, as with a one-account test spawner, ownership cannot tell them apart.)"""
    inbound = exchange / COURSE_ID / "inbound"
    found = []
    if not inbound.is_dir():
        return found
    for entry in sorted(inbound.glob(f"*+{assignment}+*")):
        claimed = entry.name.split("+")[0]
        try:
            pwd.getpwnam(claimed)
        except KeyError:  # students without Unix accounts (a test hub's one-account spawner): owners say nothing
            continue
        owner = _owner(entry)
        if owner != claimed:
            found.append((entry.name, claimed, owner))
    return found


def _owner(path: Path) -> str:
    """The user name of the folder's own owner, even where it is a link (collect refuses those)."""
    uid = path.lstat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# ----------------------------------------------------------------------------- collecting plain files only
# nbgrader's collect copies a submission with shutil.copytree, which follows symbolic links with the
# instructor's rights: a student who hands in memory_formula.ipynb -> solutions/.../memory_formula.ipynb (or a
# classmate's notebook) gets the solution back, copied into the class folder and graded as theirs. So a
# submission must be plain files and folders; one that holds anything else is not collected.

class UnsafeSubmission(Exception):
    """A submission folder holds something other than plain files and folders: (what, where in it)."""

    def __init__(self, what: str, where: str):
        super().__init__(what, where)
        self.what, self.where = what, where


def _why(exc: OSError, what: str) -> str:
    return "a symbolic link" if exc.errno == errno.ELOOP else f"{what} the grader cannot read ({exc.strerror})"


def unsafe_entry(folder: Path) -> UnsafeSubmission | None:
    """The first thing in a submission folder (the folder itself included) that is not a plain file or folder:
    a symbolic link, a named pipe, socket or device, or something the grader cannot read. None when clean."""
    try:
        copy_plain_tree(folder, None)
    except UnsafeSubmission as problem:
        return problem
    return None


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a pipe swapped in cannot hang us


def copy_plain_tree(src: Path, dest: Path | None, ignore=None) -> None:
    """Copy the folder `src` to the new folder `dest` (None: only look), reading through descriptors opened without
    following links (so a file swapped for a link after unsafe_entry looked is refused, not followed). `ignore` is
    shutil.copytree's (nbgrader's include/exclude/size filter). Raises UnsafeSubmission; `dest` may then be partial."""
    if Path(src).is_symlink():  # (opened without following, it would be ENOTDIR)
        raise UnsafeSubmission("a symbolic link", "")
    try:
        top = os.open(src, _OPEN_DIR)
    except OSError as exc:
        raise UnsafeSubmission(_why(exc, "a folder"), "") from None
    try:
        _copy_folder(top, Path(src), None if dest is None else Path(dest), "", ignore)
    finally:
        os.close(top)


def _copy_folder(dir_fd: int, src: Path, dest: Path | None, rel: str, ignore) -> None:
    if dest is not None:
        dest.mkdir(mode=0o700)
    names = sorted(os.listdir(dir_fd))
    ignored = set(ignore(str(src / rel), names)) if ignore and dest is not None else set()
    for name in names:
        where = os.path.join(rel, name)
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError as exc:  # removed while we looked: the student is still changing it
            raise UnsafeSubmission(_why(exc, "a file"), where) from None
        if stat.S_ISLNK(mode):
            raise UnsafeSubmission("a symbolic link", where)
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise UnsafeSubmission("a named pipe, socket or device file", where)
        if name in ignored:
            continue
        try:
            fd = os.open(name, _OPEN_DIR if stat.S_ISDIR(mode) else _OPEN_FILE, dir_fd=dir_fd)
        except OSError as exc:
            raise UnsafeSubmission(_why(exc, "a folder" if stat.S_ISDIR(mode) else "a file"), where) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                _copy_folder(fd, src, dest / name if dest is not None else None, where, ignore)
            elif not stat.S_ISREG(st.st_mode):
                raise UnsafeSubmission("a named pipe, socket or device file", where)
            elif dest is not None:
                with open(dest / name, "xb") as out:
                    while chunk := os.read(fd, 1 << 20):
                        out.write(chunk)
                os.chmod(dest / name, stat.S_IMODE(st.st_mode) | 0o600)
                os.utime(dest / name, ns=(st.st_atime_ns, st.st_mtime_ns))
        except OSError as exc:
            raise UnsafeSubmission(_why(exc, "a file"), where) from None
        finally:
            os.close(fd)
    if dest is not None:
        os.chmod(dest, stat.S_IMODE(os.fstat(dir_fd).st_mode) | 0o700)


def _plain_files_collect(refused: list, held: set[str]):
    """nbgrader's collect (newest submission per student, --update, due dates), except that a submission holding
    anything but plain files and folders is left in the exchange and added to `refused` as (student, folder name,
    UnsafeSubmission), and one whose folder name is in `held` (made under another student's name) is never taken:
    that student's newest own submission is."""
    from nbgrader.exchange.default.collect import ExchangeCollect
    from nbgrader.utils import ignore_patterns

    class PlainFilesCollect(ExchangeCollect):
        def _sort_by_timestamp(self, records):
            return super()._sort_by_timestamp([r for r in records if r["filename"] not in held] or records)

        def init_src(self):
            super().init_src()
            safe = []
            for rec in self.src_records:
                if rec["filename"] in held:  # only ones in the student's name: quarantined by collect()
                    continue
                problem = unsafe_entry(Path(self.inbound_path) / rec["filename"])
                if problem:
                    refused.append((rec["username"], rec["filename"], problem))
                else:
                    safe.append(rec)
            self.src_records = safe

        def do_copy(self, src, dest, log=None):
            if self.get_size(src) > 1000 * self.coursedir.max_dir_size:  # as nbgrader's own do_copy
                raise RuntimeError(f"Directory size is too big. Maximum size is {1000 * self.coursedir.max_dir_size}")
            try:
                copy_plain_tree(src, dest, ignore_patterns(exclude=self.coursedir.ignore, include=self.coursedir.include,
                                                           max_file_size=self.coursedir.max_file_size, log=self.log))
            except UnsafeSubmission as problem:  # changed after init_src looked
                shutil.rmtree(dest, ignore_errors=True)
                name = os.path.basename(src)
                refused.append((name.split("+")[0], name, problem))
                return
            if self.coursedir.groupshared:  # as nbgrader's own do_copy: the group may write what was collected
                for dirname, _, filenames in os.walk(dest):
                    os.chmod(dirname, (os.stat(dirname).st_mode | 0o2770) & 0o2777)
                    for f in filenames:
                        os.chmod(os.path.join(dirname, f), (os.stat(os.path.join(dirname, f)).st_mode | 0o660) & 0o777)

    return PlainFilesCollect


def collect(assignment: str, course: Path, exchange: Path) -> tuple[list[str], list, list]:
    """nbgrader collect (newest submission of each student) into inbox/, plain files and folders only. Returns
    (every student with a copy in inbox/, impersonations() quarantined, refused: [(student, folder, what it holds:
    UnsafeSubmission)] left in the exchange).

    A submission made under another student's name (impersonations) never reaches inbox/, where it would displace
    that student's own: it is copied to quarantine/<account that made it>/<folder>/ for the instructor to judge
    (README: "Handing in"). nbgrader's own warnings are shown, not silenced."""
    _assignment(assignment)
    root = existing_exchange(exchange) / COURSE_ID
    if not (root / "inbound").is_dir():  # nbgrader would say "Course not found", with a traceback
        raise GradingError(f"nothing is released in the exchange {exchange} yet, so there is nothing to collect: "
                           f"run `kvcourse classroom release {assignment}` first, then let the students submit")
    check_gradebook(course)  # collect reads the due date from it
    suspicious = impersonations(assignment, exchange)
    refused: list = []
    for folder, claimed, owner in suspicious:
        held = course / QUARANTINE / owner / folder
        if not held.exists():
            try:
                held.parent.mkdir(parents=True, exist_ok=True)
                copy_plain_tree(root / "inbound" / folder, held)
            except UnsafeSubmission as problem:  # left in the exchange, as any other
                shutil.rmtree(held, ignore_errors=True)
                refused.append((claimed, folder, problem))
    api = _api(course, exchange, log_level="WARN", CourseDirectory={"submitted_directory": INBOX},
               ExchangeFactory={"collect": _plain_files_collect(refused, {f for f, _, _ in suspicious})})
    log = _run(api.collect(assignment, update=True), f"collect {assignment}", course)
    if "WARN" in log:  # nbgrader's own warnings (its "cheating attempt?" among them), as nbgrader wrote them
        print(log.strip(), file=sys.stderr)
    return sorted(p.parent.name for p in (course / INBOX).glob(f"*/{assignment}")), suspicious, refused


def _report_refused(refused, course: Path, assignment: str) -> int:
    for student, folder, problem in sorted(refused, key=lambda r: r[:2]):
        held = (f"is {problem.what} ({folder})" if not problem.where else f"holds {problem.what} ({problem.where})")
        ask = ("ask the student to submit the file itself" if "link" in problem.what and problem.where else
               "ask the student to submit again")
        kept = ("; the copy collected before is kept" if (course / INBOX / student / assignment).is_dir() else "")
        print(f"error: {student}'s submission {held}: not collected; {ask}{kept}", file=sys.stderr)
    return 1 if refused else 0


def _report_impersonations(found, course: Path) -> int:
    for folder, claimed, owner in found:
        held, assignment = course / QUARANTINE / owner / folder, folder.split("+")[1]
        print(f"error: submission {folder} claims to be by {claimed!r} but was made by {owner!r}: not collected, "
              f"{claimed}'s own submission stands; it is held in {held}. Only if it is {claimed}'s work after all: "
              f"cp -r '{held}/.' '{course / INBOX / claimed / assignment}/' and grade again", file=sys.stderr)
    return 1 if found else 0


def quarantined(course: Path, assignment: str) -> dict[str, str]:
    """{"student/assignment": note} for report.csv: each submission held in quarantine/ in a student's name."""
    notes: dict[str, str] = {}
    for held in sorted((course / QUARANTINE).glob(f"*/*+{assignment}+*")):
        key = f"{held.name.split('+')[0]}/{assignment}"
        notes[key] = "; ".join(filter(None, [notes.get(key), (
            f"a submission in this student's name made by account {held.parent.name} is held in "
            f"{QUARANTINE}/{held.parent.name}/{held.name}: not graded (see `kvcourse classroom collect`)")]))
    return notes


def grade(assignment: str, course: Path, exchange: Path, jobs: int = 1, timeout: int | None = None,
          force: bool = False, progress: bool = True, log=print, cluster: str | None = None) -> list:
    """`kvcourse grade` on the collected submissions (every collected assignment; the ledger skips what
    is already graded), then give each feedback folder the submission's secret, which nbgrader's
    release_feedback names the student's feedback file by."""
    _assignment(assignment)
    inbox = course / INBOX
    if not any(inbox.glob(f"*/{assignment}/*.ipynb")):
        raise GradingError(f"nothing collected for {assignment} in {inbox}: run `kvcourse classroom "
                           f"collect {assignment}` first (or wait for submissions)")
    rows = grader.grade(inbox, course, jobs=jobs, timeout=timeout, force=force, progress=progress, log=log,
                         cluster=cluster, notes_for=quarantined(course, assignment))
    for folder in sorted(inbox.glob(f"*/{assignment}")):
        feedback = course / "feedback" / folder.parent.name / assignment
        for name in ("submission_secret.txt", "timestamp.txt"):
            if (folder / name).exists() and feedback.is_dir():
                shutil.copyfile(folder / name, feedback / name)
    return rows


def feedback(assignment: str, course: Path, exchange: Path) -> list[str]:
    """nbgrader release_feedback for every graded student. Returns the students whose feedback went out."""
    _assignment(assignment)
    made = [p for p in (course / "feedback").glob(f"*/{assignment}") if any(p.glob("*.html"))]
    if not made:
        raise GradingError(f"no feedback for {assignment} in {course / 'feedback'}: run `kvcourse classroom "
                           f"grade {assignment}` first")
    ready = sorted(p.parent.name for p in made if (p / "submission_secret.txt").is_file())
    secretless = sorted(p.parent.name for p in made if p.parent.name not in ready)
    if secretless:  # release_feedback names a student's copy by that file: it would fail on theirs
        print(f"note: the feedback of {', '.join(secretless)} is in {course / 'feedback'} but cannot go through the "
              "exchange: their submission has no submission_secret.txt (nbgrader submit writes one; this one was "
              "put in the inbox another way). Give them the HTML file there yourself", file=sys.stderr)
        if not ready:
            raise GradingError(f"no feedback of {assignment} can be released through the exchange (see the note)")
    existing_exchange(exchange)
    api = _api(course, exchange)
    for student in ready if secretless else [None]:  # one by one only to leave those without a secret out
        _run(api.release_feedback(assignment, student_id=student), f"release_feedback {assignment}", course)
    return ready


def export(course: Path, exchange: Path, dest: Path | None = None) -> Path:
    """nbgrader's CSV export of the class gradebook (one row per student and assignment)."""
    if not (course / "gradebook.db").exists():
        raise GradingError(f"no gradebook in {course}: release and grade an assignment first")
    dest = Path(dest or course / "grades.csv")
    # --to is checked while parsing, every write by files.atomic_output (a device, a pipe) and disk_error (why it
    # failed); a folder where the default file goes is said here, with what to do
    if dest.is_dir():
        raise GradingError(f"{dest} is a folder: give the CSV file to write, e.g. --to {dest / 'grades.csv'}"
                           if dest != course / "grades.csv" else
                           f"{dest} is a folder where the CSV file goes: move it out of the way, or write the "
                           "grades elsewhere with --to FILE.csv")
    with _gradebook_errors(course, "read"):
        nbgrader_api.export_csv(config(course, exchange), dest)
    return dest


def status(course: Path, exchange: Path, assignment: str | None = None) -> dict:
    """Counts per assignment: released, submissions waiting in the exchange, collected, graded, feedback."""
    names = [_assignment(assignment)] if assignment else list(nbgrader_api.assignments())
    root = existing_exchange(exchange) / COURSE_ID
    out = {}
    for a in names:
        out[a] = {"released": (root / "outbound" / a).is_dir(),
                  "submitted": len({p.name.split("+")[0] for p in (root / "inbound").glob(f"*+{a}+*")}),
                  "collected": len(list((course / INBOX).glob(f"*/{a}"))),
                  "graded": len(list((course / "autograded").glob(f"*/{a}"))),
                  "feedback": len(list((course / "feedback").glob(f"*/{a}"))),
                  "quarantined": len(list((course / QUARANTINE).glob(f"*/*+{a}+*")))}
    return out


# ----------------------------------------------------------------------------- command line

def add_arguments_classroom(p: argparse.ArgumentParser) -> None:
    p.add_argument("--course", type=Path, default=None,
                   help="the class folder (default: $KVCOURSE_CLASS_DIR, else ~/kvcourse-class)")
    p.add_argument("--exchange", type=Path, default=None,
                   help=f"nbgrader's exchange (default: $KVCOURSE_EXCHANGE, else {DEFAULT_EXCHANGE})")
    sub = p.add_subparsers(dest="step", metavar="STEP", required=True)
    s = sub.add_parser("init", help="create the class folder and the shared exchange")
    s.add_argument("--roster", type=Path, help="a file with one student user name per line")
    s = sub.add_parser("release", help="generate the student version and release it to the exchange")
    s.add_argument("assignment")
    s.add_argument("--force", action="store_true", help="release again (replaces the released version)")
    for name, text in (("collect", "collect the submissions from the exchange"),
                       ("feedback", "release the feedback to the exchange")):
        sub.add_parser(name, help=text).add_argument("assignment")
    for name, text in (("grade", "autograde the collected submissions and write feedback"),
                       ("cycle", "collect, grade, release feedback and export, in one go")):
        s = sub.add_parser(name, help=text)
        s.add_argument("assignment")
        s.add_argument("--jobs", "-j", type=int, default=1, help="grade this many submissions at once (default 1)")
        s.add_argument("--cluster", default=None, help="grade on a Dask cluster: tcp://HOST:8786, or local:N")
        s.add_argument("--timeout", type=int, default=None, help="seconds per cell (default 30)")
        s.add_argument("--force", action="store_true", help="regrade submissions that are already graded")
        s.add_argument("--quiet", action="store_true", help="no progress bar")
    s = sub.add_parser("export", help="write the gradebook as CSV")
    s.add_argument("--to", type=Path, default=None, help="CSV file (default: grades.csv in the class folder)")
    s = sub.add_parser("status", help="what is released, submitted, collected, graded")
    s.add_argument("assignment", nargs="?")
    # --course and --exchange are accepted after the step too (`classroom release 01_x --course DIR`): the same
    # options on each step, which set them only when given there (SUPPRESS), else the ones before the step stand
    for step in sub.choices.values():
        step.add_argument("--course", type=Path, default=argparse.SUPPRESS,
                          help="the class folder (as before the step)")
        step.add_argument("--exchange", type=Path, default=argparse.SUPPRESS,
                          help="nbgrader's exchange (as before the step)")


def run_classroom(args) -> int:
    course, exchange = class_dir(args.course), exchange_dir(args.exchange)
    try:
        folder_or_error(course)
        if args.step == "init":
            roster, notes = read_roster(args.roster) if args.roster else ([], [])
            added = init(course, exchange, roster)
            for note in notes:
                print(f"note: roster {args.roster}: {note}")
            print(f"class folder {course}\nexchange     {exchange} (mode {oct(stat.S_IMODE(exchange.stat().st_mode))})"
                  + (f"\n{len(added)} student(s) added to the gradebook"
                     + (f" ({len(roster) - len(added)} of the roster were there already)" if len(added) < len(roster)
                        else "") if roster else ""))
        elif args.step == "release":
            where = release(args.assignment, course, exchange, force=args.force)
            print(f"released {args.assignment} to {where}; students fetch it from Nbgrader > Assignments")
        elif args.step == "collect":
            students, suspicious, refused = collect(args.assignment, course, exchange)
            print(f"collected {len(students)} submission(s) of {args.assignment} into {course / INBOX}")
            return max(_report_impersonations(suspicious, course), _report_refused(refused, course, args.assignment))
        elif args.step == "feedback":
            students = feedback(args.assignment, course, exchange)
            print(f"released feedback on {args.assignment} for {len(students)} student(s); "
                  "they fetch it from Nbgrader > Assignments")
        elif args.step == "export":
            print(f"grades: {export(course, exchange, args.to)}")
        elif args.step == "status":
            counts_by_assignment = status(course, exchange, args.assignment)
            print(f"exchange     {exchange}\nclass folder {course}")
            for a, counts in counts_by_assignment.items():
                print(f"{a:<22} " + "  ".join(f"{k} {v}" for k, v in counts.items()))
        else:  # grade, cycle
            suspicious, refused = [], []
            if args.step == "cycle":
                students, suspicious, refused = collect(args.assignment, course, exchange)
                print(f"collected {len(students)} submission(s)")
            rows = grade(args.assignment, course, exchange, jobs=args.jobs, timeout=args.timeout,
                         force=args.force, progress=not args.quiet, cluster=args.cluster)
            code = grader.print_rows([r for r in rows if r.assignment == args.assignment])
            if args.step == "cycle":
                released = feedback(args.assignment, course, exchange)
                print(f"feedback released for {len(released)} student(s); grades: {export(course, exchange)}")
            return max(code, _report_impersonations(suspicious, course),
                       _report_refused(refused, course, args.assignment))
    except (GradingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
