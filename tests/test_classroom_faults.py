"""`kvcourse classroom` under faults: hostile submissions in the exchange, a gradebook that is damaged or held by
another program, and steps run in the wrong order. Each test runs the command in this process (fast) and
checks what the instructor reads: what went wrong and what to run, never a traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from course.grade import classroom, files
from course.paths import AUTOGRADE, SOLUTIONS
from test_classroom import classroom_main

pytestmark = pytest.mark.slow  # end to end (JupyterHub, sealed sandboxes by the dozen): out of make test-fast

ASSIGNMENT, NOTEBOOK = "01_memory_formula", "memory_formula"
REFERENCE = AUTOGRADE / "samples" / "reference" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
STAMP = "2026-01-01 10:00:00.000000 UTC"




def submission(exchange, student: str, notebook=REFERENCE):
    """A student's hand-in as nbgrader submit leaves it: inbound/<student>+<assignment>+<time>/."""
    folder = exchange / classroom.COURSE_ID / "inbound" / f"{student}+{ASSIGNMENT}+{STAMP}"
    folder.mkdir(parents=True)
    if notebook is not None:
        shutil.copy(notebook, folder / f"{NOTEBOOK}.ipynb")
    (folder / "timestamp.txt").write_text(STAMP)
    return folder


@pytest.fixture
def class_with_exchange(tmp_path):
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    classroom.init(course, exchange)
    inbound = exchange / classroom.COURSE_ID / "inbound"  # what release makes (nbgrader's mode for it)
    inbound.mkdir(parents=True)
    inbound.chmod(0o733)
    return course, exchange


# ----------------------------------------------------------------------------- 1. links in a submission

def test_collect_refuses_a_submission_holding_a_link_and_collects_the_rest(class_with_exchange, capsys):
    """A student hands in a link to the solution: nbgrader's copytree followed it with the instructor's rights,
    and the solution came back to the student in the feedback. Now: not collected, said so, exit 1."""
    course, exchange = class_with_exchange
    submission(exchange, "alice")
    solution = SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    (submission(exchange, "mallory", notebook=None) / f"{NOTEBOOK}.ipynb").symlink_to(solution)
    (submission(exchange, "eve") / "data").mkdir()
    (exchange / classroom.COURSE_ID / "inbound" / f"eve+{ASSIGNMENT}+{STAMP}" / "data" / "s").symlink_to(SOLUTIONS)
    elsewhere = exchange.parent / "zed-elsewhere"  # the whole submission folder a link
    elsewhere.mkdir()
    shutil.copy(solution, elsewhere / f"{NOTEBOOK}.ipynb")
    (elsewhere / "timestamp.txt").write_text(STAMP)
    (exchange / classroom.COURSE_ID / "inbound" / f"zed+{ASSIGNMENT}+{STAMP}").symlink_to(elsewhere)
    os.mkfifo(submission(exchange, "trudy") / "pipe")  # copytree failed on it, and the whole collect with it

    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)
    assert code == 1, out + err
    inbox = course / classroom.INBOX
    assert sorted(p.name for p in inbox.iterdir()) == ["alice"], "only the plain submission is collected"
    assert (inbox / "alice" / ASSIGNMENT / f"{NOTEBOOK}.ipynb").read_bytes() == REFERENCE.read_bytes()
    assert (f"mallory's submission holds a symbolic link ({NOTEBOOK}.ipynb): not collected; ask the student to "
            "submit the file itself") in err, err
    assert "eve's submission holds a symbolic link (data/s)" in err, err
    assert f"zed's submission is a symbolic link (zed+{ASSIGNMENT}+{STAMP}): not collected" in err, err
    assert "trudy's submission holds a named pipe" in err and "(pipe)" in err, err
    assert "Traceback" not in err


def test_a_link_made_after_the_check_is_refused_not_followed(class_with_exchange, capsys, monkeypatch):
    """The student swaps the notebook for a link between the check and the copy: the copy itself opens nothing
    through a link."""
    course, exchange = class_with_exchange
    solution = SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    (submission(exchange, "mallory", notebook=None) / f"{NOTEBOOK}.ipynb").symlink_to(solution)
    monkeypatch.setattr(classroom, "unsafe_entry", lambda folder: None, raising=False)  # the check saw a plain file
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)
    assert code == 1 and f"mallory's submission holds a symbolic link ({NOTEBOOK}.ipynb): not collected" in err, err
    assert not any((course / classroom.INBOX).glob("mallory/*/*.ipynb")), "the solution was not copied"


