"""Fixtures for the browser suite: one JupyterLab server and one headless Chromium for the whole session.

The server listens on a free loopback port with a random token; its Jupyter config, data, runtime and
IPython dirs, its JupyterLab settings and workspaces, and the course's progress file all live in a
temporary folder, so the suite never reads or writes the home folder or the learner's own progress.
Autosave is off, so running a lesson in the browser never writes outputs into the committed notebooks.

The browser is Debian's Chromium (/usr/bin/chromium, `scripts/ensure_chromium.sh` installs it), driven
by Playwright's Python sync API. Playwright never downloads a browser here. Without Chromium or
Playwright the suite is skipped with a message saying how to install them.

Screenshots go to test-artifacts/e2e/ (gitignored).
"""
from __future__ import annotations

import atexit
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
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "e2e"
CHROMIUM = Path(os.environ.get("KVCOURSE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
STARTUP_TIMEOUT_S = 240  # the machine is shared and slow: JupyterLab can take a minute to come up
UI_TIMEOUT_MS = 90_000  # default wait for any element

# JupyterLab user settings for the test server (written into its own temporary settings dir).
LAB_SETTINGS = {
    # No autosave: a Run All in the browser must never write outputs into the committed notebooks.
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    # Every cell stays in the DOM (no virtual scrolling), so outputs far down can be found and checked.
    # Each cell's run times in its metadata, as nbclient records them: the lesson tests that check a browser
    # run report its slowest cells.
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "recordTiming": True},
    # No "would you like news?" toast over the notebook, no update check (the machine is offline).
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLabServer:
    """A JupyterLab process serving the project folder; `url(path)` gives an authenticated address."""

    def __init__(self, state: Path):
        from course.measure import machine
        from course.paths import jupyter_env

        self.state = state
        self.port = _free_port()
        self.token = secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        env = jupyter_env(state=state)
        for var in ("MPLBACKEND", "KVCOURSE_RESULTS", "KVCOURSE_HEADLESS", "KVCOURSE_QUIZ", "JUPYTER_TOKEN"):
            env.pop(var, None)  # the kernels must behave as a learner's: inline plots, live widgets
        env["KVCOURSE_PROGRESS"] = str(state / "progress.sqlite")  # a fresh learner, never the real file
        env["KVCOURSE_MACHINE"] = str(machine.path())  # the machine is the one the headless lesson tests measure
        env["JUPYTERLAB_SETTINGS_DIR"] = str(state / "lab-settings")
        env["JUPYTERLAB_WORKSPACES_DIR"] = str(state / "lab-workspaces")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # Chromium shares the cores with the kernels: one torch thread keeps the lessons' timing sections
        # from stalling on threads that wait for each other (they ran ~10x slower with two).
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("KVCOURSE_THREADS", "1")
        for plugin, values in LAB_SETTINGS.items():
            path = state / "lab-settings" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        # Checkpoints (JupyterLab makes one when it opens a notebook) go to the temporary folder too,
        # mirroring the project's layout, never into lessons/.ipynb_checkpoints.
        checkpoints = state / "checkpoints"
        for folder in [ROOT, *ROOT.glob("lessons"), *ROOT.glob("exercises/*/")]:
            (checkpoints / folder.relative_to(ROOT)).mkdir(parents=True, exist_ok=True)
        jupyter = Path(sys.executable).with_name("jupyter")
        cmd = [str(jupyter) if jupyter.exists() else "jupyter", "lab", "--no-browser",
               "--ip=127.0.0.1", f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={ROOT}",
               "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: read notebook models in tests
               "--LabApp.news_url=None", f"--FileCheckpoints.root_dir={checkpoints}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log_path = state / "jupyterlab.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def url(self, path: str = "lab") -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base}/{path.lstrip('/')}{sep}token={self.token}"

    def api(self, method: str, path: str, timeout: float = 30):
        req = urllib.request.Request(f"{self.base}/api/{path.lstrip('/')}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "status", timeout=5)
                with urllib.request.urlopen(self.url("lab"), timeout=30) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def shutdown_sessions(self, path: str | None = None) -> None:
        """Shut down the kernels of every session (or of the one on `path`), as closing a notebook would."""
        try:
            sessions = self.api("GET", "sessions")
        except Exception:
            return
        for s in sessions:
            if path is None or s.get("path") == path:
                try:
                    self.api("DELETE", f"sessions/{s['id']}", timeout=60)
                except Exception:
                    pass

    def stop(self) -> None:
        if self._log.closed:
            return
        if self.proc.poll() is None:
            self.shutdown_sessions()
            try:
                self.api("POST", "shutdown", timeout=30)
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=30)
        self._log.close()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# Module scope (the browser suite is one module; "package" acts as "session" for a folder without __init__.py):
# both stop when the browser suite ends, not at the end of the run. Playwright's sync API keeps an
# asyncio loop marked running in this thread while it is started, and every later test that calls asyncio.run
# (Jupyter's contents manager, nbclient) would fail with "cannot be called from a running event loop".
@pytest.fixture(scope="module")
def jupyter_server(tmp_path_factory):
    """One JupyterLab for the whole browser suite, stopped (with its kernels) at the end."""
    pytest.importorskip("jupyterlab")
    server = JupyterLabServer(tmp_path_factory.mktemp("jupyterlab"))
    # Stop it even when pytest itself is stopped: SIGTERM (e.g. from `timeout`) becomes an interrupt,
    # whose exit runs the atexit hook. stop() is idempotent.
    atexit.register(server.stop)
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        atexit.unregister(server.stop)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = server.log_tail(200_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "jupyterlab.log").write_text(log)


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    """Headless Debian Chromium with an empty profile, shared by the session (one context, many tabs)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: run `scripts/ensure_chromium.sh` (as root it runs "
                    "`apt-get install -y chromium`), or set KVCOURSE_CHROMIUM to a Chromium binary")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: `.venv/bin/pip install playwright` (no browser download "
                    "is needed; the suite uses /usr/bin/chromium)")
    profile = tmp_path_factory.mktemp("chromium-profile")  # empty --user-data-dir
    pw = sync_playwright().start()
    try:
        # Playwright adds --headless itself (headless=True) and rejects --user-data-dir in args: the
        # empty profile is passed as user_data_dir instead.
        args = [f for f in CHROMIUM_FLAGS if f != "--headless"]
        home = tmp_path_factory.mktemp("chromium-home")  # crash reports and caches stay out of ~
        env = {**os.environ, "XDG_CONFIG_HOME": str(home / "config"), "XDG_CACHE_HOME": str(home / "cache")}
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=args, env=env,
            viewport={"width": 1500, "height": 1000}, device_scale_factor=1)
        context.set_default_timeout(UI_TIMEOUT_MS)
        try:
            yield context
        finally:
            context.close()
    finally:
        pw.stop()


# --------------------------------------------------------------------------- driving JupyterLab
JS_NOTEBOOK_STATE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!w || !w.content || !w.content.model || !w.sessionContext) return null;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  const cells = [];
  for (const cell of w.content.widgets) {
    const m = cell.model;
    if (m.type !== 'code') continue;
    const outputs = [];
    for (let i = 0; i < m.outputs.length; i++) outputs.push(m.outputs.get(i).toJSON());
    const prompt = cell.node.querySelector('.jp-InputPrompt');
    cells.push({source: m.sharedModel.getSource(), execution_count: m.executionCount,
                prompt: prompt ? prompt.textContent : '', outputs});
  }
  return {kernel: kernel ? kernel.status : 'none', ready: w.sessionContext.isReady,
          dirty: w.context.model.dirty, path: w.context.path, cells};
}"""


class Lab:
    """What a learner does in JupyterLab: open a notebook, Run All, look at outputs; plus screenshots."""

    def __init__(self, server: JupyterLabServer, context, request):
        self.server, self.context = server, context
        name = request.node.originalname.removeprefix("test_")
        callspec = getattr(request.node, "callspec", None)
        if callspec is not None:  # parametrized by a notebook path: add its stem
            name += "-" + "-".join(Path(str(v)).stem for v in callspec.params.values())
        self.test_name = re.sub(r"[^\w.-]+", "_", name)
        self.shots: list[Path] = []
        for old in ARTIFACTS.glob(f"{self.test_name}-[0-9][0-9]-*.png"):
            old.unlink(missing_ok=True)  # this test's screenshots from an earlier run
        self.pages = []

    # -- pages ---------------------------------------------------------------------------------------
    def open(self, path: str, timeout_ms: int = 180_000):
        """Open a notebook (path relative to the project) in its own workspace; wait for an idle kernel."""
        page = self.context.new_page()
        self.pages.append(page)
        workspace = re.sub(r"[^\w-]+", "-", f"{self.test_name}-{path}")[-60:]
        page.goto(self.server.url(f"lab/workspaces/{workspace}/tree/{path}?reset"),
                  wait_until="domcontentloaded", timeout=timeout_ms)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started", timeout=timeout_ms)
        page.locator(".jp-NotebookPanel .jp-Notebook").first.wait_for(state="visible", timeout=timeout_ms)
        self.wait_kernel_idle(page, timeout_ms)
        return page

    def close(self, page) -> None:
        state = self.state(page)
        page.close()
        if state:
            self.server.shutdown_sessions(state["path"])

    def keep(self, page):
        """Leave this page (and its kernel) open after the test, for a later test to reuse."""
        self.pages.remove(page)
        return page

    def adopt(self, page) -> None:
        """Take over a kept page: it is closed, with its kernel, at the end of this test."""
        self.pages.append(page)

    def scratch_copy(self, folder: Path) -> Path:
        """A copy of a committed folder inside the project (test-artifacts/, gitignored), for actions that
        save the notebook; the committed files stay untouched."""
        dest = ARTIFACTS / "work" / f"{self.test_name}-{folder.name}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(folder, dest, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        (self.server.state / "checkpoints" / dest.relative_to(ROOT)).mkdir(parents=True, exist_ok=True)
        return dest

    def close_all(self) -> None:
        for page in self.pages:
            if not page.is_closed():
                try:
                    self.close(page)
                except Exception:
                    pass

    # -- state -----------------------------------------------------------------------------------------
    def state(self, page) -> dict | None:
        return page.evaluate(JS_NOTEBOOK_STATE)

    def wait_kernel_idle(self, page, timeout_ms: int = 180_000) -> dict:
        page.wait_for_function(
            """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                       const s = w && w.sessionContext;
                       return s && s.isReady && s.session && s.session.kernel
                              && s.session.kernel.status === 'idle'; }""",
            timeout=timeout_ms, polling=500)
        return self.state(page)

    def run_all(self, page, timeout_s: float = 900) -> dict:
        """Run > Run All Cells from the menu bar, then wait until no cell is queued and the kernel is idle."""
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        return self.wait_run_finished(page, timeout_s)

    @staticmethod
    def busy(state: dict | None) -> bool:
        """The kernel works, or a cell waits in the queue (a prompt with a star)."""
        return state is None or state["kernel"] != "idle" or any("*" in c["prompt"] for c in state["cells"])

    def wait_run_finished(self, page, timeout_s: float = 900, meanwhile=None) -> dict:
        """Wait until Run All is done; `meanwhile()` is called at every poll (another page may need a look)."""
        deadline = time.monotonic() + timeout_s
        page.wait_for_timeout(1500)  # let the queue reach the kernel before looking for "idle"
        settled = 0
        while time.monotonic() < deadline:
            st = self.state(page)
            settled = 0 if self.busy(st) else settled + 1
            if settled >= 3:  # idle three polls in a row: no cell left in the queue
                return st
            if meanwhile:
                meanwhile()
            page.wait_for_timeout(1000)
        raise AssertionError(f"Run All did not finish within {timeout_s:.0f} s; "
                             f"cells still queued: {[c['source'][:60] for c in self.state(page)['cells'] if '*' in c['prompt']]}")

    @staticmethod
    def errors(state: dict) -> list[str]:
        """Every error output, and every stderr output that holds a traceback, as 'ename: evalue' lines."""
        found = []
        for cell in state["cells"]:
            for out in cell["outputs"]:
                if out.get("output_type") == "error":
                    found.append(f"{out.get('ename')}: {out.get('evalue')}  (in cell: {cell['source'][:80]!r})")
                elif out.get("output_type") == "stream" and out.get("name") == "stderr":
                    text = "".join(out.get("text", ""))
                    if "Traceback" in text or re.search(r"^\w+Error\b", text, re.M):
                        found.append(f"stderr traceback: {text[-300:]!r}")
        return found

    @staticmethod
    def output_texts(state: dict) -> list[str]:
        """The text of every stream and text/plain output, in order."""
        texts = []
        for cell in state["cells"]:
            for out in cell["outputs"]:
                if out.get("output_type") == "stream":
                    texts.append("".join(out.get("text", "")))
                elif "text/plain" in out.get("data", {}):
                    texts.append("".join(out["data"]["text/plain"]))
        return texts

    @staticmethod
    def not_run(state: dict) -> list[str]:
        return [c["source"][:80] for c in state["cells"] if c["source"].strip() and c["execution_count"] is None]

    @staticmethod
    def dom_errors(page) -> list[str]:
        """Error text rendered in the page: tracebacks in stderr-typed outputs (errors render that way too)."""
        texts = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').all_inner_texts()
        return [t[-300:] for t in texts if "Traceback" in t or re.search(r"^\w+(Error|Exception)\b", t, re.M)]

    # -- screenshots ---------------------------------------------------------------------------------
    def shot(self, page_or_locator, name: str) -> Path:
        """Save a PNG under test-artifacts/e2e/<test>-<name>.png and return its path."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{self.test_name}-{len(self.shots) + 1:02d}-{name}.png"
        page_or_locator.screenshot(path=str(path))
        self.shots.append(path)
        return path


@pytest.fixture
def lab(browser_context, jupyter_server, request):
    driver = Lab(jupyter_server, browser_context, request)
    try:
        yield driver
    finally:
        # a failing test leaves a screenshot of every page it had open
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            for i, page in enumerate(driver.pages):
                if not page.is_closed():
                    try:
                        driver.shot(page, f"failure-{i}")
                    except Exception:
                        pass
        driver.close_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


LESSON_TESTS = ("test_every_lesson_runs_clean", "test_sampling_temperature_slider_redraws_the_chart",
                "test_kv_calculator_context_slider_changes_the_bytes")


def pytest_collection_modifyitems(items):
    """The browser tests in this order: the start page first (it measures the machine profile, by itself), then the
    tests that time nothing (quiz, Validate, review, the self-paced lab), which start the lessons in other tabs, then
    the lessons' own tests and the sliders that use their pages (test_browser.keep_lanes_full)."""
    slots = [i for i, item in enumerate(items) if item.path.name == "test_browser.py"]
    rank = {"test_start_here_runs_and_streams_an_answer": 0, **dict.fromkeys(LESSON_TESTS, 2)}
    for i, item in zip(slots, sorted((items[i] for i in slots), key=lambda item: rank.get(item.originalname, 1))):
        items[i] = item
