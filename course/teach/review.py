"""Review what you missed: spaced repetition over every checkpoint question and interview card.

The schedule is the **Leitner system** (Sebastian Leitner, *So lernt man lernen*, 1972): every item sits
in a numbered box; a right answer moves it up one box, a miss sends it back to the first box, and each
box is reviewed at a longer interval than the one before. We use the common software form of it, where
the interval doubles from box to box (``INTERVALS_DAYS``), plus a box 0 for items that are due at once:
the ones you missed and the ones you have not answered yet. A right answer given before an item is due
(answering the same question twice in a row) leaves it where it is, so cramming does not push it away.

Nothing here keeps a second copy of your progress. An item's box is *replayed* from the rows the progress
store already appends (course/teach/progress.py; SQLite, one locked transaction per write, so two
notebooks and a terminal can review at once without losing anything):

* a question's history is every answer it got — in a lesson's checkpoint, with ``answer(...)``, or here;
* an interview card's history is every "I knew it" / "I missed it" you gave after revealing it (flipping
  it in a checkpoint marks it seen, with no verdict);
* ``kvcourse review --reset`` appends a reset mark; the schedule ignores everything before the latest one
  (your answers and the progress table keep it all).

An item becomes reviewable once you have reached its lesson (answered, flipped, rated or run its
checkpoint). Which due items come first is a weight: what you **missed** (more for repeated misses), then
what you **skipped** (an unanswered question, an unflipped card), then what the schedule says is due —
each raised when your self-assessment of the lesson was low ("New to it").

Explanations and model answers quote *your* measured numbers: the bank's ``[[…]]`` clauses are filled from
this kernel's record()ed values, else from the numbers the lesson saved in the progress file.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from course.lessons.recap import COURSE
from course.teach.progress import ProgressFileError, ProgressStore, default_store
from course.teach.questions import (LEVELS, CheckResult, QuestionBank, card_text, fill_numbers, grade,
                                    load_questions, measured_values, question_text)

SCHEME = "Leitner boxes (Leitner, So lernt man lernen, 1972), interval doubling per box"
DAY_S = 86_400.0
INTERVALS_DAYS = (0, 1, 2, 4, 8, 16)  # box 0 … box 5; box 0 = due at once (missed or never answered)
DEFAULT_LIMIT = 10  # items per session: a few minutes

# Which due item comes first: the reason it is due, plus how low the lesson was self-assessed.
REASON_WEIGHT = {"missed": 3.0, "skipped": 2.0, "unrated": 1.5, "reset": 1.5, "due": 1.0}
LEVEL_WEIGHT = {LEVELS[0]: 2.0, LEVELS[1]: 1.0, LEVELS[2]: 0.0, None: 1.0}
LAPSE_WEIGHT, MAX_LAPSES_WEIGHED = 0.5, 4
REASON_TEXT = {"missed": "missed last time", "skipped": "not answered yet", "unrated": "seen, not rated yet",
               "reset": "schedule reset", "due": "due on schedule", "waiting": "not due yet",
               "not started": "lesson not started"}

# Which lesson each exercise (its notebook's stem in exercises/) follows: the course table the recaps link from.
EXERCISE_LESSONS = {Path(path).stem: lesson for lesson, _title, exercises in COURSE for path in exercises}


# ---------------------------------------------------------------------- the Leitner replay
@dataclass(frozen=True)
class Schedule:
    box: int                 # 0 … len(INTERVALS_DAYS) - 1
    due_at: float | None     # epoch seconds; None: never answered
    reviews: int             # outcomes counted (right or wrong)
    lapses: int              # misses
    last_correct: bool | None


def replay(events, intervals_days=INTERVALS_DAYS) -> Schedule:
    """The Leitner box after a history of ``(at_seconds, correct)`` outcomes (any order; sorted by time).

    A miss puts the item in box 0, due at once. A right answer when the item is due (or never answered)
    moves it up one box, due ``intervals_days[box]`` days later; a right answer before it is due changes
    nothing."""
    if not intervals_days or intervals_days[0] != 0 or any(
            b <= a for a, b in zip(intervals_days, intervals_days[1:])):
        raise ValueError(f"intervals_days must start at 0 and grow strictly, got {tuple(intervals_days)}")
    box, due, reviews, lapses, last = 0, None, 0, 0, None
    for at, correct in sorted(events, key=lambda e: e[0]):
        reviews += 1
        last = bool(correct)
        if not correct:
            box, due, lapses = 0, at, lapses + 1
        elif due is None or at >= due:
            box = min(box + 1, len(intervals_days) - 1)
            due = at + intervals_days[box] * DAY_S
    return Schedule(box, due, reviews, lapses, last)


def schedule_text(intervals_days=INTERVALS_DAYS) -> str:
    """The boxes and their intervals, for the notebook (generated, so it cannot disagree with the code)."""
    parts = [f"box {b}: {'at once' if d == 0 else _days(d)}" for b, d in enumerate(intervals_days)]
    return (f"Schedule: {SCHEME}. A right answer moves an item up one box, a miss sends it back to box 0.\n"
            "  " + " · ".join(parts))


def _days(d: float) -> str:
    return f"{d:g} day" + ("" if d == 1 else "s")


# ---------------------------------------------------------------------- every item's state
@dataclass(frozen=True)
class ReviewItem:
    kind: str                 # "question" or "card"
    id: str
    lesson: str
    order: int                # position in the bank (ties keep the course's order)
    schedule: Schedule
    due_at: float | None      # None: its lesson is not started yet
    reason: str               # a key of REASON_TEXT
    level: str | None         # the lesson's latest self-assessment
    weight: float = 0.0

    def is_due(self, now: float) -> bool:
        return self.due_at is not None and self.due_at <= now

    @property
    def box(self) -> int:
        return self.schedule.box

    def describe(self) -> str:
        return REASON_TEXT[self.reason]


def _weight(reason: str, level: str | None, lapses: int) -> float:
    return (REASON_WEIGHT.get(reason, 0.0) + LEVEL_WEIGHT.get(level, LEVEL_WEIGHT[None])
            + LAPSE_WEIGHT * min(lapses, MAX_LAPSES_WEIGHED))


def all_items(store: ProgressStore | None = None, bank: QuestionBank | None = None,
              now: float | None = None) -> list[ReviewItem]:
    """Every question and interview card of the bank with its box, due time and reason, in bank order."""
    store = store if store is not None else default_store()
    bank = bank if bank is not None else load_questions()
    now = time.time() if now is None else float(now)
    reset_at = store.review_reset_at()
    since = (lambda at: at > reset_at) if reset_at is not None else (lambda at: True)
    answers = store.answers()
    ratings = store.card_ratings()
    seen_cards = store.cards_seen()
    levels = {lid: store.self_assessment(lid) for lid in bank.lessons}
    started = store.lessons_started()

    history: dict[str, list] = {}
    ever: set[str] = set()
    for a in answers:
        ever.add(a["question_id"])
        if since(a["at"]):
            history.setdefault(a["question_id"], []).append((a["at"], a["correct"]))
    for r in ratings:
        ever.add(r["card_id"])
        if since(r["at"]):
            history.setdefault(r["card_id"], []).append((r["at"], r["knew"]))

    entries = [("question", q.id, q.lesson) for q in bank.questions] + [("card", c.id, c.lesson) for c in bank.cards]
    out = []
    for order, (kind, item_id, lesson) in enumerate(entries):
        events = history.get(item_id, [])
        sched = replay(events)
        if events:
            due = sched.due_at
            reason = "missed" if sched.last_correct is False else ("due" if due <= now else "waiting")
        elif lesson not in started:
            due, reason = None, "not started"
        else:
            due = max(started[lesson], reset_at or 0.0)  # due since the lesson was reached (or the reset)
            reason = ("reset" if item_id in ever else
                      "unrated" if kind == "card" and item_id in seen_cards else "skipped")
        level = levels.get(lesson)
        out.append(ReviewItem(kind, item_id, lesson, order, sched, due, reason, level,
                              _weight(reason, level, sched.lapses)))
    return out


def due_items(store: ProgressStore | None = None, bank: QuestionBank | None = None, *, now: float | None = None,
              lesson: str | None = None, limit: int | None = None) -> list[ReviewItem]:
    """The items due now, heaviest first (missed, then skipped, then due on schedule; low self-assessment
    raises them), at most `limit` of them; optionally of one lesson only."""
    bank = bank if bank is not None else load_questions()
    if lesson is not None:
        bank.check_lesson(lesson)
    _check_limit(limit)
    now = time.time() if now is None else float(now)
    items = [i for i in all_items(store, bank, now) if i.is_due(now) and (lesson is None or i.lesson == lesson)]
    items.sort(key=lambda i: (-i.weight, i.due_at, i.order))
    return items[:limit] if limit is not None else items


def _check_limit(limit) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a whole number >= 1 (or None for all), got {limit!r}")


def next_due_at(store: ProgressStore | None = None, bank: QuestionBank | None = None,
                now: float | None = None) -> float | None:
    """When the next item that is not due yet falls due (None if there is none)."""
    now = time.time() if now is None else float(now)
    later = [i.due_at for i in all_items(store, bank, now) if i.due_at is not None and i.due_at > now]
    return min(later, default=None)


def when_text(at: float | None, now: float | None = None) -> str:
    """'at once', 'in 3 hours', 'in 2 days' …"""
    if at is None:
        return "not scheduled"
    now = time.time() if now is None else now
    left = at - now
    if left <= 60:
        return "at once"
    if left < 3600:
        return f"in {left / 60:.0f} min"
    if left < 0.95 * DAY_S:
        return f"in {left / 3600:.0f} h"
    days = round(left / DAY_S, 1)
    return f"in {days:g} day" + ("" if days == 1 else "s")


# ---------------------------------------------------------------------- one session
@dataclass
class Outcome:
    item: ReviewItem
    result: str               # "right", "missed" or "skipped"
    next_due_at: float | None = None


@dataclass
class ReviewSession:
    """The due items of one sitting and what happened to each. Used by the widget, `kvcourse review` and tests.

    For a question: ``answer("B")``. For a card: ``reveal()`` (the model answer), then ``rate(knew=True)``.
    ``skip()`` moves on without saving anything. Every answer and rating is saved at once."""

    store: ProgressStore = field(default_factory=default_store)
    bank: QuestionBank = field(default_factory=load_questions)
    limit: int | None = DEFAULT_LIMIT
    lesson: str | None = None
    now: float | None = None
    items: list[ReviewItem] = field(init=False)
    outcomes: list[Outcome] = field(init=False, default_factory=list)
    revealed: bool = field(init=False, default=False)

    def __post_init__(self):
        _check_limit(self.limit)
        due = due_items(self.store, self.bank, now=self.now, lesson=self.lesson)
        self.items = due[:self.limit] if self.limit is not None else due
        self.due_total = len(due)

    # -- where we are
    @property
    def position(self) -> int:
        return len(self.outcomes)

    @property
    def done(self) -> bool:
        return self.position >= len(self.items)

    @property
    def current(self) -> ReviewItem | None:
        return None if self.done else self.items[self.position]

    def values(self, item: ReviewItem | None = None) -> dict:
        item = item or self.current
        return measured_values(item.lesson if item else None, self.store)

    def front_text(self, item: ReviewItem | None = None) -> str:
        """The question with its options, or the card's prompt; measured numbers filled in, no answers."""
        item = item or self._need_current()
        values = self.values(item)
        if item.kind == "question":
            q = self.bank.question(item.id)
            lines = [fill_numbers(q.prompt, values)] + [f"    {o.key}. {fill_numbers(o.text, values)}" for o in q.options]
            return "\n".join(lines)
        return fill_numbers(self.bank.card(item.id).prompt, values)

    def heading(self, item: ReviewItem | None = None) -> str:
        item = item or self._need_current()
        number = self.items.index(item) + 1
        title = self.bank.lessons[item.lesson].title
        kind = "question" if item.kind == "question" else "interview card"
        return f"[{number}/{len(self.items)}] {title} · {kind} {item.id} · {item.describe()}"

    # -- actions
    def answer(self, choice: str) -> CheckResult:
        """Grade and save an answer to the current question, then move on."""
        item = self._need_current("question")
        q = self.bank.question(item.id)
        result = grade(q, choice, self.values(item))  # ValueError naming the letters
        try:  # saved here, not in grade(): a busy file or a full disk must stop the session with its own message
            self.store.record_answer(q.lesson, q.id, result.choice, result.correct)
        except ProgressFileError:
            raise
        except Exception as exc:  # as grade() does: the review goes on even if the file cannot be written
            warnings.warn(f"could not save your answer to {self.store.path}: {exc}", stacklevel=2)
            result.saved = False
        self._finish(item, "right" if result.correct else "missed")
        return result

    def reveal(self) -> str:
        """The current card's model answer (with your numbers); saved as seen."""
        item = self._need_current("card")
        card = self.bank.card(item.id)
        try:
            self.store.record_card_view(card.lesson, card.id)
        except Exception:  # a read-only progress file must not hide the answer
            pass
        self.revealed = True
        return fill_numbers(card.answer, self.values(item))

    def rate(self, knew: bool) -> Outcome:
        """Save how the current card went ("I knew it" / "I missed it"), then move on."""
        item = self._need_current("card")
        if not isinstance(knew, bool):
            raise ValueError(f"knew must be True or False, got {knew!r}")
        self.store.record_card_rating(item.lesson, item.id, knew)
        return self._finish(item, "right" if knew else "missed")

    def skip(self) -> Outcome:
        item = self._need_current()
        self.outcomes.append(Outcome(item, "skipped", item.due_at))
        self.revealed = False
        return self.outcomes[-1]

    def _finish(self, item: ReviewItem, result: str) -> Outcome:
        state = {i.id: i for i in all_items(self.store, self.bank)}[item.id]
        self.outcomes.append(Outcome(item, result, state.due_at))
        self.revealed = False
        return self.outcomes[-1]

    def _need_current(self, kind: str | None = None) -> ReviewItem:
        item = self.current
        if item is None:
            raise ValueError("the session is over: nothing left to review (start a new one with review())")
        if kind is not None and item.kind != kind:
            what = "answer(LETTER)" if item.kind == "question" else "reveal() and then rate(knew=...)"
            raise ValueError(f"the current item {item.id!r} is a {item.kind}: use {what}")
        return item

    # -- reports
    def count(self, result: str) -> int:
        return sum(o.result == result for o in self.outcomes)

    def summary_text(self) -> str:
        if not self.items:
            return nothing_due_text(self.store, self.bank)
        done = self.count("right") + self.count("missed")
        line = (f"Reviewed {done} of {len(self.items)}: {self.count('right')} right, {self.count('missed')} missed"
                + (f", {self.count('skipped')} skipped" if self.count("skipped") else "") + ".")
        after = next_due_at(self.store, self.bank)
        left = len(due_items(self.store, self.bank))
        if left:
            line += f" {left} item{'s' if left != 1 else ''} still due (missed ones come back at once)."
        elif after is not None:
            line += f" Next item due {when_text(after)}."
        return line

    def text(self) -> str:
        """The whole session as plain text with how to answer each item in code (no answers): what a
        headless run shows instead of the widget."""
        if not self.items:
            return "Review\n" + nothing_due_text(self.store, self.bank)
        lines = [f"Review — {self.due_total} item{'s' if self.due_total != 1 else ''} due now; "
                 f"the {len(self.items)} that need it most:", ""]
        for item in self.items:
            values = self.values(item)
            if item.kind == "question":
                body = question_text(self.bank.question(item.id), values=values)
            else:
                body = card_text(self.bank.card(item.id), values) + (
                    f", then rate_card({item.id!r}, knew=True) or knew=False")
            lines += [self.heading(item), body, ""]
        return "\n".join(lines).rstrip()