def test_a_refused_resubmission_keeps_the_copy_collected_before(class_with_exchange, capsys):
    course, exchange = class_with_exchange
    submission(exchange, "mallory")
    assert classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)[0] == 0
    later = exchange / classroom.COURSE_ID / "inbound" / f"mallory+{ASSIGNMENT}+2026-01-02 10:00:00.000000 UTC"
    later.mkdir()
    (later / "timestamp.txt").write_text("2026-01-02 10:00:00.000000 UTC")
    (later / f"{NOTEBOOK}.ipynb").symlink_to(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb")
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)
    assert code == 1 and "not collected" in err and "the copy collected before is kept" in err, err
    kept = course / classroom.INBOX / "mallory" / ASSIGNMENT
    assert (kept / f"{NOTEBOOK}.ipynb").read_bytes() == REFERENCE.read_bytes()
    assert (kept / "timestamp.txt").read_text() == STAMP


# ----------------------------------------------------------------------------- 2. the gradebook damaged or busy

def steps_that_open_the_gradebook(tmp_path):
    roster = tmp_path / "roster.txt"
    roster.write_text("alice\nbob\n")
    return (["export"], ["init", "--roster", roster], ["release", ASSIGNMENT, "--force"], ["collect", ASSIGNMENT])


def test_a_damaged_gradebook_is_named_with_what_to_do(class_with_exchange, tmp_path, capsys):
    course, exchange = class_with_exchange
    classroom.init(course, exchange, ["alice"])
    db = course / "gradebook.db"
    db.write_bytes(db.read_bytes()[:5000])  # `head -c 5000`: cut short by a full disk or a crash
    damaged = db.read_bytes()
    for step in steps_that_open_the_gradebook(tmp_path):
        code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, *step)
        assert code == 2 and f"the gradebook {db} is damaged" in err, (step, err)
        assert "rm " in err and "init --roster" in err, (step, err)  # nothing collected: start it again
        assert "Traceback" not in err and "sqlalchemy" not in err, (step, err)
        assert db.read_bytes() == damaged, step
    (course / classroom.INBOX / "alice" / ASSIGNMENT).mkdir(parents=True)  # once collected: grade rebuilds it
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "export")
    assert code == 2 and f"`kvcourse classroom grade {ASSIGNMENT}` moves it aside" in err, err


@pytest.fixture
def held_gradebook(class_with_exchange):
    """The gradebook held by another process (`BEGIN EXCLUSIVE`, as formgrader while it saves)."""
    course, exchange = class_with_exchange
    classroom.init(course, exchange, ["alice"])
    holder = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys, time\n"
                               "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                               "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(120)",
                               str(course / "gradebook.db")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield course, exchange
    holder.kill()
    holder.wait()


def test_a_busy_gradebook_says_close_it_and_retry(held_gradebook, tmp_path, capsys):
    course, exchange = held_gradebook
    before = (course / "gradebook.db").read_bytes()
    for step in steps_that_open_the_gradebook(tmp_path)[:2]:  # each waits 10 s for the lock
        code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, *step)
        assert code == 2 and "is busy" in err and "Close it and run the command again" in err, (step, err)
        assert "Traceback" not in err and "OperationalError" not in err, (step, err)
    assert (course / "gradebook.db").read_bytes() == before


def test_a_gradebook_taken_after_the_check_says_the_same(held_gradebook, tmp_path, capsys, monkeypatch):
    """The lock comes between the check and nbgrader's own use: its error is read, not shown as a traceback."""
    course, exchange = held_gradebook
    monkeypatch.setattr(classroom, "gradebook_problem", lambda *args, **kwargs: "", raising=False)  # seen free
    for step in steps_that_open_the_gradebook(tmp_path)[2:]:
        code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, *step)
        assert code == 2 and "is busy" in err and "Close it and run the command again" in err, (step, err)
        assert "Traceback" not in err and "Please see" not in err, (step, err)


# ----------------------------------------------------------------------------- 3. steps in the wrong order

