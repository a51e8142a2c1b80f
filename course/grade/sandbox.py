"""The sealed runner: one submission, one bubblewrap sandbox, only files come back.

Mechanism: Debian's `bubblewrap` (bwrap), the unprivileged sandbox Flatpak is built on. Each run gets
`--unshare-all` (its own user, PID, network, IPC, UTS and cgroup namespaces: no network at all, not even the
host's loopback), `--die-with-parent` and `--new-session`, and a filesystem made of read-only binds of the
system (/usr, /etc), the Python interpreter and the venv, and the installed `course` package -- nothing else
of the course folder: no other submission, no gradebook, no solutions/ or source/, no ledger. /tmp is a
private tmpfs, and the one writable folder is this submission's own copy (/sub). Caps (setrlimit before
bwrap execs, inherited by everything inside): address space (memory), CPU seconds, file size, processes
(RLIMIT_NPROC, which Linux does not apply to root: as root each run also gets its own `pids` cgroup with
pids.max); plus a wall-clock timeout, after which the whole sandbox is killed. bwrap needs no root: as a normal user it
uses unprivileged user namespaces (where a distribution disables them, bwrap says so and `kvcourse grade`
stops, naming what is missing).

The harness (course.grade.harness) runs inside and writes events.jsonl; `run_sealed` reads it back, reruns
past a cell that killed the kernel or ran past every timeout, and classifies how each run ended.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import course

MAX_EVENTS_BYTES = 64 * 2 ** 20
KILLED_FROM_OUTSIDE = "the grading process was killed from outside (not by the submission's own code)"


@dataclass
class Limits:
    cell_timeout: float = 30.0  # seconds per cell (and per check)
    memory_mb: int = 4096  # address space of the sandboxed process
    wall_s: float = 300.0  # one attempt, start to end
    file_mb: int = 256  # the largest file it may write
    extra_processes: int = 256  # processes/threads it may add to the user's count


@dataclass
class Outcome:
    events: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what the submission did (timeouts, dead kernels)
    infrastructure: str = ""  # set when the run failed for a reason that is not the submission's
    seconds: float = 0.0
    attempts: int = 0


# ----------------------------------------------------------------------------- is the sandbox there?

def _binds() -> list[tuple[str, str]]:
    """(kind, path) for the filesystem inside: read-only system, interpreter, venv and course package."""
    entries: list[tuple[str, str]] = []
    for top in ("/usr", "/etc"):
        entries.append(("ro", top))
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(link):
            entries.append(("symlink", link))
        elif os.path.isdir(link):
            entries.append(("ro", link))
    package = str(Path(course.__file__).resolve().parent)
    for path in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix,
                        os.path.dirname(os.path.realpath(sys.executable)), package}, key=len):
        if any(path == p or path.startswith(p.rstrip("/") + "/") for kind, p in entries if kind == "ro"):
            continue
        entries.append(("ro", path))
    return entries


@lru_cache(maxsize=1)
def _redacted_bank() -> tuple[str, str] | None:
    """(a copy of the question bank without the autograded quiz's questions, where the package's bank lies).

    The lessons need the bank's answers, so the installed package carries them; a quiz submission must not be
    able to read them. Inside the sandbox the package's questions.yaml is this copy (bound over it, read-only)."""
    import atexit
    import tempfile

    import yaml

    from course.teach.questions import QUESTIONS_PATH

    if not QUESTIONS_PATH.is_file():
        return None
    bank = yaml.safe_load(QUESTIONS_PATH.read_text())
    bank["questions"] = [q for q in bank.get("questions", []) if not q.get("autograded")]
    fd, name = tempfile.mkstemp(prefix="kvcourse-bank-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(bank, f, allow_unicode=True, sort_keys=False)
    os.chmod(name, 0o444)
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    return name, str(QUESTIONS_PATH.resolve())


def bwrap_command(workdir: Path, argv: list[str], env: dict) -> list[str]:
    # The private /tmp, /dev and /proc first: a later mount lies over an earlier one, and the venv or the
    # course package may themselves live under /tmp (a fresh clone in a temporary folder).
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for kind, path in _binds():
        if kind == "symlink":
            cmd += ["--symlink", os.readlink(path), path]
        else:
            cmd += ["--ro-bind", path, path]
    bank = _redacted_bank()
    if bank:  # after the package's bind, so this file lies over the real bank
        cmd += ["--ro-bind", bank[0], bank[1]]
    cmd += ["--bind", str(workdir), "/sub", "--chdir", "/sub"]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    return cmd + ["--", *argv]


@lru_cache(maxsize=1)
def sandbox_problem() -> str:
    """"" when bwrap can start a sealed process here; else what is missing and how to fix it."""
    if shutil.which("bwrap") is None:
        return ("the grading sandbox needs bubblewrap (`bwrap`), which is not installed: as root run "
                "`sh scripts/ensure_bwrap.sh` (Debian/Ubuntu: apt-get install bubblewrap)")
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvcourse-bwrap-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        package = str(Path(course.__file__).resolve().parent)
        check = "import os, sys; sys.exit(0 if os.path.isfile(sys.argv[1]) else 3)"
        out = subprocess.run(bwrap_command(probe, [sys.executable, "-c", check, f"{package}/__init__.py"],
                                           _sandbox_env(1)), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not start a sandbox: {exc}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no message"])[-1]
        hint = ""
        if "namespace" in why.lower() or "permission" in why.lower() or "operation not permitted" in why.lower():
            hint = (" -- this host does not let unprivileged users create user namespaces: ask an administrator "
                    "to allow them (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04 an AppArmor "
                    "profile for bwrap), or to install bwrap setuid root (chmod u+s /usr/bin/bwrap)")
        return f"bwrap could not start a sandbox ({why}){hint}"
    return ""


# ----------------------------------------------------------------------------- one run

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
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                pass
    return n


def _pids_cgroup(limit: int) -> Path | None:
    """A fresh cgroup whose pids.max caps processes + threads (root only; None where it cannot be made)."""
    if os.getuid() != 0:
        return None  # RLIMIT_NPROC already holds for everyone else
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):  # cgroup v1's controller, or v2
        if not (root / "cgroup.procs").exists():
            continue
        path = root / f"kvcourse-{os.getpid()}-{time.monotonic_ns()}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / "pids.max").write_text(str(limit))
            return path
        except OSError:
            path.rmdir()
    return None


def _remove_cgroup(path: Path | None) -> None:
    for _ in range(50):
        if path is None or not path.exists():
            return
        try:
            path.rmdir()
            return
        except OSError:  # processes still leaving
            time.sleep(0.1)


def _limiter(limits: Limits, nproc: int, cgroup: Path | None = None):
    libc = ctypes.CDLL(None, use_errno=True)
    memory = limits.memory_mb * 2 ** 20
    cpu = int(limits.wall_s * 2) + 10
    fsize = limits.file_mb * 2 ** 20

    def preexec():  # runs in the child between fork and exec: the limits hold for everything inside
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the sandbox dies with the grader, even on kill -9
        if cgroup is not None:
            with open(cgroup / "cgroup.procs", "w") as fh:
                fh.write(str(os.getpid()))
        if limits.memory_mb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.setsid()

    return preexec


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    with open(path, "rb") as fh:
        data = fh.read(MAX_EVENTS_BYTES)
    for line in data.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("ev"), str):
            events.append(event)
    return events


