"""Review: what you missed comes back until you answer it right.

An item is in review when you missed it: a checkpoint question answered wrong (even if you then got it right), an
interview card rated "I missed it", a prediction outside its tolerance. It stays until you answer it right in review;
a miss there keeps it. Never-answered items are not in review. Answering again is retrieval practice, which helps
long-term memory more than reading again (Roediger and Karpicke, "Test-enhanced learning", Psychological Science,
2006). Nothing here keeps state of its own: the due list is computed from the rows the progress store appends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from course.lessons.recap import COURSE
from course.teach.predict import as_number, verdict
from course.teach.progress import ProgressStore, default_store, is_within
from course.teach.questions import CheckResult, QuestionBank, fill_numbers, grade, load_questions, measured_values

RULE = "Review asks again what you missed, even if you then got it right; answer it right in review and it leaves."
DEFAULT_LIMIT = 10  # items per sitting: a few minutes
NOTHING_DUE = "Nothing to review: review holds only what you missed, and nothing you missed is waiting."
KIND_TEXT = {"question": "question", "card": "interview card", "prediction": "predict again"}
# Which lesson each exercise (its notebook's stem in exercises/) follows: the course table the recaps link from.
EXERCISE_LESSONS = {Path(path).stem: lesson for lesson, _title, exercises in COURSE for path in exercises}


@dataclass(frozen=True)
class ReviewItem:
    kind: str                       # "question", "card" or "prediction"
    id: str                         # the question's or card's id; "<lesson>/<key>" for a prediction
    lesson: str
    misses: int                     # since it was last answered right in review
    prediction: dict | None = None  # the latest prediction of that key: prompt, unit, measured, tolerance

    def describe(self) -> str:
        return "missed once" if self.misses == 1 else f"missed {self.misses} times"


def due_items(store: ProgressStore | None = None, bank: QuestionBank | None = None, *, lesson: str | None = None,
              limit: int | None = None) -> list[ReviewItem]:
    """What is in review now (RULE), most missed first, then in course order; of one lesson, at most `limit`."""
    store = store if store is not None else default_store()
    bank = bank if bank is not None else load_questions()
    if lesson is not None:
        bank.check_lesson(lesson)
    _check_limit(limit)
    history: dict[tuple, list] = {}  # (kind, id, lesson) -> [(at, right, in review)]
    predictions = {}
    for kind, rows, key, ok in (("question", store.answers(), "question_id", "correct"),
                                ("card", store.rows("card_ratings"), "card_id", "knew"),
                                ("prediction", store.rows("predictions"), None, "correct")):
        for r in rows:
            item = r[key] if key else f"{r['lesson']}/{r['key']}"
            history.setdefault((kind, item, r["lesson"]), []).append((r["at"], r[ok], False))
            if kind == "prediction":
                predictions[item] = r  # the latest: its measured value is what a new prediction is checked against
    for r in store.rows("reviews"):
        history.setdefault((r["kind"], r["item"], r["lesson"]), []).append((r["at"], r["correct"], True))
    order = {item_id: n for n, item_id in enumerate([q.id for q in bank.questions] + [c.id for c in bank.cards])}
    lessons = list(bank.lessons)
    reset = max((r["at"] for r in store.rows("review_resets")), default=0.0)
    items = []
    for (kind, item, where), events in history.items():
        cleared = max([reset] + [at for at, right, in_review in events if right and in_review])
        misses = sum(1 for at, right, _ in events if not right and at > cleared)
        if misses and (kind == "prediction" or item in order) and lesson in (None, where):  # a known question or card
            items.append(ReviewItem(kind, item, where, misses, predictions.get(item)))
    items.sort(key=lambda i: (-i.misses, lessons.index(i.lesson) if i.lesson in lessons else len(lessons),
                              order.get(i.id, len(order)), i.id))
    return items[:limit]  # limit None: all


def _check_limit(limit) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a whole number >= 1 (or None for all), got {limit!r}")


# ---------------------------------------------------------------------- one sitting
@dataclass
class Outcome:
    item: ReviewItem
    result: str   # "right", "missed" or "skipped"


@dataclass
class ReviewSession:
    """The items of one sitting and what happened to each. Used by the widget, `kvcourse review` and tests.

    A question or a prediction: ``answer(letter or number)``. A card: ``reveal()``, then ``rate(knew=...)``.
    ``skip()`` moves on without saving. Every answer is saved at once (ProgressStore.record_review)."""

    store: ProgressStore = field(default_factory=default_store)
    bank: QuestionBank = field(default_factory=load_questions)
    limit: int | None = DEFAULT_LIMIT
    lesson: str | None = None
    items: list[ReviewItem] = field(init=False)
    outcomes: list[Outcome] = field(init=False, default_factory=list)

    def __post_init__(self):
        _check_limit(self.limit)
        due = due_items(self.store, self.bank, lesson=self.lesson)
        self.due_total, self.items = len(due), due[:self.limit]

    @property
    def done(self) -> bool:
        return len(self.outcomes) >= len(self.items)

    @property
    def current(self) -> ReviewItem | None:
        return None if self.done else self.items[len(self.outcomes)]

    def values(self, item: ReviewItem) -> dict:
        return measured_values(item.lesson, self.store)

    def heading(self, item: ReviewItem) -> str:
        title = self.bank.lessons[item.lesson].title if item.lesson in self.bank.lessons else item.lesson
        return (f"[{self.items.index(item) + 1}/{len(self.items)}] {title} · {KIND_TEXT[item.kind]} {item.id} · "
                f"{item.describe()}")

    def front_text(self, item: ReviewItem) -> str:
        """The question with its options, the card's prompt, or what to predict; no answers."""
        values = self.values(item)
        if item.kind == "question":
            q = self.bank.question(item.id)
            return "\n".join([fill_numbers(q.prompt, values)] + [f"    {o.key}. {fill_numbers(o.text, values)}"
                                                                  for o in q.options])
        if item.kind == "card":
            return fill_numbers(self.bank.card(item.id).prompt, values)
        return f"Predict again: {item.prediction['prompt']} (in {item.prediction['unit']})"

    def answer(self, value) -> CheckResult:
        """Answer the current question (a letter) or prediction (a number); saved, then the session moves on."""
        item = self._need_current("question", "prediction")
        if item.kind == "question":
            result = grade(self.bank.question(item.id), value, self.values(item))  # ValueError naming the letters
        else:
            p = item.prediction
            number = as_number(value)
            result = CheckResult(item.id, f"{number:g}", is_within(number, p["measured"], p["tolerance"]),
                                 verdict(number, p["measured"], p["unit"], p["tolerance"], in_review=True))
        self.store.record_review(item.kind, item.id, item.lesson, result.choice, result.correct)
        self._finish(item, result.correct)
        return result

    def reveal(self) -> str:
        """The current card's model answer, with your numbers."""
        item = self._need_current("card")
        return fill_numbers(self.bank.card(item.id).answer, self.values(item))

    def rate(self, knew: bool) -> Outcome:
        """Save how the current card went ("I knew it" / "I missed it"), then move on."""
        item = self._need_current("card")
        if not isinstance(knew, bool):
            raise ValueError(f"knew must be True or False, got {knew!r}")
        self.store.record_review("card", item.id, item.lesson, "knew" if knew else "missed", knew)
        return self._finish(item, knew)

    def skip(self) -> Outcome:
        return self._finish(self._need_current(), None)

    def _finish(self, item: ReviewItem, right: bool | None) -> Outcome:
        self.outcomes.append(Outcome(item, "skipped" if right is None else "right" if right else "missed"))
        return self.outcomes[-1]

    def _need_current(self, *kinds: str) -> ReviewItem:
        item = self.current
        if item is None:
            raise ValueError("the sitting is over: nothing left to review (start a new one with review())")
        if kinds and item.kind not in kinds:
            how = "reveal() and then rate(knew=...)" if item.kind == "card" else "answer(...)"
            raise ValueError(f"the current item {item.id!r} is a {KIND_TEXT[item.kind]}: use {how}")
        return item

    def count(self, result: str) -> int:
        return sum(o.result == result for o in self.outcomes)

    def summary_text(self) -> str:
        if not self.items:
            return NOTHING_DUE
        right, missed, skipped = self.count("right"), self.count("missed"), self.count("skipped")
        left = len(due_items(self.store, self.bank))
        return (f"Reviewed {right + missed} of {len(self.items)}: {right} right, {missed} missed"
                f"{f', {skipped} skipped' if skipped else ''}. {left} item{'s' if left != 1 else ''} still in review.")

    def text(self) -> str:
        """The sitting as plain text, with how to answer each item in code and no answers: what a run without
        widgets shows."""
        if not self.items:
            return "Review\n" + NOTHING_DUE
        lines = [f"Review: {self.due_total} item{'s' if self.due_total != 1 else ''} to review. {RULE}", ""]
        for item in self.items:
            how = {"question": "LETTER", "card": "True or False", "prediction": "NUMBER"}[item.kind]
            then = f"show_answer({item.id!r}), then " if item.kind == "card" else ""
            lines += [self.heading(item), self.front_text(item), f"    → {then}answer_again({item.id!r}, {how})", ""]
        return "\n".join(lines).rstrip()


