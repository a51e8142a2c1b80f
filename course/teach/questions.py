"""The question bank: its data (course/teach/questions.yaml), the measured numbers in its text, its plain-text
renderings, and `grade`: everything about questions that needs no widget and no saved state. It imports nothing
else of course/teach/; functions that save take a `store` (a course.teach.progress.ProgressStore in practice).
"""
from __future__ import annotations

import math
import os
import re
from contextlib import suppress
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

LEVELS = ("New to it", "Getting there", "Confident")
QUESTIONS_PATH = Path(__file__).with_name("questions.yaml")
OPTION_KEYS = "ABCDEFGH"
MISSING_TEXT = "(not measured yet)"

# {key} {key:.1f} {key*1000:.0f} {key/1e9:.1f|fallback words}; key may be dotted: d.sub, list.0, list.last
# [[clause {key:.1f} …]] or [[clause …|fallback]]: the clause is shown only if all its keys are known.
CLAUSE = re.compile(r"\[\[(?P<body>[^\[\]|]*)(?:\|(?P<fallback>[^\[\]]*))?\]\]")
_MISSING = object()
PLACEHOLDER = re.compile(
    r"\{(?P<key>[A-Za-z_][\w.-]*)"
    r"(?:(?P<op>[*/])(?P<factor>[0-9][0-9.]*(?:e[+-]?[0-9]+)?))?"
    r"(?::(?P<spec>[^{}|]*))?"
    r"(?:\|(?P<fallback>[^{}]*))?\}")


class QuestionDataError(ValueError):
    """course/questions.yaml (or another question file) is malformed; the message lists every problem."""


@dataclass(frozen=True)
class Option:
    """One lettered choice of a question, and why picking it is right or wrong."""
    key: str
    text: str
    explanation: str


@dataclass(frozen=True)
class Question:
    id: str
    lesson: str
    prompt: str
    options: tuple[Option, ...]
    answer: str
    autograded: bool = False
    source: str = "course"

    def option(self, key: str) -> Option:
        k = str(key).strip().upper()
        for o in self.options:
            if o.key == k:
                return o
        raise ValueError(f"choice must be one of {[o.key for o in self.options]} for question "
                         f"{self.id!r}, got {key!r}")

    @property
    def correct(self) -> Option:
        return self.option(self.answer)


@dataclass(frozen=True)
class Card:
    """An interview flip card: the question to answer aloud, and a model answer."""
    id: str
    lesson: str
    prompt: str
    answer: str
    source: str = "course"


@dataclass(frozen=True)
class Lesson:
    """A lesson of the bank: its id (the notebook's name, e.g. 02_kv_cache), its title, and the question its
    self-assessment asks."""
    id: str
    title: str
    self_assessment: str


@dataclass(frozen=True)
class QuestionBank:
    lessons: dict  # lesson id → Lesson, in file order
    questions: tuple[Question, ...]
    cards: tuple[Card, ...]
    path: Path | None = None

    def for_lesson(self, lesson_id: str) -> list[Question]:
        return [q for q in self.questions if q.lesson == lesson_id]

    def cards_for(self, lesson_id: str | None = None) -> list[Card]:
        return [c for c in self.cards if lesson_id is None or c.lesson == lesson_id]

    def question(self, question_id: str) -> Question:
        return self._by_id(self.questions, "question_id", question_id)

    def card(self, card_id: str) -> Card:
        return self._by_id(self.cards, "card_id", card_id)

    def _by_id(self, items, name: str, wanted: str):
        for item in items:
            if item.id == wanted:
                return item
        raise ValueError(f"{name} {wanted!r} is not in {self.path}; known ids: {', '.join(i.id for i in items)}")

    def check_lesson(self, lesson_id: str) -> Lesson:
        if lesson_id not in self.lessons:
            raise ValueError(f"lesson_id must be one of {list(self.lessons)}, got {lesson_id!r}")
        return self.lessons[lesson_id]


