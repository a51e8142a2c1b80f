"""The names `kvcourse grade` and `kvcourse check` are reached by (course.cli maps both here).

The grading code lives in one module per topic:
  files.py         atomic writes, the course lock, reading JSON with a clear error
  nbgrader_api.py  nbgrader's config, API, assignments, exercise generation, gradebook health, CSV export
  submissions.py   finding submissions (missing ones, renamed files) and repairing locked cells
  sandbox.py       the sealed runner (bubblewrap) and its limits
  harness.py       what runs inside the sandbox
  plain.py         plain data across the sandbox wall
  verdicts.py      declared checks (autograde/checks/) and the clean comparison
  cluster.py       where the sandboxes run: here one at a time, or on Dask workers
  grader.py        the grade command (the only writer of the gradebook)
  classroom.py     `kvcourse classroom`: nbgrader's exchange cycle for a class on JupyterHub
  check.py         the learner's check (and --full)
"""
from __future__ import annotations

from course.grade.check import (HIDDEN_BEGIN, TestResult, _changed_locked_cells, add_arguments_check, check,  # noqa: F401
                                full_check, run_check)
from course.grade.files import GradingError, read_small  # noqa: F401
from course.grade.grader import Ledger, Row, add_arguments_grade, grade, print_rows, run_grade  # noqa: F401
from course.grade.nbgrader_api import (assignments, check_result, export_csv, generate_exercises,  # noqa: F401
                                       load_config, nbgrader_api, source_hash, venv_on_path)
from course.grade.submissions import Submission, discover as _discover, grade_id as _grade_id, invalid_reason, repair  # noqa: F401


def discover(folder, known=None):
    return _discover(folder, assignments() if known is None else known)