def answer_again(item_id: str, answer, *, store: ProgressStore | None = None) -> bool:
    """Without widgets: answer an item in review (a letter, a number, or knew=True/False for a card); prints the
    verdict and saves it. Returns whether it was right."""
    session = ReviewSession(store if store is not None else default_store(), limit=None)
    while not session.done and session.current.id != item_id:
        session.skip()
    if session.done:
        raise ValueError(f"{item_id!r} is not in review now; `kvcourse review --list` lists what is")
    item = session.current
    if item.kind == "card":
        if not isinstance(answer, bool):
            raise ValueError(f"for an interview card, answer True (I knew it) or False (I missed it), got {answer!r}")
        right, said = session.rate(answer).result == "right", ""
    else:
        result = session.answer(answer)
        right, said = result.correct, result.explanation
    if item.kind != "prediction":  # a prediction's verdict says it already
        said = f"{said} {'It leaves review.' if right else 'It stays in review.'}".strip()
    print(said)
    return right


# ---------------------------------------------------------------------- the one-screen progress table
@dataclass(frozen=True)
class LessonProgress:
    lesson: str
    title: str
    questions: int
    answered: int              # checkpoint questions answered at least once
    right: int                 # ... whose latest answer is right
    cards: int
    cards_seen: int
    predicted: int             # predictions made (distinct keys)
    well_predicted: int        # ... whose latest was within its tolerance
    in_review: int
    tests_passed: int | None   # visible tests passing in the lesson's exercises (latest check); None: none checked
    tests_total: int | None
    self_assessment: str | None