# ---------------------------------------------------------------------- loading and validation
def validate(data) -> list[str]:
    """Every problem in parsed question data, as readable strings (an empty list means valid)."""
    if not isinstance(data, dict):
        return ["the file must be a mapping with keys lessons, questions, interview"]
    problems: list[str] = []
    lessons = data.get("lessons") if isinstance(data.get("lessons"), dict) else {}
    if not lessons:
        problems.append("`lessons` must be a non-empty mapping of lesson id → {title, self_assessment}")
    problems += [f"lesson {lid!r} needs a non-empty title and self_assessment" for lid, info in lessons.items()
                 if not (isinstance(info, dict) and _text(info.get("title")) and _text(info.get("self_assessment")))]
    if not data.get("questions"):
        problems.append("`questions` must list at least one question")
    seen: set = set()
    for kind, items in (("question", data.get("questions") or []), ("interview card", data.get("interview") or [])):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                problems.append(f"{kind} #{i + 1} must be a mapping")
                continue
            where = f"{kind} {item['id']!r}" if _text(item.get("id")) else f"{kind} #{i + 1}"
            found = [] if _text(item.get("id")) else ["has no id"]
            found += ["duplicate id"] if item.get("id") in seen else []
            seen.add(item.get("id"))
            if item.get("lesson") not in lessons:
                found.append(f"lesson {item.get('lesson')!r} is not one of {list(lessons)}")
            found += [] if _text(item.get("prompt")) else ["empty prompt"]
            found += [] if item.get("source", "course") in ("seed", "course") else ["source must be 'seed' or 'course'"]
            texts = [item.get("prompt"), item.get("answer")]
            if kind == "interview card":
                found += [] if _text(item.get("answer")) else ["empty model answer"]
            else:
                texts = [item.get("prompt")] + _option_problems(item, found)
            found += [p for text in texts for p in placeholder_problems(text)]
            problems += [f"{where}: {p}" for p in found]
    return problems


def _option_problems(q: dict, found: list) -> list:
    """Append the problems of a question's options and answer to `found`; return the option texts to check."""
    options = q.get("options")
    if not isinstance(options, list) or not 2 <= len(options) <= len(OPTION_KEYS):
        found.append(f"needs between 2 and {len(OPTION_KEYS)} options")
        options = []
    keys = [o.get("key") for o in options if isinstance(o, dict)]
    texts = []
    for j, o in enumerate(options):
        if not isinstance(o, dict):
            found.append(f"option #{j + 1} must be a mapping")
            continue
        texts += [o.get("text"), o.get("explanation")]
        if o.get("key") != OPTION_KEYS[j]:
            found.append(f"option #{j + 1} must have key {OPTION_KEYS[j]!r}, got {o.get('key')!r}")
        found += [] if _text(o.get("text")) else [f"option {o.get('key')!r} has no text"]
        verdict = "Right" if o.get("key") == q.get("answer") else "Wrong"
        if not _text(o.get("explanation")):
            found.append(f"option {o.get('key')!r} has no explanation")
        elif q.get("answer") in keys and not o["explanation"].lstrip().startswith(verdict):
            found.append(f"option {o.get('key')!r}'s explanation must start with {verdict!r} (answer is "
                         f"{q.get('answer')!r})")
    if keys.count(q.get("answer")) != 1:
        found.append(f"answer {q.get('answer')!r} must name exactly one option of {keys}")
    if not isinstance(q.get("autograded", False), bool):
        found.append("autograded must be true or false")
    return texts


def placeholder_problems(text) -> list[str]:
    if not isinstance(text, str):
        return []
    problems = []
    for c in CLAUSE.finditer(text):
        if not PLACEHOLDER.search(c.group("body")):
            problems.append(f"clause {c.group(0)[:50]!r} cites no measured value")
        if any(m.group("fallback") is not None for m in PLACEHOLDER.finditer(c.group("body"))):
            problems.append(f"clause {c.group(0)[:50]!r}: no |fallback inside a clause's placeholders")
    rest = PLACEHOLDER.sub("", CLAUSE.sub(lambda c: c.group("body") + (c.group("fallback") or ""), text))
    if any(ch in rest for ch in "{}") or "[[" in rest or "]]" in rest:
        return problems + [f"malformed placeholder in {text[:60]!r}… (use {{key:.1f}} or [[clause {{key}}]])"]
    for m in PLACEHOLDER.finditer(text):
        if m.group("spec"):
            try:
                format(1.5, m.group("spec"))
            except ValueError:
                problems.append(f"bad format spec {m.group('spec')!r} in {m.group(0)!r}")
    return problems


