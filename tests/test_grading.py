"""The graders are proven on autograde/samples: references get full marks, blanks 0, every planted bug
loses points, differently written correct code gets full marks, hostile submissions are graded without
stopping the class and score at most what their answers earn without the attack, changing nothing outside
their own folder; feedback never shows hidden tests, grading is repeatable and survives being killed.
(Faults of the grader itself: tests/test_grading_faults.py.)

One batch run grades all samples (slow, about 2-3 minutes on 2 cores); the other slow tests use small
subsets of the memory-formula samples, whose kernels start fastest.
"""
from __future__ import annotations

import csv
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from course.grade import check, files, grader, nbgrader_api, submissions
from course.paths import AUTOGRADE, EXERCISES, PROJECT_ROOT

SAMPLES = AUTOGRADE / "samples"
MANIFEST = json.loads((SAMPLES / "manifest.json").read_text())
EVIDENCE = {  # manifest "evidence" -> words report.csv must contain for that submission
    "timeout": "ran past the timeout",
    "output truncated": "output truncated",
    "kernel died": "kernel died",
    "edited test": "edited test cell(s) restored",
    "deleted test": "deleted test cell(s) put back",
    "deleted answer": "deleted answer cell(s) replaced",
    "metadata restored": "test cell metadata restored",
    "MemoryError": "memory cap (MemoryError)",
}
needs_bwrap = pytest.mark.skipif(bool(__import__("course.grade.sandbox", fromlist=["x"]).sandbox_problem()),
                                 reason="the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")


def html_text(path: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text()))


def squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


# ----------------------------------------------------------------------------- fast: no kernels

def test_the_samples_cover_what_the_issue_asks():
    for assignment in sorted({e["assignment"] for e in MANIFEST}):
        kinds = [e["student"].split("-")[1] if "-" in e["student"] else e["student"]
                 for e in MANIFEST if e["assignment"] == assignment]
        assert kinds.count("bug") >= 6, f"{assignment}: at least 6 planted bugs"
        assert kinds.count("alt") >= 2, f"{assignment}: at least 2 correct but different submissions"
        assert {"reference", "blank"} <= set(kinds)
    adversarial = {e["about"] for e in MANIFEST if e["student"].startswith("adv-")}
    for needed in ("never ends", "raises", "rewrites the visible test", "deletes its test cells", "sys.exit()",
                   "os._exit(1)", "6 GiB", "not valid JSON", "overwrites every other notebook", "gradebook.db",
                   "reads the solutions", "input transformer", "int subclass", "torch.allclose", "prints 'visible tests",
                   "20 MB", "marshalled bytecode", "copies the installed course package", "walks gc"):
        assert any(needed in about for about in adversarial), needed
    names = {e["student"] for e in MANIFEST}
    for e in MANIFEST:
        if e["student"].startswith("adv-") and e["expect"] != "invalid":
            assert e["honest"] in names, f"{e['student']}: name the sample with the same answers and no attack"
    for bug in ("mem-bug-float", "mem-bug-batch-zero", "samp-bug-top-p-before-top-k", "samp-bug-top-k-ties-fewer"):
        assert bug in names, f"{bug}: each stronger hidden test has a planted bug it catches"


def test_config_keeps_all_nbgrader_state_in_the_course_folder(tmp_path):
    cfg = nbgrader_api.load_config(tmp_path / "course", timeout=7, memory_mb=512)
    course = str((tmp_path / "course").resolve())
    assert cfg.CourseDirectory.root == course
    assert cfg.CourseDirectory.db_url == f"sqlite:///{course}/gradebook.db"
    assert cfg.Exchange.root.startswith(course) and cfg.Exchange.cache.startswith(course)
    assert cfg.Execute.timeout == 7 and cfg.Execute.interrupt_on_timeout is True
    assert cfg.GraderKernelManager.memory_limit_mb == 512
    assert cfg.OverwriteCells.add_missing_cells is True
    default = nbgrader_api.load_config()
    assert default.CourseDirectory.root == str(AUTOGRADE) and str(AUTOGRADE) in default.CourseDirectory.db_url
    for section in ("CourseDirectory", "Exchange"):
        for key, value in default[section].items():
            assert str(Path.home()) not in str(value) or str(AUTOGRADE) in str(value), (section, key, value)


