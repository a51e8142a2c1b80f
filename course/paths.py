"""Where things live: the project folder, and the course's own state (never the home folder in tests)."""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Inside the grading sandbox (course/grade/sandbox.py sets KVCOURSE_SEALED) the package names no place where
# the solutions, the grader's checks or the gradebook live: those folders are not mounted there either.
SEALED = os.environ.get("KVCOURSE_SEALED") == "1"
_NOWHERE = Path("/nonexistent")
LESSONS = PROJECT_ROOT / "lessons"
EXERCISES = PROJECT_ROOT / "exercises"
SOLUTIONS = (_NOWHERE if SEALED else PROJECT_ROOT) / "solutions"
AUTOGRADE = (_NOWHERE if SEALED else PROJECT_ROOT) / "autograde"


def state_dir() -> Path:
    """Jupyter's config/data/runtime for `kvcourse lab`: $KVCOURSE_STATE, else .state/ in the project."""
    return Path(os.environ.get("KVCOURSE_STATE", PROJECT_ROOT / ".state"))


def jupyter_env(base: dict | None = None, state: Path | None = None) -> dict:
    """An environment whose Jupyter state lives under `state` (the course's .state/ by default)."""
    state = Path(state) if state else state_dir()
    env = dict(os.environ if base is None else base)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
        (state / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(state / sub)
    return env
