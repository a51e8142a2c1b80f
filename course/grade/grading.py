"""The names `kvcourse grade` and `kvcourse check` are reached by (course.cli maps both here).

The grading code lives in one module per topic:
  files.py         atomic writes, the course lock, reading JSON with a clear error
  nbgrader_api.py  nbgrader's config, API, assignments, exercise generation, gradebook health, CSV export
  submissions.py   finding submissions (missing ones, renamed files) and repairing locked cells
  sandbox.py       the sealed runner (bubblewrap) and its limits
  harness.py       what runs inside the sandbox
  plain.py         plain data across the sandbox wall
  verdicts.py      declared checks (autograde/checks/) and the clean comparison
  grader.py        the grade command
  check.py         the learner's check (and --full)
"""
from __future__ import annotations

from course.grade.check import (HIDDEN_BEGIN, TestResult, _changed_locked_cells, add_arguments_check, check,  # noqa: F401
                                full_check, run_check)
from course.grade.files import GradingError, read_small  # noqa: F401
from course.grade.grader import Ledger, Row, add_arguments_grade, grade, run_grade  # noqa: F401
from course.grade.nbgrader_api import (_export_csv, _venv_on_path, assignments, check_result,  # noqa: F401
                                       generate_exercises, load_config, nbgrader_api, source_hash)
from course.grade.submissions import Submission, discover as _discover, grade_id as _grade_id, invalid_reason, repair  # noqa: F401
from course.grade.submissions import invalid_reason as _invalid_reason  # noqa: F401


def discover(folder, known=None):
    return _discover(folder, assignments() if known is None else known)