def nothing_due_text(store: ProgressStore | None = None, bank: QuestionBank | None = None) -> str:
    after = next_due_at(store, bank)
    if after is None:
        return ("Nothing to review yet: finish a lesson and its checkpoint quiz, and what you missed or "
                "skipped comes back here.")
    return f"Nothing is due now. The next item is due {when_text(after)}."


def rate_card(card_id: str, knew: bool, *, store: ProgressStore | None = None) -> None:
    """Without widgets: save how an interview card went after show_answer(card_id); prints when it returns."""
    if not isinstance(knew, bool):
        raise ValueError(f"knew must be True or False, got {knew!r}")
    bank = load_questions()
    card = bank.card(card_id)
    store = store if store is not None else default_store()
    store.record_card_rating(card.lesson, card.id, knew)
    state = {i.id: i for i in all_items(store, bank)}[card.id]
    print(f"Saved: {'knew it' if knew else 'missed it'}. {card.id} comes back {when_text(state.due_at)} "
          f"(box {state.box}).")


# ---------------------------------------------------------------------- the one-screen progress view
@dataclass(frozen=True)
class LessonProgress:
    lesson: str
    title: str
    questions: int
    seen: int                  # questions answered at least once
    right: int                 # questions whose latest answer is right
    cards: int
    cards_due: int
    due: int                   # questions and cards due now
    tests_passed: int | None   # visible tests passing in the lesson's exercises (latest check); None: none checked
    tests_total: int | None
    self_assessment: str | None


