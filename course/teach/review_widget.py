"""The review session as a widget, and ``review()``, the entry point of lessons/review.ipynb: one due item at a time, built from the checkpoint's own question and card
widgets, with a Next button after a question and "I knew it" / "I missed it" after a card.

Its behaviour is plain methods (``check(letter)``, ``flip()``, ``rate(knew)``, ``next()``, ``skip()``) the
buttons call, so tests drive it without a front end. Headless, its ``text/plain`` is the whole session as
text with how to answer each item in code (course/teach/quiz.py explains the fallback). CSS classes
``kvcourse-review-*`` give browser tests stable handles.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from course.teach.progress import ProgressFileError, ProgressStore, default_store
from course.teach.questions import load_questions
from course.teach.quiz import _show
from course.teach.quiz_widget import FlipCard, QuestionWidget, _html, _TextFallback
from course.teach.review import DEFAULT_LIMIT, ReviewSession, progress_html, when_text


class ReviewWidget(_TextFallback, widgets.VBox):
    def __init__(self, session: ReviewSession):
        self.session = session
        self.status = widgets.HTML("")
        self.status.add_class("kvcourse-review-status")
        self.holder = widgets.VBox([])
        self.note = widgets.HTML("")
        self.note.add_class("kvcourse-review-note")
        self.knew_button = widgets.Button(description="I knew it", button_style="success", icon="check")
        self.knew_button.add_class("kvcourse-review-knew")
        self.missed_button = widgets.Button(description="I missed it", button_style="warning", icon="times")
        self.missed_button.add_class("kvcourse-review-missed")
        self.next_button = widgets.Button(description="Next", button_style="primary", icon="arrow-right")
        self.next_button.add_class("kvcourse-review-next")
        self.skip_button = widgets.Button(description="Skip", icon="forward", tooltip="Move on without saving")
        self.skip_button.add_class("kvcourse-review-skip")
        self.knew_button.on_click(lambda _b: self.rate(True))
        self.missed_button.on_click(lambda _b: self.rate(False))
        self.next_button.on_click(lambda _b: self.next())
        self.skip_button.on_click(lambda _b: self.skip())
        self.buttons = widgets.HBox([self.knew_button, self.missed_button, self.next_button, self.skip_button])
        self.item_widget = None
        self.shown = None       # the item on screen (the session moves on as soon as a question is answered)
        self._answered = False  # the shown question's first Check is the one that counts
        super().__init__([widgets.HTML("<h3>Review</h3>"), self.status, self.holder, self.note, self.buttons])
        self.add_class("kvcourse-review")
        self._show_current()

    # ------------------------------------------------------------------ what is on screen
    def _show_current(self) -> None:
        s = self.session
        item = self.shown = s.current
        self._answered = False
        self.note.value = ""
        if item is None:
            self.status.value = f"<b>{_html(s.summary_text())}</b>"
            self.holder.children = [widgets.HTML(progress_html(s.store, s.bank))]
            self.item_widget = None
            self._buttons()
            return
        self.status.value = _html(s.heading(item))
        values = lambda: s.values(item)  # noqa: E731
        if item.kind == "question":
            self.item_widget = QuestionWidget(s.bank.question(item.id), values=values, on_check=self._checked)
        else:
            self.item_widget = FlipCard(s.bank.card(item.id), values=values)
            self.item_widget.button.on_click(lambda _b: self._flipped())
        self.holder.children = [self.item_widget]
        self._buttons()

    def _buttons(self) -> None:
        item = self.shown
        card_open = item is not None and item.kind == "card" and self.session.revealed
        show = {self.knew_button: card_open, self.missed_button: card_open,
                self.next_button: item is not None and item.kind == "question" and self._answered,
                self.skip_button: item is not None and not self._answered and not card_open}
        for button, visible in show.items():
            button.layout.display = "" if visible else "none"

    # ------------------------------------------------------------------ actions (the buttons call these)
    def check(self, key: str):
        """Pick an option of the current question and press Check (only the first Check is saved)."""
        self._need("question")
        self.item_widget.choose(key)
        return self.item_widget.check()

    def _checked(self, question_widget) -> None:
        if self._answered:
            return  # a second try after a miss is shown, not saved: the first answer set the schedule
        outcome_item = self.shown
        try:
            self.session.answer(question_widget.options.value)
        except ProgressFileError as exc:  # busy, or the disk full: say so here, not as a traceback under it
            self.note.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            return
        self._answered = True
        due = self.session.outcomes[-1].next_due_at
        self.note.value = (f"<span style='color:#666'>{html.escape(outcome_item.id)} comes back "
                           f"{html.escape(when_text(due))}.</span>")
        self._buttons()

    def flip(self) -> str:
        """Reveal the current card's model answer (what Show answer does); returns it."""
        self._need("card")
        if not self.item_widget.revealed:
            self.item_widget.flip()
            self._flipped()
        return self.item_widget.answer_text

    def _flipped(self) -> None:
        if self.item_widget.revealed and not self.session.revealed:
            self.session.reveal()
        self._buttons()

    def rate(self, knew: bool) -> None:
        self._need("card")
        if not self.session.revealed:
            self.flip()
        try:
            self.session.rate(knew)
        except ProgressFileError as exc:
            self.note.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            return
        self._show_current()

    def next(self) -> None:
        if self.shown is not None and not self._answered:
            raise ValueError("answer the question (or skip it) before moving on")
        self._show_current()

    def skip(self) -> None:
        if self.shown is None:
            return
        if not self._answered:
            self.session.skip()
        self._show_current()

    def _need(self, kind: str) -> None:
        item = self.shown
        if item is None:
            raise ValueError("the session is over: nothing left to review")
        if item.kind != kind:
            raise ValueError(f"the current item {item.id!r} is a {item.kind}, not a {kind}")

    def text(self) -> str:
        return self.session.text()


def review(limit: int = DEFAULT_LIMIT, lesson: str | None = None, *, store: ProgressStore | None = None,
           show: bool = True):
    """A review session of what is due, as a widget (text with how to answer in code when headless).

    Displays it and returns None; with show=False returns the widget (for tests)."""
    session = ReviewSession(store if store is not None else default_store(), load_questions(),
                            limit=limit, lesson=lesson)
    make = lambda: ReviewWidget(session)  # noqa: E731
    if not show:
        return make()
    _show(make, session.text)
