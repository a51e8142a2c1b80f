"""Classroom mode: autograde/classroom/ (JupyterHub + nbgrader's exchange) and `kvcourse classroom`.

Fast tests check the role configurations against what is installed (nbgrader's extension and plug-in ids)
and the hub configuration. The slow test runs a whole class on loopback: JupyterHub with the dummy
authenticator and the simple local spawner, configurable-http-proxy from npm, one instructor and three
students, every step through the Hub:
  - the instructor types `kvcourse classroom ...` in a terminal of their JupyterLab (terminal websocket);
  - each student uses nbgrader's Assignment List endpoints of their own server (fetch, submit,
    fetch_feedback) and saves the notebook through the contents API, as JupyterLab does;
  - the instructor's formgrader (in their server) sees the graded class; grades.csv is read through the
    instructor's contents API.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import csv
import html
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import nbformat
import pytest
from traitlets.config.loader import PyFileConfigLoader

from course.grade import classroom, nbgrader_api
from course.paths import AUTOGRADE, PROJECT_ROOT

pytestmark = pytest.mark.slow  # end to end (JupyterHub, sealed sandboxes by the dozen): out of make test-fast

CLASSROOM = AUTOGRADE / "classroom"
ROLE_CONFIG = {role: CLASSROOM / "jupyter-config" / role for role in ("instructor", "student")}
HUB_CONFIG = CLASSROOM / "jupyterhub_config.py"
NODE_DIR = PROJECT_ROOT / ".state" / "node"
CHP = NODE_DIR / "node_modules" / ".bin" / "configurable-http-proxy"
ASSIGNMENT, NOTEBOOK = "01_memory_formula", "memory_formula"
SAMPLES = AUTOGRADE / "samples"
# the class: one correct, one wrong, one adversarial (same bug as the wrong one, plus a rewritten visible test)
CLASS = {"alice": "reference", "bob": "mem-bug-no-factor-2", "carol": "adv-edited-test"}
HIDDEN_MARK = "41_943_040_000"  # a number that appears only inside a hidden test of the assignment


def load_py_config(path: Path, env: dict):
    old = dict(os.environ)
    os.environ.update(env)
    try:
        return PyFileConfigLoader(path.name, str(path.parent)).load_config()
    finally:
        os.environ.clear()
        os.environ.update(old)


def enabled_server_extensions(role: str) -> dict:
    from jupyter_core.paths import jupyter_config_path
    from jupyter_server.extension.config import ExtensionConfigManager

    old = os.environ.get("JUPYTER_CONFIG_PATH")
    os.environ["JUPYTER_CONFIG_PATH"] = str(ROLE_CONFIG[role])
    try:
        paths = jupyter_config_path()
    finally:
        os.environ.pop("JUPYTER_CONFIG_PATH") if old is None else os.environ.update(JUPYTER_CONFIG_PATH=old)
    return ExtensionConfigManager(read_config_path=paths).get_jpserver_extensions()


# ----------------------------------------------------------------------------- fast: configuration

def test_students_get_the_assignment_list_and_not_the_formgrader():
    student, instructor = enabled_server_extensions("student"), enabled_server_extensions("instructor")
    assert student["nbgrader.server_extensions.assignment_list"] and student["nbgrader.server_extensions.validate_assignment"]
    assert not student["nbgrader.server_extensions.formgrader"] and not student["nbgrader.server_extensions.course_list"]
    assert all(instructor[f"nbgrader.server_extensions.{n}"]
               for n in ("formgrader", "course_list", "assignment_list", "validate_assignment"))

    disabled = json.loads((ROLE_CONFIG["student"] / "labconfig" / "page_config.json").read_text())
    disabled = {k for k, v in disabled["disabledExtensions"].items() if v}
    assert disabled == {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                        "@jupyter/nbgrader:course-list"}
    # the ids must be the installed nbgrader's JupyterLab plug-ins, or disabling them does nothing
    bundle = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "@jupyter" / "nbgrader" / "static"
    plugin_ids = set(re.findall(r"@jupyter/nbgrader:[a-z-]+", " ".join(p.read_text() for p in bundle.glob("*.js"))))
    assert disabled <= plugin_ids and "@jupyter/nbgrader:assignment-list" in plugin_ids


def test_role_nbgrader_configs_agree_with_the_instructor_command(tmp_path):
    env = {"KVCOURSE_CLASS_DIR": str(tmp_path / "class"), "KVCOURSE_EXCHANGE": str(tmp_path / "exchange"),
           "JUPYTERHUB_USER": "alice"}
    student = load_py_config(ROLE_CONFIG["student"] / "nbgrader_config.py", env)
    assert student.CourseDirectory.course_id == classroom.COURSE_ID
    assert student.CourseDirectory.student_id == "alice"  # the hub account, not the Unix account
    assert student.Exchange.root == env["KVCOURSE_EXCHANGE"]

    formgrader = load_py_config(ROLE_CONFIG["instructor"] / "nbgrader_config.py", env)
    command = classroom.config(classroom.class_dir(env["KVCOURSE_CLASS_DIR"]),
                               classroom.exchange_dir(env["KVCOURSE_EXCHANGE"]))
    for section, key in (("CourseDirectory", "root"), ("CourseDirectory", "db_url"), ("CourseDirectory", "course_id"),
                         ("CourseDirectory", "source_directory"), ("Exchange", "root"),
                         ("Autograde", "autograde_preprocessors"), ("GenerateFeedback", "preprocessors"),
                         ("Execute", "timeout")):
        assert formgrader[section][key] == command[section][key], f"{section}.{key}"
    assert any(p.__name__ == "HideHiddenTests" for p in formgrader.GenerateFeedback.preprocessors)


@pytest.mark.parametrize("role", ["student", "instructor"])
def test_validate_on_the_hub_ends_with_the_check_summary(tmp_path, role):
    """The Validate handler loads nbgrader's config from JUPYTER_CONFIG_PATH and its own folder at each press; on
    the hub that is the role's folder, not autograde/, so the role's config must install check's summary too."""
    script = ("import os\n"
              "from jupyter_core.paths import jupyter_config_path\n"
              "from nbgrader.apps import NbGrader\n"
              "from nbgrader.validator import Validator\n"
              "paths = jupyter_config_path(); paths.insert(0, os.getcwd())\n"  # what the Validate handler does
              "app = NbGrader(); app.config_file_paths.append(paths); app.load_config_file()\n"
              "print(Validator.validate.__module__)\n")
    env = dict(os.environ, JUPYTER_CONFIG_PATH=str(ROLE_CONFIG[role]), PYTHONPATH=str(PROJECT_ROOT),
               KVCOURSE_CLASS_DIR=str(tmp_path / "class"), KVCOURSE_EXCHANGE=str(tmp_path / "exchange"))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["course.grade.check"], out.stdout


