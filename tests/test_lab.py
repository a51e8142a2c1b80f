"""`kvcourse lab` (what `make start` runs): self-paced settings in the course's state folder, a taken port reported,
and a server that stops with the command: a SIGTERM leaves no JupyterLab behind."""
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from course.cli import lab
from course.cli.lab import SELF_PACED_DISABLED_PLUGINS, banner, choose_port, command, prepare_self_paced
from course.paths import PROJECT_ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_serves_the_course_folder_on_the_checked_port():
    cmd = command(port=9999, no_browser=True)
    assert cmd[1] == "lab" and f"--ServerApp.root_dir={PROJECT_ROOT}" in cmd
    assert "--port=9999" in cmd and "--ServerApp.port_retries=0" in cmd and "--no-browser" in cmd
    assert ("--allow-root" in cmd) == (os.geteuid() == 0)


def test_self_paced_settings(tmp_path):
    state = tmp_path / "state"
    page = state / "config" / "labconfig" / "page_config.json"
    page.parent.mkdir(parents=True)
    page.write_text(json.dumps({"disabledExtensions": {"some-learner-choice": True}, "other": 1}))
    prepare_self_paced(state)
    disabled = json.loads(page.read_text())["disabledExtensions"]
    assert disabled["some-learner-choice"] and json.loads(page.read_text())["other"] == 1  # kept
    for plugin in ("@jupyterlab/apputils-extension:announcements", "@jupyter/nbgrader:formgrader",
                   "@jupyter/nbgrader:create-assignment", "@jupyter/nbgrader:course-list",
                   "@jupyter/nbgrader:assignment-list"):
        assert disabled.get(plugin) is True, plugin
    assert "@jupyter/nbgrader:validate-assignment" not in disabled  # the self-paced way to check an exercise
    server = json.loads((state / "config" / "jupyter_server_config.json").read_text())["ServerApp"]
    assert server["jpserver_extensions"]["nbgrader.server_extensions.formgrader"] is False
    assert "nbgrader.server_extensions.validate_assignment" not in server["jpserver_extensions"]
    workspace = json.loads(next((state / "config" / "lab" / "workspaces").glob("*.jupyterlab-workspace")).read_text())
    assert workspace["data"]["file-browser-filebrowser:cwd"] == {"path": ""}
    assert workspace["data"]["layout-restorer:data"]["main"]["current"] == "notebook:lessons/00_start_here.ipynb"
    # a layout the learner has since changed is not replaced
    ws = next((state / "config" / "lab" / "workspaces").glob("*.jupyterlab-workspace"))
    ws.write_text(json.dumps({"data": {"mine": 1}, "metadata": {"id": "default"}}))
    prepare_self_paced(state)
    assert json.loads(ws.read_text())["data"] == {"mine": 1}


def test_notebooks_open_with_the_kernel_header_jupyterlab_would_write():
    """The cause of "modified the moment it opens": JupyterLab writes the kernel's display name and language_info
    into the notebook when the kernel starts. The course's file manager fills them in as the kernel reports them."""
    import nbformat
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager

    from course.cli.jupyter_contents import with_kernel_header

    nb = nbformat.read(PROJECT_ROOT / "lessons" / "00_start_here.ipynb", as_version=4)
    spec = KernelSpecManager().get_kernel_spec(nb.metadata.kernelspec.name)
    with_kernel_header(nb)
    assert nb.metadata.kernelspec == {"name": "python3", "display_name": spec.display_name, "language": "python"}
    assert nb.metadata.language_info == IPythonKernel.language_info


def test_the_learner_view_shows_lessons_and_exercises_only(tmp_path):
    """The learner's file browser lists lessons/ and exercises/, not the instructor's material, and a saved
    widget output becomes a one-line note instead of "Error displaying widget: model not found"."""
    import asyncio

    import nbformat
    from tornado import web

    from course.cli.jupyter_contents import WIDGET_MIME, WIDGET_NOTE, CourseContentsManager

    for folder in ("lessons", "exercises", "solutions", "autograde", "course"):
        (tmp_path / folder).mkdir()
    cm = CourseContentsManager(root_dir=str(tmp_path))

    async def scenario():
        root = await cm.get("")
        assert sorted(m["name"] for m in root["content"]) == ["exercises", "lessons"]
        for hidden in ("solutions", "autograde/RUBRIC.md", "course"):
            with pytest.raises(web.HTTPError) as err:
                await cm.get(hidden)
            assert err.value.status_code == 404
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("quiz()", outputs=[
            nbformat.v4.new_output("display_data", data={WIDGET_MIME: {"model_id": "abc"}, "text/plain": "Quiz"}),
            nbformat.v4.new_output("stream", text="kept\n")])])
        await cm.save({"type": "notebook", "format": "json", "content": nb}, "lessons/x.ipynb")
        saved = nbformat.read(tmp_path / "lessons" / "x.ipynb", as_version=4)
        widget, stream = saved.cells[0].outputs
        assert WIDGET_MIME not in widget["data"] and widget["data"]["text/plain"] == WIDGET_NOTE
        assert stream["text"] == "kept\n"

    asyncio.run(scenario())


