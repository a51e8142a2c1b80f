"""Which notebook is graded for a student: never a stray copy instead of the real one, and nothing dropped in
silence (course/grade/submissions.py, `discover`)."""
import json
import shutil

from course.grade import submissions
from course.paths import PROJECT_ROOT

SAMPLES = PROJECT_ROOT / "autograde" / "samples"
KNOWN = {"01_memory_formula": ["memory_formula"], "02_kv_cache": ["kv_cache"]}


def _put(src_student: str, assignment: str, notebook: str, dest):
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(SAMPLES / src_student / assignment / f"{notebook}.ipynb", dest)


def _rows(folder):
    return {(s.student, s.assignment, s.notebook): s for s in submissions.discover(folder, KNOWN)}


def test_the_exact_name_wins_over_a_re_download_whatever_the_sort_order(tmp_path):
    # "memory_formula (1).ipynb" sorts before "memory_formula.ipynb": the stale blank copy must not be graded
    d = tmp_path / "ann" / "01_memory_formula"
    _put("reference", "01_memory_formula", "memory_formula", d / "memory_formula.ipynb")
    _put("blank", "01_memory_formula", "memory_formula", d / "memory_formula (1).ipynb")
    subs = submissions.discover(tmp_path, KNOWN)
    graded = [s for s in subs if not s.problem]
    assert len(graded) == 1 and graded[0].path.name == "memory_formula.ipynb"
    assert any("memory_formula (1).ipynb" in p and "not graded" in p for p in graded[0].problems)
    assert len(subs) == 1, "one row for the student's notebook, the copy named on it"


def test_a_readable_copy_wins_over_a_broken_original(tmp_path):
    d = tmp_path / "ann" / "01_memory_formula"
    d.mkdir(parents=True)
    (d / "memory_formula.ipynb").write_text('{"cells": [')
    _put("reference", "01_memory_formula", "memory_formula", d / "memory_formula (1).ipynb")
    (sub,) = [s for s in submissions.discover(tmp_path, KNOWN)]
    assert sub.problem == "" and sub.path.name == "memory_formula (1).ipynb"
    assert any("invalid notebook" in p for p in sub.problems)


def test_a_notebook_in_another_assignments_folder_is_reported_not_graded_in_its_place(tmp_path):
    # a full kv_cache.ipynb slipped into the 01 folder must not replace the student's real (blank) 02 submission
    d = tmp_path / "ann" / "01_memory_formula"
    _put("reference", "01_memory_formula", "memory_formula", d / "memory_formula.ipynb")
    _put("reference", "02_kv_cache", "kv_cache", d / "kv_cache.ipynb")
    _put("blank", "02_kv_cache", "kv_cache", tmp_path / "ann" / "02_kv_cache" / "kv_cache.ipynb")
    rows = _rows(tmp_path)
    real = rows["ann", "02_kv_cache", "kv_cache"]
    assert real.problem == "" and real.path.parent.name == "02_kv_cache"
    stray = rows["ann", "01_memory_formula", "kv_cache"]
    assert stray.problem.startswith("misplaced") and "02_kv_cache" in stray.problem
    assert rows["ann", "01_memory_formula", "memory_formula"].problem == ""


def test_a_folder_holding_only_another_assignments_notebook_still_gets_its_missing_row(tmp_path):
    _put("reference", "02_kv_cache", "kv_cache", tmp_path / "bob" / "01_memory_formula" / "kv_cache.ipynb")
    rows = _rows(tmp_path)
    assert rows["bob", "01_memory_formula", "memory_formula"].missing
    assert rows["bob", "01_memory_formula", "kv_cache"].problem.startswith("misplaced")


def test_every_file_found_is_on_some_row(tmp_path):
    """Whatever the mix, each notebook file appears on a row: graded, reported, or named on the graded row."""
    d = tmp_path / "cat"
    for name in ("memory_formula.ipynb", "memory_formula (1).ipynb", "memory_formula copy.ipynb"):
        _put("reference", "01_memory_formula", "memory_formula", d / "01_memory_formula" / name)
    _put("reference", "02_kv_cache", "kv_cache", d / "01_memory_formula" / "kv_cache.ipynb")
    _put("reference", "02_kv_cache", "kv_cache", d / "02_kv_cache" / "kv_cache (2).ipynb")
    subs = submissions.discover(tmp_path, KNOWN)
    text = json.dumps([[str(s.path), s.problem, s.problems] for s in subs])
    for f in tmp_path.rglob("*.ipynb"):
        assert f.name in text, f
    keys = [(s.student, s.assignment, s.notebook) for s in subs]
    assert len(keys) == len(set(keys)), "two rows under one key: the grader would keep only one of them"


