"""Checkpoint quizzes, interview flip cards and self-assessments — all read from course/teach/questions.yaml.

Every lesson notebook ends with::

    from course.teach.quiz import checkpoint, self_assessment
    checkpoint("02_kv_cache")
    self_assessment("02_kv_cache")

``checkpoint`` shows the lesson's multiple-choice questions (pick, Check, see right/wrong and why),
then its interview questions as flip cards; ``self_assessment`` asks "New to it / Getting there /
Confident". Answers, cards seen and self-assessments are saved by course.teach.progress and survive restarts.

Explanations cite the learner's own measurements. In the YAML, ``[[ (you measured
{decode_ms_per_token:.1f} ms)]]`` is a clause shown only when every key in it is known, and
``{key:.1f|fallback words}`` an inline number with words to use instead. Values come from
course.measure.results.recorded() (this kernel), else from numbers saved in the progress file by an earlier run
of the lesson (checkpoint() saves them), so a learner who reopens a lesson still sees their own figures.

Front end or not — how the quiz decides what to show
----------------------------------------------------
We do not try to guess whether a widget front end is listening (there is no reliable signal: a kernel
started by nbclient, VS Code or JupyterLab looks the same from inside). Instead each quiz widget is
displayed ONCE with a MIME bundle holding both the widget view and a ``text/plain`` rendering of the
quiz — question, lettered options, and how to answer in code — with no answer or explanation in it.
Jupyter front ends pick the richest type they can render: JupyterLab with ipywidgets shows the
interactive widget (and never the text), while a headless run (nbclient in the tests, nbconvert, a
notebook viewer on the web, a front end without the widget manager) keeps the text. Outside IPython
(plain ``python``) the text is printed. Setting KVCOURSE_QUIZ=text forces plain printed text, for
terminals and editors whose widget support is missing or broken.

Without widgets a learner answers in code: ``answer("<question id>", "<letter>")`` prints right/wrong and the
explanation and saves it; ``show_answer("interview-1")`` reveals a flip card;
``self_assessment("02_kv_cache", level="Confident")`` saves a self-assessment.
"""
from __future__ import annotations


from course.measure.display import text_only
from course.teach.progress import ProgressStore, default_store
from course.teach.questions import (  # noqa: F401  (the bank's API, re-exported for notebooks and scripts)
    LEVELS, MISSING_TEXT, QUESTIONS_PATH, Card, CheckResult, Lesson, Option, Question, QuestionBank,
    QuestionDataError, card_text, checkpoint_text, fill_numbers, grade, load_questions, normalise_level,
    placeholder_keys, placeholder_problems, question_text, questions, self_assessment_text, validate)
from course.teach.questions import measured_values as _measured_values


def measured_values(lesson_id: str | None = None, store: ProgressStore | None = None) -> dict:
    """The numbers the quiz cites (see course.teach.questions.measured_values), from `store` or the learner's
    default progress file."""
    try:
        store = store or default_store()
    except Exception:  # a broken progress location must never stop a quiz
        store = None
    return _measured_values(lesson_id, store)


def _show(widget_factory, text_factory):
    if text_only():
        print(text_factory())
        return
    from IPython.display import display

    display(widget_factory())  # its MIME bundle carries the text fallback (see module docstring)


# ---------------------------------------------------------------------- entry points for notebooks
def checkpoint(lesson_id: str, *, cards: bool = True, store: ProgressStore | None = None, show: bool = True):
    """The lesson's checkpoint quiz (and, with cards=True, its interview flip cards).

    Displays it and returns None; with show=False returns the widget instead (for tests)."""
    load_questions().check_lesson(lesson_id)
    from course.measure.results import recorded

    store = store or default_store()
    try:
        store.record_measurements(lesson_id, recorded())  # so explanations can cite them after a restart
    except Exception as exc:  # never let the progress file stop the quiz
        import warnings

        warnings.warn(f"could not save this lesson's measurements: {exc}", stacklevel=2)
    from course.teach.quiz_widget import CheckpointQuiz

    make = lambda: CheckpointQuiz(lesson_id, cards=cards, store=store)  # noqa: E731
    if not show:
        return make()
    _show(make, lambda: checkpoint_text(lesson_id, measured_values(lesson_id, store), cards))


def self_assessment(lesson_id: str, level: str | None = None, *, store: ProgressStore | None = None,
                    show: bool = True):
    """Ask 'New to it / Getting there / Confident' for a lesson; saved across restarts.

    With level=... (for use without widgets) it saves that answer directly and prints a confirmation."""
    load_questions().check_lesson(lesson_id)
    store = store or default_store()
    if level is not None:
        saved = store.record_self_assessment(lesson_id, level)
        print(f"Saved for {lesson_id}: {saved}.")
        return None
    from course.teach.quiz_widget import SelfAssessmentWidget

    make = lambda: SelfAssessmentWidget(lesson_id, store=store)  # noqa: E731
    if not show:
        return make()
    _show(make, lambda: self_assessment_text(lesson_id))


def interview_cards(lesson_id: str | None = None, *, store: ProgressStore | None = None, show: bool = True):
    """Interview questions as flip cards: one lesson's, or all of them with lesson_id=None."""
    bank = load_questions()
    if lesson_id is not None:
        bank.check_lesson(lesson_id)
    store = store or default_store()
    from course.teach.quiz_widget import CardDeck

    make = lambda: CardDeck(bank.cards_for(lesson_id), store=store)  # noqa: E731
    if not show:
        return make()
    _show(make, lambda: "\n".join(card_text(c, measured_values(lesson_id, store))
                                  for c in bank.cards_for(lesson_id)))


def answer(question_id: str, choice: str, *, store: ProgressStore | None = None) -> bool:
    """Answer a checkpoint question without widgets: prints right/wrong and why, saves it, returns
    whether it was right."""
    from course.teach.questions import RENAMED

    q = load_questions().question(question_id)
    if question_id in RENAMED and isinstance(choice, str):  # an old id: its letters are the old order's
        choice = RENAMED[question_id][1].get(choice.strip().upper(), choice)
    result = grade(q, choice, measured_values(q.lesson, store), store=store or default_store())
    print(result.text)
    return result.correct


def show_answer(card_id: str, *, store: ProgressStore | None = None) -> None:
    """Reveal a flip card's model answer without widgets (and note that it was seen)."""
    card = load_questions().card(card_id)
    store = store or default_store()
    try:
        store.record_card_view(card.lesson, card.id)
    except Exception:
        pass
    print(card_text(card, measured_values(card.lesson, store), reveal=True))


__all__ = ["checkpoint", "self_assessment", "interview_cards", "answer", "show_answer", "load_questions",
           "validate", "questions", "fill_numbers", "measured_values", "QuestionBank", "Question", "Option",
           "Card", "Lesson", "QuestionDataError", "normalise_level", "LEVELS"]
