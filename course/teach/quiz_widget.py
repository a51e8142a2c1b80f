"""Quiz widgets: checkpoint questions, interview flip cards, the end-of-lesson self-assessment.

Each widget's behaviour is a plain method the buttons call (``choose``, ``check``, ``flip``, ``rate``), so tests
drive them without a front end. Each carries its own text rendering (no answers) as ``text/plain``: what a run without
widgets keeps (course/teach/quiz.py). CSS classes ``kvcourse-quiz-*`` give browser tests stable handles.
"""
from __future__ import annotations

import html
import re
from contextlib import suppress

import ipywidgets as widgets

from course.teach.progress import ProgressStore, default_store
from course.teach.questions import (LEVELS, CheckResult, card_text, checkpoint_text, fill_numbers, grade,
                                     load_questions, measured_values, normalise_level, question_text,
                                     self_assessment_text)

RIGHT_COLOUR, WRONG_COLOUR = "#1a7f37", "#cf222e"


def _html(text: str) -> str:
    """Escape (prompts contain things like <|im_end|>), then render `code` spans."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _verdict_html(explanation: str) -> str:
    """Bold the leading Right/Wrong of an explanation."""
    word, _, rest = explanation.partition(" ")
    return f"<b>{_html(word)}</b> {_html(rest)}"


class _TextFallback:
    """Mixin: put the widget's own text rendering in text/plain (ipywidgets puts a truncated repr)."""

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        if data:
            data["text/plain"] = self.text()
        return data

    def __str__(self):
        return self.text()


class QuestionWidget(_TextFallback, widgets.VBox):
    """One multiple-choice question: pick a letter, press Check, see right/wrong and why."""

    def __init__(self, question, *, number: int | None = None, store: ProgressStore | None = None,
                 values=None, on_check=None):
        self.question, self.number, self.store, self.on_check = question, number, store, on_check
        self._values = values if callable(values) else (lambda v=values or {}: v)
        self.result: CheckResult | None = None
        head = f"<b>{number}.</b> " if number is not None else ""
        vals = self._values()
        # Option texts go in HTML (which wraps); the picker holds only the letters, because radio-button
        # labels have a fixed one-line height in JupyterLab and long options would overlap.
        items = "".join(f"<div style='margin:.2em 0 .2em 1em'><b>{o.key}.</b> {_html(fill_numbers(o.text, vals))}</div>"
                        for o in question.options)
        self.prompt = widgets.HTML(f"<div style='font-size:1.05em'>{head}{_html(fill_numbers(question.prompt, vals))}"
                                   f"</div>{items}")
        self.options = widgets.ToggleButtons(
            options=[o.key for o in question.options], value=None,
            tooltips=[fill_numbers(o.text, vals)[:200] for o in question.options],
            style=widgets.ToggleButtonsStyle(button_width="3em"))
        self.options.add_class("kvcourse-quiz-options")
        self.check_button = widgets.Button(description="Check", button_style="primary", icon="check",
                                           tooltip="Check your answer")
        self.check_button.add_class("kvcourse-quiz-check")
        self.check_button.on_click(lambda _b: self.check())
        self.feedback = widgets.HTML("")
        self.feedback.add_class("kvcourse-quiz-feedback")
        self.options.observe(self._on_pick, names="value")
        super().__init__([self.prompt, widgets.HBox([self.options, self.check_button]), self.feedback],
                         layout=widgets.Layout(margin="0 0 1.2em 0"))
        self.add_class("kvcourse-quiz-question")
        self._show_saved()

    def _show_saved(self) -> None:
        if self.store is None:
            return
        try:
            last = self.store.latest_answers(self.question.lesson).get(self.question.id)
        except Exception:
            return
        if last:
            verdict = "right" if last["correct"] else "not right yet"
            self.feedback.value = (f"<span style='color:#666'>Saved from earlier: you chose {last['choice']} "
                                   f"({verdict}). Check again any time.</span>")

    def _on_pick(self, change) -> None:
        if change["new"] is not None and self.result is not None:
            self.feedback.value = ""  # a new pick clears the old verdict until Check is pressed

    def choose(self, key: str) -> None:
        """Select an option by its letter (what clicking a radio button does)."""
        self.options.value = self.question.option(key).key

    def check(self) -> CheckResult | None:
        """Grade the selected option, show the verdict and explanation, save the answer."""
        if self.options.value is None:
            self.feedback.value = "<span style='color:#666'>Pick an option first.</span>"
            return None
        self.result = grade(self.question, self.options.value, self._values(), self.store)
        self.feedback.value = self._feedback_html(self.result)
        if self.on_check is not None:
            self.on_check(self)
        return self.result

    @staticmethod
    def _feedback_html(r: CheckResult) -> str:
        if r.correct:
            parts = [f"<div style='color:{RIGHT_COLOUR}'>✓ {_verdict_html(r.explanation)}</div>"]
            if r.others:
                items = "".join(f"<li><b>{k}</b>: {_html(why)}</li>" for k, why in r.others.items())
                parts.append(f"<div style='color:#444;margin-top:.3em'>Why not the others:<ul>{items}</ul></div>")
        else:
            parts = [f"<div style='color:{WRONG_COLOUR}'>✗ {_verdict_html(r.explanation)}</div>",
                     "<div style='color:#444'>Try another option.</div>"]
        if r.not_saved:
            parts.append(f"<div style='color:#666'>Not saved: {_html(r.not_saved)}</div>")
        return "".join(parts)

    def text(self) -> str:
        return question_text(self.question, self.number, self._values())