def test_a_taken_port_is_reported_loudly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        port = choose_port(taken)
        assert port != taken and lab.port_is_free(port)
        text = banner(taken, port, "localhost")
    assert f"Port {taken} is taken" in text and f"http://localhost:{port}/lab" in text and "!!" in text
    assert "taken" not in banner(port, port, "localhost")


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_lab_serves_self_paced_and_sigterm_leaves_no_server(tmp_path):
    """One real `kvcourse lab` on a taken port: it says where it really serves, serves the course there with the
    self-paced settings, and a SIGTERM to the command stops JupyterLab itself (no orphan on the port)."""
    token = secrets.token_hex(16)
    env = dict(os.environ, KVCOURSE_STATE=str(tmp_path / "state"))
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "course.cli", "lab", "--no-browser", "--port", str(taken), "--",
                             f"--IdentityProvider.token={token}", "--ServerApp.ip=127.0.0.1"],
                            cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        head = "".join(proc.stdout.readline() for _ in range(4))
        m = re.search(rf"Port {taken} is taken.*?served at\s+http://127\.0\.0\.1:(\d+)/lab", head, re.S)
        assert m, head
        port = int(m.group(1))
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/contents/lessons/00_start_here.ipynb?token={token}",
                                            timeout=10) as r:
                    notebook = json.load(r)["content"]
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    pytest.fail("JupyterLab did not come up:\n" + head)
                time.sleep(1)
        assert notebook["metadata"]["language_info"].get("version") == sys.version.split()[0]
        with urllib.request.urlopen(f"{base}/lab?token={token}", timeout=30) as r:
            page = r.read().decode()
        config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S).group(1))
        assert set(SELF_PACED_DISABLED_PLUGINS) <= set(config["disabledExtensions"])
        with pytest.raises(urllib.error.HTTPError) as err:  # no formgrader server in self-paced mode
            urllib.request.urlopen(f"{base}/formgrader?token={token}", timeout=30)
        assert err.value.code == 404
        assert (tmp_path / "state" / "runtime").is_dir()  # Jupyter's runtime files went to our state dir
        assert proc.pid in _processes_with(token)  # the command *is* the server (exec), not its parent
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail("JupyterLab did not stop on SIGTERM")
        blocker.close()
    time.sleep(1)
    assert _processes_with(token) == [], "a JupyterLab process outlived `kvcourse lab`"
    assert lab.port_is_free(port), f"port {port} still in use after `kvcourse lab` stopped"


def test_kvcourse_is_on_the_path_of_a_jupyterlab_terminal(monkeypatch):
    """`make start` runs .venv/bin/kvcourse without activating the venv: a terminal in JupyterLab said
    'kvcourse: command not found', though the exercises tell learners to run `kvcourse check`."""
    import os
    import shutil
    import sys

    from course.cli import lab

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = lab.lab_env()
    first = env["PATH"].split(os.pathsep)[0]
    assert first == os.path.dirname(os.path.abspath(sys.executable))
    assert shutil.which("kvcourse", path=env["PATH"]) == os.path.join(first, "kvcourse")
    assert "/usr/bin" in env["PATH"].split(os.pathsep)


# --------------------------------------------------------------------------- settings the learner wrote
def _run_lab(monkeypatch) -> tuple[int, list]:
    """`kvcourse lab --no-browser -- --version` up to the point where it would become JupyterLab."""
    import argparse

    became = []
    monkeypatch.setattr(os, "execvpe", lambda file, cmd, env: became.append((cmd, env)))
    monkeypatch.setattr(os, "chdir", lambda path: None)  # what the command does next is not under test here
    rc = lab.run(argparse.Namespace(port=None, no_browser=True, jupyter_args=["--version"]))
    return rc, became