def test_kernels_start_under_a_memory_cap():
    from course.grade.nbgrader_ext import GraderKernelManager

    km = GraderKernelManager(kernel_name="python3")
    km.memory_limit_mb = 256
    cmd = km.format_kernel_cmd()
    if sys.platform.startswith("linux"):
        assert cmd[:2] == [sys.executable, "-c"] and "RLIMIT_AS" in cmd[2] and cmd[3] == str(256 * 2 ** 20)
        assert "ipykernel" in " ".join(cmd[4:])
    km.memory_limit_mb = 0
    assert "RLIMIT_AS" not in " ".join(km.format_kernel_cmd())


def test_discover_sorts_out_bad_files(tmp_path):
    good = SAMPLES / "reference" / "01_memory_formula" / "memory_formula.ipynb"
    (tmp_path / "ann" / "01_memory_formula").mkdir(parents=True)
    shutil.copy(good, tmp_path / "ann" / "01_memory_formula")
    (tmp_path / "bob").mkdir()
    shutil.copy(good, tmp_path / "bob")  # DIR/<student>/<notebook>.ipynb: assignment from the name
    (tmp_path / "bob" / "notes.ipynb").write_text("{}")
    (tmp_path / "bob" / "kv_cache.ipynb").write_text('{"cells": [')
    shutil.copy(good, tmp_path / "loose.ipynb")
    (tmp_path / "ann" / ".ipynb_checkpoints").mkdir()
    shutil.copy(good, tmp_path / "ann" / ".ipynb_checkpoints")
    found = {(s.student, s.path.name): s for s in submissions.discover(tmp_path, nbgrader_api.assignments())}
    assert set(found) == {("ann", "memory_formula.ipynb"), ("bob", "memory_formula.ipynb"),
                          ("bob", "notes.ipynb"), ("bob", "kv_cache.ipynb"), ("", "loose.ipynb")}
    assert found["ann", "memory_formula.ipynb"].problem == "" and found["bob", "memory_formula.ipynb"].problem == ""
    assert found["bob", "memory_formula.ipynb"].assignment == "01_memory_formula"
    assert found["bob", "notes.ipynb"].problem.startswith("unknown notebook")
    assert found["bob", "kv_cache.ipynb"].problem.startswith("invalid notebook")
    assert found["", "loose.ipynb"].problem.startswith("misplaced")
    with pytest.raises(files.GradingError, match="not a folder"):
        submissions.discover(tmp_path / "nope", nbgrader_api.assignments())


def test_repair_reports_tampering_and_restores_deleted_answer_cells():
    release = nbformat.read(str(EXERCISES / "01_memory_formula" / "memory_formula.ipynb"), as_version=4)
    nb = nbformat.read(str(EXERCISES / "01_memory_formula" / "memory_formula.ipynb"), as_version=4)
    ids = [submissions.grade_id(c) for c in nb.cells]
    nb.cells[ids.index("test_kv_cache_bytes")].source = "pass"
    nb.cells[ids.index("test_max_context")].metadata["nbgrader"]["points"] = 99
    for gone in ("max_batch", "test_max_batch", "test_gqa_saving_hidden"):
        del nb.cells[[submissions.grade_id(c) for c in nb.cells].index(gone)]
    problems = submissions.repair(nb, release)
    assert problems == ["deleted answer cell(s) replaced by empty ones: max_batch",
                        "deleted test cell(s) put back: test_max_batch, test_gqa_saving_hidden",
                        "edited test cell(s) restored: test_kv_cache_bytes",
                        "test cell metadata restored: test_max_context"]
    order = [submissions.grade_id(c) for c in nb.cells if submissions.grade_id(c)]
    assert order.index("max_batch") == order.index("test_max_context_hidden") + 1, "back where it was"
    released = [submissions.grade_id(c) for c in release.cells if submissions.grade_id(c)]
    assert order == released, "every locked cell is back, in the released order"
    by_id = {submissions.grade_id(c): c for c in nb.cells if submissions.grade_id(c)}
    assert by_id["test_kv_cache_bytes"].source == {submissions.grade_id(c): c for c in release.cells
                                                   if submissions.grade_id(c)}["test_kv_cache_bytes"].source
    assert by_id["test_max_context"].metadata["nbgrader"]["points"] == 2
    assert submissions.repair(release, release) == []


