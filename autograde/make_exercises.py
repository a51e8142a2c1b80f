"""Regenerate exercises/ (the student versions) from solutions/ with nbgrader generate_assignment.

Run after editing solutions/ (the Makefile's `make exercises` runs this, then make_samples.py):
    python autograde/make_exercises.py
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from course.grade.nbgrader_api import generate_exercises  # noqa: E402

if __name__ == "__main__":
    for path in generate_exercises():
        print(path.relative_to(ROOT))
