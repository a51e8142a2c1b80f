"""The sealed runner: one submission, one bubblewrap sandbox, only plain data comes back.

autograde/THREAT_MODEL.md says what this prevents by construction and which test shows each: bwrap with
`--unshare-all --cap-drop ALL --die-with-parent` over read-only binds of the system, the interpreter, the venv and
a copy of the course package without the exercise's reference (`course_tree`); the checks written in only after
"cells_done", and no cell output taken after it (`_accept`); rlimits, cgroups, wall-clock and silence limits.
`run_sealed` reruns past a cell or check that killed the kernel; `sandbox_problem` says why bwrap cannot start.
"""
from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import course
from course.grade.files import GradingError
from course.grade.harness import cell_source, is_test_cell
from course.grade.verdicts import load_checks, load_module
from course.paths import EXERCISES

MAX_EVENTS_BYTES = 64 * 2 ** 20
SHM_BYTES = 64 * 2 ** 20  # /dev/shm inside the sandbox
KILLED_FROM_OUTSIDE = "the grading process was killed from outside (not by the submission's own code)"
PACKAGE = Path(course.__file__).resolve().parent


@dataclass
class Limits:
    cell_timeout: float = 30.0  # seconds per cell (and per check)
    memory_mb: int = 4096  # address space of the sandboxed process
    wall_s: float = 300.0  # one attempt, start to end
    file_mb: int = 256  # the largest file it may write
    extra_processes: int = 256  # processes/threads it may add to the user's count
    stall_s: float = 0.0  # silence after which a run is killed; 0 = twice the longest timeout + 30 s

    def tmpfs_bytes(self) -> int:
        """Size of each of the two tmpfs (/sub, /tmp): together half of memory_mb (1 GiB each without a cap)."""
        total = max(64, self.memory_mb // 2 if self.memory_mb > 0 else 2048)
        return max(16, total // 2) * 2 ** 20


@dataclass
class Outcome:
    events: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what the submission did (timeouts, dead kernels)
    infrastructure: str = ""  # set when the run failed for a reason that is not the submission's
    seconds: float = 0.0
    attempts: int = 0


# ----------------------------------------------------------------------------- the filesystem inside

def _binds() -> list[tuple[str, str]]:
    """(kind, path): the read-only system, interpreter and venv (the course is bound apart: bwrap_command)."""
    entries = [("ro", "/usr"), ("ro", "/etc")]
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(link) or os.path.isdir(link):
            entries.append(("symlink" if os.path.islink(link) else "ro", link))
    for path in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix,
                        os.path.dirname(os.path.realpath(sys.executable))}, key=len):
        if not any(path == p or path.startswith(p.rstrip("/") + "/") for kind, p in entries if kind == "ro"):
            entries.append(("ro", path))
    return entries


@lru_cache(maxsize=1)
def _private_system_files() -> tuple[list[str], list[str]]:
    """(files, folders) under /etc that not every user may read (/etc/shadow, private keys). A root grader's
    sandbox runs as root, whose rights would read them: an empty file or folder lies over each."""
    def mode(path: str) -> int:
        try:
            return os.lstat(path).st_mode
        except OSError:
            return 0o777

    files, folders = [], []
    for top, dirs, names in os.walk("/etc", followlinks=False):
        for name in list(dirs):
            path = os.path.join(top, name)
            if not os.path.islink(path) and mode(path) & 0o005 != 0o005:
                folders.append(path)
                dirs.remove(name)  # nothing under it is seen
        files += [os.path.join(top, n) for n in names if os.path.isfile(os.path.join(top, n))
                  and not os.path.islink(os.path.join(top, n)) and not mode(os.path.join(top, n)) & 0o004]
    return files, folders