def placeholder_keys(text: str) -> list[str]:
    """The measurement keys a text cites (top-level names, before any dot)."""
    return [m.group("key").split(".")[0] for m in PLACEHOLDER.finditer(text or "")]  # clauses included


def load_questions(path: str | os.PathLike | None = None) -> QuestionBank:
    """Load and validate a question file (course/questions.yaml by default); raise QuestionDataError."""
    p = Path(path) if path is not None else QUESTIONS_PATH
    if not p.exists():
        raise FileNotFoundError(f"question file {p} does not exist")
    return _load_cached(str(p.resolve()), p.stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _load_cached(path: str, _mtime: int) -> QuestionBank:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise QuestionDataError(f"{path} is not valid YAML: {exc}") from exc
    return bank_from_data(data, Path(path))


def bank_from_data(data, path: Path | None = None) -> QuestionBank:
    """A QuestionBank from parsed question data (validated; QuestionDataError names every problem). Also used
    for question files kept outside the package, such as the graded quiz's (autograde/make_quiz.py)."""
    problems = validate(data)
    if problems:
        raise QuestionDataError(f"{path} has {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    lessons = {lid: Lesson(lid, info["title"].strip(), info["self_assessment"].strip())
               for lid, info in data["lessons"].items()}
    questions = tuple(
        Question(id=q["id"], lesson=q["lesson"], prompt=q["prompt"].strip(),
                 options=tuple(Option(o["key"], o["text"].strip(), o["explanation"].strip()) for o in q["options"]),
                 answer=q["answer"], autograded=q.get("autograded", False), source=q.get("source", "course"))
        for q in data["questions"])
    cards = tuple(Card(id=c["id"], lesson=c["lesson"], prompt=c["prompt"].strip(), answer=c["answer"].strip(),
                       source=c.get("source", "course")) for c in data.get("interview") or [])
    return QuestionBank(lessons=lessons, questions=questions, cards=cards, path=path)


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


# ---------------------------------------------------------------------- measured numbers in the text
def measured_values(lesson_id: str | None = None, store=None) -> dict:
    """Numbers to cite: measurements saved in `store` (a course.teach.progress.ProgressStore; all lessons,
    then this lesson's) overlaid with this kernel's course.measure.results.recorded(), which wins."""
    from course.measure.results import recorded

    values: dict = {}
    if store is not None:
        with suppress(Exception):  # a broken progress file must never stop a quiz
            values.update(store.measurements())
            if lesson_id is not None:
                values.update(store.measurements(lesson_id))
    values.update(recorded())
    return values


def fill_numbers(text: str, values: dict | None = None) -> str:
    """Fill measured values into a text: [[clauses]] appear only when all their keys are known (else
    their |fallback or nothing); {key:spec|fallback} becomes the value, or the fallback when missing."""
    values = {} if values is None else values

    def clause(c: re.Match) -> str:
        parts = [_formatted(m, values) for m in PLACEHOLDER.finditer(c.group("body"))]
        if any(p is _MISSING for p in parts):
            return c.group("fallback") or ""
        it = iter(parts)
        return PLACEHOLDER.sub(lambda _m: next(it), c.group("body"))

    def inline(m: re.Match) -> str:
        out = _formatted(m, values)
        if out is _MISSING:
            return MISSING_TEXT if m.group("fallback") is None else m.group("fallback")
        return out

    return PLACEHOLDER.sub(inline, CLAUSE.sub(clause, text))


def _formatted(m: re.Match, values: dict):
    """One placeholder's formatted value, or _MISSING (absent, not a number where one is needed, NaN)."""
    value = values
    for part in m.group("key").split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, (list, tuple)) and part == "last" and value:
            value = value[-1]
        else:
            return _MISSING
    try:
        if m.group("op"):
            factor = float(m.group("factor"))
            value = value * factor if m.group("op") == "*" else value / factor
        if isinstance(value, float) and not math.isfinite(value):
            return _MISSING
        return format(value, m.group("spec") or "")
    except (TypeError, ValueError, ZeroDivisionError):
        return _MISSING


