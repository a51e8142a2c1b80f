"""Checkpoint quizzes: the question data, measured numbers in explanations, the widgets driven
programmatically (choose, Check, explanation shown, progress saved), and the headless text fallback."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from course.teach import questions, quiz
from course.paths import LESSONS, PROJECT_ROOT
from course.teach.progress import ProgressStore
from course.teach.questions import LEVELS
from course.teach.quiz_widget import CheckpointQuiz, FlipCard, QuestionWidget, SelfAssessmentWidget

LESSON_IDS = ["00_start_here", "01_prefill_decode", "02_kv_cache", "03_sampling", "04_speculative_prefix", "05_serving"]


@pytest.fixture(scope="module")
def bank():
    return quiz.load_questions()


@pytest.fixture(autouse=True)
def clean_results(fresh_progress):
    """Each test starts with nothing record()ed and its own progress file (conftest's fresh_progress)."""


# ---------------------------------------------------------------------- the question data
def test_every_lesson_has_its_questions(bank):
    assert list(bank.lessons) == LESSON_IDS
    for lesson in LESSON_IDS:
        own = [q for q in bank.for_lesson(lesson) if q.source == "course"]
        assert len(own) >= 3, f"{lesson} needs at least three questions of its own"


def test_every_question_is_well_formed(bank):
    ids = [q.id for q in bank.questions] + [c.id for c in bank.cards]
    assert len(ids) == len(set(ids))
    for q in bank.questions:
        assert q.lesson in bank.lessons
        keys = [o.key for o in q.options]
        assert [k for k in keys if k == q.answer] == [q.answer], f"{q.id}: exactly one correct option"
        assert len(keys) == len(set(keys)) >= 2
        for o in q.options:
            assert o.text.strip() and o.explanation.strip(), f"{q.id} {o.key}"
            assert o.explanation.startswith("Right" if o.key == q.answer else "Wrong"), f"{q.id} {o.key}"
        texts = [o.text for o in q.options]
        assert len(set(texts)) == len(texts), f"{q.id}: duplicate option text"


def test_seed_checkpoints_and_interview_questions_are_all_there(bank):
    seed = {q.id: q for q in bank.questions if q.source == "seed"}
    assert sorted(seed) == sorted(["prefill-ab", "prefill-bound", "kv-70b", "kv-beam", "sampling-golden"])
    assert not [q for q in bank.questions if q.autograded], "graded questions live in autograde/quiz_questions.yaml"
    # the seed's facts, checked through the options marked correct
    assert "40 GB" in seed["kv-70b"].correct.text
    assert "beam width" in seed["kv-beam"].correct.text
    assert "bandwidth" in seed["prefill-bound"].correct.text
    assert "B" in seed["prefill-ab"].correct.text.split(",")[0]
    assert len([c for c in bank.cards if c.source == "seed"]) >= 8
    assert {c.lesson for c in bank.cards} <= set(bank.lessons)


def test_correct_answers_are_not_always_the_same_letter(bank):
    letters = [q.answer for q in bank.questions]
    assert max(letters.count(k) for k in set(letters)) <= 0.6 * len(letters)


def test_worked_numbers_in_the_questions_match_course_memory():
    from course.measure.costs import kv_bytes_per_token

    assert kv_bytes_per_token("llama-2-70b", "float16") == 327_680
    assert kv_bytes_per_token("llama-2-7b", "float16") == 524_288
    assert kv_bytes_per_token("smollm2-135m", "float16") == 23_040  # kv-1's correct option
    assert 327_680 * 32_000 * 4 / 1e9 == pytest.approx(41.9, abs=0.1)  # kv-70b: "about 40 GB"


def _valid_data():
    import yaml

    return yaml.safe_load(questions.QUESTIONS_PATH.read_text())


def _first(data, qid):
    return next(q for q in data["questions"] if q["id"] == qid)


@pytest.mark.parametrize("break_it, message", [
    (lambda d: _first(d, "prefill-ab").update(answer="D"), "must name exactly one option"),
    (lambda d: _first(d, "prefill-ab")["options"][2].update(key="B"), "must have key 'C'"),
    (lambda d: _first(d, "prefill-ab")["options"][0].update(explanation=""), "has no explanation"),
    (lambda d: _first(d, "prefill-ab")["options"][0].pop("explanation"), "has no explanation"),
    (lambda d: _first(d, "prefill-ab").update(lesson="05_nowhere"), "lesson '05_nowhere' is not one of"),
    (lambda d: _first(d, "kv-1").update(id="prefill-ab"), "duplicate id"),
    (lambda d: _first(d, "prefill-ab").update(answer="A"), "must start with 'Right'"),
    (lambda d: _first(d, "prefill-ab").update(options=_first(d, "prefill-ab")["options"][:1]), "between 2 and"),
    (lambda d: _first(d, "kv-2").update(prompt="cache {cache_speedup:.1f} and {oops"), "malformed placeholder"),
    (lambda d: _first(d, "kv-2").update(prompt="x [[ no number here]]"), "cites no measured value"),
    (lambda d: _first(d, "kv-2").update(prompt="x {cache_speedup:.1z}"), "bad format spec"),
    (lambda d: d["interview"][0].update(answer=" "), "empty model answer"),
    (lambda d: d["lessons"]["03_sampling"].pop("self_assessment"), "needs a non-empty title and self_assessment"),
])
def test_validator_catches_broken_data(break_it, message):
    data = _valid_data()
    assert questions.validate(data) == []
    broken = copy.deepcopy(data)
    break_it(broken)
    problems = questions.validate(broken)
    assert any(message in p for p in problems), problems


def test_loading_a_broken_file_names_every_problem(tmp_path):
    import yaml

    data = _valid_data()
    _first(data, "kv-70b")["answer"] = "Z"
    data["questions"][0]["lesson"] = "nope"
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(questions.QuestionDataError, match=r"2 problem\(s\)") as err:
        quiz.load_questions(path)
    assert "lesson 'nope'" in str(err.value) and "answer 'Z'" in str(err.value)
    path.write_text("questions: [unclosed")
    with pytest.raises(questions.QuestionDataError, match="not valid YAML"):
        quiz.load_questions(path)


# ---------------------------------------------------------------------- measured numbers
def test_fill_numbers_inline_and_clauses():
    values = {"decode_ms_per_token": 12.345, "bw": 2.5e10, "nested": {"256": 900.0}, "nan": float("nan")}
    assert quiz.fill_numbers("{decode_ms_per_token:.1f} ms", values) == "12.3 ms"
    assert quiz.fill_numbers("{bw/1e9:.0f} GB/s", values) == "25 GB/s"
    assert quiz.fill_numbers("{decode_ms_per_token*1000:,.0f} µs", values) == "12,345 µs"
    assert quiz.fill_numbers("{nested.256:.0f}", values) == "900"
    assert quiz.fill_numbers("{missing:.1f|a few} ms", values) == "a few ms"
    assert quiz.fill_numbers("{missing:.1f} ms", values) == f"{questions.MISSING_TEXT} ms"
    assert quiz.fill_numbers("{nan:.1f|unknown}", values) == "unknown"
    text = "Fast.[[ You measured {decode_ms_per_token:.1f} ms at {bw/1e9:.0f} GB/s.]] Done."
    assert quiz.fill_numbers(text, values) == "Fast. You measured 12.3 ms at 25 GB/s. Done."
    assert quiz.fill_numbers(text, {"decode_ms_per_token": 1.0}) == "Fast. Done."  # one key missing
    assert quiz.fill_numbers("A[[ {missing}|, roughly]] B", values) == "A, roughly B"
    assert quiz.fill_numbers("{decode_ms_per_token:.1f}", {"decode_ms_per_token": "n/a"}) == questions.MISSING_TEXT


def test_every_text_reads_cleanly_with_and_without_measurements(bank):
    keys = {k for q in bank.questions for t in [q.prompt, *(o.explanation for o in q.options)]
            for k in questions.placeholder_keys(t)} | {k for c in bank.cards for k in questions.placeholder_keys(c.answer)}
    assert keys, "some explanations should cite the learner's measurements"
    full = {k: 0.5 for k in keys}
    texts = [q.prompt for q in bank.questions] + [o.explanation for q in bank.questions for o in q.options] \
        + [c.answer for c in bank.cards] + [c.prompt for c in bank.cards]
    for values in ({}, full):
        for text in texts:
            out = quiz.fill_numbers(text, values)
            assert not re.search(r"[{}]|\[\[|\]\]", out), out
            assert questions.MISSING_TEXT not in out, text  # every placeholder is in a clause or has a fallback
            assert "  " not in out.strip() and " ." not in out and " ," not in out, out


def _notebook_source(lesson: str) -> str | None:
    path = LESSONS / f"{lesson}.ipynb"
    if not path.exists():
        return None
    nb = json.loads(path.read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"])


def _recording_sources() -> str:
    return "\n".join(p.read_text() for p in (PROJECT_ROOT / "course").rglob("*.py"))


@pytest.mark.parametrize("lesson", LESSON_IDS)
def test_cited_measurements_are_recorded_by_the_lesson(bank, lesson):
    """A key an explanation cites must be one the lesson records, or it will never be filled in."""
    source = _notebook_source(lesson)
    if source is None:
        pytest.skip(f"lessons/{lesson}.ipynb does not exist yet")
    texts = [t for q in bank.for_lesson(lesson) for t in [q.prompt, *(o.explanation for o in q.options)]]
    texts += [c.answer for c in bank.cards_for(lesson)]
    keys = {k for t in texts for k in questions.placeholder_keys(t)}
    haystack = source + _recording_sources()
    missing = sorted(k for k in keys if not _is_recorded(k, haystack))
    assert not missing, f"{lesson} cites {missing}, which neither the notebook nor course/ records"


def _is_recorded(key: str, source: str) -> bool:
    """Does `source` name `key` as a quoted string, a dict(key=...) keyword, or an f-string template
    such as f"ab_{name}_total_s"?"""
    if re.search(rf"""["']{re.escape(key)}["']|\b{re.escape(key)}\s*=(?!=)""", source):
        return True
    for template in re.findall(r"""f["']([\w{}]*\{[\w{}]*)["']""", source):
        pattern = "".join(r"\w+" if part.startswith("{") else re.escape(part)
                          for part in re.split(r"(\{\w*\})", template) if part)
        if re.fullmatch(pattern, key):
            return True
    return False


def test_recorded_key_detection():
    assert _is_recorded("cache_speedup", 'record("cache_speedup", 3)')
    assert _is_recorded("bandwidth_gb_s", "dict(bandwidth_gb_s=self.bytes_per_s / 1e9)")
    assert _is_recorded("ab_A_total_s", 'out[f"ab_{name}_total_s"] = 1')
    assert not _is_recorded("ab_A_total_s", 'out[f"ab_{name}_ttft_s"] = 1')
    assert not _is_recorded("cache_speedup", 'record("cache_speedups", 3); if cache_speedup == 2: pass')


@pytest.mark.parametrize("lesson", LESSON_IDS)
def test_lesson_notebook_ends_with_its_checkpoint(lesson):
    path = LESSONS / f"{lesson}.ipynb"
    if not path.exists():
        pytest.skip(f"lessons/{lesson}.ipynb does not exist yet")
    nb = json.loads(path.read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    # the quiz and the self-assessment close the lesson (one cell, or one each)
    assert re.search(rf"""self_assessment\(\s*["']{lesson}["']""", code[-1]), code[-1]
    assert re.search(rf"""checkpoint\(\s*["']{lesson}["']""", "\n".join(code[-2:])), code[-2:]


# ---------------------------------------------------------------------- widgets, driven programmatically
def test_question_widget_wrong_then_right(bank, store):
    q = bank.question("kv-70b")
    w = QuestionWidget(q, number=1, store=store)
    assert w.check() is None and "Pick an option first" in w.feedback.value
    assert store.answers() == []

    wrong = next(o for o in q.options if o.key != q.answer)
    w.choose(wrong.key.lower())  # letters are case-insensitive
    w.check_button.click()  # what pressing Check does
    assert w.result.correct is False
    assert "Wrong" in w.feedback.value and _plain(wrong.explanation)[:60] in _plain(w.feedback.value)
    assert _plain(q.correct.explanation)[:60] not in _plain(w.feedback.value)  # no spoiler when wrong

    w.choose(q.answer)
    result = w.check()
    assert result.correct and "Right" in w.feedback.value
    assert _plain(q.correct.explanation)[:60] in _plain(w.feedback.value)
    for o in q.options:  # once right, every option's explanation is there
        assert _plain(o.explanation)[:40] in _plain(w.feedback.value)
    saved = store.answers("02_kv_cache")
    assert [(a["question_id"], a["choice"], a["correct"]) for a in saved] == [
        ("kv-70b", wrong.key, False), ("kv-70b", q.answer, True)]
    with pytest.raises(ValueError, match="choice must be one of"):
        w.choose("Z")


def _plain(html_text: str) -> str:
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", html_text))


def test_explanations_cite_the_number_just_measured(bank, store):
    from course.measure.results import record

    q = bank.question("prefill-ab")
    w = QuestionWidget(q, store=store, values=lambda: quiz.measured_values("01_prefill_decode", store))
    w.choose(q.answer)
    assert "predicted" not in w.check().explanation  # nothing measured: the clause is left out
    record("ab_A_total_s", 3.21)
    record("ab_B_total_s", 98.76)
    text = w.check().explanation
    assert "98.8 s for B" in text and "3.2 s for A" in text
    # a list-valued measurement is cited by position
    record("decode_ms_per_token", [21.04, 23.5, 30.25])
    record("decode_contexts", [16, 256, 1024])
    p3 = bank.question("prefill-3")
    w3 = QuestionWidget(p3, store=store, values=lambda: quiz.measured_values("01_prefill_decode", store))
    w3.choose(p3.answer)
    assert "from 21.0 ms per eager token at 16 tokens of context to 30.2 ms at 1024" in w3.check().explanation


def test_measurements_are_kept_for_after_a_restart(bank, store):
    from course.measure import results

    results.record("cache_speedup", 6.25)
    quiz.checkpoint("02_kv_cache", store=store, show=False)  # saves recorded() to the progress file
    results._recorded.clear()  # "restart the kernel"
    assert quiz.measured_values("02_kv_cache", store)["cache_speedup"] == 6.25
    fresh = ProgressStore(store.path)
    assert "6.2× at the longest" in quiz.fill_numbers(bank.question("kv-2").prompt, quiz.measured_values(None, fresh))


def test_checkpoint_quiz_scores_saves_and_remembers(bank, store):
    quiz_w = quiz.checkpoint("03_sampling", store=store, show=False)
    assert isinstance(quiz_w, CheckpointQuiz)
    assert [q.question.id for q in quiz_w.questions] == [q.id for q in bank.for_lesson("03_sampling")]
    for qw in quiz_w.questions:
        qw.choose(qw.question.answer)
        qw.check()
    n = len(quiz_w.questions)
    assert quiz_w.right == n and f"{n} of {n}" in quiz_w.score.value
    # A new widget (a restarted kernel) shows what was saved.
    again = quiz.checkpoint("03_sampling", store=ProgressStore(store.path), show=False)
    assert all("Saved from earlier" in qw.feedback.value for qw in again.questions)
    from course.teach.review import progress

    row = {r.lesson: r for r in progress(store)}["03_sampling"]
    assert row.answered == row.right == n and row.in_review == 0


def test_flip_cards_reveal_the_answer_and_are_remembered(bank, store):
    card = bank.card("interview-3")
    w = FlipCard(card, store=store)
    assert w.answer_text == "" and w.back.layout.display == "none"
    assert w.flip() is True
    assert "0.33 MB" in w.answer_text and w.back.layout.display != "none"
    assert w.button.description == "Hide answer"
    assert w.flip() is False and w.answer_text == ""
    assert store.cards_seen("02_kv_cache") == {"interview-3"}
    w.missed.click()  # after turning it over: "I missed it" brings it back in review
    assert store.rows("card_ratings")[-1]["knew"] is False and "comes back in review" in w.said.value


def test_self_assessment_is_saved_and_shown_again(store):
    w = quiz.self_assessment("04_speculative_prefix", store=store, show=False)
    assert w.levels.value is None and list(w.levels.options) == list(LEVELS)
    assert w.choose("getting there") == "Getting there"
    assert store.self_assessment("04_speculative_prefix") == "Getting there"
    w.levels.value = "Confident"  # what clicking the button does
    assert store.self_assessment("04_speculative_prefix") == "Confident"
    again = SelfAssessmentWidget("04_speculative_prefix", store=ProgressStore(store.path))
    assert again.levels.value == "Confident" and "Saved earlier" in again.status.value
    with pytest.raises(ValueError, match="level must be one of"):
        w.choose("expert")


def test_unknown_lesson_is_a_clear_error(store):
    with pytest.raises(ValueError, match=r"lesson_id must be one of \['00_start_here'"):
        quiz.checkpoint("2_kv_cache", store=store)
    with pytest.raises(ValueError, match="lesson_id must be one of"):
        quiz.self_assessment("sampling", store=store)


# ---------------------------------------------------------------------- headless text
def _explanations(bank, lesson):
    return [quiz.fill_numbers(o.explanation, {}) for q in bank.for_lesson(lesson) for o in q.options] + \
        [quiz.fill_numbers(c.answer, {}) for c in bank.cards_for(lesson)]


def test_text_fallback_shows_questions_but_not_answers(bank, store):
    w = quiz.checkpoint("02_kv_cache", store=store, show=False)
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    text = bundle["text/plain"]
    for q in bank.for_lesson("02_kv_cache"):
        assert q.id in text
        for o in q.options:
            assert quiz.fill_numbers(o.text, {})[:50] in text
    for explanation in _explanations(bank, "02_kv_cache"):
        assert explanation[:50] not in text
    assert "Right" not in text and "Wrong" not in text


def test_text_mode_prints_and_answers_in_code(bank, monkeypatch, capsys):
    monkeypatch.setenv("KVCOURSE_QUIZ", "text")
    quiz.checkpoint("01_prefill_decode")
    quiz.self_assessment("01_prefill_decode")
    out = capsys.readouterr().out
    assert "prefill-ab" in out and "answer('prefill-ab', LETTER)" in out and "New to it" in out
    assert not any(e[:50] in out for e in _explanations(bank, "01_prefill_decode"))

    q = bank.question("prefill-ab")
    assert quiz.answer("prefill-ab", q.answer) is True
    assert quiz.fill_numbers(q.correct.explanation, {})[:50] in capsys.readouterr().out
    quiz.show_answer("interview-1")
    assert bank.card("interview-1").answer[:50] in capsys.readouterr().out
    quiz.self_assessment("01_prefill_decode", level="Confident")
    store = ProgressStore()  # the default file, from KVCOURSE_PROGRESS
    assert store.latest_answers()["prefill-ab"]["correct"] is True
    assert store.self_assessment("01_prefill_decode") == "Confident"
    assert store.cards_seen() == {"interview-1"}
    with pytest.raises(ValueError, match=r"choice must be one of \['A', 'B', 'C'\]"):
        quiz.answer("prefill-ab", "E")
    with pytest.raises(ValueError, match="question_id 'no-such-9' is not in"):
        quiz.answer("no-such-9", "A")


def test_a_progress_file_not_ours_is_one_line_saying_the_answer_was_not_saved(bank, tmp_path, capsys):
    import sqlite3

    path = tmp_path / "app.db"  # another program's database: refused, never written
    sqlite3.connect(path).execute("CREATE TABLE notes (text TEXT)").connection.close()
    before = path.read_bytes()
    q = bank.for_lesson("02_kv_cache")[0]
    assert quiz.answer(q.id, q.answer, store=ProgressStore(path)) is True
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "saved" in ln]
    assert line.strip().startswith(f"Not saved: {path} is another program's database") and "KVCOURSE_PROGRESS" in line
    qw = QuestionWidget(q, store=ProgressStore(path))
    qw.choose(q.answer)
    assert qw.check().correct and f"Not saved: {path} is another program" in _plain(qw.feedback.value)
    card = FlipCard(bank.cards_for("02_kv_cache")[0], store=ProgressStore(path))
    card.rate(True)
    assert card.revealed and _plain(card.said.value).startswith(f"Not saved: {path} is another program")
    sa = SelfAssessmentWidget("02_kv_cache", store=ProgressStore(path))
    sa.choose("Confident")
    assert _plain(sa.status.value).startswith(f"Not saved: {path} is another program")
    assert path.read_bytes() == before


def test_a_broken_progress_file_never_stops_the_quiz(bank, tmp_path):
    from course.teach.progress import ProgressFileWarning

    path = tmp_path / "broken.sqlite"
    path.write_bytes(b"garbage" * 100)
    with pytest.warns(ProgressFileWarning):
        w = quiz.checkpoint("00_start_here", store=ProgressStore(path), show=False)
        qw = w.questions[0]
        qw.choose(qw.question.answer)
        assert qw.check().correct
    assert len(list(tmp_path.glob("broken.sqlite.corrupt-*"))) == 1


@pytest.mark.slow
def test_headless_notebook_prints_the_quiz_as_text(run_notebook, tmp_path, bank):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell('from course.measure.results import record\nrecord("cache_speedup", 4.5)'),
                nbformat.v4.new_code_cell('from course.teach.quiz import checkpoint, self_assessment\n'
                                          'checkpoint("02_kv_cache")\nself_assessment("02_kv_cache")')]
    path = tmp_path / "quiz_demo.ipynb"
    nbformat.write(nb, path)
    run_notebook(path, timeout=300, env={"KVCOURSE_PROGRESS": str(tmp_path / "nb-progress.sqlite")})
    executed = nbformat.read(tmp_path / "quiz_demo-executed.ipynb", as_version=4)
    outputs = executed.cells[-1].outputs
    texts = [o["data"]["text/plain"] for o in outputs if o.get("output_type") == "display_data"]
    assert len(texts) == 2, outputs
    assert "Checkpoint — " in texts[0] and "kv-70b" in texts[0] and "4.5× at the longest" in texts[0]
    assert "Self-assessment" in texts[1]
    assert all("application/vnd.jupyter.widget-view+json" in o["data"] for o in outputs
               if o.get("output_type") == "display_data")
    assert not any(e[:50] in texts[0] for e in _explanations(bank, "02_kv_cache"))
    assert ProgressStore(tmp_path / "nb-progress.sqlite").measurements("02_kv_cache")["cache_speedup"] == 4.5


# ---------------------------------------------------------------------- the graded quiz (exercise 04)
def _make_quiz():
    import sys

    sys.path.insert(0, str(PROJECT_ROOT / "autograde"))
    import make_quiz

    return make_quiz


@pytest.fixture(scope="module")
def graded():
    return _make_quiz().graded_questions()


def test_the_graded_quiz_is_its_own_five_questions(bank, graded):
    """Five new questions on lessons 1-3: no id, prompt or option of a lesson checkpoint (which learners may
    retry until right, with the answers in the package) comes back in the graded quiz."""
    from collections import Counter

    assert len(graded) == 5 and all(q.autograded for q in graded)
    assert [q.lesson for q in graded] == ["01_prefill_decode"] * 2 + ["02_kv_cache"] * 2 + ["03_sampling"]
    practice_ids = {q.id for q in bank.questions}
    practice_texts = {t for q in bank.questions for t in [q.prompt] + [o.text for o in q.options]}
    for q in graded:
        assert q.id not in practice_ids
        assert q.prompt not in practice_texts and not {o.text for o in q.options} & practice_texts, q.id
        assert len(q.options) >= 3 and all(o.explanation for o in q.options)
    assert max(Counter(q.answer for q in graded).values()) <= 2, "one letter everywhere must score at most 40 %"


def test_the_graded_questions_numbers_are_right(graded):
    by_id = {q.id: q for q in graded}
    per_token = 2 * 80 * 8 * 128 * 2  # Llama-3.1-70B, FP16
    assert per_token == 327_680 and round(per_token * 100_000 * 3 / 1e9) == 98
    assert "About 98 GB" in by_id["quiz-kv-size"].correct.text
    smol = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32
    assert smol == 46_080 and round(smol * 2_000 / 1e6) == 92 and round(5 * smol * 2_000 / 1e6) == 461
    assert "461 MB" in by_id["quiz-kv-beam-width"].correct.text
    assert by_id["quiz-finish-first"].correct.text.startswith("X")


def test_the_kv_size_question_needs_the_arithmetic(bank, graded):
    """The lesson's practice question kv-70b writes its right answer as '2·80·8·128·2 bytes ... per token, × ...':
    every option of the graded quiz-kv-size carries that same per-token product, and only the multipliers after it
    (and the total) tell them apart, so matching the practice's template picks nothing; each option's total is its
    own arithmetic, and only the right one's is 98 GB."""
    import re

    practice = bank.question("kv-70b").correct.text
    template = "2·80·8·128·2 bytes"
    assert template in practice
    q = {g.id: g for g in graded}["quiz-kv-size"]
    per_token = 2 * 80 * 8 * 128 * 2
    totals = {"A": per_token * 100_000, "B": per_token * 8 * 100_000 * 3, "C": per_token * 2 * 100_000 * 3,
              "D": per_token * 100_000 * 3}
    assert q.answer == "D" and sorted(totals) == sorted(o.key for o in q.options)
    for option in q.options:
        assert f"{template} per token" in option.text, option.key
        stated = int(re.match(r"About (\d+) GB", option.text).group(1))
        assert stated == round(totals[option.key] / 1e9), (option.key, stated, totals[option.key])
    assert len({round(t / 1e9) for t in totals.values()}) == 4


def _leaks(texts: dict, graded) -> list:
    """(file, what) for every graded id, right option or explanation found in `texts` (whitespace squeezed)."""
    squeeze = lambda t: re.sub(r"\s+", " ", t)  # noqa: E731
    found = []
    for path, text in texts.items():
        flat = squeeze(text)
        for q in graded:
            for needle in [q.id, squeeze(q.correct.text)[:60]] + [squeeze(o.explanation)[:60] for o in q.options]:
                if needle in flat:
                    found.append((str(path), needle))
    return found


def test_the_package_holds_no_graded_question_or_answer(graded):
    """Every learner has the package: none of the graded quiz's ids, right options or explanations is in it,
    and its question bank marks nothing as graded (the sandbox's redacted copy would otherwise be all that
    hides them)."""
    import yaml

    package = PROJECT_ROOT / "course"
    texts = {p: p.read_text(encoding="utf-8", errors="replace") for p in package.rglob("*")
             if p.is_file() and p.suffix in (".py", ".yaml", ".yml", ".md", ".json", ".txt", ".ipynb")}
    assert questions.QUESTIONS_PATH in texts
    assert _leaks(texts, graded) == []
    data = yaml.safe_load(questions.QUESTIONS_PATH.read_text())
    assert not [q["id"] for q in data["questions"] if q.get("autograded")]


def test_the_leak_check_catches_a_graded_question_put_back_in_the_bank(graded):
    """The check can fail: a graded question (answer included) copied into the package's bank is found."""
    import yaml

    data = yaml.safe_load(questions.QUESTIONS_PATH.read_text())
    q = graded[-1]
    data["questions"].append({"id": q.id, "lesson": q.lesson, "prompt": q.prompt, "answer": q.answer,
                              "options": [{"key": o.key, "text": o.text, "explanation": o.explanation}
                                          for o in q.options]})
    leaked = _leaks({questions.QUESTIONS_PATH: yaml.safe_dump(data, allow_unicode=True, sort_keys=False)}, graded)
    assert {n for _, n in leaked} >= {q.id, re.sub(r"\s+", " ", q.correct.text)[:60]}


def test_make_quiz_refuses_a_graded_id_that_is_in_the_package_bank(tmp_path):
    import yaml

    make_quiz = _make_quiz()
    data = yaml.safe_load(make_quiz.QUIZ_PATH.read_text())
    data["questions"][0]["id"] = "prefill-ab"
    path = tmp_path / "quiz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    with pytest.raises(questions.QuestionDataError, match="graded ids must be new"):
        make_quiz.graded_questions(path)


def _submissions(folder: Path, graded, answers: dict[str, dict[int, str] | None]) -> Path:
    """FOLDER/<student>/04_checkpoint_quiz/checkpoint_quiz.ipynb from the released exercise; None = as released."""
    import nbformat

    released = PROJECT_ROOT / "exercises" / "04_checkpoint_quiz" / "checkpoint_quiz.ipynb"
    for student, letters in answers.items():
        nb = nbformat.read(str(released), as_version=4)
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id", "")
            if letters is not None and gid.startswith("answer_"):
                cell.source = f"{gid} = {letters[int(gid.split('_')[1])]!r}"
        out = folder / student / "04_checkpoint_quiz" / "checkpoint_quiz.ipynb"
        out.parent.mkdir(parents=True)
        nbformat.write(nb, str(out))
    return folder


@pytest.mark.slow
def test_grading_the_quiz_rewards_knowledge_only(graded, tmp_path):
    """Through the real grader: the right letters score 5/5, the released notebook 0, and one letter
    everywhere at most 40 %."""
    from course.grade import grader, sandbox

    if sandbox.sandbox_problem():
        pytest.skip("the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")
    right = {n: q.answer for n, q in enumerate(graded, start=1)}
    answers = {"reference": right, "blank": None}
    answers |= {f"all-{k.lower()}": {n: k for n in right} for k in "ABCD"}
    folder = _submissions(tmp_path / "submissions", graded, answers)
    rows = grader.grade(folder, tmp_path / "course", jobs=1, progress=False, log=lambda *_: None)
    scores = {r.student: (r.score, r.max_score) for r in rows}
    assert scores["reference"] == (5, 5)
    assert scores["blank"][0] == 0
    for k in "ABCD":
        score, top = scores[f"all-{k.lower()}"]
        assert top == 5 and score <= 0.4 * top, (k, score)