def test_collect_before_init_or_release_names_the_step_to_run(tmp_path, capsys):
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)
    assert code == 2 and f"no exchange at {exchange}" in err and "kvcourse classroom init" in err, err
    assert not exchange.exists(), "the exchange is made by init (with its mode), not by a failed collect"
    exchange.mkdir()
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)
    assert code == 2 and f"kvcourse classroom release {ASSIGNMENT}" in err, err
    assert "Traceback" not in err and "ExchangeError" not in err and "Course not found" not in err, err


def test_an_exchange_that_is_a_file_is_named(tmp_path, capsys):
    course, blocker = tmp_path / "class", tmp_path / "exchange"
    blocker.write_text("not a folder")
    for exchange in (blocker, blocker / "below"):
        code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "init")
        assert code == 2 and f"{blocker} is a file, not a folder" in err and "--exchange" in err, err
        assert "Errno" not in err and "Traceback" not in err, err
    assert not course.exists(), "init refused before making anything"
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", blocker, "release", ASSIGNMENT)
    assert code == 2 and f"{blocker} is a file, not a folder" in err and "--exchange" in err, err
    assert "no exchange" not in err, err


def test_init_that_cannot_make_the_class_folder_makes_no_exchange(tmp_path, capsys, monkeypatch):
    """It made the exchange, then failed on the class folder with "[Errno 13] Permission denied"."""
    from pathlib import Path

    course, exchange = tmp_path / "ro" / "class", tmp_path / "exchange"
    mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):
        if self == course:
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "init")
    assert code == 2 and f"cannot create the class folder {course} (Permission denied)" in err, err
    assert "--course" in err and "Errno" not in err
    assert not exchange.exists(), "the exchange was made before the class folder failed"


def test_course_and_exchange_are_accepted_after_the_step(tmp_path, capsys):
    """`classroom release X --course DIR` was "unrecognized arguments ... (see `kvcourse --help`)"."""
    from course.cli import build_parser

    parser, _ = build_parser()
    after = parser.parse_args(["classroom", "release", ASSIGNMENT, "--course", str(tmp_path / "c"),
                               "--exchange", str(tmp_path / "x")])
    assert (after.course, after.exchange) == (tmp_path / "c", tmp_path / "x")
    before = parser.parse_args(["classroom", "--course", str(tmp_path / "c"), "release", ASSIGNMENT])
    assert before.course == tmp_path / "c" and before.exchange is None  # not reset by the step's own option
    code, out, err = classroom_main(capsys, "release", ASSIGNMENT, "--course", tmp_path / "c",
                                    "--exchange", tmp_path / "x")
    assert code == 2 and f"no exchange at {tmp_path / 'x'}" in err and "unrecognized" not in err, err


# ----------------------------------------------------------------------------- 4. the fault sweep of issue 43

def _filed_by_another(exchange, student: str, monkeypatch) -> "os.PathLike":
    """A blank notebook handed in, later than the student's own, under `student`'s name from account stu2 (the
    folder's owner as the exchange would show it: only root could make it so here, with chown)."""
    later = "2026-01-02 10:00:00.000000 UTC"
    fake = exchange / classroom.COURSE_ID / "inbound" / f"{student}+{ASSIGNMENT}+{later}"
    fake.mkdir()
    shutil.copy(AUTOGRADE / "samples" / "blank" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", fake / f"{NOTEBOOK}.ipynb")
    (fake / "timestamp.txt").write_text(later)
    real = classroom._owner
    monkeypatch.setattr(classroom, "_owner", lambda path: "stu2" if path.name == fake.name else real(path))
    return fake


def test_a_submission_filed_under_another_name_is_quarantined_not_collected(class_with_exchange, capsys,
                                                                           monkeypatch):
    """`stu2` filed a blank notebook as stu1's: collect copied it over stu1's collected copy, and the next grade
    turned stu1's 14/14 into 0/14. Now it never reaches inbox/; it is held in quarantine/ and named."""
    import pwd

    course, exchange = class_with_exchange
    me = pwd.getpwuid(os.getuid()).pw_name  # the claimed student: a real account, as impersonations() asks
    submission(exchange, me)
    assert classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)[0] == 0
    mine = course / classroom.INBOX / me / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    assert mine.read_bytes() == REFERENCE.read_bytes()
    fake = _filed_by_another(exchange, me, monkeypatch)
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)
    assert code == 1 and f"claims to be by '{me}' but was made by 'stu2': not collected" in err, err
    held = course / classroom.QUARANTINE / "stu2" / fake.name
    assert str(held) in err and "cp -r" in err, err
    assert mine.read_bytes() == REFERENCE.read_bytes(), "the student's own submission stays in the inbox"
    assert (held / f"{NOTEBOOK}.ipynb").read_bytes() == (fake / f"{NOTEBOOK}.ipynb").read_bytes()
    notes = classroom.quarantined(course, ASSIGNMENT)
    assert list(notes) == [f"{me}/{ASSIGNMENT}"] and "stu2" in notes[f"{me}/{ASSIGNMENT}"], notes
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "status", ASSIGNMENT)
    assert "quarantined 1" in out, out