def _module_file(name: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _imports(source: str, package: str = "") -> tuple[set[str], set[str]]:
    """(course modules named by any import, those imported when the code is first run: not inside a function)."""
    every, at_import = set(), set()

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package the file is in
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + [base]).strip(".")
                names = [base] + [f"{base}.{a.name}" for a in child.names]
            for parts in (name.split(".") for name in names):
                for i in range(1, len(parts) + 1):  # a package's __init__ runs before its modules
                    if parts[0] == "course" and _module_file(".".join(parts[:i])):
                        every.add(".".join(parts[:i]))
                        if top:
                            at_import.add(".".join(parts[:i]))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    try:
        tree = ast.parse(source)
    except SystemError:  # Python 3.11's AST building can trip over another thread's (python/cpython#106905)
        tree = ast.parse(source)
    visit(tree, True)
    return every, at_import


def course_tree(checks: Path) -> Path:
    """The course package the sandbox gets for the exercise whose checks are `checks`: a copy holding the modules
    the harness, the checks and the released notebook import (at once or inside a function, followed through
    their own imports), minus the checks module's ABSENT. The exercise's reference is not in the sandbox at all,
    so no import, file read or bytecode trick reaches it. Raises GradingError when a module that stays imports
    an absent one when it is loaded."""
    checks = Path(checks)
    absent = tuple(sorted(getattr(load_module(checks), "ABSENT", ())))
    code = [checks.read_text()]
    for notebook in sorted((EXERCISES / checks.stem).glob("*.ipynb")):
        code += ["\n".join(ln for ln in "".join(c.get("source", "")).splitlines()  # IPython's % and ! lines out
                           if not ln.lstrip().startswith(("%", "!")))
                 for c in json.loads(notebook.read_text()).get("cells", []) if c.get("cell_type") == "code"]
    return _tree(frozenset(_imports("\n".join(code))[0] | {"course.grade.harness"}), absent)


@lru_cache(maxsize=None)
def _tree(roots: frozenset, absent: tuple) -> Path:
    keep, todo = set(), sorted(roots)
    while todo:
        name = todo.pop()
        if name in keep or name in absent:
            continue
        keep.add(name)
        package = name if _module_file(name).name == "__init__.py" else name.rpartition(".")[0]
        every, at_import = _imports(_module_file(name).read_text(), package)
        if at_import & set(absent):
            raise GradingError(f"{name} imports {sorted(at_import & set(absent))[0]} when it is loaded, but that "
                               "module is the exercise's reference, which the sandbox leaves out (ABSENT in the "
                               "checks): import it inside the function that needs it")
        todo += sorted(every - keep)
    folder = Path(tempfile.mkdtemp(prefix="kvcourse-course-"))  # 0700: only this user reads it
    atexit.register(shutil.rmtree, folder, True)
    for name in keep:
        source = _module_file(name)
        target = folder / source.relative_to(PACKAGE.parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        for extra in source.parent.iterdir():  # data beside the code (a C++ source), never caches or the bank
            if extra.is_file() and extra.suffix not in (".py", ".pyc", ".yaml"):
                shutil.copyfile(extra, target.parent / extra.name)
    return folder / "course"


def bwrap_command(workdir: Path | None, argv: list[str], env: dict, tmpfs_bytes: int | None = None,
                  tree: Path | None = None) -> list[str]:
    """bwrap's command line. workdir None: /sub is a fresh tmpfs (the grader's runs); else that folder. tree: the
    course package inside (course_tree; default: the harness's modules). tmpfs_bytes caps /tmp and a tmpfs /sub
    each (None: the kernel's default, half the RAM: for the probes and tests only)."""
    size = ["--size", str(int(tmpfs_bytes))] if tmpfs_bytes else []
    # /tmp first: a later mount lies over an earlier one, and the venv or the course may live under /tmp.
    # --cap-drop ALL: as root, bwrap otherwise keeps CAP_SYS_ADMIN inside (a submission remounted the package)
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL",
           "--dev", "/dev", "--proc", "/proc", *size, "--tmpfs", "/tmp"]
    if tmpfs_bytes:  # bwrap's /dev has a /dev/shm of half the RAM
        cmd += ["--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"]
    for kind, path in _binds():
        cmd += ["--symlink", os.readlink(path), path] if kind == "symlink" else ["--ro-bind", path, path]
    # the exercise's copy lies over the package's own place (also where the venv holds an installed copy)
    cmd += ["--ro-bind", str(tree or _tree(frozenset({"course.grade.harness"}), ())), str(PACKAGE)]
    files, folders = _private_system_files()
    for path in files:
        cmd += ["--ro-bind", "/dev/null", path]
    for path in folders:
        cmd += ["--tmpfs", path]
    cmd += [*size, "--tmpfs", "/sub"] if workdir is None else ["--bind", str(workdir), "/sub"]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    return cmd + ["--chdir", "/sub", "--", *argv]


