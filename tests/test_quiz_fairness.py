"""The question bank is fair: an option's length and form say nothing about whether it is right, and no
learner-facing text mentions the source lesson the course grew from. Computed over the whole bank, so
questions added for later lessons are held to the same rule."""
from __future__ import annotations

import re

import pytest

from course.teach import quiz
from learner_text import quiz_text, source_sense_seeds

# A worked computation: two numbers joined by an arithmetic operator, or an equals / approximately sign
# next to a number ("2 · 30 · 3", "≈ 0.31 MB", "= 23,040").
COMPUTATION = re.compile(r"\d[\d,.]*\s*[×x*/÷·+−]\s*[\d(]|[=≈]\s*~?\d|\d\s*[=≈]")


def fairness(bank) -> dict:
    """Counts over the bank: the right option is (one of) the longest; it alone carries a computation."""
    longest, lone_computation = [], []
    for q in bank.questions:
        right = q.correct.text
        others = [o.text for o in q.options if o.key != q.answer]
        if len(right) >= max(len(t) for t in others):
            longest.append(q.id)
        if COMPUTATION.search(right) and not any(COMPUTATION.search(t) for t in others):
            lone_computation.append(q.id)
    return {"n": len(bank.questions), "longest": longest, "lone_computation": lone_computation}


@pytest.fixture(scope="module")
def bank():
    return quiz.load_questions()


def test_the_right_option_is_the_longest_in_at_most_a_third_of_the_questions(bank):
    stats = fairness(bank)
    assert stats["n"] >= 28
    assert len(stats["longest"]) <= stats["n"] / 3, stats["longest"]


def test_no_right_option_alone_carries_the_working(bank):
    assert fairness(bank)["lone_computation"] == []


def test_the_statistics_catch_a_giveaway_bank(bank):
    """The checks can fail: pad every right option and give it the only sum, and both statistics fire."""
    import copy

    rigged = copy.deepcopy(bank)
    for q in rigged.questions:
        right = q.correct
        object.__setattr__(right, "text", right.text + " — since 2 × 3 = 6 and so on, at great length" * 3)
    stats = fairness(rigged)
    assert len(stats["longest"]) == stats["n"]
    assert stats["lone_computation"]


def test_computation_pattern():
    for text in ("23,040 bytes (2 · 30 · 3 · 64 · 2).", "≈ 0.31 MB per token", "1 − 600/4,096"):
        assert COMPUTATION.search(text), text
    for text in ("About 85 %; a paged cache.", "Temperature 0 to 0.2.", "One token, many for the other"):
        assert not COMPUTATION.search(text), text


def test_quiz_text_never_mentions_the_source_lesson(bank):
    assert source_sense_seeds(quiz_text(bank)) == []


def test_seed_detector_tells_the_two_senses_apart():
    assert source_sense_seeds("Pin a random seed; sample(seed=1); each press uses a new seed; seed 3") == []
    assert source_sense_seeds("the seed quotes 5.21×") and source_sense_seeds("(seed: ~36 MB)")
    assert source_sense_seeds("The seed lesson's table") and source_sense_seeds("seed_kv_table()")


def _graded():
    import sys

    from course.paths import PROJECT_ROOT

    sys.path.insert(0, str(PROJECT_ROOT / "autograde"))
    import make_quiz

    return make_quiz.graded_questions()


def test_the_graded_quiz_is_fair_too():
    """The graded questions (autograde/quiz_questions.yaml) follow the same rules: the right option is never the
    longest nor alone in carrying a computation, and no letter is right more than twice in five."""
    from collections import Counter

    from course.teach.questions import QuestionBank

    graded = _graded()
    stats = fairness(QuestionBank({}, tuple(graded), ()))
    assert stats["longest"] == [] and stats["lone_computation"] == [], stats
    assert max(Counter(q.answer for q in graded).values()) <= 2
    assert source_sense_seeds(" ".join(q.prompt + " " + " ".join(o.text + " " + o.explanation for o in q.options)
                                       for q in graded)) == []


def test_no_autograded_answer_is_written_in_the_package():
    """No graded question's id is followed by its right letter anywhere in course/ (a docstring's example
    answer("prefill-ab", "B") was once the real one, read by a submission from course/teach/quiz.py)."""
    from course.paths import PROJECT_ROOT

    graded = [(q.id, q.answer) for q in _graded()]
    assert graded, "the checkpoint quiz has graded questions"
    package = PROJECT_ROOT / "course"
    texts = {p: p.read_text(encoding="utf-8") for p in package.rglob("*") if p.suffix in (".py", ".yaml", ".md")}
    for path, text in texts.items():
        for qid, letter in graded:
            for m in re.finditer(re.escape(qid), text):
                near = text[m.end(): m.end() + 12]
                assert not re.match(rf"""\s*["']\s*,\s*["']{letter}["']""", near), (path, qid, near)
