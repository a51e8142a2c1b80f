"""The exercises: nbgrader source notebooks in solutions/, student versions in exercises/.

exercises/ must be exactly what nbgrader generate_assignment makes from solutions/, leak no solution line
or hidden test, and give a learner nothing for free: the blank exercise passes no test.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from course.grade.check import HIDDEN_BEGIN
from course.grade.nbgrader_api import assignments, generate_exercises
from course.paths import AUTOGRADE, EXERCISES, PROJECT_ROOT, SOLUTIONS

ASSIGNMENTS = assignments()
SOLUTION_REGION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)
HIDDEN_REGION = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)


def notebooks(folder: Path):
    for assignment, stems in ASSIGNMENTS.items():
        for stem in stems:
            yield assignment, folder / assignment / f"{stem}.ipynb"


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def test_the_four_assignments_exist():
    assert list(ASSIGNMENTS)[:4] == ["01_memory_formula", "02_kv_cache", "03_sampler", "04_checkpoint_quiz"]
    for assignment, path in notebooks(EXERCISES):
        assert path.exists(), f"{path} missing: run `python autograde/make_exercises.py`"


@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
def test_source_notebooks_are_well_formed(assignment):
    (path,) = [p for a, p in notebooks(SOLUTIONS) if a == assignment]
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    ids = [nbgrader_meta(c)["grade_id"] for c in nb.cells if nbgrader_meta(c)]
    assert len(ids) == len(set(ids)), "grade ids must be unique"
    graded = [c for c in nb.cells if nbgrader_meta(c).get("grade")]
    answers = [c for c in nb.cells if nbgrader_meta(c).get("solution")]
    assert answers and len(graded) >= len(answers), "every answer cell has at least one test cell"
    assert any(HIDDEN_BEGIN in c.source for c in graded), "each assignment has hidden tests"
    previous = None
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if not meta:
            continue
        if meta.get("solution"):
            assert SOLUTION_REGION.search(cell.source + "\n"), f"{meta['grade_id']}: no BEGIN/END SOLUTION region"
        if meta.get("grade"):
            assert meta["locked"] and meta["points"] > 0, f"{meta['grade_id']}: tests are locked and worth points"
            assert "# Hint:" in cell.source or HIDDEN_BEGIN in cell.source, f"{meta['grade_id']}: give a hint"
            # nbgrader puts a deleted test cell back after the nbgrader cell before it, which it finds only
            # among answer and test cells: any other locked cell there would make that restore fail.
            assert previous is not None and (previous.get("solution") or previous.get("grade")), meta["grade_id"]
        previous = meta
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit without outputs"


def test_exercises_equal_what_nbgrader_generates(tmp_path):
    generate_exercises(dest=tmp_path / "exercises", workdir=tmp_path / "course")
    for assignment, committed in notebooks(EXERCISES):
        fresh = nbformat.read(str(tmp_path / "exercises" / assignment / committed.name), as_version=4)
        mine = nbformat.read(str(committed), as_version=4)
        assert [(c.cell_type, c.source) for c in mine.cells] == [(c.cell_type, c.source) for c in fresh.cells], (
            f"{committed} differs from nbgrader's student version of solutions/{assignment}: "
            "run `python autograde/make_exercises.py` and commit exercises/")
        assert [nbgrader_meta(c) for c in mine.cells] == [nbgrader_meta(c) for c in fresh.cells], committed


@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
def test_no_solution_or_hidden_test_leaks(assignment):
    (source,) = [p for a, p in notebooks(SOLUTIONS) if a == assignment]
    (exercise,) = [p for a, p in notebooks(EXERCISES) if a == assignment]
    src = nbformat.read(str(source), as_version=4)
    text = exercise.read_text()
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text
    student = " ".join(c.source for c in nbformat.read(str(exercise), as_version=4).cells)
    public = {ln.strip() for c in src.cells  # lines shown to students anyway (visible tests, set-up cells)
              for ln in HIDDEN_REGION.sub("", SOLUTION_REGION.sub("", c.source + "\n")).splitlines()}
    leaked = []
    for cell in src.cells:
        for region in SOLUTION_REGION.findall(cell.source + "\n") + HIDDEN_REGION.findall(cell.source + "\n"):
            for line in region.splitlines():
                line = line.strip()
                if len(line) > 12 and not line.startswith("#") and line not in public and line in student:
                    leaked.append(line)
    assert not leaked, f"solution or hidden-test lines in the student version: {leaked[:5]}"


def test_quiz_answers_are_not_in_the_student_version():
    sys.path.insert(0, str(AUTOGRADE))
    import make_quiz

    text = (EXERCISES / "04_checkpoint_quiz" / "checkpoint_quiz.ipynb").read_text()
    questions = make_quiz.graded_questions()
    assert len(questions) == 5 and {q.lesson for q in questions} == {"01_prefill_decode", "02_kv_cache", "03_sampling"}
    for number, q in enumerate(questions, start=1):
        assert make_quiz.variable(number) in text
        assert f"{make_quiz.variable(number)} = {q.answer!r}" not in text
        assert make_quiz.digest(q.id, q.answer) not in text, "the answer's digest lives in the hidden tests only"
        assert q.correct.explanation[:40] not in text, "explanations would give the answer away"


def test_the_graded_quiz_speaks_to_learners_and_its_answers_are_spread():
    """The learner's variables and the feedback's labels are question numbers, never the bank's ids; no one
    letter answers most of the quiz (answering one letter everywhere scores at most 40 %)."""
    from collections import Counter

    sys.path.insert(0, str(AUTOGRADE))
    import make_quiz

    text = (EXERCISES / "04_checkpoint_quiz" / "checkpoint_quiz.ipynb").read_text()
    questions = make_quiz.graded_questions()
    assert not re.search(r"seed[-_]\d", text), "the bank's old ids reach the learner"
    assert [f"answer_{n}" in text and f"test_{n}" in text for n in range(1, 6)] == [True] * 5
    assert max(Counter(q.answer for q in questions).values()) <= 2


def test_quiz_source_is_generated_from_the_graded_questions():
    sys.path.insert(0, str(AUTOGRADE))
    import make_quiz

    fresh = make_quiz.build(make_quiz.graded_questions())
    committed = nbformat.read(str(SOLUTIONS / "04_checkpoint_quiz" / "checkpoint_quiz.ipynb"), as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in fresh.cells], \
        "autograde/quiz_questions.yaml changed: run `python autograde/make_quiz.py` and `python autograde/make_exercises.py`"


def test_samples_are_built_from_the_current_exercises(tmp_path):
    """The sample submissions follow the exercises: regenerate them and compare."""
    out = tmp_path / "samples"
    subprocess.run([sys.executable, str(AUTOGRADE / "make_samples.py"), str(out)], check=True, cwd=PROJECT_ROOT,
                   capture_output=True)
    committed = AUTOGRADE / "samples"
    assert json.loads((out / "manifest.json").read_text()) == json.loads((committed / "manifest.json").read_text())
    for path in sorted(out.rglob("*.ipynb")):
        assert path.read_bytes() == (committed / path.relative_to(out)).read_bytes(), (
            f"{path.relative_to(out)} is out of date: run `python autograde/make_samples.py`")


def test_attention_replaced_runs_the_given_attention_and_restores_the_model(tiny):
    import torch.nn.functional as F

    from course.grade.exercise_tools import attention_replaced
    from course.engine.kv_cache import KVCache

    calls = []

    def reference(q, k, v, layer_cache, start_pos):  # the course model's own computation
        calls.append(start_pos)
        k, v = layer_cache.update(start_pos, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=start_pos == 0, enable_gqa=True)

    ids = torch.randint(0, tiny.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tiny(ids)
        cache = KVCache(tiny.config, batch=2, max_seq_len=16)
        with attention_replaced(tiny, reference):
            got = torch.cat([tiny(ids[:, :8], 0, cache), tiny(ids[:, 8:], 8, cache)], dim=1)
        assert torch.allclose(got, expected, atol=1e-5)
        assert calls == [0, 0, 8, 8], "each layer's attention goes through the given function"
        assert all("forward" not in block.attention.__dict__ for block in tiny.layers), "the model is restored"

        def wrong_shape(q, k, v, layer_cache, start_pos):
            return q[:, :1]

        with pytest.raises(ValueError, match=r"\[B, H, T, D_h\]"), attention_replaced(tiny, wrong_shape):
            tiny(ids, 0, KVCache(tiny.config, batch=2, max_seq_len=16))


@pytest.mark.slow
@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
def test_blank_exercise_passes_no_visible_test(assignment):
    """`kvcourse check` on the released exercise: every visible test fails (hidden ones: see test_grading)."""
    from course.grade.check import check

    (exercise,) = [p for a, p in notebooks(EXERCISES) if a == assignment]
    results, answer_errors = check(exercise, timeout=120)
    visible = [t for t in results if t.status != "hidden"]
    assert visible and all(t.status == "fail" for t in visible), [(t.grade_id, t.status) for t in visible]
    # they fail because nothing is implemented (the stubs raise), not because the tests are broken
    assert all(re.match(r"(NotImplementedError|NameError)", t.message) for t in visible), [t.message for t in visible]
    assert all("NotImplementedError" in e for e in answer_errors)


@pytest.mark.slow
def test_real_model_demo_with_the_reference_solution(real):
    """The KV-cache exercise's demo cell: the reference cache + attention on SmolLM2 match no cache at all."""
    from course.grade.exercise_tools import real_model_demo

    source = nbformat.read(str(SOLUTIONS / "02_kv_cache" / "kv_cache.ipynb"), as_version=4)
    namespace: dict = {}
    for cell in source.cells:
        if cell.cell_type == "code" and (cell.source.startswith("import math") or nbgrader_meta(cell).get("solution")):
            exec(cell.source, namespace)
    result = real_model_demo(namespace["new_cache"], namespace["cached_attention"], n_tokens=12)
    assert result["identical"], "greedy tokens with the reference cache must equal those without a cache"