def _attempt(workdir: Path, job: dict, limits: Limits, sealed: bool, threads: int, on_start=None):
    """One harness run. Returns (events, how it ended: done | killed | wall | cpu | died:<code>)."""
    (workdir / "events.jsonl").unlink(missing_ok=True)
    inside = "/sub" if sealed else str(workdir)
    job = dict(job, notebook=f"{inside}/submission.ipynb", checks=f"{inside}/checks.py",
               events=f"{inside}/events.jsonl")
    (workdir / "job.json").write_text(json.dumps(job))
    argv = [sys.executable, "-m", "course.grade.harness", f"{inside}/job.json"]
    env = _sandbox_env(threads)
    if sealed:
        cmd, cwd, run_env = bwrap_command(workdir, argv, env), None, {"PATH": os.environ.get("PATH", "/usr/bin")}
    else:
        cmd, cwd = argv, str(workdir)
        run_env = dict(env, HOME=str(workdir), TMPDIR=str(workdir), MPLCONFIGDIR=str(workdir / ".mpl"),
                       IPYTHONDIR=str(workdir / ".ipython"))
    cgroup = _pids_cgroup(limits.extra_processes)
    proc = subprocess.Popen(cmd, cwd=cwd, env=run_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(workdir / "harness.log", "ab"),
                            preexec_fn=_limiter(limits, _user_tasks() + limits.extra_processes, cgroup))
    if on_start:
        on_start(proc)
    ended = None
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        ended = "wall"
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        _remove_cgroup(cgroup)
    events = _events(workdir / "events.jsonl")
    code = proc.returncode
    if any(e["ev"] == "done" for e in events):
        ended = "done"
    elif ended is None:
        if code in (-signal.SIGKILL, 128 + signal.SIGKILL):
            ended = "killed"
        elif code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            ended = "cpu"
        else:
            ended = f"died:{code}"
    return events, ended


