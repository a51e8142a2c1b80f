"""Review: only what was missed is in it (once, even if then answered right), it leaves when answered right in review;
questions, cards and predictions; two writers; the terminal; the widget; the progress table; the notebook headless."""
from __future__ import annotations

import io
import multiprocessing as mp
from pathlib import Path

import pytest

from course.paths import EXERCISES, LESSONS
from course.teach import review
from course.teach.progress import ProgressStore
from course.teach.questions import fill_numbers, load_questions, placeholder_keys
from course.teach.review import RULE, ReviewSession, due_items


@pytest.fixture(scope="module")
def bank():
    return load_questions()


@pytest.fixture(autouse=True)
def clean_results(fresh_progress):
    """Each test starts with nothing record()ed and its own progress file (conftest's fresh_progress)."""


def _ids(items):
    return [i.id for i in items]


def _wrong(q):
    return next(o.key for o in q.options if o.key != q.answer)


# ---------------------------------------------------------------------- what is in review
def test_only_what_was_missed_is_in_review_and_wrong_then_right_counts_once(store, bank):
    """After one answer review said '31 items due': every question never answered counted. And an answer that was
    wrong, then right, was saved as right and never came back."""
    right, retried = bank.for_lesson("02_kv_cache")[:2]
    store.record_answer(right.lesson, right.id, right.answer, True)
    assert due_items(store, bank) == []
    store.record_answer(retried.lesson, retried.id, _wrong(retried), False)
    store.record_answer(retried.lesson, retried.id, _wrong(retried), False)
    store.record_answer(retried.lesson, retried.id, retried.answer, True)  # the checkpoint's "try another option"
    (item,) = due_items(store, bank)
    assert (item.id, item.kind, item.misses) == (retried.id, "question", 2)
    assert "1 item in review" in review.progress_text(store, bank) and RULE in review.progress_text(store, bank)

    session = ReviewSession(store, bank)
    assert session.answer(_wrong(retried)).correct is False  # a miss in review keeps it
    assert _ids(due_items(store, bank)) == [retried.id] and due_items(store, bank)[0].misses == 3
    assert ReviewSession(store, bank).answer(retried.answer).correct  # right in review: it leaves
    assert due_items(store, bank) == []
    assert len(store.answers()) == 4  # review answers are kept apart: the checkpoint's saved answers stay as they were

    store.record_answer(retried.lesson, retried.id, _wrong(retried), False)  # missed again, later, in the lesson
    assert _ids(due_items(store, bank)) == [retried.id]


def test_cards_and_predictions_come_back_when_missed(store, bank):
    card = bank.cards_for("03_sampling")[0]
    store.record_card_view(card.lesson, card.id)  # turned over, never rated: not in review
    store.record_card_rating(card.lesson, card.id, True)
    assert due_items(store, bank) == []
    store.record_card_rating(card.lesson, card.id, False)
    store.record_prediction("01_prefill_decode", "decode_ms", "ms per decode token", 10, 30, 0.3, "ms")
    store.record_prediction("01_prefill_decode", "ttft_ms", "ms to the first token", 95, 100, 0.3, "ms")  # within
    items = due_items(store, bank)
    assert [(i.kind, i.id) for i in items] == [("prediction", "01_prefill_decode/decode_ms"), ("card", card.id)]
    assert items[0].prediction["measured"] == 30 and items[0].prediction["unit"] == "ms"

    session = ReviewSession(store, bank)
    assert "ms per decode token (in ms)" in session.front_text(session.current)
    result = session.answer("20")  # off by 33 %: outside ±30 %
    assert not result.correct and "off by 33 %, outside ±30 %: it stays in review" in result.explanation
    assert session.reveal() == fill_numbers(card.answer, {})
    session.rate(True)
    assert _ids(due_items(store, bank)) == ["01_prefill_decode/decode_ms"]
    assert ReviewSession(store, bank).answer(28).correct and due_items(store, bank) == []


