"""nbgrader for an instructor of the course on JupyterHub (the formgrader, `nbgrader ...`, `kvcourse classroom`).

The hub puts this folder on the instructor's JUPYTER_CONFIG_PATH. It is the course's own configuration
(autograde/nbgrader_config.py: safe execution, hidden tests kept out of feedback) moved into the
instructor's class folder, with the shared exchange:
    $KVCOURSE_CLASS_DIR   the class folder: gradebook.db, release/, inbox/, submitted/, autograded/,
                          feedback/, grades.csv (default ~/kvcourse-class)
    $KVCOURSE_EXCHANGE    nbgrader's exchange, shared with the students (default /srv/nbgrader/exchange)
course/classroom.py computes the same paths from the same variables (a test checks they agree).
"""
import os

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)

# this file is <project>/autograde/classroom/jupyter-config/instructor/nbgrader_config.py
COURSE_CONFIG = os.path.join(os.path.abspath(__file__).rsplit(os.sep, 4)[0], "nbgrader_config.py")
if not os.path.exists(COURSE_CONFIG):  # load_subconfig would skip a missing file without a word
    raise FileNotFoundError(f"the course's nbgrader configuration is missing: {COURSE_CONFIG}")
load_subconfig(COURSE_CONFIG)  # noqa: F821

CLASS_DIR = os.environ.get("KVCOURSE_CLASS_DIR") or os.path.join(os.path.expanduser("~"), "kvcourse-class")
c.CourseDirectory.root = CLASS_DIR
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(CLASS_DIR, "gradebook.db")
c.CourseDirectory.course_id = "kvcourse"
c.Exchange.root = os.environ.get("KVCOURSE_EXCHANGE") or "/srv/nbgrader/exchange"
