"""Runs inside the sandbox: the notebook's cells first, then the exercise's checks; writes plain-data events.

stdin carries two JSON lines (sandbox._attempt). Line 1, {"notebook", "cell_timeout", "stop_before",
"events_fd"}: every code cell but the test cells runs in an IPython shell here, each under a timeout, and its
outputs (at most OUTPUT_CAP characters per stream) go out as "cell_done"; then "cells_done". Only then does the
grader write line 2, {"checks", "checks_name", "skip_checks"}: while the learner's cells run, the hidden checks
are in no file, pipe or memory of the sandbox, and once they are in, the grader takes no cell output (what is
printed now goes nowhere). Nothing here is trusted: an event the learner's code writes can only claim a value
for a check, judged outside like any value its functions return.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback

from course.grade.plain import encode, error
from course.grade.verdicts import load_checks

OUTPUT_CAP = 1_000_000  # characters of stdout/stderr kept per cell (feedback says how much was cut)


class CellTimeout(BaseException):
    """Raised by the alarm in the learner's code; a BaseException so `except Exception` does not swallow it."""


class CappedIO(io.TextIOBase):
    def __init__(self, cap: int = OUTPUT_CAP):
        self.parts, self.kept, self.dropped, self.cap = [], 0, 0, cap

    def writable(self):
        return True

    def write(self, s):
        s = str(s)
        room = max(0, self.cap - self.kept)
        if room:
            self.parts.append(s[:room])
        self.kept += min(room, len(s))
        self.dropped += max(0, len(s) - room)
        return len(s)

    def text(self) -> str:
        more = f"\n... (output truncated: {self.dropped:,} more characters not shown)\n" if self.dropped else ""
        return "".join(self.parts) + more


def _alarm(seconds: float | None):
    def fire(signum, frame):
        raise CellTimeout(f"ran past the {seconds:g} s timeout")

    signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds or 0)


def is_test_cell(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return isinstance(meta, dict) and bool(meta.get("grade")) and not meta.get("solution")


def cell_source(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def run_cells(nb: dict, emit, timeout: float, stop_before: int | None) -> dict:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="NoColor")
    last_error = {}

    def show(*args, **kw):  # errors become an "error" output instead of text on stdout
        last_error["e"] = sys.exc_info()[1]

    shell.showtraceback = show
    shell.showsyntaxerror = lambda *a, **k: show()
    for i, cell in enumerate(nb["cells"]):
        if stop_before is not None and i >= stop_before:
            break
        source = cell_source(cell)
        if cell.get("cell_type") != "code" or is_test_cell(cell) or not source.strip():
            continue
        emit(ev="cell_start", i=i)
        out, err = CappedIO(), CappedIO()
        last_error.clear()
        started = time.perf_counter()
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        try:
            _alarm(timeout)
            result = shell.run_cell(source, store_history=False)
        except CellTimeout as exc:  # fired outside the learner's code, in IPython itself
            result, last_error["e"] = None, exc
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout, sys.stderr = saved
        outputs = [{"output_type": "stream", "name": name, "text": stream.text()}
                   for name, stream in (("stdout", out), ("stderr", err)) if stream.kept or stream.dropped]
        exc = last_error.get("e") or (result is not None and (result.error_in_exec or result.error_before_exec))
        if exc:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20_000:]
            outputs.append({"output_type": "error", "ename": type(exc).__name__, "evalue": str(exc)[:2000],
                            "traceback": tb.splitlines()[-40:]})
        emit(ev="cell_done", i=i, outputs=outputs, seconds=round(time.perf_counter() - started, 3),
             timeout=isinstance(exc, CellTimeout))
    return shell.user_ns


def run_checks(checks: dict, ns: dict, emit, timeout: float, skip: set) -> None:
    for gid, items in checks.items():
        for k, check in enumerate(items):
            if (gid, k) in skip:
                continue
            emit(ev="check_start", gid=gid, k=k)
            saved = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = CappedIO(0), CappedIO(0)  # what the learner's code prints now goes nowhere
            try:
                _alarm(check.timeout or timeout)
                value = encode(check.run(ns))
            except CellTimeout:
                value = {"t": "rejected", "why": "timeout"}
            except BaseException as exc:  # SystemExit, KeyboardInterrupt included: the learner's code raised
                value = error(exc)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                sys.stdout, sys.stderr = saved
            emit(ev="check", gid=gid, k=k, value=value)


def main() -> int:
    stdin = open(0, "rb", closefd=False)  # line 2 is not in the pipe before "cells_done": no read-ahead takes it

    def line() -> dict:
        with contextlib.suppress(OSError):
            os.set_blocking(0, True)  # a cell that probed every descriptor left it non-blocking
        data = stdin.readline()
        return json.loads(data) if data.strip() else {}

    job = line()
    fd, write, dumps, timeout = job["events_fd"], os.write, json.dumps, job["cell_timeout"]  # held before any
    # learner's code runs (it could replace os.write or json.dumps)

    def emit(**event) -> None:
        write(fd, dumps(event).encode() + b"\n")

    os.environ["NBGRADER_EXECUTION"] = "autograde"  # notebooks skip their slow demos while grading
    ns = run_cells(job["notebook"], emit, timeout, job.get("stop_before"))
    # the scratch folders with (almost) no space left, which the report names; not outside the sandbox (the
    # reference run), where the host's /tmp is not ours to judge
    free = {path: os.statvfs(path) for path in ("/sub", "/tmp")} if os.getcwd() == "/sub" else {}
    emit(ev="cells_done", full=[path for path, st in free.items() if st.f_bavail * st.f_frsize < 2 ** 20])
    job = line()  # the grader writes the checks only now: see the module's docstring
    if "checks" in job:
        checks = load_checks(f"{job.get('checks_name', 'checks')}.py", job["checks"])
        run_checks(checks, ns, emit, timeout, {tuple(x) for x in job.get("skip_checks", [])})
    emit(ev="done")
    sys.stdout.flush()
    os._exit(0)  # the learner's atexit hooks and threads do not get a say after the last event


if __name__ == "__main__":
    sys.exit(main())