def test_most_missed_first_then_course_order_and_reset_empties_review(store, bank):
    a, b = bank.for_lesson("03_sampling")[:2]
    early = bank.for_lesson("00_start_here")[0]
    for q, misses in ((a, 1), (b, 2), (early, 1)):
        for _ in range(misses):
            store.record_answer(q.lesson, q.id, _wrong(q), False)
    assert _ids(due_items(store, bank)) == [b.id, early.id, a.id]
    assert _ids(due_items(store, bank, lesson="03_sampling", limit=1)) == [b.id]
    with pytest.raises(ValueError, match="limit must be a whole number >= 1"):
        due_items(store, bank, limit=0)
    store.record("review_resets", {})
    assert due_items(store, bank) == [] and len(store.answers()) == 4


def test_explanations_quote_the_learners_own_numbers(store, bank):
    card = next(c for c in bank.cards if [k for k in placeholder_keys(c.answer) if "." not in k])
    values = {k: 1234.5678 for k in placeholder_keys(card.answer)}
    store.record_measurements(card.lesson, values)
    store.record_card_rating(card.lesson, card.id, False)
    shown = ReviewSession(store, bank).reveal()
    assert shown == fill_numbers(card.answer, values) != fill_numbers(card.answer, {})


def _reviewer(path: str, lesson: str, start) -> None:
    session = ReviewSession(ProgressStore(path), load_questions(), limit=None, lesson=lesson)
    start.wait()  # every sitting has its items before anyone answers
    while not session.done:
        session.answer(session.bank.question(session.current.id).answer)


def test_two_writers_lose_nothing(tmp_path, bank):
    """Two kernels reviewing the same lessons at the same moment: every answer is kept."""
    path, lessons = tmp_path / "shared.sqlite", ["02_kv_cache", "03_sampling"]
    store = ProgressStore(path)
    for q in (q for lid in lessons for q in bank.for_lesson(lid)):
        store.record_answer(q.lesson, q.id, _wrong(q), False)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    start = ctx.Barrier(2 * len(lessons))
    procs = [ctx.Process(target=_reviewer, args=(str(path), lesson, start)) for lesson in lessons * 2]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    n = sum(len(bank.for_lesson(lid)) for lid in lessons)
    assert len(store.rows("reviews")) == 2 * n and due_items(store, bank) == []