def test_feedback_preprocessor_removes_hidden_tests():
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    from course.grade.nbgrader_ext import HideHiddenTests

    source = "# visible part\nprint(1)\n### BEGIN HIDDEN TESTS\nassert secret(3) == 42, 'hint: think'\n### END HIDDEN TESTS"
    failed = new_code_cell(source, outputs=[new_output("error", ename="AssertionError", evalue="hint: think",
                                                       traceback=["assert secret(3) == 42"])])
    passed = new_code_cell(source, outputs=[new_output("stream", name="stdout", text="1\n")])
    other = new_code_cell(source, outputs=[new_output("error", ename="KeyError", evalue="'the answer is 42'",
                                                      traceback=[])])
    nb, _ = HideHiddenTests().preprocess(new_notebook(cells=[failed, passed, other]), {})
    for cell in nb.cells:
        assert "secret" not in cell.source and "42" not in json.dumps(cell.outputs)
        assert "print(1)" in cell.source
    assert nb.cells[0].outputs[0].text == "hidden tests failed (AssertionError: hint: think)\n"
    assert nb.cells[1].outputs[0].text == "hidden tests passed\n"
    assert nb.cells[2].outputs[0].text == "hidden tests failed (KeyError)\n"


def test_grade_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="jobs"):
        grader.grade(SAMPLES, tmp_path, jobs=0)
    with pytest.raises(ValueError, match="timeout"):
        grader.grade(SAMPLES, tmp_path, timeout=0)


# ----------------------------------------------------------------------------- one batch run over all samples

def _fingerprint(*folders: Path) -> dict[str, str]:
    import hashlib

    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for folder in folders
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if __import__("course.grade.sandbox", fromlist=["x"]).sandbox_problem():
        pytest.skip("the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")
    course = tmp_path_factory.mktemp("course")
    folder = tmp_path_factory.mktemp("class") / "submissions"  # a copy: nobody else edits it while it is graded
    shutil.copytree(SAMPLES, folder)
    watched = [folder] + [PROJECT_ROOT / top / a for top in ("solutions", "exercises")
                          for a in sorted({e["assignment"] for e in MANIFEST})[:4]]  # 05's are another's
    before = _fingerprint(*watched)
    started = time.perf_counter()
    rows = grader.grade(folder, course, jobs=2, progress=False, log=lambda *_: None)
    seconds = time.perf_counter() - started
    report = list(csv.DictReader(open(course / "report.csv")))
    print(f"\ngraded {len(rows)} samples in {seconds:.0f} s")
    return {"course": course, "rows": {(r.student, r.assignment): r for r in rows}, "report": report,
            "changed": sorted(k for k, v in _fingerprint(*watched).items() if before.get(k) != v)}