@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
def test_every_test_cell_has_checks_for_the_sealed_grader(assignment):
    """The grader scores a test cell from its declared checks (autograde/checks/<assignment>.py), never by
    running the cell: every test cell needs its checks, and every check list belongs to a test cell."""
    from course.grade.verdicts import checks_path, load_checks

    path = checks_path(assignment)
    assert path.exists(), f"write {path}: one list of Check per test cell (see course/grade/verdicts.py)"
    checks = load_checks(path)
    (source,) = [p for a, p in notebooks(SOLUTIONS) if a == assignment]
    test_cells = [nbgrader_meta(c)["grade_id"] for c in nbformat.read(str(source), as_version=4).cells
                  if nbgrader_meta(c).get("grade") and not nbgrader_meta(c).get("solution")]
    assert sorted(checks) == sorted(test_cells), "the checks' grade ids must be the notebook's test cells"
    for gid, items in checks.items():
        assert all(c.hint.startswith("hint:") for c in items), f"{gid}: feedback shows the hint; start it with 'hint:'"


def test_each_exercise_is_linked_after_the_last_lesson_it_covers():
    """Every exercise is linked from exactly one lesson's recap; the graded quiz from the last lesson its
    questions come from (a quiz on lessons 1-3 linked from lesson 4 would be scheduled a lesson late)."""
    from course.lessons.recap import COURSE

    sys.path.insert(0, str(AUTOGRADE))
    import make_quiz

    order = [lesson for lesson, _, _ in COURSE]
    linked = [(path.split("/")[0], lesson) for lesson, _, paths in COURSE for path in paths]
    assert sorted(a for a, _ in linked) == sorted(ASSIGNMENTS), "each exercise is linked from one lesson"
    covered = {q.lesson for q in make_quiz.graded_questions()}
    assert dict(linked)["04_checkpoint_quiz"] == max(covered, key=order.index)
