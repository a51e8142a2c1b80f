"""Write the sample submissions that prove the grader: autograde/samples/<student>/<assignment>/<nb>.ipynb.

The samples are data, autograde/samples.yaml (its header says what each field means); the checkpoint quiz's are
made here from the graded questions (autograde/quiz_questions.yaml). Each sample starts from the released
exercise (exercises/) and fills its answer cells. samples/manifest.json records what each one must score;
tests/test_grading.py checks it.

Run after changing solutions/ (and regenerating exercises/):  python autograde/make_samples.py
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from course.paths import EXERCISES, SOLUTIONS  # noqa: E402

OUT = HERE / "samples"
SOLUTION_MARKERS = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")


def quiz_samples() -> dict[str, dict]:
    sys.path.insert(0, str(HERE))
    import make_quiz

    questions = make_quiz.graded_questions()  # kept out of the course package: autograde/quiz_questions.yaml
    name = {q.id: f"answer_{n}" for n, q in enumerate(questions, start=1)}  # the quiz's answer_N (make_quiz.py)
    right = {name[q.id]: f"{name[q.id]} = {q.answer!r}" for q in questions}
    samples = {"reference": {"about": "the right letters", "expect": "full"},
               "blank": {"about": "the exercise as released", "expect": "zero", "blank": True}}
    for n, q in enumerate(questions, start=1):
        option = next(o for o in q.options if o.key != q.answer)
        samples[f"quiz-bug-q{n}"] = {"about": f"question {n}: picks {option.key}, '{option.text[:60]}'",
                                     "expect": "loses", "answers": {**right, name[q.id]: f"{name[q.id]} = {option.key!r}"}}
    for letter in sorted({o.key for q in questions for o in q.options}):  # one letter everywhere: never full marks
        samples[f"quiz-bug-all-{letter.lower()}"] = {"about": f"answers {letter} everywhere", "expect": "loses",
                                                      "answers": {name[q.id]: f"{name[q.id]} = {letter!r}" for q in questions}}
    first = questions[0]
    samples["quiz-bug-option-text"] = {"about": "writes the option's text instead of its letter", "expect": "loses",
                                       "answers": {**right, name[first.id]: f"{name[first.id]} = {first.correct.text!r}"}}
    samples["quiz-alt-lowercase"] = {"about": "lower-case letters with spaces", "expect": "full", "answers": {
        name[q.id]: f"{name[q.id]} = ' {q.answer.lower()} '" for q in questions}}
    samples["quiz-alt-computed"] = {"about": "letters computed from option numbers", "expect": "full", "answers": {
        name[q.id]: f"options = 'ABCDEFGH'\n{name[q.id]} = options[{'ABCDEFGH'.index(q.answer)}]" for q in questions}}
    reader = yaml.safe_load((HERE / "samples.yaml").read_text())["01_memory_formula"]["adv-read-solutions"]
    samples["adv-read-solutions"] = json.loads(json.dumps(reader).replace(
        "01_memory_formula/memory_formula.ipynb", "04_checkpoint_quiz/checkpoint_quiz.ipynb"))
    return samples


def samples() -> dict[str, dict[str, dict]]:
    data = yaml.safe_load((HERE / "samples.yaml").read_text())
    data["04_checkpoint_quiz"] = quiz_samples()
    return dict(sorted(data.items()))


def reference_answers(source_nb) -> dict[str, str]:
    """What a student who wrote the solutions would have in each answer cell."""
    return {c.metadata["nbgrader"]["grade_id"]: "\n".join(ln for ln in c.source.splitlines()
                                                           if not SOLUTION_MARKERS.match(ln))
            for c in source_nb.cells if c.metadata.get("nbgrader", {}).get("solution")}


def _edit(nb, edit: dict, student: str) -> None:
    ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]
    if "after" in edit or "first" in edit:
        cell = nbformat.v4.new_code_cell(edit.get("code", edit.get("first")))
        cell["id"] = f"added-after-{edit['after']}" if "after" in edit else "added-first"  # reproducible bytes
        at = ids.index(edit["after"]) + 1 if "after" in edit else next(i for i, g in enumerate(ids) if g)
        nb.cells.insert(at, cell)
    elif "test" in edit:
        nb.cells[ids.index(edit["test"])].source = edit["code"]
    elif "delete" in edit:
        del nb.cells[ids.index(edit["delete"])]
    elif "points" in edit:
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("grade"):
                cell.metadata["nbgrader"]["points"] = edit["points"]
    elif "replace_text" in edit:
        old, new = edit["replace_text"]
        (cell,) = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        cell.source = cell.source.replace(old, new)
    else:
        raise ValueError(f"{student}: unknown edit {sorted(edit)}")


def build(assignment: str, student: str, sample: dict) -> bytes:
    (notebook,) = sorted((EXERCISES / assignment).glob("*.ipynb"))
    nb = nbformat.read(str(notebook), as_version=4)
    if not sample.get("blank"):
        (source,) = sorted((SOLUTIONS / assignment).glob("*.ipynb"))
        answers = reference_answers(nbformat.read(str(source), as_version=4))
        answers.update(sample.get("answers", {}))
        for grade_id, replacements in sample.get("patches", {}).items():
            for old, new in replacements:
                if old not in answers[grade_id]:
                    raise ValueError(f"{student}: {old!r} is not in the reference answer {grade_id!r}")
                answers[grade_id] = answers[grade_id].replace(old, new)
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if cell.metadata.get("nbgrader", {}).get("solution") and grade_id in answers:
                cell.source = answers[grade_id]
    for edit in sample.get("edits", []):
        _edit(nb, edit, student)
    return nbformat.writes(nb).encode()


def main(out: Path = OUT) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    manifest = []
    for assignment, group in samples().items():
        (notebook,) = sorted((EXERCISES / assignment).glob("*.ipynb"))
        for student, sample in group.items():
            path = out / student / assignment / notebook.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(sample["raw"].encode() if "raw" in sample else build(assignment, student, sample))
            manifest.append({"student": student, "assignment": assignment, "notebook": notebook.stem,
                             "about": sample["about"], "expect": sample["expect"],
                             "evidence": sample.get("evidence", ""), "honest": sample.get("honest", "")})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


if __name__ == "__main__":
    for entry in main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(f"{entry['student']:<28} {entry['assignment']:<20} expect {entry['expect']:<8} {entry['about']}")