@pytest.mark.slow
def test_a_quarantined_submission_leaves_the_students_grade_alone_and_report_says_so(class_with_exchange, capsys,
                                                                                    monkeypatch):
    import csv
    import pwd

    from course.grade import sandbox

    if sandbox.sandbox_problem():
        pytest.skip("the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")
    course, exchange = class_with_exchange
    me = pwd.getpwuid(os.getuid()).pw_name
    classroom.release(ASSIGNMENT, course, exchange, force=True)
    submission(exchange, me)
    fake = _filed_by_another(exchange, me, monkeypatch)
    assert classroom_main(capsys, "--course", course, "--exchange", exchange, "collect", ASSIGNMENT)[0] == 1
    (row,) = classroom.grade(ASSIGNMENT, course, exchange, progress=False, log=lambda *_: None)
    assert row.status == "graded" and row.score == row.max_score > 0, row  # the reference, not the blank
    (reported,) = list(csv.DictReader(open(course / "report.csv")))
    assert "made by account stu2 is held in quarantine/stu2/" in reported["problems"], reported


def test_export_writes_only_a_new_or_plain_file(tmp_path, capsys):
    """`export --to /dev/full` exited 0 and the device became a CSV file."""
    import socket

    from course.cli import build_parser

    course, exchange = tmp_path / "class", tmp_path / "exchange"
    classroom.init(course, exchange, ["alice"])
    parser, _ = build_parser()
    for device in ("/dev/full", "/dev/null"):  # parsed only: nothing runs, so nothing can touch the device
        with pytest.raises(SystemExit):
            parser.parse_args(["classroom", "export", "--to", device])
        assert "is a device, named pipe or socket" in capsys.readouterr().err
    os.mkfifo(tmp_path / "pipe")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        for special in ("pipe", "sock"):
            with pytest.raises(files.GradingError, match="is a device, named pipe or socket"):
                classroom.export(course, exchange, tmp_path / special)
            with pytest.raises(files.GradingError, match="is a device, named pipe or socket"):
                files.atomic_write(tmp_path / special, "x")
    assert (tmp_path / "pipe").is_fifo() and (tmp_path / "sock").is_socket()
    (tmp_path / "old.csv").write_text("old")
    assert classroom.export(course, exchange, tmp_path / "old.csv") == tmp_path / "old.csv"
    assert (tmp_path / "old.csv").read_text().startswith("assignment,duedate,")  # a plain file is replaced


@pytest.mark.timeout(60)
def test_a_roster_is_checked_for_type_and_size_before_it_is_read(tmp_path, capsys):
    """`init --roster /dev/zero` read the device whole, until the machine's memory ran out."""
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as fh:
        fh.truncate(50 * 2**30)  # sparse: 50 GiB that take no disk
    os.mkfifo(tmp_path / "pipe")
    for roster, says in (("/dev/zero", "not a regular file"), (tmp_path / "pipe", "not a regular file"),
                         (huge, "over the")):
        code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "init", "--roster", roster)
        assert code == 2 and says in err and str(roster) in err and "Traceback" not in err, err
    for roster in ("/dev/zero", tmp_path / "pipe", huge):  # and what the command itself reads
        with pytest.raises(files.GradingError, match="not a plain file|over the"):
            classroom.read_roster(roster)
    assert not (course / "gradebook.db").exists()


