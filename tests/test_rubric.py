"""autograde/RUBRIC.md (points, checks, hints and the quiz's answer key, for instructors) is current."""
import sys

from course.paths import AUTOGRADE


def test_the_rubric_is_generated_from_the_current_checks_and_solutions():
    sys.path.insert(0, str(AUTOGRADE))
    import make_rubric

    fresh = make_rubric.build()
    assert (AUTOGRADE / "RUBRIC.md").read_text(encoding="utf-8") == fresh, \
        "checks, solutions or the graded quiz changed: run `python autograde/make_rubric.py`"
    total = sum(float(line.split(": ")[-1].split()[0]) for line in fresh.splitlines() if line.startswith("## "))
    assert f"All assignments together: {total:g} points." in fresh