def run_sealed(notebook: Path, checks: Path, workdir: Path, limits: Limits, sealed: bool = True,
               threads: int = 1, on_start=None, max_attempts: int = 4) -> Outcome:
    """Grade-run one notebook (already repaired) in a fresh sandbox; return every event it wrote."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(notebook, workdir / "submission.ipynb")
    shutil.copyfile(checks, workdir / "checks.py")
    outcome, started = Outcome(), time.perf_counter()
    stop_before, skip = None, []
    kept: list[dict] = []
    while outcome.attempts < max_attempts:
        outcome.attempts += 1
        job = {"cell_timeout": limits.cell_timeout, "stop_before": stop_before, "skip_checks": skip}
        events, ended = _attempt(workdir, job, limits, sealed, threads, on_start)
        kept += [e for e in events if e["ev"] in ("cell_done", "check")
                 and not (e["ev"] == "cell_done" and any(k["ev"] == "cell_done" and k["i"] == e["i"] for k in kept))]
        if ended == "done":
            break
        if ended == "killed":
            outcome.infrastructure = KILLED_FROM_OUTSIDE
            break
        why = {"wall": f"killed: it ran past the {limits.wall_s:g} s wall-clock limit (a loop that ignores "
                       "the per-cell timeout?)",
               "cpu": "killed: it used up its CPU-time cap"}.get(
            ended, f"the kernel died (os._exit, a crash, or it ignored an interrupt; exit status {ended[5:]})")
        last = next((e for e in reversed(events) if e["ev"] in ("cell_start", "check_start", "cells_done")), None)
        if last is None:
            outcome.infrastructure = f"the harness stopped before running anything ({why}); see harness.log"
            break
        if why not in outcome.problems:
            outcome.problems.append(why)
        if last["ev"] == "cell_start":
            kept.append({"ev": "cell_done", "i": last["i"], "died": True, "outputs": [
                {"output_type": "error", "ename": "DeadKernelError", "evalue": why, "traceback": [why]}]})
            stop_before = last["i"]
        elif last["ev"] == "check_start":
            kept.append({"ev": "check", "gid": last["gid"], "k": last["k"],
                         "value": {"t": "raised", "name": "DeadKernelError", "builtin_bases": [], "message": why}})
        skip = [[e["gid"], e["k"]] for e in kept if e["ev"] == "check"]
        if last["ev"] == "cells_done" or (stop_before is not None and stop_before <= 0):
            break
    outcome.events = kept
    outcome.seconds = time.perf_counter() - started
    return outcome
