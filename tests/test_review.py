"""Review (spaced repetition): the Leitner intervals, what comes back first, two writers, the terminal session,
the widget, the progress view, and lessons/review.ipynb run headless."""
from __future__ import annotations

import io
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from course.paths import EXERCISES, LESSONS
from course.teach import review
from course.teach.progress import LEVELS, ProgressStore
from course.teach.questions import fill_numbers, load_questions, placeholder_keys
from course.teach.review import DAY_S, INTERVALS_DAYS, ReviewSession, due_items, replay


@pytest.fixture(scope="module")
def bank():
    return load_questions()


@pytest.fixture(autouse=True)
def clean_results(fresh_progress):
    """Each test starts with nothing record()ed and its own progress file (conftest's fresh_progress)."""


def _ids(items):
    return [i.id for i in items]


# ---------------------------------------------------------------------- the schedule
def test_leitner_intervals_for_a_scripted_history():
    t0 = 1_000_000.0
    day = DAY_S
    script = [  # (time, right?) → (box, due) after it
        (t0, True, 1, t0 + INTERVALS_DAYS[1] * day),                  # first right answer: box 1
        (t0 + 3600, True, 1, t0 + INTERVALS_DAYS[1] * day),           # again before it is due: no change
        (t0 + 1 * day, True, 2, t0 + day + INTERVALS_DAYS[2] * day),  # due: up one box, interval doubles
        (t0 + 3 * day, True, 3, t0 + 3 * day + INTERVALS_DAYS[3] * day),
        (t0 + 8 * day, False, 0, t0 + 8 * day),                       # a miss: back to box 0, due at once
        (t0 + 8 * day + 60, True, 1, t0 + 8 * day + 60 + INTERVALS_DAYS[1] * day),  # interval starts over
    ]
    events = []
    for at, right, box, due in script:
        events.append((at, right))
        s = replay(list(reversed(events)))  # order of the rows must not matter
        assert (s.box, s.due_at) == (box, due), (at - t0) / day
    assert (s.reviews, s.lapses, s.last_correct) == (6, 1, True)
    assert INTERVALS_DAYS == tuple(sorted(set(INTERVALS_DAYS))) and INTERVALS_DAYS[0] == 0

    # right every time it is due: the box climbs to the last one and stays there
    at, history = t0, []
    for _ in range(len(INTERVALS_DAYS) + 3):
        history.append((at, True))
        at = replay(history).due_at
    assert replay(history).box == len(INTERVALS_DAYS) - 1
    assert replay([]).due_at is None
    with pytest.raises(ValueError, match="intervals_days must start at 0 and grow"):
        replay([(t0, True)], intervals_days=(1, 2))


def test_a_missed_question_returns_before_an_answered_one(store, bank):
    kv = [q.id for q in bank.for_lesson("02_kv_cache")]
    missed, answered = kv[0], kv[1]
    q_missed, q_answered = bank.question(missed), bank.question(answered)
    store.record_answer("02_kv_cache", missed, next(o.key for o in q_missed.options if o.key != q_missed.answer), False)
    store.record_answer("02_kv_cache", answered, q_answered.answer, True)
    now = time.time()
    due_now = _ids(due_items(store, bank, now=now))
    assert due_now[0] == missed and answered not in due_now
    later = _ids(due_items(store, bank, now=now + 2 * DAY_S))  # both due by now: the miss still comes first
    assert later.index(missed) < later.index(answered)
    # skipped questions of the lesson are due too, between the two
    skipped = kv[2]
    assert later.index(missed) < later.index(skipped) < later.index(answered)
    # a lesson not started yet asks nothing
    assert not [i for i in due_items(store, bank, now=now) if i.lesson == "04_speculative_prefix"]


def test_low_self_assessment_comes_first(store, bank):
    store.record_self_assessment("01_prefill_decode", LEVELS[2])  # Confident
    store.record_self_assessment("03_sampling", LEVELS[0])        # New to it
    items = due_items(store, bank)
    lessons = [i.lesson for i in items]
    assert set(lessons) == {"01_prefill_decode", "03_sampling"}
    assert lessons.index("03_sampling") == 0 and max(
        i for i, lid in enumerate(lessons) if lid == "03_sampling") < lessons.index("01_prefill_decode")
    assert {i.reason for i in items} == {"skipped"}
    assert review.due_items(store, bank, limit=3) == items[:3]
    with pytest.raises(ValueError, match="limit must be a whole number >= 1"):
        due_items(store, bank, limit=0)