@pytest.mark.slow
def test_every_sample_gets_the_grade_it_must(graded):
    rows = graded["rows"]
    assert len(rows) == len(MANIFEST), "one row per submission: no grade lost"
    wrong = []
    for entry in MANIFEST:
        row = rows[entry["student"], entry["assignment"]]
        expect = entry["expect"]
        if expect == "invalid":
            ok = row.status == "invalid"
        else:
            ok = row.status == "graded" and row.max_score > 0 and {
                "full": row.score == row.max_score, "zero": row.score == 0,
                "loses": 0 <= row.score < row.max_score}[expect]
        if not ok:
            wrong.append(f"{entry['student']}/{entry['assignment']}: expected {expect}, got {row}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_attack_scores_at_most_its_honest_score_and_changes_nothing_outside(graded):
    rows = graded["rows"]
    report = []
    for entry in MANIFEST:
        if entry["honest"]:
            row, honest = rows[entry["student"], entry["assignment"]], rows[entry["honest"], entry["assignment"]]
            report.append(f"{entry['student']}/{entry['assignment']}: {row.score:g} (honest {honest.score:g})")
            assert row.status == "graded" and honest.status == "graded", (row, honest)
            assert row.score <= honest.score, f"{entry['student']} earned more than its answers: {row} vs {honest}"
    print("\n" + "\n".join(report))
    assert not graded["changed"], f"a submission changed files outside its folder: {graded['changed'][:5]}"
    from nbgrader.api import Gradebook  # the gradebook holds exactly the verdicts (nobody else wrote it)

    with Gradebook(f"sqlite:///{graded['course'] / 'gradebook.db'}", "kvcourse") as gb:
        for (student, assignment), row in rows.items():
            if row.status == "graded":
                assert float(gb.find_submission(assignment, student).score) == row.score, (student, assignment)
    assert all(r.sandbox == "sealed" for r in rows.values() if r.status == "graded")


@pytest.mark.slow
def test_feedback_truncates_huge_outputs(graded):
    page = graded["course"] / "feedback" / "adv-huge-output" / "01_memory_formula" / "memory_formula.html"
    assert page.stat().st_size < 3 * 2 ** 20, "a 20 MB print must not go whole into the feedback page"
    assert "output truncated" in html_text(page)


@pytest.mark.slow
def test_adversarial_submissions_leave_evidence(graded):
    rows = graded["rows"]
    for entry in MANIFEST:
        if entry["evidence"]:
            row = rows[entry["student"], entry["assignment"]]
            assert EVIDENCE[entry["evidence"]] in row.problems, (entry["student"], row.problems)
    autograded = graded["course"] / "autograded"
    restored = nbformat.read(str(autograded / "adv-deleted-test" / "01_memory_formula" / "memory_formula.ipynb"), 4)
    assert {"test_gqa_saving", "test_gqa_saving_hidden"} <= {submissions.grade_id(c) for c in restored.cells}
    edited = nbformat.read(str(autograded / "adv-edited-test" / "01_memory_formula" / "memory_formula.ipynb"), 4)
    (cell,) = [c for c in edited.cells if submissions.grade_id(c) == "test_kv_cache_bytes"]
    assert "524_288" in cell.source and any(o.output_type == "error" for o in cell.outputs)
    assert "print('all good')" not in json.dumps(nbformat.writes(edited)), "the edited test is gone"
    assert rows["adv-points", "01_memory_formula"].max_score == rows["reference", "01_memory_formula"].max_score
    hog = nbformat.read(str(autograded / "adv-huge-alloc" / "01_memory_formula" / "memory_formula.ipynb"), 4)
    assert any(o.get("ename") == "MemoryError" for c in hog.cells for o in c.get("outputs", []))


@pytest.mark.slow
def test_reference_tests_give_no_partial_credit_or_stderr(graded):
    """nbgrader scores a test cell by its outputs: a value or stderr output would change the score."""
    for path in (graded["course"] / "autograded" / "reference").rglob("*.ipynb"):
        nb = nbformat.read(str(path), as_version=4)
        for cell in nb.cells:
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
                kinds = {o.output_type for o in cell.outputs} | {o.get("name") for o in cell.outputs}
                assert not kinds & {"execute_result", "error", "stderr"}, (path.name, submissions.grade_id(cell))


@pytest.mark.slow
def test_csv_exports_match_the_gradebook(graded):
    course, rows = graded["course"], graded["rows"]
    exported = {(r["student_id"], r["assignment"]): r for r in csv.DictReader(open(course / "grades.csv"))}
    for (student, assignment), row in rows.items():
        if row.status == "graded":
            assert float(exported[student, assignment]["score"]) == row.score
            assert float(exported[student, assignment]["max_score"]) == row.max_score
    assert exported["adv-invalid-json", "01_memory_formula"]["score"] == "0.0", "invalid files count as 0"
    report = {(r["student"], r["assignment"]): r for r in graded["report"]}
    assert set(report) == set(rows)
    assert "not appear to be JSON" in report["adv-invalid-json", "01_memory_formula"]["problems"]


@pytest.mark.slow
def test_feedback_never_shows_hidden_tests(graded):
    course = graded["course"]
    hidden = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)
    secrets, public = [], set()  # hidden-test lines (quiz digests included), and lines students see anyway
    for source in (PROJECT_ROOT / "solutions").rglob("*.ipynb"):
        for cell in nbformat.read(str(source), as_version=4).cells:
            public |= {squeeze(ln) for ln in hidden.sub("", cell.source).splitlines()}
            for region in hidden.findall(cell.source):
                secrets += [squeeze(ln) for ln in region.splitlines() if len(ln.strip()) > 15]
    secrets = [s for s in secrets if s not in public]
    assert len(secrets) > 40
    pages = sorted((course / "feedback").rglob("*.html"))
    graded_rows = [r for r in graded["rows"].values() if r.status == "graded"]
    assert len(pages) == len(graded_rows), "feedback for every graded submission"
    for path in pages:
        text = html_text(path)
        assert "BEGIN HIDDEN TESTS" not in text
        flat = squeeze(text)
        student, assignment = path.parent.parent.name, path.parent.name
        own = squeeze(" ".join(c.source for nb in (SAMPLES / student / assignment).glob("*.ipynb")
                               for c in nbformat.read(str(nb), as_version=4).cells))  # the student's own code
        leaked = [s for s in secrets if s in flat and s not in own]
        assert not leaked, f"{path}: {leaked[:3]}"
    text = html_text(course / "feedback" / "mem-bug-rounds-up" / "01_memory_formula" / "memory_formula.html")
    assert "hidden tests failed (AssertionError: hint: round down to whole tokens" in text
    assert "hidden tests passed" in text
    text = html_text(course / "feedback" / "mem-bug-float" / "01_memory_formula" / "memory_formula.html")
    assert "(your code returned a float where an integer is asked)" in text, "a wrong type is named"
    # walked gc for the hidden checks in a cell and at check time, printed them, raised an exception named after them
    leaky = html_text(course / "feedback" / "adv-gc-hidden" / "01_memory_formula" / "memory_formula.html")
    assert "LEAK-CELL []" in leaky, "the cells ran while no hidden check was in the sandbox"
    hidden_inputs = ("32000", "13476839424", "Leak_30_1_1", "LEAK-CHECK (")  # kv(30, 1, 1, ...), kv(80, 4, 32_000, ...)
    assert not [x for x in hidden_inputs if x in leaky], [x for x in hidden_inputs if x in leaky]