def progress(store: ProgressStore | None = None, bank: QuestionBank | None = None,
             now: float | None = None) -> list[LessonProgress]:
    """Per lesson: questions right/seen, cards due, items due, exercise visible tests passing."""
    store = store if store is not None else default_store()
    bank = bank if bank is not None else load_questions()
    now = time.time() if now is None else float(now)
    items = all_items(store, bank, now)
    latest = store.latest_answers()
    checks = store.exercise_checks()
    rows = []
    for lid, lesson in bank.lessons.items():
        mine = [i for i in items if i.lesson == lid]
        qids = {q.id for q in bank.for_lesson(lid)}
        answered = [a for qid, a in latest.items() if qid in qids]
        ex = [c for c in checks if EXERCISE_LESSONS.get(c["exercise"]) == lid]
        rows.append(LessonProgress(
            lesson=lid, title=lesson.title, questions=len(qids), seen=len(answered),
            right=sum(a["correct"] for a in answered), cards=len(bank.cards_for(lid)),
            cards_due=sum(i.kind == "card" and i.is_due(now) for i in mine),
            due=sum(i.is_due(now) for i in mine),
            tests_passed=sum(c["passed"] for c in ex) if ex else None,
            tests_total=sum(c["total"] for c in ex) if ex else None,
            self_assessment=store.self_assessment(lid)))
    return rows