# ---------------------------------------------------------------------- the terminal
def _cli(monkeypatch, capsys, argv, stdin: str = ""):
    from course.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["review", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_kvcourse_review_asks_each_kind_and_lists_without_asking(monkeypatch, capsys, tmp_path, bank):
    store = ProgressStore(tmp_path / "default-progress.sqlite")
    rc, out, _ = _cli(monkeypatch, capsys, ["--list"])
    assert rc == 0 and "Nothing to review" in out
    q, card = bank.for_lesson("03_sampling")[0], bank.cards_for("03_sampling")[0]
    store.record_answer(q.lesson, q.id, _wrong(q), False)
    store.record_card_rating(card.lesson, card.id, False)
    store.record_prediction("03_sampling", "top_k_kept", "tokens top-k keeps", 10, 50, 0.2, "tokens")
    rc, out, _ = _cli(monkeypatch, capsys, ["--list"])
    assert rc == 0 and out.startswith("3 items to review") and RULE in out
    assert all(f" {i.id} " in out for i in due_items(store, bank)) and store.rows("reviews") == []

    replies = {q.id: f"x\n{q.answer.lower()}\n", card.id: "\nmaybe\ny\n", "03_sampling/top_k_kept": "lots\n45\n"}
    order = _ids(due_items(store, bank))
    rc, out, err = _cli(monkeypatch, capsys, [], "".join(replies[i] for i in order))
    assert rc == 0, err
    assert "Type one of" in out and "Did you know it?" in out and "Type a number" in out
    assert "within ±20 %: well predicted, so it leaves review" in out and "Reviewed 3 of 3: 3 right, 0 missed" in out
    assert due_items(store, bank) == []

    store.record_answer(q.lesson, q.id, _wrong(q), False)
    rc, out, _ = _cli(monkeypatch, capsys, [], "")  # the input ends at once
    assert rc == 0 and "Stopped; everything answered so far is saved." in out


@pytest.mark.parametrize("argv, message", [
    (["--limit", "0"], "must be at least 1"),
    (["--lesson", "99_nope"], "--lesson must be one of"),
    (["--yes"], "--yes only goes with --reset"),
    (["--reset", "--list"], "either --reset or --list"),
    (["--file", "missing.sqlite"], "does not exist"),
    (["--file", __file__], "is not a progress file"),  # never moved aside as a damaged progress file
])
def test_bad_arguments_exit_2_with_one_line(monkeypatch, capsys, argv, message):
    try:
        rc, out, err = _cli(monkeypatch, capsys, argv)
    except SystemExit as exc:  # refused while parsing
        rc, (out, err) = exc.code, capsys.readouterr()
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(Path(__file__).parent.glob("*.corrupt-*"))


@pytest.mark.parametrize("reply, emptied", [("yes", True), ("no", False)])
def test_reset_asks_first(monkeypatch, capsys, tmp_path, bank, reply, emptied):
    store = ProgressStore(tmp_path / "default-progress.sqlite")
    q = bank.for_lesson("00_start_here")[0]
    store.record_answer(q.lesson, q.id, _wrong(q), False)
    monkeypatch.setattr("builtins.input", lambda prompt: reply)
    assert _cli(monkeypatch, capsys, ["--reset"])[0] == (0 if emptied else 1)
    assert (due_items(store, bank) == []) == emptied and len(store.answers()) == 1  # answers are never deleted


def test_kvcourse_review_asks_nothing_when_the_file_cannot_take_it(monkeypatch, capsys, tmp_path, bank):
    import os

    path = tmp_path / "default-progress.sqlite"
    q = bank.for_lesson("03_sampling")[0]
    ProgressStore(path).record_answer(q.lesson, q.id, _wrong(q), False)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: real_access(p, mode) and not (
        mode & os.W_OK and Path(p) == path))
    rc, out, err = _cli(monkeypatch, capsys, [], f"{q.answer}\n")
    assert rc == 1 and "✓" not in out and "Your answer" not in out and "Traceback" not in err, out + err
    (line,) = err.strip().splitlines()  # one line: the file, and what to do
    assert line == (f"kvcourse review: progress cannot be saved in {path}: it is not writable "
                    f"(`chmod u+w {path}` makes it so)")
    monkeypatch.undo()
    assert ProgressStore(path).rows("reviews") == []


# ---------------------------------------------------------------------- the widget and the progress table
def test_widget_asks_a_card_a_question_and_a_prediction(store, bank):
    from course.teach.review_widget import ReviewWidget

    q, card = bank.for_lesson("02_kv_cache")[0], bank.cards_for("02_kv_cache")[0]
    store.record_answer(q.lesson, q.id, _wrong(q), False)
    for _ in range(3):  # most missed: it comes first
        store.record_card_rating(card.lesson, card.id, False)
    for _ in range(2):
        store.record_prediction("02_kv_cache", "kv_mb", "MB of KV cache per token", 1, 3, 0.3, "MB")
    widget = ReviewWidget(ReviewSession(store, bank, limit=3))
    assert widget.shown.id == card.id and card.id in widget.status.value and RULE in widget.children[0].value
    with pytest.raises(ValueError, match="is a card, not a question"):
        widget.check("A")
    assert widget.flip() == fill_numbers(card.answer, {})
    assert "kvcourse-review-knew" in widget.item_widget.knew._dom_classes
    widget.item_widget.knew.click()
    assert store.rows("reviews")[-1]["item"] == card.id and store.rows("reviews")[-1]["correct"] is True

    assert widget.shown.kind == "prediction"
    widget.predict(2.9)
    assert "well predicted" in widget.note.value and widget.next_button.layout.display == ""
    widget.next()
    assert widget.shown.id == q.id
    assert not widget.check(_wrong(q)).correct and "stays in review" in widget.note.value
    widget.check(q.answer)  # a second try is shown, not counted
    assert [r["correct"] for r in store.rows("reviews") if r["item"] == q.id] == [False]
    widget.next()
    assert widget.shown is None and "Reviewed 3 of 3: 2 right, 1 missed. 1 item still in review." in widget.status.value
    text = widget._repr_mimebundle_()["text/plain"]
    assert q.id in text and card.id in text and fill_numbers(card.answer, {})[:40] not in text