# ----------------------------------------------------------------------------- repeatable, resumable, parallel

def _subset(tmp_path: Path, students: list[str], assignment: str = "01_memory_formula") -> Path:
    folder = tmp_path / "submissions"
    for student in students:
        shutil.copytree(SAMPLES / student / assignment, folder / student / assignment)
    return folder


def _scores(rows):
    return {(r.student, r.assignment): (r.status, r.score, r.max_score) for r in rows}


@pytest.mark.slow
def test_grading_twice_gives_the_same_grades_and_a_second_run_skips(tmp_path):
    folder = _subset(tmp_path, ["reference", "mem-bug-no-factor-2", "mem-bug-rounds-up", "adv-os-exit"])
    course = tmp_path / "course"
    first = grader.grade(folder, course, jobs=2, progress=False, log=lambda *_: None)
    messages = []
    again = grader.grade(folder, course, progress=False, log=messages.append)
    assert _scores(again) == _scores(first) and not messages, "nothing changed: nothing is regraded"
    forced = grader.grade(folder, course, jobs=1, force=True, progress=False, log=lambda *_: None)
    assert _scores(forced) == _scores(first), "regrading from scratch gives the same grades"
    (folder / "mem-bug-rounds-up" / "01_memory_formula" / "memory_formula.ipynb").write_bytes(
        (SAMPLES / "reference" / "01_memory_formula" / "memory_formula.ipynb").read_bytes())
    fixed = grader.grade(folder, course, progress=False, log=messages.append)
    assert messages and messages[0].startswith("grading 1 submission"), "only the changed file is regraded"
    assert _scores(fixed)["mem-bug-rounds-up", "01_memory_formula"] == ("graded", 14.0, 14.0)