@pytest.mark.timeout(60)
def test_a_named_pipe_called_ipynb_does_not_hang_the_grader(tmp_path):
    """It held the grade lock forever: discover read it as a notebook and waited for a writer."""
    from course.grade import grader, submissions

    folder = tmp_path / "subs"
    (folder / "ann" / ASSIGNMENT).mkdir(parents=True)
    os.mkfifo(folder / "ann" / ASSIGNMENT / f"{NOTEBOOK}.ipynb")
    (sub,) = submissions.discover(folder, {ASSIGNMENT: [NOTEBOOK]})
    assert "not a plain file" in sub.problem, sub
    (row,) = grader.grade(folder, tmp_path / "course", progress=False, log=lambda *_: None, unsandboxed=True)
    assert row.status == "invalid" and "named pipe" in row.problems, row
    assert "invalid notebook" in submissions.invalid_reason(folder / "ann" / ASSIGNMENT / f"{NOTEBOOK}.ipynb")


def test_an_empty_path_is_an_error_never_the_current_folder(tmp_path, capsys, monkeypatch):
    """`grade "" --course X` graded everything below the current folder; `grade DIR --course ""` wrote a
    gradebook, grades.csv and feedback/ into it."""
    from course import cli

    (tmp_path / "here" / "ann" / ASSIGNMENT).mkdir(parents=True)
    shutil.copy(REFERENCE, tmp_path / "here" / "ann" / ASSIGNMENT)
    monkeypatch.chdir(tmp_path / "here")
    for argv in (["grade", "", "--course", str(tmp_path / "course")], ["grade", str(tmp_path / "here"), "--course", ""],
                 ["classroom", "--course", "", "status"], ["classroom", "--exchange", "", "status"],
                 ["classroom", "export", "--to", ""], ["classroom", "init", "--roster", ""], ["check", ""]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "empty path" in err, (argv, err)
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["ann"] and not (tmp_path / "course").exists()


def test_a_full_disk_names_the_path_and_says_the_grades_are_intact(tmp_path, monkeypatch):
    """It said only `[Errno 28] No space left on device`, or showed nbgrader's traceback."""
    import errno

    from course.grade import nbgrader_api

    where = tmp_path / "class"
    err = str(files.disk_error(OSError(errno.ENOSPC, "No space left on device"), where / "report.csv"))
    assert str(where / "report.csv") in err and "grades written before are intact" in err, err
    traceback = {"success": False, "log": "[GenerateAssignmentApp | ERROR] There was an error processing assignment",
                 "error": "Traceback (most recent call last):\n"
                          "  File \"/x/nbgrader/converters/base.py\", line 1, in f\n"
                          "    self.write()\nOSError: [Errno 28] No space left on device: '/x/release/a.ipynb'\n"}
    with pytest.raises(files.GradingError) as full:
        nbgrader_api.check_result(traceback, "generate_assignment x", where)
    assert str(where) in str(full.value) and "grades written before are intact" in str(full.value)
    assert "Traceback" not in str(full.value) and "File " not in str(full.value)
    traceback["error"] = traceback["error"].replace("OSError: [Errno 28] No space left on device", "KeyError: 'cells'")
    with pytest.raises(files.GradingError) as other:
        nbgrader_api.check_result(traceback, "generate_assignment x", where)
    assert "KeyError: 'cells'" in str(other.value) and "Traceback" not in str(other.value), other.value


def test_feedback_without_the_submission_secret_says_so(class_with_exchange, capsys):
    """Right after a successful grade it said "run grade first" while `status` counted the feedback."""
    course, exchange = class_with_exchange
    page = course / "feedback" / "alice" / ASSIGNMENT / f"{NOTEBOOK}.html"
    page.parent.mkdir(parents=True)
    page.write_text("<html>14/14</html>")
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "feedback", ASSIGNMENT)
    assert code == 2 and "submission_secret.txt" in err and "alice" in err, err
    assert "run `kvcourse classroom grade" not in err, err
    assert "feedback 1" in classroom_main(capsys, "--course", course, "--exchange", exchange, "status")[1]


def test_a_zero_byte_gradebook_is_damage_not_a_fresh_start(class_with_exchange, capsys):
    """An empty gradebook.db (cut short by a crash or a full disk) was taken for none and rebuilt silently."""
    from course.grade import nbgrader_api

    course, exchange = class_with_exchange
    (course / "gradebook.db").write_bytes(b"")
    assert "empty" in nbgrader_api.gradebook_problem(course / "gradebook.db")
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "export")
    assert code == 2 and "is damaged (it is empty" in err, err
    assert (course / "gradebook.db").read_bytes() == b""