def test_cards_follow_their_self_ratings(store, bank):
    card = bank.cards_for("02_kv_cache")[0]
    store.record_card_view(card.lesson, card.id)
    (item,) = [i for i in review.all_items(store, bank) if i.id == card.id]
    assert item.reason == "unrated" and item.is_due(time.time())
    store.record_card_rating(card.lesson, card.id, True)
    (item,) = [i for i in review.all_items(store, bank) if i.id == card.id]
    assert item.box == 1 and not item.is_due(time.time()) and item.is_due(time.time() + DAY_S + 1)
    store.record_card_rating(card.lesson, card.id, False)
    assert due_items(store, bank)[0].id == card.id  # a missed card leads the next session


def test_reset_starts_the_schedule_over_and_keeps_the_answers(store, bank):
    q = bank.for_lesson("00_start_here")[0]
    store.record_answer(q.lesson, q.id, q.answer, True)
    assert q.id not in _ids(due_items(store, bank))
    store.record_review_reset()
    (item,) = [i for i in due_items(store, bank) if i.id == q.id]
    assert item.reason == "reset" and item.box == 0
    assert len(store.answers()) == 1


def test_explanations_quote_the_learners_own_numbers(store, bank):
    """A card or question that cites a measurement shows the value saved in the progress file."""
    cited = [c for c in bank.cards if [k for k in placeholder_keys(c.answer) if "." not in k]]
    assert cited, "no interview card cites a measured number"
    card = cited[0]
    values = {k: 1234.5678 for k in placeholder_keys(card.answer)}
    store.record_measurements(card.lesson, values)
    store.record_card_rating(card.lesson, card.id, False)
    session = ReviewSession(store, bank, limit=1)
    assert session.current.id == card.id
    shown = session.reveal()
    assert shown == fill_numbers(card.answer, values) != fill_numbers(card.answer, {})
    assert "1234" in shown or "1235" in shown


# ---------------------------------------------------------------------- two writers
def _reviewer(path: str, lesson: str, start) -> None:
    store = ProgressStore(path)
    session = ReviewSession(store, load_questions(), limit=None, lesson=lesson)
    start.wait()  # every session has picked its items before anyone answers: all of them write every item
    while not session.done:
        item = session.current
        if item.kind == "question":
            session.answer(session.bank.question(item.id).answer)
        else:
            session.reveal()
            session.rate(True)


def test_two_writers_lose_nothing(tmp_path, bank):
    """Two kernels reviewing the same lessons at the same moment: every answer and rating is kept."""
    path = tmp_path / "shared.sqlite"
    lessons = ["02_kv_cache", "03_sampling"]
    seed = ProgressStore(path)
    for lesson in lessons:
        seed.record_self_assessment(lesson, LEVELS[0])
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    start = ctx.Barrier(2 * len(lessons))
    procs = [ctx.Process(target=_reviewer, args=(str(path), lesson, start)) for lesson in lessons * 2]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    store = ProgressStore(path)
    n_questions = sum(len(bank.for_lesson(lid)) for lid in lessons)
    n_cards = sum(len(bank.cards_for(lid)) for lid in lessons)
    assert len(store.answers()) == 2 * n_questions  # each of the two writers per lesson answered all of them
    assert len(store.card_ratings()) == 2 * n_cards
    assert not due_items(store, bank)  # every item moved to box 1
    assert {i.box for i in review.all_items(store, bank) if i.lesson in lessons} == {1}