# ---------------------------------------------------------------------- plain-text renderings
def question_text(q: Question, number: int | None = None, values: dict | None = None) -> str:
    head = f"Q{number}. " if number is not None else ""
    lines = [f"{head}{fill_numbers(q.prompt, values)}  [{q.id}]"]
    lines += [f"    {o.key}. {fill_numbers(o.text, values)}" for o in q.options]
    lines.append(f"    → to answer: answer({q.id!r}, LETTER) with LETTER one of {'/'.join(o.key for o in q.options)}")
    return "\n".join(lines)


def card_text(c: Card, values: dict | None = None, reveal: bool = False) -> str:
    text = f"• {fill_numbers(c.prompt, values)}  [{c.id}]"
    if reveal:
        return text + "\n    " + fill_numbers(c.answer, values)
    return text + f"\n    → show the model answer: show_answer({c.id!r})"


def checkpoint_text(lesson_id: str, values: dict | None = None, cards: bool = True) -> str:
    bank = load_questions()
    lesson = bank.check_lesson(lesson_id)
    lines = [f"Checkpoint — {lesson.title}", ""]
    for i, q in enumerate(bank.for_lesson(lesson_id), 1):
        lines += [question_text(q, i, values), ""]
    if cards and bank.cards_for(lesson_id):
        lines.append("Interview prep — answer aloud first, then look:")
        lines += [card_text(c, values) for c in bank.cards_for(lesson_id)]
    return "\n".join(lines).rstrip()


def self_assessment_text(lesson_id: str) -> str:
    lesson = load_questions().check_lesson(lesson_id)
    return (f"Self-assessment — {lesson.self_assessment}\n    {' / '.join(LEVELS)}\n"
            f"    → save yours: self_assessment({lesson_id!r}, level={LEVELS[1]!r})")


def normalise_level(level: str) -> str:
    """Accept 'Confident', 'confident', 'getting_there', 2 … and return the canonical label."""
    if isinstance(level, int) and not isinstance(level, bool) and 0 <= level < len(LEVELS):
        return LEVELS[level]
    if isinstance(level, str):
        wanted = level.strip().lower().replace("_", " ").replace("-", " ")
        for label in LEVELS:
            if wanted == label.lower():
                return label
    raise ValueError(f"level must be one of {list(LEVELS)} (or 0, 1, 2), got {level!r}")


# ---------------------------------------------------------------------- grading one answer
@dataclass
class CheckResult:
    question_id: str
    choice: str
    correct: bool
    explanation: str                                   # why the chosen option is right or wrong
    others: dict[str, str] = field(default_factory=dict)  # shown once right: why the rest are wrong
    not_saved: str = ""                                # why the answer could not be saved, when it could not

    @property
    def text(self) -> str:
        lines = [f"{self.choice}: {self.explanation}"]  # explanations start with Right/Wrong
        if self.correct:
            lines += [f"  {k}: {why}" for k, why in self.others.items()]
        else:
            lines.append("  Try another option.")
        if self.not_saved:
            lines.append(f"  Not saved: {self.not_saved}")
        return "\n".join(lines)


def grade(question, choice: str, values: dict | None = None, store=None) -> CheckResult:
    """Grade one answer, fill measured numbers into the explanations, save it (if a store is given: anything
    with record_answer(lesson, question_id, choice, correct), e.g. a course.teach.progress.ProgressStore)."""
    option = question.option(choice)  # ValueError naming the valid letters
    correct = option.key == question.answer
    others = {o.key: fill_numbers(o.explanation, values) for o in question.options if o.key != option.key}
    result = CheckResult(question.id, option.key, correct, fill_numbers(option.explanation, values), others)
    if store is not None:
        try:
            store.record_answer(question.lesson, question.id, option.key, correct)
        except Exception as exc:  # the quiz keeps working, and says in one line why nothing was saved
            result.not_saved = str(exc)
    return result