@lru_cache(maxsize=1)
def sandbox_problem() -> str:
    """"" when bwrap can start a sealed process here; else what is missing and how to fix it."""
    if shutil.which("bwrap") is None:
        return ("the grading sandbox needs bubblewrap (`bwrap`), which is not installed: as root run "
                "`sh scripts/ensure_bwrap.sh` (Debian/Ubuntu: apt-get install bubblewrap)")
    probe = tempfile.mkdtemp(prefix="kvcourse-bwrap-probe-")
    # the harness must import from the package this process uses (a second checkout sharing a virtual
    # environment imports another copy inside, which the sandbox does not show): 3 = not there, 4 = elsewhere
    check = ("import os, sys\nif not os.path.isfile(sys.argv[1]): sys.exit(3)\n"
             "try:\n    import course.grade.harness as h\nexcept Exception: sys.exit(4)\n"
             "sys.exit(0 if os.path.dirname(os.path.dirname(os.path.abspath(h.__file__))) == "
             "os.path.dirname(sys.argv[1]) else 4)")
    try:  # with a sized /tmp, as every grading run has: an old bwrap without --size stops here, named
        out = subprocess.run(bwrap_command(probe, [sys.executable, "-c", check, f"{PACKAGE}/__init__.py"],
                                           _sandbox_env(1), tmpfs_bytes=64 * 2 ** 20),
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not start a sandbox: {exc}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    if out.returncode == 4:
        return (f"inside the sandbox Python cannot import this copy of the course ({PACKAGE}): the virtual "
                "environment was installed from another checkout. Run the grader from that checkout, or run "
                "`make setup` (pip install -e .) in this one")
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no message"])[-1]
        hint = (" -- this host does not let unprivileged users create user namespaces: ask an administrator to "
                "allow them (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04 an AppArmor profile "
                "for bwrap), or to install bwrap setuid root (chmod u+s /usr/bin/bwrap)"
                if any(w in why.lower() for w in ("namespace", "permission", "operation not permitted")) else "")
        return f"bwrap could not start a sandbox ({why}){hint}"
    return ""


# ----------------------------------------------------------------------------- caps

def _sandbox_env(threads: int) -> dict:
    return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
            "LANG": "C.UTF-8", "MPLBACKEND": "Agg", "MPLCONFIGDIR": "/tmp/matplotlib",
            "IPYTHONDIR": "/tmp/ipython", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "KVCOURSE_SEALED": "1",
            "NBGRADER_EXECUTION": "autograde"}


def _user_tasks() -> int:
    """Processes and threads of this user now (RLIMIT_NPROC counts them all)."""
    uid, n = os.getuid(), 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                n += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            pass
    return n


def _cgroup(places: list[tuple[Path, str]], value: int, kind: str) -> Path | None:
    """A fresh cgroup under the first of `places` (folder, knob) that takes one, its knob set to value."""
    for base, knob in places:
        if not (base / "cgroup.procs").exists():
            continue
        path = base / f"kvcourse-{kind}{os.getpid()}-{time.monotonic_ns()}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / knob).write_text(str(int(value)))
            return path
        except OSError:
            path.rmdir()
    return None


