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


def _course_dirs() -> tuple[str, ...]:
    """The course package's folder, as written and resolved: its code is the course's, not the learner's."""
    import course

    place = os.path.dirname(os.path.abspath(course.__file__))
    return tuple(sorted({place, os.path.realpath(place)}))


def _system_prefixes() -> tuple[str, ...]:
    places = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return tuple(sorted({os.path.realpath(p) for p in places} | places) + list(_course_dirs())) + ("<frozen ",)


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

    trusted_names = ("<frozen ", "<checks ", *_course_dirs())

    def hook(event, args):
        if busy[0] or event not in AUDITED and event != "compile":
            return
        busy[0] = True
        try:
            if event == "compile":  # code named as the interpreter's, the checks' or the course's is trusted by
                # name (here and in guard_reference): compiling under such a name is hiding, whoever calls compile
                name = args[1] if len(args) > 1 else None
                if not isinstance(name, str) or not name.startswith(trusted_names) or \
                        sys._getframe(1).f_code.co_filename.startswith("<frozen importlib"):  # an import's own
                    return
                what = f"compiled code under the name {name[:60]!r}, which the grader trusts"
            elif event == "object.__setattr__" or event == "object.__delattr__":
                module = str(getattr(args[0], "__module__", "") or "")
                if module == "__main__" or not module:
                    return  # the learner's own classes and functions
                what = f"set {module}.{getattr(args[0], '__name__', '?')}.{args[1]}"
            elif event == "object.__getattr__":
                what = f"read .{args[1]}"
            else:
                what = event
            if what in seen or len(seen) >= 40 or event != "compile" and not learner(sys._getframe(1)):
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
    use however the module was reached (importlib, sys.modules, getattr chains):

    * every function of those modules is replaced, in every course module that names it, by one that notes a
      call whose caller (past the interpreter's and the libraries' own frames: functools, a C wrapper) is not
      the course's code: the learner's, or the checks' (the checks never call these themselves, so a call from
      them is the learner's answer handed in as it is: `sample = staticmethod(S.sample)`);
    * every method of those modules' classes (and their __init__) likewise, and also when it runs on an object
      that is not of its class (`update = LayerKVCache.update` in a class of the learner's own);
    * after the cells, the learner's names are searched (into functions' closures and defaults, classes,
      wrappers such as partial, staticmethod and lru_cache, and containers) for these functions and classes,
      and for any function whose code comes from their files (a second copy of the module, loaded anew).

    Calls the course makes itself (the model, generate) are not noted. Like every note, it is for the teacher's
    eyes and never changes a score; code written to hide from it is what the source scan's notes are for."""
    import importlib
    import inspect

    system = _system_prefixes()
    course_dirs = _course_dirs()
    seen: set = set()

    def handed_in(depth: int = 2) -> bool:
        """The first caller past the interpreter's and libraries' frames is not the course's own code."""
        frame = sys._getframe(depth)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(course_dirs):
                return False
            if not name.startswith(system):
                return True  # the learner's, or the checks' (<checks ...>)
            frame = frame.f_back
        return False

    def note(qual: str) -> None:
        what = f"used the course's own {qual}"
        if what not in seen and len(seen) < 20:
            seen.add(what)
            emit(ev="audit", what=what)

    known: dict = {}  # id -> name, of every guarded function and its guard (the search stops at them)

    def guarded(fn, qual, owner=None):
        def call(*args, **kwargs):
            if handed_in() or owner is not None and args and not isinstance(args[0], owner):
                note(qual)
            return fn(*args, **kwargs)

        known[id(fn)] = known[id(call)] = qual

        call.__name__, call.__qualname__, call.__doc__, call.__module__ = \
            fn.__name__, fn.__qualname__, fn.__doc__, fn.__module__
        try:
            call.__signature__ = inspect.signature(fn)  # not __wrapped__: that would hand out the original
        except (TypeError, ValueError):
            pass
        return call

    def guard_class(cls, qual):
        for attr, value in list(vars(cls).items()):
            if attr in ("__new__", "__init_subclass__", "__class_getitem__"):
                continue
            if inspect.isfunction(value):
                type.__setattr__(cls, attr, guarded(value, f"{qual}.{attr}" if attr != "__init__" else qual, cls))
            elif isinstance(value, (staticmethod, classmethod)) and inspect.isfunction(value.__func__):
                type.__setattr__(cls, attr, type(value)(guarded(value.__func__, f"{qual}.{attr}")))
        if "__init__" not in vars(cls):  # an inherited __init__ (a dataclass's is its own): noted on its own
            init = cls.__init__

            def __init__(self, *args, **kwargs):
                if handed_in():
                    note(qual)
                return init(self, *args, **kwargs)

            type.__setattr__(cls, "__init__", __init__)

    swapped, classes, files, modules = {}, [], {}, set()
    for name, allowed in reference.items():
        module = importlib.import_module(name)
        files[os.path.realpath(module.__file__)] = set(allowed)  # a copy's code names its file
        modules.add(id(module))
        for attr, value in list(vars(module).items()):
            if attr in allowed or getattr(value, "__module__", None) != module.__name__:
                continue
            qual = f"{name}.{attr}"
            if isinstance(value, type):
                guard_class(value, qual)
                classes.append((value, qual))
            elif inspect.isfunction(value):
                swapped[id(value)] = (value, guarded(value, qual), qual)
    for module in list(sys.modules.values()):  # course.engine.generate's name for sample is the guarded one too
        if str(getattr(module, "__name__", "")).startswith("course"):
            for attr, value in list(vars(module).items()):
                if id(value) in swapped and swapped[id(value)][0] is value:
                    setattr(module, attr, swapped[id(value)][1])

    def inside(value):
        """What a value holds that could be a function or class: wrappers' targets, closures, containers."""
        if isinstance(value, (staticmethod, classmethod)):
            yield value.__func__
        for attr in ("func", "__func__", "__wrapped__", "__self__", "fget", "fset"):  # partial, methods, lru_cache
            try:  # the learner's own __getattr__ may run: no more than their cells could already do
                held = getattr(value, attr, None)
            except Exception:
                held = None
            if held is not None and not isinstance(held, (str, int, float, bool)):
                yield held
        if inspect.isfunction(value) and value.__code__.co_filename.startswith(course_dirs) or \
                isinstance(value, type) and str(value.__module__).startswith("course"):
            return  # the course's own code, given to the learner: what it holds is not the learner's doing
        if inspect.isfunction(value):
            yield from (c.cell_contents for c in value.__closure__ or () if _cell_filled(c))
            yield from value.__defaults__ or ()
            yield from (value.__kwdefaults__ or {}).values()
        elif isinstance(value, type):
            if value.__module__ != "builtins" and not str(value.__module__).startswith(("torch", "numpy")):
                yield from list(vars(value).values())
        elif isinstance(value, dict):
            yield from list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            yield from list(value)[:1000]
        elif hasattr(value, "registry") and isinstance(getattr(value, "registry", None), dict):
            yield from list(value.registry.values())  # functools.singledispatch
        elif type(value).__module__ == "__main__" and isinstance(getattr(value, "__dict__", None), dict):
            yield from list(vars(value).values())  # an object of the learner's own class

    def check(value) -> bool:
        """Note what `value` is; True when the search should look inside it."""
        if id(value) in known:
            note(known[id(value)])
            return False
        if isinstance(value, type):
            for cls, qual in classes:
                if issubclass(value, cls):
                    note(qual)
                    return False
        elif inspect.isfunction(value) and os.path.realpath(value.__code__.co_filename) in files:
            if value.__qualname__.split(".")[0] not in files[os.path.realpath(value.__code__.co_filename)]:
                note(f"{value.__module__}.{value.__qualname__} (copied)")
            return False
        elif inspect.ismodule(value) and id(value) not in modules and \
                os.path.realpath(str(getattr(value, "__file__", ""))) in files:
            note(f"{value.__name__} (its module loaded again)")
            return False
        return True

    def namespace(ns: dict) -> None:
        todo, visited, budget = [(v, 0) for v in list(ns.values())], set(), 20_000
        while todo and budget > 0:
            value, depth = todo.pop()
            if id(value) in visited or isinstance(value, (str, bytes, int, float, bool, type(None))):
                continue
            visited.add(id(value))
            budget -= 1
            try:
                if check(value) and depth < 4 and not inspect.ismodule(value):
                    todo.extend((v, depth + 1) for v in inside(value))
            except Exception:  # an object of the learner's that fights being looked at: its calls are watched
                continue

    return namespace


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:  # an empty cell
        return False


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
