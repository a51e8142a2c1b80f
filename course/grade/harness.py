"""Runs inside the sandbox: execute one notebook, then the exercise's checks, and write plain-data events.

    python -c "import course.grade.harness as h; h.main()" < JOB (JSON on stdin; not -m: see sandbox._attempt)

JOB: {"notebook": the notebook itself, "checks": the checks module's source, "checks_name", "events_fd", "key"
(the events' MAC key), "cell_timeout", "stop_before", "skip_checks"}. The job is read whole from stdin, a pipe, and the checks are
compiled before any learner's cell runs; stdin is then /dev/null, so no file and no descriptor in the sandbox
still holds the hidden checks. What remains is in-process introspection: the learner's code runs in this
interpreter and can reach the compiled checks through gc or frames (the hidden inputs are constants of
their code objects), and can write to the events pipe, but without the key it cannot sign an event: the
grader drops unsigned and replayed lines and notes that they were written (course.grade.sandbox._parse), then
drops events the harness could not have written at that point (_accept), and judges values outside.
nbgrader's hidden tests share the first property (they run in the learner's kernel). Every code cell
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
from typing import Callable

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
    """The harness's side of the events pipe. Each line is `MAC JSON`: the JSON carries a number that rises by
    one per event, and the MAC (HMAC-SHA256 under a key the grader passes in the job, then dropped from it)
    covers it, so a line the learner's code writes to the pipe itself, or replays, is not taken for the
    harness's (course.grade.sandbox._parse). os.write is bound here, before any learner's code can replace it."""

    def __init__(self, fd: int, key: str = ""):
        import hashlib
        import hmac

        # everything write() uses is held here, read before any learner's code: patching json, os or this
        # module's globals later changes nothing it writes (the harness passes on the bound method, `emit`)
        self.fd, self.n, self._os_write, self._dumps = fd, 0, os.write, json.dumps
        self._mac = hmac.new(bytes.fromhex(key), digestmod=hashlib.sha256) if key else None

    def write(self, **event) -> None:
        event["n"], self.n = self.n, self.n + 1
        line = self._dumps(event).encode()
        if self._mac is not None:
            mac = self._mac.copy()
            mac.update(line)
            line = mac.hexdigest().encode() + b" " + line
        self._os_write(self.fd, line + b"\n")


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


def full_scratch() -> list[str]:
    """The sandbox's scratch folders with (almost) no space left: the report names them."""
    if os.getcwd() != "/sub":  # not in the sandbox (the reference run): the host's /tmp is not ours to judge
        return []
    full = []
    for path in ("/sub", "/tmp"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize < 2 ** 20:
            full.append(path)
    return full


def run_cells(nb: dict, emit, timeout: float, stop_before: int | None) -> dict:
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
        emit(ev="cell_done", i=i, outputs=outputs, seconds=round(time.perf_counter() - started, 3),
                     timeout=isinstance(exc, CellTimeout))
    return shell.user_ns


def run_checks(checks: dict, ns: dict, emit, timeout: float, skip: set, encode, error, audit) -> None:
    """encode, error: course.grade.plain's, taken before any learner's code ran; audit: watch()'s check for
    replaced functions, run after each check's call and before its value is encoded (a replacement that undoes
    itself inside encode is seen in place)."""
    for gid, items in checks.items():
        for k, check in enumerate(items):
            if (gid, k) in skip:
                continue
            emit(ev="check_start", gid=gid, k=k)
            saved = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = CappedIO(10_000), CappedIO(10_000)  # the learner's prints are not output
            try:
                _alarm(check.timeout or timeout)
                raw = check.run(ns)
                audit()
                value = encode(raw)
            except CellTimeout as exc:
                value = {"t": "raised", "name": "CellTimeout", "builtin_bases": ["CellTimeout"], "message": str(exc)}
            except BaseException as exc:  # SystemExit, KeyboardInterrupt included: the learner's code raised
                value = error(exc)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                sys.stdout, sys.stderr = saved
            emit(ev="check", gid=gid, k=k, value=value)


# Run-time events that no exercise needs and that tampering with the checks does (they run in this process):
# reaching frames and code objects, walking the heap, raw memory, tracing, signals to processes, patching a type.
AUDITED = frozenset({"sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
                     "gc.get_referents", "object.__getattr__", "object.__setattr__", "object.__delattr__",
                     "ctypes.dlopen", "ctypes.dlsym", "ctypes.string_at", "ctypes.addressof", "ctypes.cdata",
                     "ctypes.call_function", "sys.addaudithook", "sys.settrace", "sys.setprofile", "os.fork",
                     "os.forkpty", "os.kill", "os.killpg", "code.__new__", "function.__new__"})
WATCHED_MODULES = ("builtins", "math", "random", "json", "torch", "torch.nn.functional", "torch.linalg", "numpy",
                   "course.grade.plain", "course.grade.verdicts", "course.grade.harness")


def _system_prefixes() -> tuple[str, ...]:
    import course

    places = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.abspath(course.__file__))}
    return tuple(sorted({os.path.realpath(p) for p in places} | places)) + ("<frozen ",)


