"""Write autograde/RUBRIC.md: what each autograded assignment is worth and what its checks look at.

For the instructor (like solutions/, it holds the graded quiz's answer key: do not hand it to students). Made
from the solution notebooks (test cells and points), autograde/checks/ (each check's label and the hint a
student sees when it fails) and autograde/quiz_questions.yaml. Regenerate after changing any of them:

    python autograde/make_rubric.py

tests/test_rubric.py fails when the committed file is out of date.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "autograde"))
from course.grade.verdicts import load_checks  # noqa: E402
from course.paths import SOLUTIONS  # noqa: E402

OUT = Path(__file__).resolve().with_name("RUBRIC.md")
HIDDEN = "### BEGIN HIDDEN TESTS"


def _test_cells(notebook: Path) -> list[tuple[str, float, bool]]:
    """(grade id, points, has hidden tests) of every test cell, in notebook order."""
    nb = nbformat.read(str(notebook), as_version=4)
    cells = []
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            cells.append((meta["grade_id"], float(meta.get("points", 0)), HIDDEN in cell.source))
    return cells


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def build() -> str:
    import make_quiz

    lines = ["# Grading rubric (for instructors)", "",
             "Made by `python autograde/make_rubric.py` from the solution notebooks, `autograde/checks/` and "
             "`autograde/quiz_questions.yaml`; do not edit by hand. It holds the graded quiz's answer key: keep it "
             "with `solutions/`, away from students.", "",
             "Every test cell is worth its points only when all of its checks pass (no partial credit within a "
             "cell). A *visible* cell's checks are the ones the student can run (`kvcourse check`); a *hidden* "
             "one's run only in the grader's sandbox, and the student sees only the hint of a failed check (and the "
             "type of a value of the wrong kind, never the value). The sandbox holds no copy of an exercise's "
             "reference implementation (`ABSENT` in its checks; see `autograde/THREAT_MODEL.md`), but the course "
             "package a student installs ships working versions of most exercises, so a student can still copy "
             "one by hand into the notebook: that is for a teacher's eye, as any copied work is.", ""]
    grand = 0.0
    for folder in sorted(p for p in SOLUTIONS.iterdir() if p.is_dir()):
        (notebook,) = sorted(folder.glob("*.ipynb"))
        checks = load_checks(ROOT / "autograde" / "checks" / f"{folder.name}.py")
        cells = _test_cells(notebook)
        total = sum(points for _, points, _ in cells)
        grand += total
        lines += [f"## {folder.name} ({notebook.name}): {total:g} points", "",
                  "| test cell | points | | checks (what each looks at · the hint a failure shows) |",
                  "|---|---|---|---|"]
        for gid, points, hidden in cells:
            shown = "<br>".join(f"{_cell(c.label)} · {_cell(c.hint)}" for c in checks.get(gid, []))
            lines.append(f"| `{gid}` | {points:g} | {'hidden' if hidden else 'visible'} | {shown} |")
        if folder.name == make_quiz.ASSIGNMENT:
            lines += ["", "Answer key:", ""]
            for n, q in enumerate(make_quiz.graded_questions(), start=1):
                lines.append(f"{n}. **{q.answer}** ({q.id}, lesson {q.lesson}): {_cell(q.correct.text)}")
        lines.append("")
    lines += [f"All assignments together: {grand:g} points.", ""]
    return "\n".join(lines)


def main() -> int:
    OUT.write_text(build(), encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
