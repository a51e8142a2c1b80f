"""`kvcourse lab`: open JupyterLab on the course, starting at lessons/00_start_here.ipynb."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from course.paths import LESSONS, PROJECT_ROOT, jupyter_env


def add_arguments(p):
    p.add_argument("--port", type=int, default=None, help="port to listen on (default: Jupyter picks 8888 or the next free one)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser window (e.g. on a remote machine)")
    p.add_argument("jupyter_args", nargs="*", metavar="-- JUPYTER_ARGS",
                   help="anything after -- goes to `jupyter lab` as is, e.g. -- --ServerApp.ip=0.0.0.0")


def command(port: int | None = None, no_browser: bool = False, extra: list[str] | None = None) -> list[str]:
    jupyter = shutil.which("jupyter", path=os.path.dirname(sys.executable)) or "jupyter"
    cmd = [jupyter, "lab", str(LESSONS / "00_start_here.ipynb"), f"--ServerApp.root_dir={PROJECT_ROOT}"]
    if port:
        cmd.append(f"--port={port}")
    if no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # Jupyter refuses root without it (containers, CI machines)
    return cmd + list(extra or [])


def run(args) -> int:
    cmd = command(args.port, args.no_browser, args.jupyter_args)
    print("Opening the course in JupyterLab. Stop it with Ctrl-C (twice).")
    try:
        return subprocess.call(cmd, cwd=PROJECT_ROOT, env=jupyter_env())
    except KeyboardInterrupt:
        return 0