class FlipCard(_TextFallback, widgets.VBox):
    """An interview question: answer it aloud, Show answer, then say whether you knew it (a miss comes back in
    review). The rating is saved, or handed to `on_rate(knew)` (the review widget)."""

    def __init__(self, card, *, store: ProgressStore | None = None, values=None, on_rate=None):
        self.card, self.store, self.on_rate = card, store, on_rate
        self._values = values if callable(values) else (lambda v=values or {}: v)
        self.front = widgets.HTML(f"<b>{_html(fill_numbers(card.prompt, self._values()))}</b>")
        self.back = widgets.HTML("", layout=widgets.Layout(display="none"))
        self.back.add_class("kvcourse-quiz-card-answer")
        self.button = widgets.Button(description="Show answer", icon="eye")
        self.button.add_class("kvcourse-quiz-flip")
        self.button.on_click(lambda _b: self.flip())
        self.knew = widgets.Button(description="I knew it", button_style="success", icon="check")
        self.missed = widgets.Button(description="I missed it", button_style="warning", icon="times")
        for button, knew in ((self.knew, True), (self.missed, False)):
            button.add_class(f"kvcourse-quiz-{'knew' if knew else 'missed'}")
            button.on_click(lambda _b, knew=knew: self.rate(knew))
        self.rating = widgets.HBox([self.knew, self.missed], layout=widgets.Layout(display="none"))
        self.said = widgets.HTML("")
        self.revealed = False
        super().__init__([self.front, self.button, self.back, self.rating, self.said],
                         layout=widgets.Layout(border="1px solid #ddd", padding="0.5em", margin="0 0 0.6em 0"))
        self.add_class("kvcourse-quiz-card")

    def flip(self) -> bool:
        """Show or hide the model answer; returns whether it is now shown. The first reveal is saved."""
        self.revealed = not self.revealed
        if self.revealed:
            answer = _html(fill_numbers(self.card.answer, self._values()))
            self.back.value = f"<div style='margin-top:.4em'>{answer}</div>"
            self._save(self.store.record_card_view if self.store is not None else None, self.card.lesson, self.card.id)
        self.back.layout.display = self.rating.layout.display = "" if self.revealed else "none"
        self.button.description = "Hide answer" if self.revealed else "Show answer"
        return self.revealed

    def rate(self, knew: bool) -> None:
        """"I knew it" / "I missed it" (what the buttons do), after revealing the answer."""
        if not self.revealed:
            self.flip()
        if self.on_rate is not None:
            return self.on_rate(knew)
        if self._save(self.store.record_card_rating if self.store is not None else None, self.card.lesson,
                      self.card.id, knew):
            self.said.value = ("<span style='color:#666'>Saved: you knew it.</span>" if knew else
                               "<span style='color:#666'>Saved: it comes back in review.</span>")

    def _save(self, record, *args) -> bool:
        try:
            return record is not None and record(*args) is None
        except Exception as exc:  # a progress file that cannot be written must not hide the card: one line says why
            self.said.value = f"<span style='color:#666'>Not saved: {_html(str(exc))}</span>"
            return False

    @property
    def answer_text(self) -> str:
        """What the back of the card shows ('' while hidden)."""
        return re.sub(r"<[^>]+>", "", self.back.value) if self.revealed else ""

    def text(self) -> str:
        return card_text(self.card, self._values())


