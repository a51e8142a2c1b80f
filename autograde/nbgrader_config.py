"""nbgrader configuration for the course. Every bit of nbgrader state lives in this folder.

    autograde/            CourseDirectory.root (`kvcourse grade --course` picks another one)
      gradebook.db        the SQLite gradebook
      release/            student versions made by `nbgrader generate_assignment` (exercises/ is a copy)
      submitted/          submissions, one folder per student and assignment
      autograded/         executed, scored notebooks (instructors only: they contain the hidden tests)
      feedback/           HTML feedback for students (hidden tests removed)
      exchange/           Exchange.root for nbgrader's release/submit commands
      grades.csv          `nbgrader export`; report.csv says how each submission went
The source notebooks are the project's solutions/ folder.

`kvcourse grade DIR` loads this file for the course layout, the release and the feedback, but executes
nothing through nbgrader: each submission runs sealed off in a bubblewrap sandbox and is scored from plain
data by course/grade/verdicts.py (see course/grade/grader.py). Plain `nbgrader ...` commands run from this
folder (or the project root, whose nbgrader_config.py loads this one) use it too; their own `autograde`
(and the formgrader's Autograde button) runs the notebooks unsealed with the preprocessors below, so grade
a class with `kvcourse grade` / `kvcourse classroom grade`.
"""
import os

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, GetGrades, IgnorePattern,
                                    LimitOutput, SaveAutoGrades)
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor

from course.grade.check import use_check_for_validate
from course.grade.nbgrader_ext import HideHiddenTests, SafeExecute
from course.grade.feedback_html import SanitizeMarkdown

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
use_check_for_validate()  # Validate ends with `kvcourse check`'s summary line, not a traceback per cell

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)

c.CourseDirectory.root = HERE
c.CourseDirectory.course_id = "kvcourse"
c.CourseDirectory.source_directory = os.path.join(PROJECT, "solutions")  # release/, submitted/ ...: nbgrader's names
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(HERE, "gradebook.db")
c.Exchange.root = os.path.join(HERE, "exchange")
c.Exchange.cache = os.path.join(HERE, "exchange", ".cache")  # nbgrader's default is in the home folder

# Student version: nbgrader's defaults (a solution region becomes "# YOUR CODE HERE" and a
# `raise NotImplementedError()` that fails loudly; "### BEGIN/END HIDDEN TESTS" regions are removed).

# Execution: a per-cell timeout that interrupts the kernel (an infinite loop costs one cell, not the run).
# SafeExecute (course/nbgrader_ext.py) adds: a memory cap on the kernel (RLIMIT_AS), a kernel that dies
# (os._exit, a crash) fails the remaining cells instead of the whole submission, and a kernel that
# ignores the interrupt is killed at the next timeout.
c.Execute.timeout = 30
c.Execute.interrupt_on_timeout = True
c.Execute.startup_timeout = 120
c.Execute.extra_arguments = ["--IPKernelApp.log_level=ERROR"]  # the kernel's own chatter, not the student's output
c.GraderKernelManager.memory_limit_mb = 4096

# A deleted test cell is put back from the gradebook; an edited one is overwritten (nbgrader's checksums).
c.OverwriteCells.add_missing_cells = True

c.Autograde.autograde_preprocessors = [SafeExecute, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
                                       SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]

# Feedback never shows hidden tests: their source is cut out and their output reduced to pass/fail.
c.GenerateFeedback.preprocessors = [GetGrades, HideHiddenTests, SanitizeMarkdown, CSSHTMLHeaderPreprocessor]

# Feedback HTML: a student's markdown and outputs are sanitised (no <script>, no onerror=, no javascript: links),
# keeping headings, paragraphs, lists, tables and images (course/grade/feedback_html.py says why nbconvert's own
# filter is not enough).
c.HTMLExporter.sanitize_html = True
c.HTMLExporter.filters = {"clean_html": "course.grade.feedback_html.clean_html"}