PROGRESS_COLUMNS = ("lesson", "right/seen", "questions", "cards due", "due now", "tests", "self-assessment")
PROGRESS_LEGEND = ("right/seen: checkpoint questions you answered right / answered; questions: how many the lesson "
                   "has; cards due: interview cards due for another look / all of the lesson's cards; due now: "
                   "questions and cards to review today; tests: your exercise's visible tests passing")


def _cells(r: LessonProgress) -> list[str]:
    tests = f"{r.tests_passed}/{r.tests_total}" if r.tests_total is not None else "—"
    return [r.lesson, f"{r.right}/{r.seen}", str(r.questions), f"{r.cards_due}/{r.cards}", str(r.due), tests,
            r.self_assessment or "—"]


def progress_text(store: ProgressStore | None = None, bank: QuestionBank | None = None,
                  now: float | None = None) -> str:
    """The per-lesson table (what `kvcourse progress` prints first), with a line on what to review."""
    store = store if store is not None else default_store()
    bank = bank if bank is not None else load_questions()
    data = progress(store, bank, now)
    total = ["total", f"{sum(r.right for r in data)}/{sum(r.seen for r in data)}", str(sum(r.questions for r in data)),
             f"{sum(r.cards_due for r in data)}/{sum(r.cards for r in data)}", str(sum(r.due for r in data)), "", ""]
    table = [list(PROGRESS_COLUMNS)] + [_cells(r) for r in data] + [total]
    widths = [max(len(row[c]) for row in table) for c in range(len(PROGRESS_COLUMNS) - 1)]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             + "  " + row[-1] for row in table]
    due = sum(r.due for r in data)
    lines += ["", PROGRESS_LEGEND]
    lines.append("")
    lines.append(f"{due} item{'s' if due != 1 else ''} due for review: run `kvcourse review` or open "
                 "lessons/review.ipynb." if due else nothing_due_text(store, bank))
    other = [c for c in store.exercise_checks() if EXERCISE_LESSONS.get(c["exercise"]) not in bank.lessons]
    for c in other:
        lines.append(f"{c['exercise']}: {c['passed']}/{c['total']} visible tests pass")
    return "\n".join(lines)


