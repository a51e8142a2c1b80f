"""What a submission folder may make the grader read or pass on (audit findings 3-5): a timestamp.txt is used only
when it is a small plain file holding a timestamp (grader.submitted_timestamp), a notebook file over
NOTEBOOK_FILE_LIMIT is refused before it is read, one over NOTEBOOK_SIZE_LIMIT without its outputs after, one made
large only by its stored outputs is graded, and a folder name with glob characters is refused rather than handed to
nbgrader as a pattern (submissions.discover)."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from course.grade import grader, sandbox, submissions
from course.paths import AUTOGRADE, PROJECT_ROOT

SAMPLES = AUTOGRADE / "samples"
ASSIGNMENT = "01_memory_formula"
KNOWN = {ASSIGNMENT: ["memory_formula"], "02_kv_cache": ["kv_cache"]}
STAMP = "2026-01-01 10:00:00.000000 UTC"


def _put(folder: Path, student: str, sample: str = "reference", assignment: str = ASSIGNMENT) -> Path:
    shutil.copytree(SAMPLES / sample / assignment, folder / student / assignment)
    return folder / student / assignment


def _rows(folder: Path) -> dict[str, submissions.Submission]:
    return {s.student: s for s in submissions.discover(folder, KNOWN)}


# ----------------------------------------------------------------------------- timestamp.txt (finding 3)

def test_a_plain_timestamp_in_nbgraders_format_is_used(tmp_path):
    (tmp_path / "timestamp.txt").write_text(STAMP + "\n")
    assert grader.submitted_timestamp(tmp_path) == (STAMP, "")
    assert grader.submitted_timestamp(tmp_path / "elsewhere") == (None, ""), "no file: no time, no note"


@pytest.mark.parametrize("target", ["/dev/zero", "/etc/hostname", "secret.txt"])
def test_a_linked_timestamp_is_never_read(tmp_path, target):
    (tmp_path / "secret.txt").write_text(STAMP)  # even a link to a good timestamp: the grader never follows one
    (tmp_path / "timestamp.txt").symlink_to(target)
    stamp, why = grader.submitted_timestamp(tmp_path)
    assert stamp is None and "symbolic link" in why


def test_a_huge_sparse_timestamp_is_refused_by_its_size_without_reading_it(tmp_path):
    with open(tmp_path / "timestamp.txt", "wb") as f:
        f.truncate(350 * 2**20)  # 0 bytes on disk, 350 MB to copy
    stamp, why = grader.submitted_timestamp(tmp_path)
    assert stamp is None and "367,001,600 bytes" in why and str(grader.TIMESTAMP_LIMIT) in why.replace(",", "")


def test_a_timestamp_that_is_a_pipe_or_folder_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "timestamp.txt")  # opening it for reading would wait for a writer forever
    result = []
    reader = threading.Thread(target=lambda: result.append(grader.submitted_timestamp(tmp_path)), daemon=True)
    reader.start()
    reader.join(10)
    assert result and result[0][0] is None and "not a plain file" in result[0][1]
    os.remove(tmp_path / "timestamp.txt")
    (tmp_path / "timestamp.txt").mkdir()
    assert "not a plain file" in grader.submitted_timestamp(tmp_path)[1]


@pytest.mark.parametrize("content, why", [
    (b"", "empty"),
    (b"\xff\xfe2026", "not UTF-8"),
    (b"next Tuesday, honest", "not a timestamp"),
    (b"2020-01-01 00:00:00 /etc/passwd", "not a timestamp"),  # dateutil would open the "time zone" file
    (b"2020-01-01 00:00:00 99999999", "not a timestamp"),  # an offset past a day: parse_utc raises
    (STAMP.encode() + b" " * 2000, "over the 1,024"),
])
def test_a_timestamp_file_nbgrader_would_not_accept_is_ignored_with_a_reason(tmp_path, content, why):
    (tmp_path / "timestamp.txt").write_bytes(content)
    stamp, reason = grader.submitted_timestamp(tmp_path)
    assert stamp is None and why in reason, reason


# ----------------------------------------------------------------------------- notebook size (finding 4)

def test_a_notebook_over_the_size_limit_is_refused_before_it_is_read_and_the_others_are_graded(tmp_path):
    _put(tmp_path, "ann")
    big = tmp_path / "bob" / ASSIGNMENT
    big.mkdir(parents=True)
    with open(big / "memory_formula.ipynb", "wb") as f:  # sparse: nothing written, no time spent reading it
        f.truncate(submissions.NOTEBOOK_FILE_LIMIT + 1)
    rows = _rows(tmp_path)
    assert rows["ann"].problem == ""
    assert rows["bob"].problem.startswith("too large to grade") and "Clear Outputs" in rows["bob"].problem
    assert "invalid notebook" not in rows["bob"].problem, "the size is checked before the file is parsed"


def test_a_valid_notebook_over_the_limit_is_refused_and_a_small_copy_wins(tmp_path, monkeypatch):
    d = _put(tmp_path, "ann")
    nb = json.loads((d / "memory_formula.ipynb").read_text())
    nb["cells"].insert(0, {"cell_type": "markdown", "metadata": {}, "source": "x" * 50_000})
    (d / "memory_formula.ipynb").write_text(json.dumps(nb))
    monkeypatch.setattr(submissions, "NOTEBOOK_SIZE_LIMIT", 40_000)
    assert _rows(tmp_path)["ann"].problem.startswith("too large to grade")
    shutil.copy(SAMPLES / "reference" / ASSIGNMENT / "memory_formula.ipynb", d / "memory_formula (1).ipynb")
    (sub,) = submissions.discover(tmp_path, KNOWN)
    assert sub.problem == "" and sub.path.name == "memory_formula (1).ipynb"
    assert any("too large to grade" in p and "not graded" in p for p in sub.problems)


def _with_outputs(folder: Path, megabytes: int) -> Path:
    """The reference answer with `megabytes` MB of stored outputs (a long print kept in the saved file)."""
    path = folder / "memory_formula.ipynb"
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for cell in code:
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "x" * (megabytes * 2**20 // len(code))}]
    path.write_text(json.dumps(nb))
    return path


def test_a_notebook_made_large_by_its_outputs_is_read_without_them_not_refused(tmp_path):
    path = _with_outputs(_put(tmp_path, "ann"), 60)
    assert path.stat().st_size > 3 * submissions.NOTEBOOK_SIZE_LIMIT
    assert _rows(tmp_path)["ann"].problem == "", "outputs are discarded anyway: the notebook is graded"
    nb = submissions.read_notebook(path)
    assert all(c.outputs == [] for c in nb.cells if c.cell_type == "code")
    assert submissions.invalid_reason(path) == "", "kvcourse check refuses a notebook on this reason"


@pytest.mark.slow
@pytest.mark.skipif(bool(sandbox.sandbox_problem()), reason="the sealed grader needs bubblewrap")
def test_a_notebook_made_large_by_its_outputs_is_graded_and_checked(tmp_path):
    folder = tmp_path / "submissions"
    path = _with_outputs(_put(folder, "ann"), 60)
    (row,) = grader.grade(folder, tmp_path / "course", progress=False, log=lambda *_: None)
    assert row.status == "graded" and row.score == row.max_score > 0, row
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), KVCOURSE_PROGRESS=str(tmp_path / "progress.sqlite"))
    out = subprocess.run([sys.executable, "-m", "course.cli", "check", str(path)], cwd=PROJECT_ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "5 of 5 visible tests pass" in out.stdout, out.stdout + out.stderr


def test_the_course_own_notebooks_are_far_below_the_size_limit():
    notebooks = [*(PROJECT_ROOT / "solutions").rglob("*.ipynb"), *SAMPLES.rglob("*.ipynb")]
    assert notebooks and max(p.stat().st_size for p in notebooks) < submissions.NOTEBOOK_SIZE_LIMIT / 100


# ----------------------------------------------------------------------------- glob characters (finding 5)

@pytest.mark.parametrize("name", ["[A-Z]*", "*", "al[i]ce", "b?b"])
def test_a_student_folder_named_like_a_pattern_is_refused_and_the_others_are_found(tmp_path, name):
    _put(tmp_path, "ALICE")
    _put(tmp_path, "BOB", "blank")
    _put(tmp_path, name)
    (tmp_path / f"{name}x").mkdir()  # no notebook at all: still a row, with the same reason, never "missing"
    rows = _rows(tmp_path)
    assert rows["ALICE"].problem == "" and rows["BOB"].problem == ""
    for student in (name, f"{name}x"):
        assert "* ? [ or ]" in rows[student].problem and "rename the folder" in rows[student].problem
        assert not rows[student].missing
    assert len(rows) == 4


def test_an_assignment_folder_named_like_a_pattern_is_refused(tmp_path):
    d = _put(tmp_path, "ann")
    d.rename(tmp_path / "ann" / "0[1]_memory_formula")
    (sub,) = [s for s in submissions.discover(tmp_path, KNOWN) if s.path]
    assert "'0[1]_memory_formula'" in sub.problem and "* ? [ or ]" in sub.problem


# ----------------------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.skipif(bool(sandbox.sandbox_problem()), reason="the sealed grader needs bubblewrap")
def test_grading_notes_a_linked_timestamp_keeps_a_good_one_and_refuses_a_pattern_name(tmp_path):
    folder, course = tmp_path / "submissions", tmp_path / "course"
    (_put(folder, "ann") / "timestamp.txt").symlink_to("/dev/zero")
    (_put(folder, "bob") / "timestamp.txt").write_text(STAMP)
    _put(folder, "[a-z]*")
    rows = {r.student: r for r in grader.grade(folder, course, progress=False, log=lambda *_: None)}
    assert rows["ann"].status == "graded" and rows["ann"].score == rows["ann"].max_score > 0
    assert "timestamp.txt ignored: it is a symbolic link" in rows["ann"].problems
    assert not (course / "autograded" / "ann" / ASSIGNMENT / "timestamp.txt").exists()
    assert rows["bob"].status == "graded" and "timestamp" not in rows["bob"].problems
    assert (course / "autograded" / "bob" / ASSIGNMENT / "timestamp.txt").read_text() == STAMP
    assert rows["[a-z]*"].status == "invalid" and "* ? [ or ]" in rows["[a-z]*"].problems
    report = {r["student"]: r for r in csv.DictReader(open(course / "report.csv"))}
    assert "timestamp.txt ignored" in report["ann"]["problems"] and report["[a-z]*"]["status"] == "invalid"
    exported = {r["student_id"]: r for r in csv.DictReader(open(course / "grades.csv"))}
    assert exported["bob"]["timestamp"].startswith("2026-01-01 10:00:00")