def _pids_cgroup(limit: int) -> Path | None:
    """A cgroup whose pids.max caps processes + threads (root only: RLIMIT_NPROC holds for everyone else)."""
    places = [(Path("/sys/fs/cgroup/pids"), "pids.max"), (Path("/sys/fs/cgroup"), "pids.max")]
    return None if os.getuid() else _cgroup(places, limit, "")


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A cgroup under this process's own that caps the RAM of everything inside (root only): RLIMIT_AS counts one
    process's mappings, not memfd files, /dev/shm or tmpfs pages (2.5 GiB of memfds went under a 2 GiB cap)."""
    if os.getuid() != 0:
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:
        num, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):  # cgroup v1: the memory hierarchy
            places.append((Path("/sys/fs/cgroup/memory") / rel.lstrip("/"), "memory.limit_in_bytes"))
        elif num == "0" and controllers == "":  # cgroup v2: at the top, where "memory" is delegated
            for top in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                try:
                    if "memory" in (top / "cgroup.subtree_control").read_text().split():
                        places.append((top, "memory.max"))
                except OSError:
                    pass
    return _cgroup(places, limit_bytes, "mem-")


def _oom_kills(groups) -> int:
    """How many processes the kernel killed in these cgroups for going over memory (0 where it cannot tell)."""
    n = 0
    for group in filter(None, groups):
        for name in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
            try:
                text = (group / name).read_text()
            except OSError:
                continue
            n += sum(int(v) for k, _, v in (ln.partition(" ") for ln in text.splitlines())
                     if k == "oom_kill" and v.strip().isdigit())
    return n


def _remove_cgroups(groups: list) -> None:
    for group in groups:
        for _ in range(50):
            if group is None or not group.exists():
                break
            try:
                group.rmdir()
                break
            except OSError:  # processes still leaving
                time.sleep(0.1)


def _limiter(limits: Limits, nproc: int, groups: list = ()):  # groups: cgroups to join (None skipped)
    libc = ctypes.CDLL(None, use_errno=True)
    memory, cpu, fsize = limits.memory_mb * 2 ** 20, int(limits.wall_s * 2) + 10, limits.file_mb * 2 ** 20

    def preexec():  # runs in the child between fork and exec: the limits hold for everything inside
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the sandbox dies with the grader, even on kill -9
        for group in filter(None, groups):
            (group / "cgroup.procs").write_text(str(os.getpid()))
        if limits.memory_mb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.setsid()

    return preexec


# ----------------------------------------------------------------------------- the events

def _parse(data: bytes) -> list[dict]:
    """The events: one JSON object with a str "ev" per line (anything else is skipped)."""
    events = []
    for line in data.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("ev"), str):
            events.append(event)
    return events


@dataclass
class _Run:
    """What one attempt recorded, keeping only events the harness could have written at that point."""
    cells: dict = field(default_factory=dict)  # i -> cell_done event
    checks: dict = field(default_factory=dict)  # (gid, k) -> encoded value
    last: tuple | None = None  # the last step started: ("cell", i) | ("cells_done",) | ("check", gid, k)
    full: list = field(default_factory=list)  # scratch folders the harness found full after the cells


