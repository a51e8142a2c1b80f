"""Runs inside the sandbox: execute one notebook, then the exercise's checks, and write plain-data events.

    python -m course.grade.harness JOB.json

JOB.json: {"notebook", "checks", "events", "cell_timeout", "stop_before", "skip_checks"}. Every code cell
but the test cells runs in an IPython shell in this process (test cells are the grader's business and never
run in the learner's interpreter), each under a timeout; each cell's outputs are captured (at most
OUTPUT_CAP characters) and written as an event. Then every check's `run(namespace)` is called and its
result written, converted by course.grade.plain. The grader outside reads only that file: nothing here
decides a score. A cell that kills the process (os._exit) or outlives its timeout is found from the last
"cell_start" event, and the grader reruns the harness with stop_before set to it.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
import traceback

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
        room = self.cap - self.kept
        if room > 0:
            self.parts.append(s[:room])
            self.kept += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self) -> str:
        out = "".join(self.parts)
        if self.dropped:
            out += f"\n... (output truncated: {self.dropped:,} more characters not shown)\n"
        return out


class Events:
    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, **event) -> None:
        os.write(self.fd, (json.dumps(event) + "\n").encode())


def _alarm(seconds: float | None):
    def fire(signum, frame):
        raise CellTimeout(f"ran past the {seconds:g} s timeout")

    signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds or 0)


def _is_test_cell(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def run_cells(nb: dict, events: Events, timeout: float, stop_before: int | None) -> dict:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="NoColor")
    last_error = {}

    def show(*args, **kw):  # errors become an "error" output instead of text on stdout
        etype, value, tb = sys.exc_info()
        last_error["e"] = value

    shell.showtraceback = show
    shell.showsyntaxerror = lambda *a, **k: show()
    for i, cell in enumerate(nb["cells"]):
        if stop_before is not None and i >= stop_before:
            break
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell.get("cell_type") != "code" or _is_test_cell(cell) or not source.strip():
            continue
        events.write(ev="cell_start", i=i)
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
        outputs = []
        if out.kept or out.dropped:
            outputs.append({"output_type": "stream", "name": "stdout", "text": out.text()})
        if err.kept or err.dropped:
            outputs.append({"output_type": "stream", "name": "stderr", "text": err.text()})
        exc = last_error.get("e") or (result is not None and (result.error_in_exec or result.error_before_exec))
        if exc:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20_000:]
            outputs.append({"output_type": "error", "ename": type(exc).__name__, "evalue": str(exc)[:2000],
                            "traceback": tb.splitlines()[-40:]})
        events.write(ev="cell_done", i=i, outputs=outputs, seconds=round(time.perf_counter() - started, 3),
                     timeout=isinstance(exc, CellTimeout))
    return shell.user_ns


def run_checks(checks: dict, ns: dict, events: Events, timeout: float, skip: set) -> None:
    from course.grade.plain import encode, error

    for gid, items in checks.items():
        for k, check in enumerate(items):
            if (gid, k) in skip:
                continue
            events.write(ev="check_start", gid=gid, k=k)
            saved = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = CappedIO(10_000), CappedIO(10_000)  # the learner's prints are not output
            try:
                _alarm(check.timeout or timeout)
                value = encode(check.run(ns))
            except CellTimeout as exc:
                value = {"t": "raised", "name": "CellTimeout", "builtin_bases": ["CellTimeout"], "message": str(exc)}
            except BaseException as exc:  # SystemExit, KeyboardInterrupt included: the learner's code raised
                value = error(exc)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                sys.stdout, sys.stderr = saved
            events.write(ev="check", gid=gid, k=k, value=value)


def main(job_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    os.environ["NBGRADER_EXECUTION"] = "autograde"  # notebooks skip their slow demos while grading
    events = Events(job["events"])
    with open(job["notebook"]) as fh:
        nb = json.load(fh)
    from course.grade.verdicts import load_checks

    checks = load_checks(job["checks"])
    ns = run_cells(nb, events, job["cell_timeout"], job.get("stop_before"))
    events.write(ev="cells_done")
    run_checks(checks, ns, events, job["cell_timeout"], {tuple(x) for x in job.get("skip_checks", [])})
    events.write(ev="done")
    sys.stdout.flush()
    os._exit(0)  # the learner's atexit hooks and threads do not get a say after the last event


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