# ---------------------------------------------------------------------- the terminal
def _cli(monkeypatch, capsys, argv, stdin: str = ""):
    from course.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["review", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_kvcourse_review_reads_answers_from_stdin(monkeypatch, capsys, tmp_path, bank):
    store = ProgressStore(tmp_path / "default-progress.sqlite")
    q = bank.for_lesson("03_sampling")[0]
    wrong = next(o.key for o in q.options if o.key != q.answer)
    store.record_answer(q.lesson, q.id, wrong, False)
    card = bank.cards_for("03_sampling")[0]
    store.record_card_rating(card.lesson, card.id, False)
    first = _ids(due_items(store, bank, limit=2))
    assert set(first) == {q.id, card.id}
    replies = {q.id: f"x\n{q.answer.lower()}\n", card.id: "\nmaybe\ny\n"}  # a bad letter and a bad y/n first
    rc, out, err = _cli(monkeypatch, capsys, ["--limit", "2"], "".join(replies[i] for i in first))
    assert rc == 0, err
    assert "Type one of" in out and "Did you know it?" in out and "Reviewed 2 of 2: 2 right, 0 missed" in out
    assert store.answers()[-1]["question_id"] == q.id and store.answers()[-1]["correct"]
    assert store.card_ratings()[-1]["knew"] is True
    assert not {q.id, card.id} & set(_ids(due_items(store, bank)))

    # the input ends mid-session: what was answered is kept, and it says so
    rc, out, _ = _cli(monkeypatch, capsys, ["--limit", "3"], "")
    assert rc == 0 and "Stopped; everything answered so far is saved." in out


def test_kvcourse_review_list_asks_nothing(monkeypatch, capsys, tmp_path, bank):
    rc, out, _ = _cli(monkeypatch, capsys, ["--list"])
    assert rc == 0 and "Nothing to review yet" in out
    store = ProgressStore(tmp_path / "default-progress.sqlite")
    store.record_self_assessment("00_start_here", LEVELS[0])
    rc, out, _ = _cli(monkeypatch, capsys, ["--list", "--lesson", "00_start_here"])
    n = len(bank.for_lesson("00_start_here")) + len(bank.cards_for("00_start_here"))
    assert rc == 0 and out.startswith(f"{n} items due now")
    assert all(f" {i.id} " in out for i in due_items(store, bank))
    assert store.counts()["answers"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--limit", "0"], "must be at least 1"),
    (["--limit", "many"], "a whole number is needed"),
    (["--lesson", "99_nope"], "--lesson must be one of"),
    (["--yes"], "--yes only goes with --reset"),
    (["--reset", "--list"], "either --reset or --list"),
    (["--file", "."], "is a folder"),
    (["--file", "missing.sqlite"], "does not exist"),
    (["--file", __file__], "is not a progress file"),  # never moved aside as a "corrupt" progress file
])
def test_bad_arguments_exit_2_with_one_line(monkeypatch, capsys, argv, message):
    try:
        rc, out, err = _cli(monkeypatch, capsys, argv)
    except SystemExit as exc:  # refused while parsing
        rc, (out, err) = exc.code, capsys.readouterr()
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(Path(__file__).parent.glob("*.corrupt-*"))


def test_progress_refuses_a_file_that_is_not_a_progress_file(tmp_path, capsys):
    from course.cli import main

    other = tmp_path / "notes.txt"
    other.write_text("my notes")
    with pytest.raises(SystemExit) as exc:
        main(["progress", "--file", str(other)])
    assert exc.value.code == 2 and "is not a progress file" in capsys.readouterr().err
    assert other.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("reply, changed", [("yes", True), ("no", False), ("", False)])
def test_reset_asks_first(monkeypatch, capsys, tmp_path, bank, reply, changed):
    store = ProgressStore(tmp_path / "default-progress.sqlite")
    q = bank.for_lesson("00_start_here")[0]
    store.record_answer(q.lesson, q.id, q.answer, True)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or reply)
    rc = _cli(monkeypatch, capsys, ["--reset"])[0]
    assert asked and str(store.path) in asked[0]
    assert rc == (0 if changed else 1)
    assert (store.review_reset_at() is not None) == changed
    assert len(store.answers()) == 1  # answers are never deleted by a review reset

    monkeypatch.setattr("builtins.input", lambda _p: pytest.fail("must not ask with --yes"))
    assert _cli(monkeypatch, capsys, ["--reset", "--yes"])[0] == 0