def _accept(events: list[dict], runnable: set[int], declared: dict[str, int], stop_before: int | None) -> _Run:
    """One pass over an attempt's events (linear in their number).

    The learner's code shares the harness's process and can write any event to the pipe, so an event counts only
    where the harness could have written it. Up to the first "cells_done" (where the grader wrote the checks in):
    a cell_start names the cell after the last one started (every cell runs, in order); a cell_done follows its
    own start (the last one wins: the harness writes its own after the learner's code returned). After it: no
    cell event at all, whatever it says; a check follows its own check_start and names a declared (gid, k)."""
    run, current, started = _Run(), None, None
    order = sorted(i for i in runnable if stop_before is None or i < stop_before)
    following = dict(zip([None, *order], order))
    for e in events:
        ev = e["ev"]
        if run.last and run.last[0] in ("cells_done", "check"):
            if ev == "check_start" and isinstance(e.get("gid"), str) and type(e.get("k")) is int \
                    and 0 <= e["k"] < declared.get(e["gid"], 0):
                current = run.last = ("check", e["gid"], e["k"])
            elif ev == "check" and current == ("check", e.get("gid"), e.get("k")):
                run.checks[e["gid"], e["k"]] = e.get("value")
        elif ev == "cells_done":
            current = run.last = ("cells_done",)
            run.full = [str(x)[:20] for x in e.get("full", [])][:2] if isinstance(e.get("full"), list) else []
        elif ev == "cell_start" and type(e.get("i")) is int and e["i"] == following.get(started, -1):
            current, run.last, started = ("cell", e["i"]), ("cell", e["i"]), e["i"]
        elif ev == "cell_done" and current == ("cell", e.get("i")):
            run.cells[e["i"]] = e
    return run


# ----------------------------------------------------------------------------- one attempt, one submission

