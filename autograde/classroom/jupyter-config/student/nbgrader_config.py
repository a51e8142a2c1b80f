"""nbgrader for a student of the course on JupyterHub: the Assignment List fetches from and submits to
the shared exchange. The hub puts this folder on the student's JUPYTER_CONFIG_PATH.

The student is named after the hub account ($JUPYTERHUB_USER, set by the hub for each server). Left
alone, nbgrader would use the Unix account running the server: the same name with one Unix account per
student (LocalProcessSpawner), but one shared name when every server runs as the same Unix user
(containers, SimpleLocalProcessSpawner), and submissions would overwrite each other.

Validate (its handler loads this file at every press) ends with `kvcourse check`'s summary line, as in the
course's own autograde/nbgrader_config.py, not a traceback per cell.
"""
import os

from course.grade.check import use_check_for_validate

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
use_check_for_validate()

c.CourseDirectory.course_id = "kvcourse"
c.Exchange.root = os.environ.get("KVCOURSE_EXCHANGE") or "/srv/nbgrader/exchange"
c.CourseDirectory.student_id = os.environ.get("JUPYTERHUB_USER") or "*"  # "*": nbgrader's default
