"""`kvcourse lab`: open the course in JupyterLab, self-paced, with lessons/00_start_here.ipynb in front.

Self-paced mode (this command; `make start`) writes its settings into the course's Jupyter state folder
(.state/ or $KVCOURSE_STATE, never the home folder):

* no "get notified about official Jupyter news?" pop-up: the announcements plugin is off;
* no instructor tools: nbgrader's Formgrader, Create Assignment, Course List and Assignment List are off
  (front end and server), so nothing asks for an exchange folder a learner alone does not have. nbgrader's
  Validate button stays: with `kvcourse check`, it is how a self-paced learner checks an exercise. Classroom
  mode (JupyterHub, `course/grade/classroom.py`) has its own configuration and keeps them;
* the learner's view (course.cli.jupyter_contents): the file browser shows lessons/ and exercises/ (not the
  instructor's solutions/ and autograde/), a saved widget says how to bring it back, and notebooks open unmodified.

Then the command *becomes* JupyterLab (os.execvpe): a signal sent to `kvcourse lab` (Ctrl-C, a spawner's or
systemd's SIGTERM) reaches the server itself, which stops its kernels and exits; nothing is left behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from course.cli.args import port as port_type
from course.grade.files import atomic_write
from course.paths import PROJECT_ROOT, jupyter_env, state_dir

START_NOTEBOOK = "lessons/00_start_here.ipynb"
DEFAULT_PORT = 8888  # Jupyter's own default
PORT_TRIES = 50

# JupyterLab plugins switched off in self-paced mode, and why.
SELF_PACED_DISABLED_PLUGINS = {
    "@jupyterlab/apputils-extension:announcements": "the Jupyter news pop-up and update check (covers code; offline)",
    "@jupyter/nbgrader:formgrader": "instructor tool",
    "@jupyter/nbgrader:create-assignment": "instructor tool",
    "@jupyter/nbgrader:course-list": "needs a classroom exchange ('Error fetching courses!')",
    "@jupyter/nbgrader:assignment-list": "needs a classroom exchange ('exchange directory does not exist')",
    "@jupyter/nbgrader:menu": "its items open the tools above",
}
SELF_PACED_DISABLED_SERVER_EXTENSIONS = (
    "nbgrader.server_extensions.formgrader",
    "nbgrader.server_extensions.assignment_list",
    "nbgrader.server_extensions.course_list",
)


def add_arguments(p):
    p.add_argument("--port", type=port_type, default=None,
                   help=f"port to listen on (default {DEFAULT_PORT}, or the next free one; a taken port is reported)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser window (e.g. on a remote machine)")
    p.add_argument("jupyter_args", nargs="*", metavar="-- JUPYTER_ARGS",
                   help="anything after -- goes to `jupyter lab` as is, e.g. -- --ServerApp.ip=0.0.0.0")


# --------------------------------------------------------------------------- settings
def _write_json(path: Path, data: dict) -> None:
    """Replace the settings file atomically (a crash leaves the old one), keeping its permissions. A file that is a
    symbolic link (settings kept in a dotfiles folder) is written where the link points: the link stays a link."""
    atomic_write(Path(os.path.realpath(path)), json.dumps(data, indent=2))


class UnreadableSettings(ValueError):
    """A settings file the learner (or Jupyter) wrote that is not valid JSON: never overwritten."""


def _read_json(path: Path) -> dict:
    """A JSON settings file's object ({} when there is none yet). A file that is not valid JSON, or not an object,
    raises UnreadableSettings: writing our keys over it would lose the learner's own (a password, an ip)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise UnreadableSettings(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc}): fix it or move "
                                 "it aside, then run the command again") from None
    if not text.strip():
        return {}  # an empty file holds nothing to keep
    try:
        data = json.loads(text)
    except ValueError as exc:
        line = f" (line {exc.lineno})" if hasattr(exc, "lineno") else ""
        raise UnreadableSettings(f"{path} is not valid JSON{line}: fix it or move it aside, then run the command "
                                 "again (nothing was changed)") from None
    if not isinstance(data, dict):
        raise UnreadableSettings(f"{path} holds a JSON {type(data).__name__}, not an object of settings: fix it or "
                                 "move it aside, then run the command again (nothing was changed)")
    return data


def default_workspace() -> dict:
    """JupyterLab's first layout: the start notebook open, the file browser at the course folder."""
    widget = f"notebook:{START_NOTEBOOK}"
    return {
        "data": {
            "layout-restorer:data": {
                "main": {"dock": {"type": "tab-area", "currentIndex": 0, "widgets": [widget]}, "current": widget},
                # the left sidebar open on the file browser (a layout without it starts collapsed)
                "left": {"collapsed": False, "visible": True, "current": "filebrowser",
                         "widgets": ["filebrowser", "running-sessions", "table-of-contents", "extensionmanager.main-view"]},
            },
            widget: {"data": {"path": START_NOTEBOOK, "factory": "Notebook"}},
            "file-browser-filebrowser:cwd": {"path": ""},
        },
        "metadata": {"id": "default"},
    }