def _attempt(workdir: Path, job: dict, limits: Limits, sealed: bool, threads: int, on_start=None,
             stall_s: float | None = None):
    """One harness run: (events, how it ended: done | killed | memory | wall | stalled | cpu | died:<code>).

    stdin gets two lines: the notebook at once, the checks once the pump has read the harness's "cells_done" (the
    same first "cells_done" _accept goes by). The events come back on a second pipe, of which the grader keeps
    MAX_EVENTS_BYTES. A run silent for stall_s is killed: the harness writes at every cell's and check's start
    and end, each under a timeout, so that much silence is code that swallowed the timeout's interrupt."""
    read_fd, write_fd = os.pipe()
    payloads = [json.dumps({k: job[k] for k in ("notebook", "cell_timeout", "stop_before")} | {"events_fd": write_fd}),
                json.dumps({k: job[k] for k in ("checks", "checks_name", "skip_checks")})]
    argv = [sys.executable, "-c", "import course.grade.harness as h; h.main()"]
    env = _sandbox_env(threads)
    if sealed:
        cmd, cwd, run_env = bwrap_command(None, argv, env, limits.tmpfs_bytes(), job["tree"]), None, {
            "PATH": os.environ.get("PATH", "/usr/bin")}
    else:  # the solution (trusted) or --unsandboxed: a fresh scratch folder, the same course tree
        scratch = workdir / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        cmd, cwd = argv, str(scratch)
        run_env = dict(env, HOME=str(scratch), TMPDIR=str(scratch), MPLCONFIGDIR=str(scratch / ".mpl"),
                       IPYTHONDIR=str(scratch / ".ipython"), PYTHONPATH=str(job["tree"].parent))
    cgroup = [_pids_cgroup(limits.extra_processes)]
    if limits.memory_mb > 0 and sealed:  # RAM of the whole sandbox: its memory cap plus its tmpfs
        cgroup.append(_memory_cgroup(limits.memory_mb * 2 ** 20 + 2 * limits.tmpfs_bytes() + SHM_BYTES))
    try:
        with open(workdir / "harness.log", "ab") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, env=run_env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=log, pass_fds=(write_fd,),
                                    preexec_fn=_limiter(limits, _user_tasks() + limits.extra_processes, cgroup))
    except BaseException:
        os.close(read_fd)
        _remove_cgroups(cgroup)
        raise
    finally:
        os.close(write_fd)
    chunks, heard, cells_done = [], [time.monotonic()], threading.Event()

    def pump():
        kept, partial = 0, b""
        while True:
            try:
                chunk = os.read(read_fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            heard[0] = time.monotonic()
            if kept < MAX_EVENTS_BYTES:  # past the cap: read and drop, so the writer never blocks
                chunks.append(chunk[:MAX_EVENTS_BYTES - kept])
                kept += len(chunks[-1])
                if not cells_done.is_set():
                    *lines, partial = (partial + chunks[-1]).split(b"\n")
                    if any(e["ev"] == "cells_done" for e in _parse(b"\n".join(lines))):
                        cells_done.set()
        cells_done.set()  # it ended: the feeder stops waiting

    def feed():
        with contextlib.suppress(OSError):  # it died before reading its job: the exit status says how
            proc.stdin.write(payloads[0].encode() + b"\n")
            proc.stdin.flush()
            cells_done.wait()
            if proc.poll() is None:
                proc.stdin.write(payloads[1].encode() + b"\n")
            proc.stdin.close()

    threads_ = [threading.Thread(target=f, daemon=True) for f in (pump, feed)]
    for t in threads_:
        t.start()
    if on_start:
        on_start(proc)
    ended, deadline = None, time.monotonic() + limits.wall_s
    try:
        while ended is None:
            try:
                proc.wait(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                ended = "wall" if time.monotonic() >= deadline else (
                    "stalled" if stall_s and time.monotonic() - heard[0] > stall_s else None)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        oom = _oom_kills(cgroup)
        _remove_cgroups(cgroup)
    threads_[0].join(timeout=30)  # every writer is gone with the sandbox (bwrap's PID namespace)
    threads_[1].join(timeout=5)
    if not threads_[0].is_alive():
        os.close(read_fd)
    events, code = _parse(b"".join(chunks[:])), proc.returncode
    if code == 0 and any(e["ev"] == "done" for e in events):
        ended = "done"
    elif ended is None:
        ended = ("memory" if oom else "killed") if code in (-signal.SIGKILL, 128 + signal.SIGKILL) else (
            "cpu" if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) else f"died:{code}")
    return events, ended


def _log_tail(path: Path, n: int = 400) -> str:
    """The last lines of the harness's stderr (the learner's code may have written hundreds of MiB there)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 64 * 1024))
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return " | ".join(lines[-3:])[-n:] if lines else "no output"


def run_sealed(notebook: Path, checks: Path, workdir: Path, limits: Limits, sealed: bool = True,
               threads: int = 1, on_start=None, max_attempts: int = 4) -> Outcome:
    """Grade-run one notebook (already repaired) in a fresh sandbox; return the events that count.

    A run that dies in a cell is rerun up to that cell (the cell and those after it count as not run); one that
    dies in a check is rerun without that check. A first SIGKILL at a step may come from outside (the host's
    out-of-memory killer) and reruns the same job; a second at the same step is the submission's doing. When the
    attempts are used up, what was recorded is graded (checks that never ran fail); only a run that never reached
    its first cell (the sandbox itself failed) is left ungraded, as infrastructure."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(notebook) as fh:
        nb = json.load(fh)
    loaded = load_checks(checks)
    declared = {gid: len(items) for gid, items in loaded.items()}
    longest = max([limits.cell_timeout] + [c.timeout or 0 for items in loaded.values() for c in items])
    stall_s = limits.stall_s or 2 * longest + 30  # silence this long: the learner's code swallowed an interrupt
    # the cells the harness runs (code, not a test cell, not empty): the only `i` an event may name
    runnable = {i for i, cell in enumerate(nb.get("cells", [])) if isinstance(cell, dict)
                and cell.get("cell_type") == "code" and not is_test_cell(cell) and cell_source(cell).strip()}
    base = {"notebook": nb, "checks": Path(checks).read_text(), "checks_name": Path(checks).stem,
            "cell_timeout": limits.cell_timeout, "tree": course_tree(checks)}
    outcome, started = Outcome(), time.perf_counter()
    stop_before, killed_at, finished = None, None, False
    cells, values, dead_checks, full = {}, {}, {}, set()
    while outcome.attempts < max_attempts:
        spent = time.perf_counter() - started
        if outcome.attempts and spent + min(limits.wall_s, 60) > 2 * limits.wall_s:  # one submission's whole budget
            outcome.problems.append(f"no further run: its runs took {spent:.0f} s of the {2 * limits.wall_s:g} s one "
                                    "submission may take (twice the wall-clock limit)")
            break
        outcome.attempts += 1
        job = dict(base, stop_before=stop_before, skip_checks=[list(k) for k in sorted(dead_checks)])
        events, ended = _attempt(workdir, job, limits, sealed, threads, on_start, stall_s)
        run = _accept(events, runnable, declared, stop_before)
        for i, e in run.cells.items():
            cells.setdefault(i, e)
        values.update(run.checks)  # the latest attempt's values: each reran every check not known to kill
        full.update(run.full)
        if ended == "done":
            finished = True
            break
        last = run.last or ("start",)
        if ended == "killed" and killed_at != last:
            killed_at = last
            note = ("the sandbox was killed (SIGKILL: its own code, the host's out-of-memory killer or someone "
                    "outside); it was run again")
            if note not in outcome.problems:
                outcome.problems.append(note)
            continue
        why = {"wall": f"killed: it ran past the {limits.wall_s:g} s wall-clock limit (a loop that ignores "
                       "the per-cell timeout?)",
               "stalled": f"killed: a cell or check went on {stall_s:g} s without finishing (it caught the "
                          "timeout's interrupt and kept running)",
               "cpu": "killed: it used up its CPU-time cap",
               "memory": f"killed: it used more memory than its cap ({limits.memory_mb} MiB, plus its scratch "
                         "space; memfd files and /dev/shm count too)",
               "killed": "the kernel died: killed by SIGKILL twice at the same step (its own code, or memory "
                         "the host could not give)"}.get(
            ended, "the kernel died (os._exit, a crash, or it ignored an interrupt"  # a check's exit status is not
            + (f"; exit status {ended[5:]})" if last[0] == "cell" else ")"))  # told: code that saw hidden inputs chose it
        if last == ("start",):  # no learner's code ran yet: the sandbox itself failed, twice if killed
            outcome.infrastructure = (f"the harness stopped before running anything ({ended}): "
                                      f"{_log_tail(workdir / 'harness.log')}" if ended != "killed" else KILLED_FROM_OUTSIDE)
            break
        if why not in outcome.problems:
            outcome.problems.append(why)
        if last[0] == "cell":
            cells[last[1]] = {"ev": "cell_done", "i": last[1], "died": True, "outputs": [
                {"output_type": "error", "ename": "DeadKernelError", "evalue": why, "traceback": [why]}]}
            stop_before = last[1]
        elif last[0] == "check":
            dead_checks[last[1:]] = {"t": "rejected", "why": "died"}
        if last[0] == "cells_done" or (stop_before is not None and stop_before <= 0):
            break
    if not finished and not outcome.infrastructure:
        outcome.problems.append(f"graded on what {outcome.attempts} run(s) recorded: checks that never ran count "
                                "as failed")
    errors = " ".join(str(o.get("evalue", "")) for e in cells.values() for o in
                      (e.get("outputs") if isinstance(e.get("outputs"), list) else []) if isinstance(o, dict))
    if full:
        outcome.problems.append(f"it filled its scratch space ({', '.join(sorted(full))}: "
                                f"{limits.tmpfs_bytes() // 2 ** 20} MiB each): writes there failed")
    elif "No space left on device" in errors or "File too large" in errors:
        outcome.problems.append(f"a write hit the disk cap ({limits.tmpfs_bytes() // 2 ** 20} MiB each in /sub and "
                                f"/tmp, {limits.file_mb} MiB per file)")
    values.update(dead_checks)
    outcome.events = [cells[i] for i in sorted(cells)] + [
        {"ev": "check", "gid": gid, "k": k, "value": v} for (gid, k), v in values.items()]
    outcome.seconds = time.perf_counter() - started
    return outcome
