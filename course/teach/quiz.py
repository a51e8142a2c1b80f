"""Checkpoint quizzes, interview flip cards and self-assessments, from course/teach/questions.yaml.

Every lesson notebook ends with ``checkpoint("02_kv_cache")`` (its questions: pick, Check, see why; then its
interview cards, to answer aloud, turn over and rate) and ``self_assessment("02_kv_cache")``. Everything is saved by
course.teach.progress. Explanations cite the learner's own measurements (course.teach.questions.fill_numbers).

Each widget is displayed once, with a ``text/plain`` rendering in its MIME bundle: the question and its options, how
to answer in code, and no answer. JupyterLab shows the widget; a run without a widget front end (nbclient,
nbconvert, a notebook viewer) keeps the text. KVCOURSE_QUIZ=text prints the text instead. Without widgets a learner
answers in code: ``answer("kv-1", "A")``, ``show_answer("interview-1")``, ``self_assessment(lesson, level=...)``.
"""
from __future__ import annotations

import warnings
from contextlib import suppress

from course.measure.display import text_only
from course.teach.progress import ProgressStore, default_store
from course.teach.questions import fill_numbers, load_questions  # noqa: F401  (what notebooks and tests import here)
from course.teach.questions import card_text, checkpoint_text, grade, self_assessment_text
from course.teach.questions import measured_values as _measured_values


def measured_values(lesson_id: str | None = None, store: ProgressStore | None = None) -> dict:
    """The numbers the quiz cites (course.teach.questions.measured_values), from `store` or the default file."""
    try:
        store = store or default_store()
    except Exception:  # a broken progress location must never stop a quiz
        store = None
    return _measured_values(lesson_id, store)


def _show(make, text, show: bool = True):
    """Display make()'s widget, or print text() with KVCOURSE_QUIZ=text; show=False returns the widget (for tests)."""
    if not show:
        return make()
    if text_only():
        print(text())
        return None
    from IPython.display import display

    display(make())  # its MIME bundle carries the text fallback (see the module's docstring)


def checkpoint(lesson_id: str, *, cards: bool = True, store: ProgressStore | None = None, show: bool = True):
    """The lesson's checkpoint quiz (and, with cards=True, its interview flip cards). Displays it and returns None;
    with show=False returns the widget (for tests). Saves the lesson's record()ed numbers, for its explanations."""
    load_questions().check_lesson(lesson_id)
    from course.measure.results import recorded
    from course.teach.quiz_widget import CheckpointQuiz

    store = store or default_store()
    try:
        store.record_measurements(lesson_id, recorded())  # so explanations can cite them after a restart
    except Exception as exc:  # never let the progress file stop the quiz
        warnings.warn(f"could not save this lesson's measurements: {exc}", stacklevel=2)
    return _show(lambda: CheckpointQuiz(lesson_id, cards=cards, store=store),
                 lambda: checkpoint_text(lesson_id, measured_values(lesson_id, store), cards), show)


def self_assessment(lesson_id: str, level: str | None = None, *, store: ProgressStore | None = None,
                    show: bool = True):
    """Ask 'New to it / Getting there / Confident' for a lesson; with level=... (no widgets) save it directly."""
    load_questions().check_lesson(lesson_id)
    store = store or default_store()
    if level is not None:
        print(f"Saved for {lesson_id}: {store.record_self_assessment(lesson_id, level)}.")
        return None
    from course.teach.quiz_widget import SelfAssessmentWidget

    return _show(lambda: SelfAssessmentWidget(lesson_id, store=store), lambda: self_assessment_text(lesson_id), show)


def answer(question_id: str, choice: str, *, store: ProgressStore | None = None) -> bool:
    """Answer a checkpoint question without widgets: prints right/wrong and why, saves it, returns whether right."""
    q = load_questions().question(question_id)
    result = grade(q, choice, measured_values(q.lesson, store), store=store or default_store())
    print(result.text)
    return result.correct


def show_answer(card_id: str, *, store: ProgressStore | None = None) -> None:
    """Reveal a flip card's model answer without widgets (and note that it was seen)."""
    card = load_questions().card(card_id)
    store = store or default_store()
    with suppress(Exception):  # a progress file that cannot be written must not hide the answer
        store.record_card_view(card.lesson, card.id)
    print(card_text(card, measured_values(card.lesson, store), reveal=True))