def hub_config(tmp_path, **env):
    base = {"KVCOURSE_HUB_STATE": str(tmp_path), "KVCOURSE_INSTRUCTORS": "prof, ta",
            "KVCOURSE_STUDENTS": "alice,bob", "KVCOURSE_EXCHANGE": str(tmp_path / "exchange")}
    return load_py_config(HUB_CONFIG, {**base, **env})


def test_hub_config_roles_and_class_list(tmp_path):
    roster = tmp_path / "roster.txt"
    roster.write_text("# the class\ncarol\nalice\nprof\n")
    cfg = hub_config(tmp_path, KVCOURSE_ROSTER=str(roster), KVCOURSE_CLASS_DIR="/srv/classes/{username}")
    assert cfg.Authenticator.allowed_users == {"prof", "ta", "alice", "bob", "carol"}
    assert cfg.Authenticator.admin_users == {"prof", "ta"}
    assert cfg.JupyterHub.load_groups == {"kvcourse-instructors": ["prof", "ta"],
                                          "kvcourse-students": ["alice", "bob", "carol"]}
    assert cfg.JupyterHub.authenticator_class == "pam" and cfg.JupyterHub.spawner_class == "localprocess"
    assert cfg.Spawner.environment["KVCOURSE_EXCHANGE"] == str(tmp_path / "exchange")
    assert "services" not in cfg.JupyterHub  # no API token unless asked for

    def spawn(name):
        spawner = SimpleNamespace(user=SimpleNamespace(name=name), environment={})
        cfg.Spawner.pre_spawn_hook(spawner)
        return spawner.environment

    assert spawn("prof")["JUPYTER_CONFIG_PATH"] == str(ROLE_CONFIG["instructor"])
    assert spawn("prof")["KVCOURSE_CLASS_DIR"] == "/srv/classes/prof"
    assert spawn("prof")["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert spawn("carol")["JUPYTER_CONFIG_PATH"] == str(ROLE_CONFIG["student"])
    assert "KVCOURSE_CLASS_DIR" not in spawn("carol")

    test = hub_config(tmp_path, KVCOURSE_HUB_AUTH="dummy", KVCOURSE_HUB_SPAWNER="simple",
                      KVCOURSE_HUB_HOMES=str(tmp_path / "{username}"), KVCOURSE_HUB_API_TOKEN="t0ken")
    assert test.SimpleLocalProcessSpawner.home_dir_template == str(tmp_path / "{username}")
    assert test.JupyterHub.services == [{"name": "kvcourse-admin", "api_token": "t0ken"}]


def test_exchange_is_made_writable_for_everyone(tmp_path):
    exchange = tmp_path / "srv" / "exchange"
    exchange.mkdir(parents=True, mode=0o755)
    classroom.make_exchange(exchange)
    assert exchange.stat().st_mode & 0o7777 == 0o1777, "writable by everyone, and sticky as /tmp is"
    readme = (CLASSROOM / "README.md").read_text()
    assert "chmod 1777 /srv/nbgrader/exchange" in readme and "chmod ugo+rw " not in readme


def kvcourse(*args, env=None):
    return subprocess.run([sys.executable, "-m", "course.cli", "classroom", *args], capture_output=True, text=True,
                          cwd=PROJECT_ROOT, env={**os.environ, **(env or {})}, timeout=300)


def test_steps_refuse_what_cannot_work_with_a_hint(tmp_path):
    where = ["--course", str(tmp_path / "class"), "--exchange", str(tmp_path / "exchange")]
    bad = kvcourse(*where, "release", "05_nope")
    assert bad.returncode == 2 and "01_memory_formula" in bad.stderr and "05_nope" in bad.stderr
    no_exchange = kvcourse(*where, "release", ASSIGNMENT)
    assert no_exchange.returncode == 2 and "kvcourse classroom init" in no_exchange.stderr
    nothing = kvcourse(*where, "grade", ASSIGNMENT)
    assert nothing.returncode == 2 and f"collect {ASSIGNMENT}" in nothing.stderr
    jobs = kvcourse(*where, "grade", ASSIGNMENT, "--jobs", "0")
    assert jobs.returncode == 2 and "--jobs" in jobs.stderr and "must be at least 1" in jobs.stderr
    no_book = kvcourse(*where, "export")
    assert no_book.returncode == 2 and "no gradebook" in no_book.stderr



def test_release_without_force_refuses_before_regenerating(tmp_path):
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    (exchange / classroom.COURSE_ID / "outbound" / ASSIGNMENT).mkdir(parents=True)  # already released
    out = kvcourse("--course", str(course), "--exchange", str(exchange), "release", ASSIGNMENT)
    assert out.returncode == 2 and "already released" in out.stderr and "--force" in out.stderr
    assert not (course / "release").exists() and not (course / "gradebook.db").exists(), "refused first"


def test_collect_reports_a_submission_made_as_another_student(tmp_path):
    """`nbgrader submit --CourseDirectory.student_id=daemon` by root: the folder's name and owner disagree, so it is
    held in quarantine/ (tests/test_classroom_faults.py: the student's own submission stands)."""
    import pwd

    claimed = "daemon"  # a Unix account that exists on Debian; the submission below is owned by this user
    me = pwd.getpwuid(os.getuid()).pw_name
    if me == claimed:
        pytest.skip("runs as the account it would impersonate")
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    classroom.init(course, exchange)
    folder = exchange / classroom.COURSE_ID / "inbound" / f"{claimed}+{ASSIGNMENT}+2026-01-01 10:00:00.000000 UTC+x1"
    folder.mkdir(parents=True)
    shutil.copy(SAMPLES / "reference" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", folder)
    (folder / "timestamp.txt").write_text("2026-01-01 10:00:00.000000 UTC")
    assert classroom.impersonations(ASSIGNMENT, exchange) == [(folder.name, claimed, me)]
    out = kvcourse("--course", str(course), "--exchange", str(exchange), "collect", ASSIGNMENT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"claims to be by '{claimed}' but was made by '{me}': not collected" in out.stderr
    assert not (course / classroom.INBOX / claimed).exists()
    assert (course / classroom.QUARANTINE / me / folder.name / f"{NOTEBOOK}.ipynb").is_file()

def classroom_main(capsys, *args) -> tuple[int, str, str]:
    """`kvcourse classroom ARGS` in this process (fast): (exit status, stdout, stderr)."""
    from course import cli

    try:
        code = cli.main(["classroom", *map(str, args)])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_status_names_the_exchange_and_refuses_one_that_is_not_there(tmp_path, capsys):
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    (tmp_path / "a-file").write_text("not an exchange")
    for where, words in ((tmp_path / "typo", "no exchange at"), (tmp_path / "a-file", "is a file, not a folder")):
        code, out, err = classroom_main(capsys, "--course", course, "--exchange", where, "status")
        assert code == 2 and "released" not in out, out
        assert words in err and str(where) in err and "--exchange" in err and "Traceback" not in err, err
    exchange.mkdir()
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "status")
    assert code == 0 and f"exchange     {exchange}" in out and "released False" in out, out + err


def test_export_to_a_folder_says_so_not_free_some_space(tmp_path, capsys):
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    classroom.init(course, exchange, ["alice"])
    (tmp_path / "out").mkdir()
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "export", "--to", tmp_path / "out")
    assert code == 2 and "is a folder" in err and "--to" in err and "Free some space" not in err, err
    (course / "grades.csv").mkdir()
    code, out, err = classroom_main(capsys, "--course", course, "--exchange", exchange, "export")
    assert code == 2 and f"{course / 'grades.csv'} is a folder" in err and "Free some space" not in err, err


def test_roster_refuses_bad_ids_reports_duplicates_and_counts_what_was_added(tmp_path, capsys):
    course, exchange = tmp_path / "class", tmp_path / "exchange"
    where = ["--course", course, "--exchange", exchange]
    bad = tmp_path / "bad.txt"
    bad.write_text("alice\n../evil\nbob smith\nx/y\nx+y\n")
    code, out, err = classroom_main(capsys, *where, "init", "--roster", bad)
    assert code == 2 and str(bad) in err and all(f"'{s}'" in err for s in ("../evil", "bob smith", "x/y", "x+y")), err
    assert "'alice'" not in err and not (course / "gradebook.db").exists(), "nothing is added from a bad roster"
    binary = tmp_path / "roster.xlsx"
    binary.write_bytes(b"PK\x03\x04\xff\xfe junk")
    code, out, err = classroom_main(capsys, *where, "init", "--roster", binary)
    assert code == 2 and str(binary) in err and "UTF-8" in err and "codec" not in err, err
    roster = tmp_path / "roster.txt"
    roster.write_text("alice\nbob\n# a comment\nalice\ncarol\ndave\neve\n")
    code, out, err = classroom_main(capsys, *where, "init", "--roster", roster)
    assert code == 0 and "5 student(s) added" in out and "'alice' is listed twice" in out, out + err
    code, out, err = classroom_main(capsys, *where, "init", "--roster", roster)
    assert code == 0 and "0 student(s) added" in out and "5 of the roster were there already" in out, out + err


def test_class_folder_that_is_a_file_is_named(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out, err = classroom_main(capsys, "--course", blocker, "--exchange", tmp_path, "status")
    assert code == 2 and f"{blocker} is a file, not a folder" in err and "Errno" not in err, err
    monkeypatch.setenv("KVCOURSE_CLASS_DIR", str(blocker / "class"))  # the variable is not parsed by argparse
    code, out, err = classroom_main(capsys, "--exchange", tmp_path, "init")
    assert code == 2 and f"{blocker} is a file" in err and "KVCOURSE_CLASS_DIR" in err and "Errno" not in err, err


# ----------------------------------------------------------------------------- slow: a class on JupyterHub

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_proxy() -> Path:
    """configurable-http-proxy in .state/node (npm), installed on first use; skip when that cannot work."""
    if CHP.exists():
        return CHP
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("JupyterHub needs configurable-http-proxy from npm, and node/npm are not installed")
    try:
        out = subprocess.run(["sh", str(CLASSROOM / "install_proxy.sh")], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("npm install configurable-http-proxy timed out (no access to the npm registry?)")
    if out.returncode != 0 or not CHP.exists():
        pytest.skip(f"npm could not install configurable-http-proxy: {out.stderr.strip()[-300:]}")
    return CHP


class Hub:
    """A JupyterHub on loopback, driven through its REST API and the users' servers behind its proxy."""

    def __init__(self, root: Path, instructors: list[str], students: list[str]):
        import requests

        self.requests = requests
        self.root = root
        self.port, self.hub_port, proxy_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = {"Authorization": f"token {secrets.token_hex(16)}"}
        self.homes = root / "homes"
        self.exchange = root / "exchange"
        (root / "hub").mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "KVCOURSE_", "IPYTHON"))}
        env.update(KVCOURSE_HUB_AUTH="dummy", KVCOURSE_HUB_SPAWNER="simple", KVCOURSE_HUB_IP="127.0.0.1",
                   KVCOURSE_HUB_PORT=str(self.port), KVCOURSE_HUB_API_PORT=str(self.hub_port),
                   KVCOURSE_PROXY_API_PORT=str(proxy_port), KVCOURSE_HUB_STATE=str(root / "hub"),
                   KVCOURSE_HUB_HOMES=str(self.homes / "{username}"), KVCOURSE_EXCHANGE=str(self.exchange),
                   KVCOURSE_CLASS_DIR=str(self.homes / "{username}" / "kvcourse-class"),
                   KVCOURSE_INSTRUCTORS=",".join(instructors), KVCOURSE_STUDENTS=",".join(students),
                   KVCOURSE_HUB_API_TOKEN=self.admin["Authorization"].split()[1], KVCOURSE_CHP=str(CHP))
        self.log = open(root / "hub.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(HUB_CONFIG)], cwd=root / "hub",
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.tokens: dict[str, dict] = {}
        self.wait(lambda: self._get("/hub/api/", self.admin).status_code == 200, 90, "the hub to answer")

    def _get(self, path, headers):
        try:
            return self.requests.get(self.url + path, headers=headers, timeout=30)
        except self.requests.ConnectionError:
            return SimpleNamespace(status_code=0, text="")

    def wait(self, ready, timeout, what):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"JupyterHub exited ({self.proc.returncode}):\n{self.log_tail()}")
            if ready():
                return
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log_tail()}")

    def log_tail(self, n=4000):
        self.log.flush()
        return (self.root / "hub.log").read_text()[-n:]

    def api(self, method, path, **kw):
        r = self.requests.request(method, f"{self.url}/hub/api{path}", headers=self.admin, timeout=60, **kw)
        assert r.status_code < 400, f"{method} {path}: {r.status_code} {r.text[:300]}"
        return r.json() if r.text else {}

    def start(self, users):
        for user in users:
            self.api("POST", f"/users/{user}/server")
            token = self.api("POST", f"/users/{user}/tokens", json={"note": "classroom test", "expires_in": 3600})
            self.tokens[user] = {"Authorization": f"token {token['token']}"}

        def all_ready():
            states = {u: self.api("GET", f"/users/{u}") for u in users}
            for u, s in states.items():
                if not s["servers"].get("") and not s.get("pending"):
                    raise AssertionError(f"{u}'s server stopped while starting:\n{self.log_tail()}")
            return all(s["servers"][""].get("ready") for s in states.values())

        self.wait(all_ready, 240, "the users' servers")

    def user(self, method, user, path, *, as_user=None, **kw):
        """A request to `user`'s single-user server through the proxy, with as_user's token (default: own)."""
        return self.requests.request(method, f"{self.url}/user/{user}/{path}", timeout=300,
                                     headers=self.tokens[as_user or user], **kw)

    def terminal(self, user, command, timeout=300) -> tuple[int, str]:
        """Type a command into a JupyterLab terminal of user's server; return (exit status, output)."""
        r = self.user("POST", user, "api/terminals")
        assert r.status_code == 200, r.text
        name = r.json()["name"]
        try:
            # A thread of its own: an event loop may already run in this one (Playwright's, when the
            # browser suite ran first in the same session), and asyncio.run refuses to nest.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(asyncio.run, self._type(user, name, command, timeout)).result()
        finally:
            self.user("DELETE", user, f"api/terminals/{name}")

    async def _type(self, user, name, command, timeout):
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = f"ws://127.0.0.1:{self.port}/user/{user}/terminals/websocket/{name}"
        ws = await websocket_connect(HTTPRequest(url, headers=self.tokens[user]))
        # the marker is split in the typed line so that the terminal's echo of the line never matches it
        await ws.write_message(json.dumps(["stdin", f"{command}; echo KV''DONE=$?\r"]))
        out, end = "", time.monotonic() + timeout
        while time.monotonic() < end:
            msg = await asyncio.wait_for(ws.read_message(), timeout=max(1.0, end - time.monotonic()))
            if msg is None:
                break
            kind, *data = json.loads(msg)
            if kind == "stdout":
                out += data[0]
                done = re.search(r"KVDONE=(\d+)", out)
                if done:
                    ws.close()
                    return int(done.group(1)), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
        ws.close()
        raise AssertionError(f"the terminal command did not finish in {timeout} s:\n{out[-3000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the hub stops the users' servers and the proxy
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        # the users' servers run in their own sessions: stop any this hub left behind, by pid
        api_url = f"JUPYTERHUB_API_URL=http://127.0.0.1:{self.hub_port}/hub/api".encode()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if api_url in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def html_text(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_class_on_jupyterhub_release_submit_grade_feedback_export(tmp_path):
    pytest.importorskip("jupyterhub", reason="classroom mode needs JupyterHub: pip install jupyterhub")
    ensure_proxy()
    started = time.perf_counter()
    timings = {}
    students = list(CLASS)
    hub = Hub(tmp_path, ["instructor"], students)
    try:
        hub.start(["instructor", *students])
        timings["hub_and_servers_s"] = time.perf_counter() - started
        kv = "kvcourse classroom"  # the hub puts the course's environment first on the terminal's PATH

        # each role gets its tools: the formgrader is in the instructor's server, not in a student's
        assert hub.user("GET", "alice", "formgrader/api/assignments").status_code == 404
        assert hub.user("GET", "instructor", "api/status", as_user="alice").status_code in (403, 404)
        lab = hub.user("GET", "alice", "lab").text
        assert "@jupyter/nbgrader:formgrader" in lab  # listed among JupyterLab's disabled plug-ins
        assert "@jupyter/nbgrader:formgrader" not in hub.user("GET", "instructor", "lab").text

        # instructor, in a JupyterLab terminal: create the class folder, release the assignment
        t = time.perf_counter()
        code, out = hub.terminal("instructor", f"{kv} init && {kv} release {ASSIGNMENT}")
        assert code == 0, out
        assert f"released {ASSIGNMENT}" in out
        assert hub.exchange.stat().st_mode & 0o777 == 0o777
        outbound = hub.exchange / classroom.COURSE_ID / "outbound" / ASSIGNMENT
        assert outbound.stat().st_mode & 0o022 == 0  # nbgrader's own permissions: students cannot change it
        inbound = hub.exchange / classroom.COURSE_ID / "inbound"
        assert inbound.stat().st_mode & 0o777 == 0o733  # ... and can hand in, but not list others' work
        timings["release_s"] = time.perf_counter() - t
        released = hub.user("GET", "instructor", "formgrader/api/assignments")
        assert released.status_code == 200, released.text[:300]
        status = {a["name"]: a["status"] for a in released.json()}  # it lists every assignment of solutions/
        assert status == {a: "released" if a == ASSIGNMENT else "draft" for a in nbgrader_api.assignments()}

        # students, through their servers' Assignment List: fetch, work (saved as JupyterLab saves), submit
        t = time.perf_counter()
        course_q = {"course_id": classroom.COURSE_ID, "assignment_id": ASSIGNMENT}
        for student, sample in CLASS.items():
            listed = hub.user("GET", student, "assignments", params={"course_id": classroom.COURSE_ID}).json()
            assert listed["success"] and [a["assignment_id"] for a in listed["value"]] == [ASSIGNMENT]
            assert listed["value"][0]["status"] == "released"
            r = hub.user("POST", student, "assignments/fetch", data=course_q)
            assert r.status_code == 200 and r.json()["success"], r.text[:500]
            path = f"api/contents/{ASSIGNMENT}/{NOTEBOOK}.ipynb"
            fetched = hub.user("GET", student, path).json()["content"]
            released = nbformat.read(outbound / f"{NOTEBOOK}.ipynb", as_version=4)
            assert len(fetched["cells"]) == len(released.cells)
            work = json.loads((SAMPLES / sample / ASSIGNMENT / f"{NOTEBOOK}.ipynb").read_text())
            r = hub.user("PUT", student, path, json={"type": "notebook", "format": "json", "content": work})
            assert r.status_code == 200, r.text[:500]
            r = hub.user("POST", student, "assignments/submit", data=course_q)
            assert r.status_code == 200 and r.json()["success"], r.text[:500]
            mine = [a for a in r.json()["value"] if a["status"] == "submitted"]
            assert len(mine) == 1 and mine[0]["student_id"] == student
        assert sorted(p.name.split("+")[0] for p in inbound.iterdir()) == sorted(CLASS)
        timings["students_fetch_submit_s"] = time.perf_counter() - t

        # instructor: collect, grade (2 workers), release feedback, export, in one command
        t = time.perf_counter()
        code, out = hub.terminal("instructor", f"{kv} cycle {ASSIGNMENT} --jobs 2 --quiet", timeout=600)
        assert code == 0, out
        assert "collected 3 submission(s)" in out and "feedback released for 3 student(s)" in out
        timings["collect_grade_feedback_export_s"] = time.perf_counter() - t

        # grades.csv, read through the instructor's server: right relative scores
        r = hub.user("GET", "instructor", "api/contents/kvcourse-class/grades.csv", params={"content": 1})
        grades = {row["student_id"]: row for row in csv.DictReader(io.StringIO(r.json()["content"]))}
        assert set(grades) == set(CLASS) and {g["assignment"] for g in grades.values()} == {ASSIGNMENT}
        score = {s: float(g["score"]) for s, g in grades.items()}
        max_score = {float(g["max_score"]) for g in grades.values()}
        assert len(max_score) == 1 and max_score.pop() > 0  # raised points in a submission change nothing
        assert score["alice"] == float(grades["alice"]["max_score"])  # correct: full marks
        assert 0 < score["bob"] < score["alice"]  # wrong: loses the tests its bug fails
        assert score["carol"] == score["bob"]  # same bug, and rewriting the visible test earned nothing
        report = {row["student"]: row for row in csv.DictReader(open(hub.homes / "instructor" / "kvcourse-class" / "report.csv"))}
        assert "edited test cell(s) restored" in report["carol"]["problems"]

        # the formgrader in the instructor's server sees the same graded class
        subs = hub.user("GET", "instructor", f"formgrader/api/submissions/{ASSIGNMENT}").json()
        assert {s["student"]: s["score"] for s in subs} == pytest.approx(score)

        # students fetch their feedback through the Assignment List: their own score, no hidden test
        t = time.perf_counter()
        for student in CLASS:
            listed = hub.user("GET", student, "assignments", params={"course_id": classroom.COURSE_ID}).json()
            before = [a for a in listed["value"] if a["status"] == "submitted"][0]["submissions"][-1]
            assert before["has_exchange_feedback"] and not before["has_local_feedback"]  # the UI offers "Fetch Feedback"
            r = hub.user("POST", student, "assignments/fetch_feedback", data=course_q)
            assert r.status_code == 200, r.text[:500]
            after = [a for a in r.json()["value"] if a["status"] == "submitted"][0]["submissions"][-1]
            assert after["has_local_feedback"] and not after["feedback_updated"], after
            page = hub.user("GET", student, "api/contents/" + quote(f"{after['local_feedback_path']}/{NOTEBOOK}.html"))
            assert page.status_code == 200, page.text[:300]
            page = page.json()["content"]
            text = html_text(page)
            assert f"{NOTEBOOK} (Score: {score[student]:.1f} / {float(grades[student]['max_score']):.1f})" in text
            assert HIDDEN_MARK not in text
        timings["students_fetch_feedback_s"] = time.perf_counter() - t
        timings["cycle_s"] = time.perf_counter() - started
    finally:
        t = time.perf_counter()
        hub.stop()
        timings["hub_stop_s"] = time.perf_counter() - t
    print("classroom cycle timings:", json.dumps({k: round(v, 1) for k, v in timings.items()}))
    out = PROJECT_ROOT / ".state" / "tests" / "classroom-cycle.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: round(v, 1) for k, v in timings.items()}, indent=1))