def test_widget_says_when_the_progress_file_cannot_be_written(store, bank, monkeypatch):
    from course.teach.progress import ProgressFileError
    from course.teach.review_widget import ReviewWidget

    q = bank.for_lesson("02_kv_cache")[0]
    store.record_answer(q.lesson, q.id, _wrong(q), False)
    widget = ReviewWidget(ReviewSession(store, bank, limit=1))

    def full(*_a, **_k):
        raise ProgressFileError("cannot write the progress file: its disk is full; free some space")

    monkeypatch.setattr(widget.session, "answer", full)
    widget.check(q.answer)
    assert "disk is full" in widget.note.value and widget.shown.id == q.id and not widget._answered


def test_progress_table_per_lesson(store, bank):
    q1, q2 = bank.for_lesson("03_sampling")[:2]
    store.record_answer(q1.lesson, q1.id, q1.answer, True)
    store.record_answer(q2.lesson, q2.id, _wrong(q2), False)
    store.record_exercise_check("sampler", 5, 7)
    store.record_exercise_check("an_extra_exercise", 3, 4)  # in no lesson's list: shown on its own line
    s = {r.lesson: r for r in review.progress(store, bank)}["03_sampling"]
    assert (s.right, s.answered, s.in_review, s.tests_passed, s.tests_total) == (1, 2, 1, 5, 7)
    text = review.progress_text(store, bank)
    assert len(text.splitlines()) <= 24  # one screen
    (line,) = [ln for ln in text.splitlines() if ln.startswith("03_sampling ")]
    assert line.split()[:7] == ["03_sampling", "1/2", str(len(bank.for_lesson("03_sampling"))),
                                f"0/{len(bank.cards_for('03_sampling'))}", "0/0", "1", "5/7"]
    assert "an_extra_exercise: 3/4 visible tests pass" in text and "right/answered: checkpoint questions" in text
    assert "<table" in review.progress_view(store)._repr_mimebundle_()["text/html"]


def test_every_exercise_follows_a_lesson():
    stems = {p.stem for p in EXERCISES.glob("*/*.ipynb") if ".ipynb_checkpoints" not in p.parts}
    missing = stems - set(review.EXERCISE_LESSONS)
    assert not missing, f"add these to course/lessons/recap.py's COURSE table: {missing}"


# ---------------------------------------------------------------------- without widgets, and the notebook
def test_answer_again_without_widgets(store, bank, capsys):
    q = bank.for_lesson("01_prefill_decode")[0]
    store.record_answer(q.lesson, q.id, _wrong(q), False)
    text = ReviewSession(store, bank).text()
    assert f"answer_again({q.id!r}, LETTER)" in text and RULE in text
    assert fill_numbers(q.correct.explanation, {})[:40] not in text
    assert review.answer_again(q.id, q.answer, store=store) is True
    assert "It leaves review." in capsys.readouterr().out and due_items(store, bank) == []
    with pytest.raises(ValueError, match="is not in review now"):
        review.answer_again(q.id, q.answer, store=store)


@pytest.mark.slow
def test_review_notebook_runs_headless(run_notebook, tmp_path, bank):
    import nbformat

    progress = tmp_path / "nb-progress.sqlite"
    q = bank.for_lesson("01_prefill_decode")[0]
    ProgressStore(progress).record_answer(q.lesson, q.id, _wrong(q), False)
    run_notebook(LESSONS / "review.ipynb", timeout=300, env={"KVCOURSE_PROGRESS": str(progress)})
    executed = nbformat.read(tmp_path / "review-executed.ipynb", as_version=4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    assert not any(o.get("output_type") == "error" for o in outputs)
    texts = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "01_prefill_decode" in texts and "1 item in review" in texts  # the progress table
    assert f"{q.id} · missed once" in texts and f"answer_again({q.id!r}, LETTER)" in texts  # the sitting, as text
