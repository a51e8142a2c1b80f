"""`kvcourse classroom` under faults: hostile submissions in the exchange, a gradebook that is damaged or held by
another program, and steps run in the wrong order. Each test runs the command in this process (fast) and
checks what the instructor reads: what went wrong and what to run, never a traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from course.grade import classroom
from course.paths import AUTOGRADE, SOLUTIONS
from test_classroom import classroom_main

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
    assert code == 2 and f"the exchange {blocker} is a file, not a folder" in err and "no exchange" not in err, err


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