def watch(emit):
    """Report, once each, what the learner's own code does of AUDITED, through a hook Python cannot remove
    (sys.addaudithook); the hook writes at once, so a later tamper cannot take the report back. Code is the
    learner's when it is not from the interpreter, the virtual environment or the course package (a cell, or a
    file the cells wrote); a frame taken through inspect or traceback counts for the code that asked. Returns
    a function that reports library functions replaced since this call (torch.manual_seed = …)."""
    for name in ("torch", "torch.nn.functional", "numpy"):  # loaded before the learner's code, to be watched
        try:
            __import__(name)
        except ImportError:
            pass
    system = _system_prefixes()
    seen: set = set()
    busy = [False]

    def learner(frame) -> bool:
        """The code that made the call is the learner's (a frame inspect, traceback or logging takes for the
        learner counts as theirs, so a debugging print_stack is not noted; the source scan names currentframe)."""
        return frame is not None and not frame.f_code.co_filename.startswith(system)

    def hook(event, args):
        if event not in AUDITED or busy[0]:
            return
        busy[0] = True
        try:
            if event == "object.__setattr__" or event == "object.__delattr__":
                module = str(getattr(args[0], "__module__", "") or "")
                if module == "__main__" or not module:
                    return  # the learner's own classes and functions
                what = f"set {module}.{getattr(args[0], '__name__', '?')}.{args[1]}"
            elif event == "object.__getattr__":
                what = f"read .{args[1]}"
            else:
                what = event
            if what in seen or len(seen) >= 40 or not learner(sys._getframe(1)):
                return
            seen.add(what)
            emit(ev="audit", what=what)
        except Exception:
            pass
        finally:
            busy[0] = False

    def snapshot() -> dict:
        out = {}
        for name in WATCHED_MODULES:
            module = sys.modules.get(name)
            for attr, value in (list(vars(module).items()) if module is not None else ()):
                if callable(value):
                    out[f"{name}.{attr}"] = (id(value), str(getattr(value, "__module__", "") or ""))
                if name.startswith("course.") and isinstance(value, type) and value.__module__ == name:
                    for method, fn in list(vars(value).items()):  # Events.write = …: no audit event for a class
                        if callable(fn):
                            out[f"{name}.{attr}.{method}"] = (id(fn), str(getattr(fn, "__module__", "") or ""))
        return out

    before = snapshot()
    sys.addaudithook(hook)

    def replaced() -> None:
        now = snapshot()
        # a library replacing its own function is not the learner's doing (importing torch._dynamo, which
        # torch.compile does, wraps torch.manual_seed): only a replacement from elsewhere is noted
        for key in sorted(k for k in before if k in now and now[k][0] != before[k][0]
                          and not now[k][1].startswith(("torch", "numpy")))[:10]:
            if f"replaced {key}" not in seen:
                seen.add(f"replaced {key}")
                emit(ev="audit", what=f"replaced {key}")

    return replaced


