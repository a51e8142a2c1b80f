"""`kvcourse lab` (what `make start` runs) serves the course, with its Jupyter state kept out of the home folder."""
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from course.cli.lab import command
from course.paths import PROJECT_ROOT

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_opens_start_here_and_allows_root():
    cmd = command(port=9999, no_browser=True)
    assert cmd[1] == "lab" and cmd[2].endswith("lessons/00_start_here.ipynb")
    assert "--port=9999" in cmd and "--no-browser" in cmd
    assert ("--allow-root" in cmd) == (os.geteuid() == 0)


def test_lab_serves_the_start_notebook(tmp_path):
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, KVCOURSE_STATE=str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-m", "course.cli", "lab", "--no-browser", "--port", str(port), "--",
                             f"--IdentityProvider.token={token}", "--ServerApp.ip=127.0.0.1"],
                            cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api/contents/lessons/00_start_here.ipynb?content=0&token={token}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    proc.kill()
                    pytest.fail("JupyterLab did not come up:\n" + proc.stdout.read().decode()[-3000:])
                time.sleep(1)
        assert (tmp_path / "state" / "runtime").is_dir()  # Jupyter's runtime files went to our state dir
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