class CheckpointQuiz(_TextFallback, widgets.VBox):
    """A lesson's checkpoint: its questions, a running score, then its interview cards."""

    def __init__(self, lesson_id: str, *, cards: bool = True, store: ProgressStore | None = None, bank=None):
        self.bank = bank or load_questions()
        self.lesson = self.bank.check_lesson(lesson_id)
        self.store = store if store is not None else default_store()
        values = lambda: measured_values(lesson_id, self.store)  # noqa: E731  (fresh at every Check)
        self.questions = [QuestionWidget(q, number=i, store=self.store, values=values, on_check=self._update)
                          for i, q in enumerate(self.bank.for_lesson(lesson_id), 1)]
        self.score = widgets.HTML("")
        self.score.add_class("kvcourse-quiz-score")
        header = widgets.HTML(f"<h3>Checkpoint — {_html(self.lesson.title)}</h3>")
        children = [header, *self.questions, self.score]
        self.cards = [FlipCard(c, store=self.store, values=values) for c in self.bank.cards_for(lesson_id) if cards]
        if self.cards:
            children += [widgets.HTML("<h4>Interview prep — answer aloud, then flip</h4>"), widgets.VBox(self.cards)]
        super().__init__(children)
        self.add_class("kvcourse-quiz")
        self._update()

    @property
    def right(self) -> int:
        return sum(1 for q in self.questions if q.result is not None and q.result.correct)

    def _update(self, _question=None) -> None:
        self.score.value = (f"<b>{self.right} of {len(self.questions)}</b> right so far (saved: see <code>kvcourse "
                            "progress</code>; what you missed comes back in lessons/review.ipynb).")

    def text(self) -> str:
        return checkpoint_text(self.lesson.id, measured_values(self.lesson.id, self.store), cards=bool(self.cards))


class SelfAssessmentWidget(_TextFallback, widgets.VBox):
    """New to it / Getting there / Confident — saved at once, shown again after a restart."""

    def __init__(self, lesson_id: str, *, store: ProgressStore | None = None, bank=None):
        self.lesson = (bank or load_questions()).check_lesson(lesson_id)
        self.store = store if store is not None else default_store()
        saved = None
        with suppress(Exception):  # a broken progress file must not hide the question
            saved = self.store.self_assessment(lesson_id)
        self.prompt = widgets.HTML(f"<b>Self-assessment.</b> {_html(self.lesson.self_assessment)}")
        self.levels = widgets.ToggleButtons(options=list(LEVELS), value=saved)
        self.levels.add_class("kvcourse-quiz-levels")
        self.status = widgets.HTML(self._status(saved, earlier=True) if saved else "")
        self.levels.observe(lambda change: self._save(change["new"]), names="value")
        super().__init__([self.prompt, self.levels, self.status])
        self.add_class("kvcourse-quiz-self-assessment")

    @staticmethod
    def _status(level: str, earlier: bool = False) -> str:
        when = "Saved earlier" if earlier else "Saved"
        return f"<span style='color:#666'>{when}: <b>{html.escape(level)}</b>. It is kept across restarts.</span>"

    def choose(self, level) -> str:
        """Pick a level (what clicking a button does); returns the canonical label."""
        label = normalise_level(level)
        if self.levels.value == label:
            self._save(label)  # re-saving the same level still records when it was said
        self.levels.value = label
        return label

    def _save(self, level) -> None:
        if level is None:
            return
        try:
            self.store.record_self_assessment(self.lesson.id, level)
            self.status.value = self._status(level)
        except Exception as exc:  # one line says why
            self.status.value = f"<span style='color:#666'>Not saved: {_html(str(exc))}</span>"

    def text(self) -> str:
        return self_assessment_text(self.lesson.id)