def guard_reference(reference: dict, emit) -> Callable[[dict], None]:
    """Note, as it happens, the learner's code using the course's own implementation of the exercise.

    `reference`: the checks module's REFERENCE, {module: names it may use}. The course package has to be
    importable here (the checks run its model), and it holds working versions of most exercises (its sampler,
    its paged cache, ...). A source scan (course.grade.integrity) notes the imports it can read; this sees the
    use however the module was reached (importlib, sys.modules, getattr chains): every function of those modules
    is replaced, in every course module that names it, by one that notes a call made from the learner's code,
    and every class's __init__ likewise (a learner's subclass calls it too). Calls the course makes itself (the
    model, generate) are not noted. Returns a check of the namespace the cells left, for a reference function or
    class taken over as the learner's own (`sample = S.sample`, which the checks then call directly). Like every
    note, it is for the teacher's eyes and never changes a score."""
    import importlib
    import inspect

    system = _system_prefixes()
    seen: set = set()

    def learner_called(depth: int = 2) -> bool:
        frame = sys._getframe(depth)
        name = frame.f_code.co_filename if frame is not None else ""
        return frame is not None and not name.startswith(system) and not name.startswith("<checks ")

    def note(qual: str) -> None:
        what = f"used the course's own {qual}"
        if what not in seen and len(seen) < 20:
            seen.add(what)
            emit(ev="audit", what=what)

    def guarded(fn, qual):
        def call(*args, **kwargs):
            if learner_called():
                note(qual)
            return fn(*args, **kwargs)

        call.__name__, call.__qualname__, call.__doc__, call.__module__ = \
            fn.__name__, fn.__qualname__, fn.__doc__, fn.__module__
        try:
            call.__signature__ = inspect.signature(fn)  # not __wrapped__: that would hand out the original
        except (TypeError, ValueError):
            pass
        return call

    def guard_init(cls, qual):
        init = cls.__init__

        def __init__(self, *args, **kwargs):
            if learner_called():
                note(qual)
            return init(self, *args, **kwargs)

        type.__setattr__(cls, "__init__", __init__)

    swapped, classes = {}, []
    for name, allowed in reference.items():
        module = importlib.import_module(name)
        for attr, value in list(vars(module).items()):
            if attr in allowed or getattr(value, "__module__", None) != module.__name__:
                continue
            qual = f"{name}.{attr}"
            if isinstance(value, type):
                guard_init(value, qual)
                classes.append((value, qual))
            elif inspect.isfunction(value):
                swapped[id(value)] = (value, guarded(value, qual), qual)
    for module in list(sys.modules.values()):  # course.engine.generate's name for sample is the guarded one too
        if str(getattr(module, "__name__", "")).startswith("course"):
            for attr, value in list(vars(module).items()):
                if id(value) in swapped and swapped[id(value)][0] is value:
                    setattr(module, attr, swapped[id(value)][1])
    taken = {id(fn): qual for fn, call, qual in swapped.values()} | \
        {id(call): qual for fn, call, qual in swapped.values()}

    def namespace(ns: dict) -> None:
        for value in list(ns.values()):
            value = getattr(value, "func", value)  # functools.partial(S.sample, ...)
            if id(value) in taken:
                note(taken[id(value)])
            elif isinstance(value, type):
                for cls, qual in classes:
                    if issubclass(value, cls):
                        note(qual)

    return namespace


def main() -> int:
    job = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)  # the pipe is drained; nothing can be read from fd 0 again
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ["NBGRADER_EXECUTION"] = "autograde"  # notebooks skip their slow demos while grading
    emit = Events(job.pop("events_fd"), job.pop("key", "")).write  # bound now: see Events
    nb = job.pop("notebook")
    from course.grade.plain import encode, error
    from course.grade.verdicts import load_checks_source

    module: dict = {}
    checks = load_checks_source(job.pop("checks"), job.get("checks_name", "checks"), module)
    checking, scratch, timeout = run_checks, full_scratch, job["cell_timeout"]  # this module's globals can be
    skip = {tuple(x) for x in job.get("skip_checks", [])}  # reached from a cell (a function's __globals__): taken now
    taken_over = guard_reference(module.get("REFERENCE") or {}, emit)
    replaced = watch(emit)
    ns = run_cells(nb, emit, timeout, job.get("stop_before"))
    replaced()
    taken_over(ns)
    emit(ev="cells_done", full=scratch())
    checking(checks, ns, emit, timeout, skip, encode, error, replaced)
    replaced()
    emit(ev="done")
    sys.stdout.flush()
    os._exit(0)  # the learner's atexit hooks and threads do not get a say after the last event


if __name__ == "__main__":
    sys.exit(main())