def progress_html(store: ProgressStore | None = None, bank: QuestionBank | None = None,
                  now: float | None = None) -> str:
    import html

    rows = progress(store, bank, now)
    align = ["left" if k in (0, len(PROGRESS_COLUMNS) - 1) else "right" for k in range(len(PROGRESS_COLUMNS))]
    head = "".join(f"<th style='padding:0 .6em;text-align:{a}'>{html.escape(c)}</th>"
                   for a, c in zip(align, PROGRESS_COLUMNS))
    body = "".join("<tr>" + "".join(f"<td style='padding:0 .6em;text-align:{a}'>{html.escape(cell)}</td>"
                                    for a, cell in zip(align, _cells(r))) + "</tr>" for r in rows)
    return (f"<table class='kvcourse-review-progress'><tr>{head}</tr>{body}</table>"
            f"<p style='font-size:smaller'>{html.escape(PROGRESS_LEGEND)}</p>")


class ProgressView:
    """Displays as an HTML table in JupyterLab and as text elsewhere."""

    def __init__(self, store: ProgressStore | None = None, bank: QuestionBank | None = None):
        self.store = store if store is not None else default_store()
        self.bank = bank if bank is not None else load_questions()

    def _repr_mimebundle_(self, **kwargs):
        return {"text/plain": progress_text(self.store, self.bank), "text/html": progress_html(self.store, self.bank)}

    def __str__(self):
        return progress_text(self.store, self.bank)

    __repr__ = __str__


def progress_view(store: ProgressStore | None = None) -> ProgressView:
    """The one-screen progress table (a notebook cell's last line displays it)."""
    return ProgressView(store)


__all__ = ["SCHEME", "INTERVALS_DAYS", "replay", "Schedule", "ReviewItem", "all_items", "due_items", "next_due_at",
           "ReviewSession", "rate_card", "progress", "progress_text", "progress_view", "schedule_text",
           "EXERCISE_LESSONS"]