@pytest.mark.slow
def test_a_run_killed_halfway_resumes_and_completes(tmp_path, graded):
    students = ["reference", "blank", "mem-bug-bits", "mem-bug-gqa-inverted", "mem-alt-prod", "adv-sys-exit"]
    folder, course = _subset(tmp_path, students), tmp_path / "course"
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    output = tmp_path / "killed-run.txt"  # what the killed run said, kept for the failure message
    with open(output, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "course.cli", "grade", str(folder), "--course", str(course),
                                 "--quiet"], cwd=PROJECT_ROOT, env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)
    ledger = course / "work" / "ledger.json"
    started = time.monotonic()
    try:  # on a busy 2-core machine the run's start (nbgrader, the solution's reference run) takes minutes
        while time.monotonic() < started + 1800 and proc.poll() is None:
            if ledger.exists() and len(json.loads(ledger.read_text() or "{}").get("graded", {})) >= 2:
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the main process and its kernels (a sandbox dies with its parent)
        proc.wait()
    done_before = len(json.loads(ledger.read_text())["graded"]) if ledger.exists() else 0
    assert 2 <= done_before < len(students), (
        f"the run was to be killed halfway: {done_before} of {len(students)} graded after "
        f"{time.monotonic() - started:.0f} s, exit status {proc.returncode}; it said: {output.read_text()[-3000:]}")
    messages = []
    rows = grader.grade(folder, course, progress=False, log=messages.append)
    assert messages[0].startswith(f"grading {len(students) - done_before} submission"), messages
    assert len(rows) == len(students) and all(r.status == "graded" for r in rows), \
        ("every grade is present", [r for r in rows if r.status != "graded"])
    clean = {key: graded["rows"][key] for key in _scores(rows)}  # the same files in the uninterrupted batch run
    assert _scores(rows) == _scores(clean.values()), "the resumed run gives the grades of an uninterrupted one"


# ----------------------------------------------------------------------------- the learner's side

