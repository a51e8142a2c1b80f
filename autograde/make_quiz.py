"""Write the checkpoint-quiz assignment (solutions/04_checkpoint_quiz) from autograde/quiz_questions.yaml.

The graded questions live here, on the instructor's side (like solutions/), not in the `course` package: every
learner has the package, whose question bank (course/teach/questions.yaml) holds the lessons' practice
checkpoints WITH their answers. The graded ones ask about the same topics with other scenarios and numbers.

Every question of quiz_questions.yaml becomes one answer cell and one test cell, named by its number in the
quiz (answer_1 … answer_5), not by its id. The visible part of the test only checks that the answer is one of
the option letters; the hidden part compares a digest of the answer, so neither the student version nor the
feedback shows which letter is right. Regenerate after editing quiz_questions.yaml, then
`python autograde/make_exercises.py`:

    python autograde/make_quiz.py
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import replace
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from course.paths import SOLUTIONS  # noqa: E402
from course.teach.questions import QUESTIONS_PATH, QuestionDataError, bank_from_data  # noqa: E402
from course.teach.quiz import fill_numbers, load_questions  # noqa: E402

ASSIGNMENT, NOTEBOOK = "04_checkpoint_quiz", "checkpoint_quiz"
QUIZ_PATH = Path(__file__).resolve().with_name("quiz_questions.yaml")


def graded_questions(path: Path = QUIZ_PATH) -> list:
    """The graded quiz's questions (course.teach.questions.Question, autograded=True), in quiz order.

    Validated like the package's bank, with its lessons; an id that is also in the package's bank, or a file
    with no question, is an error."""
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    package = load_questions()
    lessons = yaml.safe_load(QUESTIONS_PATH.read_text(encoding="utf-8"))["lessons"]
    bank = bank_from_data({"lessons": lessons, "questions": data.get("questions")}, Path(path))
    problems = [f"question {q.id!r} is also in the package's bank {QUESTIONS_PATH}; graded ids must be new"
                for q in bank.questions if q.id in {p.id for p in package.questions}]
    if problems:
        raise QuestionDataError(f"{path}: " + "; ".join(problems))
    return [replace(q, autograded=True) for q in bank.questions]


def variable(number: int) -> str:
    """The learner's variable for question `number` (1-based), also the answer cell's grade id."""
    return f"answer_{number}"


def digest(question_id: str, letter: str) -> str:
    """What the hidden test compares: the answer letter never appears in it."""
    return hashlib.sha256(f"kvcourse-quiz:{question_id}:{letter}".encode()).hexdigest()[:24]


def _nbgrader(cell, **meta):
    base = {"grade": False, "solution": False, "locked": False, "schema_version": 3, "task": False}
    cell.metadata["nbgrader"] = {**base, **meta}
    return cell


REL = "exercises/04_checkpoint_quiz/checkpoint_quiz.ipynb"
HAND_IN = (
    "## Hand it in\n\n"
    f"* **On your own (self-paced):** `kvcourse check {REL}` (or **Validate** in JupyterLab) checks the format\n"
    f"  of each answer. `kvcourse check --full {REL}` grades the notebook the way the course's grader does\n"
    "  (sealed off, hidden tests included) and prints your score, without showing the hidden tests.\n"
    "* **In a class (JupyterHub):** save the notebook, open **Nbgrader → Assignment List** in JupyterLab and\n"
    "  press **Submit** next to this assignment. Your instructor grades it; the feedback comes back in the same\n"
    "  list (**Fetch Feedback**).")


def build(questions) -> nbformat.NotebookNode:
    cells = [new_markdown_cell(
        "# Exercise 4 · Checkpoint quiz\n\n"
        f"**You will:** answer {len(questions)} questions on lessons 1-3 (prefill vs decode, the KV cache, "
        "sampling) for a grade. They are not the lessons' checkpoint questions: they put the same ideas to work "
        "on new models, numbers and situations.\n\n"
        "**Time:** about 10 minutes.\n\n"
        "**How it works.** Under each question, replace the `# YOUR CODE HERE` line and the "
        "`raise NotImplementedError()` line under it with one line that sets the variable to the letter you "
        "choose, in quotes: `" + variable(1) + " = \"<letter>\"`. The visible check under it only "
        "confirms that your answer is one of the letters; whether it is right is checked by the grader, and "
        "the feedback says right or wrong without showing the answer. The lessons' own checkpoints (with "
        "explanations) are the place to practise first. Check the format with "
        f"`kvcourse check exercises/{ASSIGNMENT}/{NOTEBOOK}.ipynb`.")]
    for number, q in enumerate(questions, start=1):
        letters = [o.key for o in q.options]
        options = "\n".join(f"- **{o.key}.** {fill_numbers(o.text, {})}" for o in q.options)
        cells.append(new_markdown_cell(
            f"## Question {number} · from lesson `{q.lesson}`\n\n{fill_numbers(q.prompt, {})}\n\n{options}"))
        name = variable(number)
        cells.append(_nbgrader(new_code_cell(
            f"# Your answer to question {number}: one of {', '.join(repr(k) for k in letters)}.\n"
            f"### BEGIN SOLUTION\n{name} = {q.answer!r}\n### END SOLUTION"),
            solution=True, grade_id=name))
        test = _nbgrader(new_code_cell(
            f"# Hint: {name} must be a string holding one letter: {', '.join(letters)}.\n"
            f"assert str({name}).strip().upper() in {letters!r}, "
            f"\"{name} must be one of {', '.join(letters)}\"\n"
            f"print(\"question {number}: answer recorded; the grader checks it\")\n"
            "### BEGIN HIDDEN TESTS\n"
            "import hashlib\n"
            f"_chosen = str({name}).strip().upper()\n"
            f"assert hashlib.sha256(f\"kvcourse-quiz:{q.id}:{{_chosen}}\".encode()).hexdigest()[:24] == "
            f"{digest(q.id, q.answer)!r}, \"hint: not the best option; revisit lesson {q.lesson}\"\n"
            "### END HIDDEN TESTS"),
            grade=True, locked=True, grade_id=f"test_{number}", points=1)
        test.metadata.update({"deletable": False, "editable": False})
        cells.append(test)
    cells.append(new_markdown_cell(
        "## What to do next\n\nSubmit the notebook. If the feedback marks a question wrong, reopen that lesson's "
        "checkpoint: every option there comes with the reason it is right or wrong.\n\n" + HAND_IN))
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    nbformat.validate(nb)
    return nb


def main(dest: Path = SOLUTIONS) -> Path:
    path = Path(dest) / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(build(graded_questions()), str(path))  # graded_questions() refuses a file with no question
    return path


if __name__ == "__main__":
    print(main())