# ---------------------------------------------------------------------- the widget and the progress view
def test_widget_answers_a_question_and_rates_a_card(store, bank):
    from course.teach.review_widget import ReviewWidget

    q = bank.for_lesson("02_kv_cache")[0]
    card = bank.cards_for("02_kv_cache")[0]
    wrong = next(o.key for o in q.options if o.key != q.answer)
    store.record_answer(q.lesson, q.id, wrong, False)
    store.record_card_rating(card.lesson, card.id, False)
    store.record_card_rating(card.lesson, card.id, False)  # two misses: the card comes first
    widget = ReviewWidget(ReviewSession(store, bank, limit=2))
    assert widget.shown.id == card.id and card.id in widget.status.value
    with pytest.raises(ValueError, match="is a card, not a question"):
        widget.check("A")
    assert widget.flip() == fill_numbers(card.answer, {})
    assert widget.knew_button.layout.display == ""
    widget.rate(True)
    assert store.card_ratings()[-1]["knew"] is True
    assert widget.shown.id == q.id
    result = widget.check(wrong)
    assert not result.correct and widget.next_button.layout.display == ""
    widget.check(q.answer)  # a second try is shown, not counted
    assert [a["correct"] for a in store.answers() if a["question_id"] == q.id] == [False, False]
    widget.next()
    assert widget.shown is None and "Reviewed 2 of 2: 1 right, 1 missed" in widget.status.value
    assert "kvcourse-review-progress" in widget.holder.children[0].value
    text = widget._repr_mimebundle_()["text/plain"]
    assert q.id in text and card.id in text and fill_numbers(card.answer, {})[:40] not in text


def test_progress_view_per_lesson(store, bank):
    q1, q2 = bank.for_lesson("03_sampling")[:2]
    store.record_answer(q1.lesson, q1.id, q1.answer, True)
    store.record_answer(q2.lesson, q2.id, next(o.key for o in q2.options if o.key != q2.answer), False)
    store.record_exercise_check("sampler", 5, 7)
    store.record_exercise_check("an_extra_exercise", 3, 4)  # in no lesson's list: shown on its own line
    rows = {r.lesson: r for r in review.progress(store, bank)}
    s = rows["03_sampling"]
    n_q, n_c = len(bank.for_lesson("03_sampling")), len(bank.cards_for("03_sampling"))
    assert (s.right, s.seen, s.questions, s.cards_due, s.cards) == (1, 2, n_q, n_c, n_c)
    assert s.due == (n_q - 1) + n_c  # all but the one answered right
    assert (s.tests_passed, s.tests_total) == (5, 7)
    assert rows["00_start_here"].due == 0 and rows["00_start_here"].tests_total is None
    text = review.progress_text(store, bank)
    assert len(text.splitlines()) <= 24  # one screen
    (line,) = [ln for ln in text.splitlines() if ln.startswith("03_sampling ")]
    assert line.split()[:6] == ["03_sampling", "1/2", str(n_q), f"{n_c}/{n_c}", str(s.due), "5/7"]
    assert "an_extra_exercise: 3/4 visible tests pass" in text
    assert "<table" in review.progress_view(store)._repr_mimebundle_()["text/html"]


def test_every_exercise_follows_a_lesson():
    stems = {p.stem for p in EXERCISES.glob("*/*.ipynb") if ".ipynb_checkpoints" not in p.parts}
    missing = stems - set(review.EXERCISE_LESSONS)
    assert not missing, f"add these to course/lessons/recap.py's COURSE table: {missing}"


