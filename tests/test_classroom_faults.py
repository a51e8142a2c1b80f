"""`kvcourse classroom` under faults: hostile submissions in the exchange. Each test runs the command in this process (fast) and
checks what the instructor reads: what went wrong and what to run, never a traceback."""
from __future__ import annotations

import os
import shutil

import pytest

from course.grade import classroom
from course.paths import AUTOGRADE, SOLUTIONS

ASSIGNMENT, NOTEBOOK = "01_memory_formula", "memory_formula"
REFERENCE = AUTOGRADE / "samples" / "reference" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
STAMP = "2026-01-01 10:00:00.000000 UTC"


def classroom_main(capsys, *args) -> tuple[int, str, str]:
    """`kvcourse classroom ARGS` in this process: (exit status, stdout, stderr)."""
    from course import cli

    try:
        code = cli.main(["classroom", *map(str, args)])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


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