def test_odd_nbgrader_metadata_and_deep_code_are_read_without_error():
    """A submission's metadata and code are the student's: `"nbgrader": []`, a list or dict as grade_id, and a
    cell nested past Python's parser limits are repaired without error before any sandbox starts."""
    import copy

    import nbformat
    from nbformat.v4 import new_code_cell

    from course.grade.submissions import grade_id, repair
    from course.paths import AUTOGRADE

    ref = nbformat.read(str(AUTOGRADE / "samples" / "reference" / "01_memory_formula" / "memory_formula.ipynb"),
                        as_version=4)
    nb = copy.deepcopy(ref)
    for meta in ([], {"grade_id": ["x"], "solution": True}, {"grade_id": {"a": 1}, "grade": True, "points": 9}, "s",
                 None):
        cell = new_code_cell("x = 1")
        cell.metadata["nbgrader"] = meta
        nb.cells.append(cell)
    nb.cells.append(new_code_cell("total = " + " + ".join(["1"] * 10_000) + "\ny = " + "-" * 200_000 + "1"))
    problems = repair(nb, ref)
    assert [grade_id(c) for c in nb.cells if grade_id(c)] == [grade_id(c) for c in ref.cells if grade_id(c)]
    assert any("the release does not have" in p for p in problems), problems
    assert all(isinstance(c.metadata["nbgrader"], dict) for c in nb.cells if "nbgrader" in c.metadata)


def test_a_symbolic_link_is_not_graded_as_the_students_work(tmp_path):
    """A link to the solutions (or to another student's notebook) was graded as the student's own: 14/14."""
    import os

    import pytest

    subs = tmp_path / "subs"
    _put("reference", "01_memory_formula", "memory_formula", tmp_path / "elsewhere" / "memory_formula.ipynb")
    (subs / "mallory" / "01_memory_formula").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere" / "memory_formula.ipynb",
               subs / "mallory" / "01_memory_formula" / "memory_formula.ipynb")
    _put("reference", "01_memory_formula", "memory_formula", subs / "ann" / "01_memory_formula" / "memory_formula.ipynb")
    rows = _rows(subs)
    assert "symbolic link" in rows["mallory", "01_memory_formula", "memory_formula"].problem
    assert rows["ann", "01_memory_formula", "memory_formula"].problem == ""
    with pytest.raises(Exception, match="one student's folder"):
        submissions.discover(subs / "ann", KNOWN)  # one student's folder given: it graded them as '01_memory_formula'


def test_a_name_that_is_not_utf8_gets_a_row_and_stops_no_one(tmp_path):
    """A folder 'Ren\\xe9' from a zip made on Windows ended `kvcourse grade` with a UnicodeEncodeError, no report."""
    import os

    bad = os.fsdecode(bytes(tmp_path / "subs") + b"/Ren\xe9/01_memory_formula")
    os.makedirs(bad)
    shutil.copy(SAMPLES / "reference" / "01_memory_formula" / "memory_formula.ipynb", bad)
    os.makedirs(os.fsdecode(bytes(tmp_path / "subs") + b"/Zo\xeb"))  # no notebook at all
    _put("reference", "01_memory_formula", "memory_formula",
         tmp_path / "subs" / "ann" / "01_memory_formula" / "memory_formula.ipynb")
    subs = submissions.discover(tmp_path / "subs", KNOWN)
    json.dumps([(s.student, s.assignment, s.notebook, s.problem) for s in subs], ensure_ascii=False).encode("utf-8")
    odd = [s for s in subs if s.student in ("Ren\ufffd", "Zo\ufffd")]
    assert {s.student for s in odd} == {"Ren\ufffd", "Zo\ufffd"} and all("not UTF-8" in s.problem for s in odd)
    assert [s.problem for s in subs if s.student == "ann"] == [""]


def test_linked_folders_macos_leftovers_and_an_assignment_folder(tmp_path):
    """A student's folder or assignment folder that is a symbolic link was reported 'missing'; a __MACOSX folder
    from a macOS zip became a student with 0/14; an assignment's folder given as DIR was graded and replaced the
    class's report.csv."""
    import os

    import pytest

    subs = tmp_path / "subs"
    _put("reference", "01_memory_formula", "memory_formula", subs / "ann" / "01_memory_formula" / "memory_formula.ipynb")
    (subs / "fay").mkdir()
    os.symlink(subs / "ann" / "01_memory_formula", subs / "fay" / "01_memory_formula")
    os.symlink(subs / "ann", subs / "gus")
    mac = subs / "__MACOSX" / "ann" / "01_memory_formula"
    mac.mkdir(parents=True)
    (mac / "._memory_formula.ipynb").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    found = submissions.discover(subs, KNOWN)
    by_student = {}
    for s in found:
        by_student.setdefault(s.student, []).append(s)
    assert "__MACOSX" not in by_student
    assert [s.problem for s in by_student["ann"]] == [""]
    assert len(by_student["fay"]) == 1 and "symbolic link" in by_student["fay"][0].problem
    assert len(by_student["gus"]) == 1 and "symbolic link" in by_student["gus"][0].problem
    with pytest.raises(Exception, match="one assignment's folder"):
        submissions.discover(subs / "ann" / "01_memory_formula", KNOWN)
