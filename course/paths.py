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


PROGRESS_VAR = "KVCOURSE_PROGRESS"
PROGRESS_FILE = "progress.sqlite"


def progress_path() -> Path:
    """The learner's progress file: $KVCOURSE_PROGRESS (a file, or a folder for progress.sqlite), else
    progress.sqlite in the user's data folder (platformdirs: ~/.local/share/kvcourse on Linux).

    The machine profile (course.measure.machine) is kept beside it, so a reset of one folder resets both."""
    env = os.environ.get(PROGRESS_VAR)
    if env:
        path = Path(env).expanduser()
        # a trailing slash names a folder, made on the first write, even before it exists
        return path / PROGRESS_FILE if path.is_dir() or env.endswith(("/", os.sep)) else path
    from platformdirs import user_data_dir

    return Path(user_data_dir("kvcourse", appauthor=False)) / PROGRESS_FILE


def state_dir() -> Path:
    """Jupyter's config/data/runtime for `kvcourse lab`: $KVCOURSE_STATE, else .state/ in the project.

    Always absolute: a relative KVCOURSE_STATE means the folder from where the command was started, not from where
    Jupyter runs (`kvcourse lab` moves into the project first; ~ is the home folder)."""
    env = os.environ.get("KVCOURSE_STATE")
    return Path(os.path.abspath(os.path.expanduser(env))) if env else PROJECT_ROOT / ".state"


def jupyter_env(base: dict | None = None, state: Path | None = None) -> dict:
    """An environment whose Jupyter state lives under `state` (the course's .state/ by default)."""
    chosen = state is None
    state = Path(os.path.abspath(state)) if state else state_dir()  # Jupyter may run from another folder
    env = dict(os.environ if base is None else base)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
        try:
            (state / sub).mkdir(parents=True, exist_ok=True)
            if not os.access(state / sub, os.W_OK):  # Jupyter writes its runtime files and settings here
                raise PermissionError(13, "Permission denied", str(state / sub))
        except OSError as exc:
            raise ValueError(_state_problem(state / sub, exc, from_env=chosen and "KVCOURSE_STATE" in os.environ)
                             ) from None
        env[var] = str(state / sub)
    return env


def _state_problem(folder: Path, exc: OSError, from_env: bool) -> str:
    """One line: which folder, what is wrong with it, and what to do."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        what = f"{blocker} is a file, not a folder"
    elif isinstance(exc, PermissionError):
        what = f"{next((p for p in (folder, *folder.parents) if p.exists()), folder)} is not writable by you"
    else:
        what = exc.strerror or str(exc)
    fix = ("set KVCOURSE_STATE to a folder you can write to (or unset it to use the project's .state/)" if from_env
           else "move the file out of the way or make the folder writable (or set KVCOURSE_STATE to another folder)")
    return f"cannot use Jupyter's state folder {folder} ({what}): {fix}"