def prepare_self_paced(state: Path | None = None) -> Path:
    """Write self-paced mode's JupyterLab settings under `state` (the course's .state/ by default); returns it.

    Settings a learner changed are kept: only our own keys are set, and the first layout is written only when
    there is no saved layout yet.
    """
    state = Path(os.path.abspath(state)) if state else state_dir()
    config = state / "config"
    page_config = config / "labconfig" / "page_config.json"
    server_config = config / "jupyter_server_config.json"
    page_data, server_data = _read_json(page_config), _read_json(server_config)
    # Both files are checked before either is written: a wrong shape in the second must not leave the first changed.
    disabled = page_data.setdefault("disabledExtensions", {})
    if isinstance(disabled, list):  # the older form: a list of names
        disabled = page_data["disabledExtensions"] = {name: True for name in disabled if isinstance(name, str)}
    def an_object(value, where: Path, what: str) -> dict:
        if not isinstance(value, dict):
            raise UnreadableSettings(f"{where}: {what} is a JSON {type(value).__name__}, not an object: fix it or move "
                                     "the file aside, then run the command again (nothing was changed)")
        return value

    an_object(disabled, page_config, "disabledExtensions")
    server = an_object(server_data.setdefault("ServerApp", {}), server_config, "ServerApp")
    extensions = an_object(server.setdefault("jpserver_extensions", {}), server_config, "ServerApp.jpserver_extensions")
    disabled.update({name: True for name in SELF_PACED_DISABLED_PLUGINS})
    extensions.update({name: False for name in SELF_PACED_DISABLED_SERVER_EXTENSIONS})
    server["contents_manager_class"] = "course.cli.jupyter_contents.CourseContentsManager"
    _write_json(page_config, page_data)
    _write_json(server_config, server_data)

    workspaces = config / "lab" / "workspaces"
    if not any(workspaces.glob("*.jupyterlab-workspace")):
        from jupyterlab_server.workspaces_handler import WorkspacesManager

        WorkspacesManager(str(workspaces)).save("default", json.dumps(default_workspace()))
    return state


# --------------------------------------------------------------------------- the port
def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will bind it
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(requested: int | None, host: str = "127.0.0.1") -> int:
    """The requested port if free, else the next free one above it (as Jupyter would, but we say so)."""
    start = requested or DEFAULT_PORT
    for port in range(start, min(start + PORT_TRIES, 65536)):
        if port_is_free(port, host):
            return port
    raise OSError(f"no free port among {start}..{start + PORT_TRIES - 1}: stop another server or pass --port")


def _host(extra: list[str]) -> str:
    for arg in extra:
        m = re.fullmatch(r"--(?:ServerApp\.)?ip=(.+)", arg)
        if m:
            return m.group(1)
    return "localhost"


def command(port: int | None = None, no_browser: bool = False, extra: list[str] | None = None) -> list[str]:
    """The `jupyter lab` command line. JupyterLab opens its saved layout (first time: the start notebook), and
    keeps to the port we checked (port_retries=0: it never moves to another one without saying so)."""
    jupyter = shutil.which("jupyter", path=os.path.dirname(sys.executable)) or "jupyter"
    cmd = [jupyter, "lab", f"--ServerApp.root_dir={PROJECT_ROOT}"]
    if port:
        cmd += [f"--port={port}", "--ServerApp.port_retries=0"]
    if no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # Jupyter refuses root without it (containers, CI machines)
    return cmd + list(extra or [])


def banner(requested: int | None, port: int, host: str) -> str:
    url = f"http://{host}:{port}/lab"
    if requested and requested != port:
        bar = "!" * 78
        return (f"{bar}\n!!  Port {requested} is taken: another program is listening there.\n"
                f"!!  The course is served at   {url}   instead.\n{bar}")
    return f"Opening the course in JupyterLab at {url}  (stop it with Ctrl-C, twice)."


def lab_env() -> dict:
    """Jupyter's environment: its state in the project, and this Python's bin folder first on PATH, so
    `kvcourse` (which the exercises tell learners to run) works in a JupyterLab terminal; `make start` runs
    .venv/bin/kvcourse without activating the virtual environment."""
    env = jupyter_env()
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
    env["PATH"] = os.pathsep.join([bin_dir, *parts])
    for name in ("KVCOURSE_PROGRESS", "KVCOURSE_MODEL", "KVCOURSE_CACHE"):  # the kernels start in lessons/ or
        if env.get(name) and not os.path.isabs(os.path.expanduser(env[name])):  # exercises/: a relative path
            trail = os.sep if env[name].endswith(("/", os.sep)) else ""  # would name another file there
            env[name] = os.path.abspath(os.path.expanduser(env[name])) + trail
    return env


def run(args) -> int:
    extra = list(args.jupyter_args)
    host = _host(extra)
    bind = "127.0.0.1" if host in ("localhost", "127.0.0.1") else ("" if host == "0.0.0.0" else host)
    port = choose_port(args.port, bind)
    env = lab_env()
    try:
        prepare_self_paced()
    except UnreadableSettings as exc:
        print(f"kvcourse lab: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a read-only or full settings folder: the old files stay (atomic writes)
        where = f" {exc.filename}" if exc.filename else ""
        print(f"kvcourse lab: cannot write the self-paced settings{where} ({exc.strerror or exc}): make the folder "
              "writable or free space on its disk (or set KVCOURSE_STATE to another folder), then run the command "
              "again", file=sys.stderr)
        return 1
    print(banner(args.port, port, host))
    print("(Jupyter prints the address with its login token below.)", flush=True)
    cmd = command(port, args.no_browser, extra)
    os.chdir(PROJECT_ROOT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)  # this process becomes JupyterLab: signals reach the server itself
    return 0  # not reached
