"""The review sitting as a widget, and ``review()``, the entry point of lessons/review.ipynb: one item at a time,
shown with the checkpoint's own question and card widgets and the lessons' prediction box.

Its behaviour is plain methods (``check(letter)``, ``flip()``, ``rate(knew)``, ``predict(number)``, ``next()``,
``skip()``) the buttons call, so tests drive it without a front end. Without widgets its ``text/plain`` is the sitting
as text, with how to answer each item in code. CSS classes ``kvcourse-review-*`` give browser tests handles.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from course.teach.predict import Prediction
from course.teach.progress import ProgressFileError, ProgressStore, default_store
from course.teach.quiz import _show
from course.teach.quiz_widget import FlipCard, QuestionWidget, _html, _TextFallback
from course.teach.review import DEFAULT_LIMIT, RULE, ReviewSession, progress_html


class ReviewWidget(_TextFallback, widgets.VBox):
    def __init__(self, session: ReviewSession):
        self.session = session
        self.status, self.note, self.holder = widgets.HTML(""), widgets.HTML(""), widgets.VBox([])
        self.status.add_class("kvcourse-review-status")
        self.note.add_class("kvcourse-review-note")
        self.next_button = widgets.Button(description="Next", button_style="primary", icon="arrow-right")
        self.skip_button = widgets.Button(description="Skip", icon="forward", tooltip="Move on without saving")
        self.next_button.add_class("kvcourse-review-next")
        self.skip_button.add_class("kvcourse-review-skip")
        self.next_button.on_click(lambda _b: self.next())
        self.skip_button.on_click(lambda _b: self.skip())
        self.item_widget = self.shown = None
        self._answered = False  # the shown item's first answer is the one that counts
        super().__init__([widgets.HTML(f"<h3>Review</h3><p>{html.escape(RULE)}</p>"), self.status, self.holder,
                          self.note, widgets.HBox([self.next_button, self.skip_button])])
        self.add_class("kvcourse-review")
        self._show_current()

    def _show_current(self) -> None:
        s = self.session
        item = self.shown = s.current
        self._answered, self.note.value = False, ""
        if item is None:
            self.holder.children, self.item_widget = [widgets.HTML(progress_html(s.store, s.bank))], None
        else:
            values = lambda: s.values(item)  # noqa: E731
            if item.kind == "question":
                self.item_widget = QuestionWidget(s.bank.question(item.id), values=values, on_check=self._checked)
            elif item.kind == "card":
                self.item_widget = FlipCard(s.bank.card(item.id), values=values, on_rate=self.rate)
                self.item_widget.knew.add_class("kvcourse-review-knew")
                self.item_widget.missed.add_class("kvcourse-review-missed")
            else:
                p = item.prediction
                self.item_widget = Prediction(item.lesson, p["key"], p["prompt"], p["unit"], p["tolerance"],
                                              on_lock=self.predict)
            self.holder.children = [self.item_widget.widget() if item.kind == "prediction" else self.item_widget]
        self._buttons()
        # the status line last: a front end (and a browser test waiting on it) sees the new item already in place
        self.status.value = f"<b>{_html(s.summary_text())}</b>" if item is None else _html(s.heading(item))

    def _buttons(self) -> None:
        self.next_button.layout.display = "" if self.shown is not None and self._answered else "none"
        self.skip_button.layout.display = "" if self.shown is not None and not self._answered else "none"

    def _save(self, answer) -> bool:
        """Hand the first answer to the session; a busy or full progress file is said here, not as a traceback."""
        if self._answered:
            return False  # a second try is shown, not saved
        try:
            answer()
        except ProgressFileError as exc:
            self.note.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            return False
        self._answered = True
        self._buttons()
        return True

    # ------------------------------------------------------------------ what the buttons call
    def check(self, key: str):
        """Pick an option of the current question and press Check."""
        self._need("question")
        self.item_widget.choose(key)
        return self.item_widget.check()

    def _checked(self, question_widget) -> None:
        if self._save(lambda: self.session.answer(question_widget.options.value)):
            self.note.value = html.escape("Right: it leaves review." if question_widget.result.correct
                                          else "Missed: it stays in review.")

    def predict(self, number) -> None:
        """Lock in a prediction for the current "predict again" item (what its Lock in button does)."""
        self._need("prediction")
        if self.item_widget.value != number:
            return setattr(self.item_widget, "value", number)  # comes back here through on_lock
        self._save(lambda: setattr(self.note, "value", html.escape(self.session.answer(number).explanation)))

    def flip(self) -> str:
        """Reveal the current card's model answer (what Show answer does); returns it."""
        self._need("card")
        if not self.item_widget.revealed:
            self.item_widget.flip()
        self.session.reveal()
        return self.item_widget.answer_text

    def rate(self, knew: bool) -> None:
        """I knew it / I missed it, for the current card; then the next item."""
        self._need("card")
        if self._save(lambda: self.session.rate(knew)):
            self._show_current()

    def next(self) -> None:
        if self.shown is not None and not self._answered:
            raise ValueError("answer the item (or skip it) before moving on")
        self._show_current()

    def skip(self) -> None:
        if self.shown is not None:
            if not self._answered:
                self.session.skip()
            self._show_current()

    def _need(self, kind: str) -> None:
        if self.shown is None:
            raise ValueError("the sitting is over: nothing left to review")
        if self.shown.kind != kind:
            raise ValueError(f"the current item {self.shown.id!r} is a {self.shown.kind}, not a {kind}")

    def text(self) -> str:
        return self.session.text()


def review(limit: int = DEFAULT_LIMIT, lesson: str | None = None, *, store: ProgressStore | None = None,
           show: bool = True):
    """A review sitting of what you missed, as a widget (text with how to answer in code when there are no widgets).

    Displays it and returns None; with show=False returns the widget (for tests)."""
    session = ReviewSession(store if store is not None else default_store(), limit=limit, lesson=lesson)
    return _show(lambda: ReviewWidget(session), session.text, show)