def progress(store: ProgressStore | None = None, bank: QuestionBank | None = None) -> list[LessonProgress]:
    store = store if store is not None else default_store()
    bank = bank if bank is not None else load_questions()
    latest, checks, due = store.latest_answers(), store.exercise_checks(), due_items(store, bank)
    guesses = {(p["lesson"], p["key"]): p["correct"] for p in store.rows("predictions")}
    rows = []
    for lid, lesson in bank.lessons.items():
        answered = [a for a in latest.values() if a["lesson"] == lid]
        ex = [c for c in checks if EXERCISE_LESSONS.get(c["exercise"]) == lid]
        mine = [ok for (where, _), ok in guesses.items() if where == lid]
        rows.append(LessonProgress(
            lid, lesson.title, len(bank.for_lesson(lid)), len(answered), sum(a["correct"] for a in answered),
            len(bank.cards_for(lid)), len(store.cards_seen(lid)), len(mine), sum(mine),
            sum(i.lesson == lid for i in due), sum(c["passed"] for c in ex) if ex else None,
            sum(c["total"] for c in ex) if ex else None, store.self_assessment(lid)))
    return rows


def summary(store: ProgressStore | None = None, bank: QuestionBank | None = None) -> SimpleNamespace:
    """Per lesson (`lessons`), the exercises' latest checks (`exercises`), and whether nothing is saved (`empty`)."""
    store = store if store is not None else default_store()
    lessons, exercises = progress(store, bank), store.exercise_checks()
    return SimpleNamespace(lessons=lessons, exercises=exercises, empty=not exercises and not any(
        r.answered or r.cards_seen or r.predicted or r.self_assessment for r in lessons))


COLUMNS = ("lesson", "right/answered", "questions", "cards seen", "predicted", "in review", "tests", "self-assessment")
LEGEND = ("right/answered: checkpoint questions whose latest answer is right, of those you answered. cards seen: of "
          "the lesson's interview cards. predicted: predictions within their tolerance, of those made. tests: your "
          "exercise's visible tests passing.")


def _cells(r: LessonProgress) -> list[str]:
    tests = f"{r.tests_passed}/{r.tests_total}" if r.tests_total is not None else "—"
    return [r.lesson, f"{r.right}/{r.answered}", str(r.questions), f"{r.cards_seen}/{r.cards}",
            f"{r.well_predicted}/{r.predicted}", str(r.in_review), tests, r.self_assessment or "—"]


def progress_text(store: ProgressStore | None = None, bank: QuestionBank | None = None) -> str:
    """The per-lesson table (what `kvcourse progress` prints), with what is in review and the rule for it."""
    store = store if store is not None else default_store()
    data = progress(store, bank)
    table = [list(COLUMNS)] + [_cells(r) for r in data]
    widths = [max(len(row[c]) for row in table) for c in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if c in (0, len(COLUMNS) - 1) else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in table]
    due = sum(r.in_review for r in data)
    lines += ["", LEGEND, "", f"{due} item{'s' if due != 1 else ''} in review: run `kvcourse review` or open "
              f"lessons/review.ipynb. {RULE}" if due else NOTHING_DUE]
    lines += [f"{c['exercise']}: {c['passed']}/{c['total']} visible tests pass" for c in store.exercise_checks()
              if EXERCISE_LESSONS.get(c["exercise"]) not in (bank or load_questions()).lessons]
    return "\n".join(lines)


def progress_html(store: ProgressStore | None = None, bank: QuestionBank | None = None) -> str:
    import html

    head = "".join(f"<th style='padding:0 .6em'>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td style='padding:0 .6em'>{html.escape(cell)}</td>" for cell in _cells(r))
                   + "</tr>" for r in progress(store, bank))
    return (f"<table class='kvcourse-review-progress'><tr>{head}</tr>{body}</table>"
            f"<p style='font-size:smaller'>{html.escape(LEGEND)} {html.escape(RULE)}</p>")


class ProgressView:
    """The per-lesson table: HTML in JupyterLab, text elsewhere (a notebook cell's last line displays it)."""

    def __init__(self, store: ProgressStore | None = None):
        self.store = store if store is not None else default_store()

    def _repr_mimebundle_(self, **kwargs):
        return {"text/plain": progress_text(self.store), "text/html": progress_html(self.store)}

    def __repr__(self):
        return progress_text(self.store)


def progress_view(store: ProgressStore | None = None) -> ProgressView:
    return ProgressView(store)