def _kvcourse(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    return subprocess.run([sys.executable, "-m", "course.cli", *args], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_check_passes_a_correct_notebook_and_explains_a_wrong_one():
    ok = _kvcourse("check", str(SAMPLES / "mem-alt-prod" / "01_memory_formula" / "memory_formula.ipynb"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "[pass] test_kv_cache_bytes" in ok.stdout and "[hidden] test_kv_cache_bytes_hidden" in ok.stdout
    assert "5 of 5 visible tests pass" in ok.stdout
    bad = _kvcourse("check", str(SAMPLES / "mem-bug-no-factor-2" / "01_memory_formula" / "memory_formula.ipynb"))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "[FAIL] test_kv_cache_bytes" in bad.stdout
    assert "AssertionError: Llama-2-7B in FP16 holds 524,288 bytes per token" in bad.stdout
    assert "hint: one K and one V per layer" in bad.stdout
    assert "[pass] test_gqa_saving" in bad.stdout, "a part that does not use the formula still passes"
    assert bad.stdout.strip().splitlines()[-1].startswith(
        "1 of 5 visible tests pass; first failing: test_kv_cache_bytes — one K and one V per layer")
    wrong_type = _kvcourse("check", str(SAMPLES / "mem-bug-float" / "01_memory_formula" / "memory_formula.ipynb"))
    assert "(your code returned a float where an integer is asked)" in wrong_type.stdout.splitlines()[-1], \
        "the type is named as the grader names it"


@pytest.mark.slow
def test_check_saves_its_result_in_the_progress_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    (tmp_path / "progress.sqlite").write_bytes(b"damaged " * 600)  # said in one note, set aside, a fresh file made
    bad = _kvcourse("check", str(SAMPLES / "mem-bug-no-factor-2" / "01_memory_formula" / "memory_formula.ipynb"))
    assert bad.returncode == 1
    (note,) = [ln for ln in bad.stderr.splitlines() if ln.startswith("Note: ")]
    assert "moved aside to" in note and len(list(tmp_path.glob("progress.sqlite.corrupt-*"))) == 1
    shown = _kvcourse("progress")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "memory_formula" in shown.stdout and "1/5" in shown.stdout


@pytest.mark.slow
def test_check_runs_the_original_tests_of_an_edited_notebook():
    edited = _kvcourse("check", str(SAMPLES / "adv-edited-test" / "01_memory_formula" / "memory_formula.ipynb"))
    assert edited.returncode == 1, edited.stdout + edited.stderr
    assert "the ORIGINAL tests were run instead" in edited.stdout
    assert "[FAIL] test_kv_cache_bytes (2 pt) (original test)" in edited.stdout, "its own 'all good' test is not run"
    assert "all good" not in edited.stdout


@pytest.mark.slow
@needs_bwrap
def test_check_full_runs_the_hidden_checks_without_showing_them():
    out = _kvcourse("check", "--full", str(SAMPLES / "mem-bug-rounds-up" / "01_memory_formula" / "memory_formula.ipynb"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[FAIL] test_max_context_hidden (2 pt)" in out.stdout and "hint: round down to whole tokens" in out.stdout
    assert "[pass] test_kv_cache_bytes_hidden (2 pt)" in out.stdout
    assert re.search(r"score: 1[0-2]/14", out.stdout), out.stdout
    assert "20_071" not in out.stdout and "13_476_839_424" not in out.stdout, "no hidden input or expected value"


def test_check_warns_about_changed_test_cells():
    edited = SAMPLES / "adv-edited-test" / "01_memory_formula" / "memory_formula.ipynb"
    assert check.restored(edited)[1] == [
        "you edited test cell(s): test_kv_cache_bytes, test_kv_cache_bytes_hidden"]
    assert check.restored(SAMPLES / "reference" / "02_kv_cache" / "kv_cache.ipynb")[1] == []


def test_check_rejects_files_it_cannot_run(tmp_path):
    broken = _kvcourse("check", str(SAMPLES / "adv-invalid-json" / "01_memory_formula" / "memory_formula.ipynb"))
    assert broken.returncode == 2 and "not appear to be JSON" in broken.stderr
    missing = _kvcourse("check", str(tmp_path / "nope.ipynb"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


@pytest.mark.slow
def test_the_validate_button_still_works(tmp_path):
    """JupyterLab's Validate button loads nbgrader_config.py from the server's folder (the project root)."""
    script = (
        "import json, os, sys\n"
        "from jupyter_core.paths import jupyter_config_path\n"
        "from nbgrader.apps import NbGrader\n"
        "from nbgrader.validator import Validator\n"
        "paths = jupyter_config_path(); paths.insert(0, os.getcwd())\n"  # what the Validate handler does
        "app = NbGrader(); app.config_file_paths.append(paths); app.load_config_file()\n"
        "assert app.config.CourseDirectory.root.endswith('autograde'), app.config\n"
        "print(json.dumps(Validator(config=app.config).validate(sys.argv[1])))\n")
    from course.paths import jupyter_env

    env = jupyter_env(dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)), state=tmp_path / "jupyter")
    results = {}
    for student in ("reference", "mem-bug-no-factor-2", "blank"):
        path = SAMPLES / student / "01_memory_formula" / "memory_formula.ipynb"
        out = subprocess.run([sys.executable, "-c", script, str(path)], cwd=PROJECT_ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        results[student] = json.loads(out.stdout.strip().splitlines()[-1])
    assert "failed" not in results["reference"]
    (failed,) = results["mem-bug-no-factor-2"]["failed"]
    assert failed["raw_error"].startswith("1 of 5 visible tests pass; first failing: test_kv_cache_bytes — ")
    assert "524,288" in failed["source"], "the entry is the first failing test's cell"
    (blank,) = results["blank"]["failed"]  # one summary, not a traceback per cell
    assert blank["raw_error"].startswith("0 of 5 visible tests pass; first failing: test_kv_cache_bytes — ")
    assert blank["raw_error"].endswith("(not written yet)"), blank["raw_error"]
    assert "not written yet" not in failed["raw_error"], "a wrong answer is not called unwritten"