# ---------------------------------------------------------------------- the notebook
@pytest.mark.slow
def test_review_notebook_runs_headless(run_notebook, tmp_path, bank):
    import nbformat

    progress = tmp_path / "nb-progress.sqlite"
    store = ProgressStore(progress)
    q = bank.for_lesson("01_prefill_decode")[0]
    store.record_answer(q.lesson, q.id, next(o.key for o in q.options if o.key != q.answer), False)
    run_notebook(LESSONS / "review.ipynb", timeout=300, env={"KVCOURSE_PROGRESS": str(progress)})
    executed = nbformat.read(tmp_path / "review-executed.ipynb", as_version=4)
    texts = [o.get("text", "") + o.get("data", {}).get("text/plain", "")
             for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    joined = "\n".join(texts)
    assert "Leitner" in joined and "01_prefill_decode" in joined  # the schedule and the progress table
    session = [t for t in texts if t.startswith("Review — ")]
    assert session and f"{q.id} · missed last time" in session[0] and f"answer({q.id!r}, LETTER)" in session[0]
    assert not any(o.get("output_type") == "error" for c in executed.cells if c.cell_type == "code" for o in c.outputs)


# ---------------------------------------------------------------------- the terminal, when the file is not fine
def test_kvcourse_review_says_where_a_moved_aside_file_is(monkeypatch, capsys, tmp_path):
    good = tmp_path / "good.sqlite"
    ProgressStore(good).record_answer("02_kv_cache", "kv-1", "A", False)
    path = tmp_path / "default-progress.sqlite"
    path.write_bytes(good.read_bytes()[:3000])  # a truncated copy: really not a readable database
    rc, out, err = _cli(monkeypatch, capsys, ["--list"])
    (aside,) = [p for p in tmp_path.glob(path.name + ".corrupt-*") if not p.name.endswith(("-wal", "-shm"))]
    assert rc == 0 and "Nothing to review yet" in out
    (note,) = [ln for ln in err.splitlines() if ln.strip()]
    assert note.startswith("Note: ") and f"moved aside to {aside}; your earlier progress is in that file" in note
    assert "ProgressFileWarning" not in err and ".py:" not in err


def test_kvcourse_review_in_a_read_only_folder_says_nothing_is_saved(monkeypatch, capsys, tmp_path, bank):
    """A folder the learner may not write: the saved answers are read (a session copy), and neither the note nor
    the stop message claims that this session's answers are saved."""
    import tempfile

    import filelock

    folder = tmp_path / "read-only"
    folder.mkdir()
    path = folder / "progress.sqlite"
    q = bank.for_lesson("03_sampling")[0]
    ProgressStore(path).record_answer(q.lesson, q.id, next(o.key for o in q.options if o.key != q.answer), False)
    saved = ProgressStore(path).answers()
    assert len(saved) == 1
    real_lock = filelock.FileLock

    def lock(name, *args, **kwargs):  # what creating the lock file beside it does in a read-only folder
        if Path(name).parent == folder:
            raise PermissionError(13, "Permission denied", name)
        return real_lock(name, *args, **kwargs)

    monkeypatch.setattr(filelock, "FileLock", lock)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    rc, out, err = _cli(monkeypatch, capsys, ["--limit", "3"], f"{q.answer}\n")  # one answer, then the input ends
    assert rc == 0 and "✓" in out, err
    assert "everything answered so far is saved" not in out
    assert f"Stopped; nothing answered in this session is saved in {path}" in out
    assert err.startswith("Note: New progress cannot be saved in") and "Traceback" not in err
    monkeypatch.undo()  # the folder writable again: the learner's file is as it was
    assert ProgressStore(path).answers() == saved


def test_kvcourse_review_on_a_busy_file_says_busy(monkeypatch, capsys, tmp_path):
    import sqlite3

    import course.cli.review as cli_review
    from course.teach.progress import BUSY_MESSAGE

    path = tmp_path / "default-progress.sqlite"
    ProgressStore(path).record_answer("02_kv_cache", "kv-1", "A", False)
    monkeypatch.setattr(cli_review, "default_store", lambda: ProgressStore(path, timeout=0.2))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("COMMIT")
    try:
        rc, out, err = _cli(monkeypatch, capsys, ["--list"])
    finally:
        holder.close()
    assert rc == 1 and BUSY_MESSAGE in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("*.corrupt-*")) and len(ProgressStore(path).answers()) == 1


def test_the_progress_table_says_what_its_columns_count(tmp_path):
    """A learner read 'right/seen' and 'cards due' with no word on what they count."""
    from course.teach import review
    from course.teach.progress import ProgressStore

    store = ProgressStore(tmp_path / "p.sqlite")
    for shown in (review.progress_text(store), review.progress_html(store)):
        assert "right/seen: checkpoint questions you answered right / answered" in shown
        assert "cards due: interview cards due for another look" in shown


def test_widget_says_when_the_progress_file_cannot_be_written(store, bank, monkeypatch):
    """With the disk full the session raises ProgressFileDiskError: the widget showed it as a traceback under
    itself; it shows the message and stays on the item, so the learner can try again."""
    from course.teach.progress import ProgressFileDiskError
    from course.teach.review_widget import ReviewWidget

    q = bank.for_lesson("02_kv_cache")[0]
    store.record_answer(q.lesson, q.id, next(o.key for o in q.options if o.key != q.answer), False)
    widget = ReviewWidget(ReviewSession(store, bank, limit=1))
    assert widget.shown.id == q.id

    def full(*_a, **_k):
        raise ProgressFileDiskError("cannot write the progress file: its disk is full; free some space")

    monkeypatch.setattr(widget.session, "answer", full)
    widget.check(q.answer)
    assert "disk is full" in widget.note.value and widget.shown.id == q.id and not widget._answered