@pytest.mark.parametrize("which", ["jupyter_server_config.json", "labconfig/page_config.json"])
def test_settings_that_are_not_valid_json_are_never_overwritten(tmp_path, monkeypatch, capsys, which):
    """A trailing comma in jupyter_server_config.json: `kvcourse lab` replaced the file with only the course's keys
    (the learner's password and ip lost, no backup, no message). Now it stops, names the file and the line."""
    state = tmp_path / "state"
    broken = state / "config" / which
    broken.parent.mkdir(parents=True)
    text = '{"ServerApp": {"password": "argon2:$argon2id$v=19$m=10240,t=10,p=8$abc", "ip": "0.0.0.0",}}\n'
    broken.write_text(text)
    monkeypatch.setenv("KVCOURSE_STATE", str(state))
    rc, became = _run_lab(monkeypatch)
    err = capsys.readouterr().err
    assert rc == 1 and became == []
    assert broken.read_text() == text
    assert f"{broken} is not valid JSON (line 1): fix it or move it aside" in err, err
    others = [p for p in (state / "config").rglob("*.json") if p != broken]
    assert others == []  # nothing written before the check either


def test_a_relative_state_folder_is_the_one_jupyter_reads(tmp_path, monkeypatch):
    """KVCOURSE_STATE=relstate from another folder: the settings went to $PWD/relstate, but Jupyter (started in the
    project folder) read PROJECT_ROOT/relstate: the instructor tools came back, and a stray folder in the project."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCOURSE_STATE", "relstate")
    assert not (PROJECT_ROOT / "relstate").exists()
    rc, [(cmd, env)] = _run_lab(monkeypatch)
    assert env["JUPYTER_CONFIG_DIR"] == str(tmp_path / "relstate" / "config")
    server = json.loads((tmp_path / "relstate" / "config" / "jupyter_server_config.json").read_text())
    assert server["ServerApp"]["jpserver_extensions"]["nbgrader.server_extensions.formgrader"] is False
    assert not (PROJECT_ROOT / "relstate").exists()


def test_a_settings_file_that_is_a_symbolic_link_is_written_where_it_points(tmp_path, monkeypatch):
    """jupyter_server_config.json as a link into a dotfiles folder: `kvcourse lab` replaced the link with a plain
    file (the dotfiles copy no longer used, and the learner not told). Now the link stays and its target is updated,
    keeping the learner's keys and the file's permissions."""
    state = tmp_path / "state"
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    target = dotfiles / "jupyter_server_config.json"
    target.write_text(json.dumps({"ServerApp": {"ip": "0.0.0.0"}}))
    target.chmod(0o640)
    link = state / "config" / "jupyter_server_config.json"
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(target, link.parent))
    monkeypatch.setenv("KVCOURSE_STATE", str(state))
    rc, became = _run_lab(monkeypatch)
    assert rc == 0 and len(became) == 1
    assert link.is_symlink() and link.resolve() == target.resolve()
    server = json.loads(target.read_text())["ServerApp"]
    assert server["ip"] == "0.0.0.0" and server["jpserver_extensions"]["nbgrader.server_extensions.formgrader"] is False
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in dotfiles.iterdir()) == ["jupyter_server_config.json"]  # no temp file left


@pytest.mark.parametrize("server_text", ['{"ServerApp": []}', '{"ServerApp": {"jpserver_extensions": 3}}'])
def test_both_settings_files_are_checked_before_either_is_written(tmp_path, monkeypatch, capsys, server_text):
    """ServerApp as a list in jupyter_server_config.json: page_config.json had already been rewritten when the
    error came. Now neither file is written."""
    state = tmp_path / "state"
    page = state / "config" / "labconfig" / "page_config.json"
    server = state / "config" / "jupyter_server_config.json"
    page.parent.mkdir(parents=True)
    page_text = '{"disabledExtensions": {"some-learner-choice": true}}'
    page.write_text(page_text)
    server.write_text(server_text)
    monkeypatch.setenv("KVCOURSE_STATE", str(state))
    rc, became = _run_lab(monkeypatch)
    err = capsys.readouterr().err
    assert rc == 1 and became == []
    assert page.read_text() == page_text and server.read_text() == server_text
    (line,) = err.splitlines()
    assert line.startswith(f"kvcourse lab: {server}: ServerApp") and "not an object: fix it" in line, err
    assert "nothing was changed" in line


def test_settings_that_cannot_be_written_are_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    import errno

    def full(path, data, private=False):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(lab, "atomic_write", full)
    monkeypatch.setenv("KVCOURSE_STATE", str(tmp_path / "state"))
    rc, became = _run_lab(monkeypatch)
    (line,) = capsys.readouterr().err.splitlines()
    assert rc == 1 and became == []
    assert line.startswith("kvcourse lab: cannot write the self-paced settings") and "No space left" in line


def test_no_asyncio_loop_is_left_running_by_the_browser_suite():
    """Run after the browser suite (tests/e2e sorts first): Playwright's sync API marks an asyncio loop running in
    the main thread while it is started, which made Jupyter's contents manager and nbclient fail in later tests."""
    import asyncio

    assert asyncio._get_running_loop() is None, "a fixture left Playwright (or another loop) running"
