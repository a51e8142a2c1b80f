"""Where the sandboxes run: here one at a time (`serial`), or on a Dask cluster (https://distributed.dask.org):
`--cluster tcp://HOST:8786` (a running scheduler), `--cluster local:N` or `--jobs N` (a LocalCluster of N worker
processes here, its scratch in a temporary folder). Each submission is one task (`run_one`), carrying the
notebook and its checks as data (a worker on another machine does not mount the class folder): the same sandbox on a
worker, its Outcome back as plain data, merged once by the grader's process, the only writer, as it arrives. A
task writes only in its own temporary folder, so Dask may run it again when a worker is lost; one that took down
`distributed.scheduler.allowed-failures` workers is reported on its row. Before any grade is written `connect`
checks that the scheduler answers (within `distributed.comm.timeouts.connect`), that it has workers, that each can
start the sandbox and, on a cluster reached by address, runs this very course package (`course_version`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import tempfile
import uuid
from functools import lru_cache
from pathlib import Path

import course
from course.grade import sandbox
from course.grade.files import GradingError
from course.grade.nbgrader_api import sha

START_HINT = ("start one with `dask scheduler` and `dask worker tcp://HOST:8786` on each grading machine (the course "
              "installed there too), or grade on this machine with --cluster local:N")


def parse(spec: str | None, jobs: int = 1) -> tuple[str, int] | None:
    """("local", N) or (scheduler address, 0) from --cluster and --jobs; None for one sandbox at a time here."""
    if spec is not None and jobs > 1:
        raise ValueError(f"give --jobs {jobs} or --cluster {spec}, not both (--jobs N is --cluster local:N)")
    if spec is None:
        return ("local", jobs) if jobs > 1 else None
    if spec.startswith("local:") and spec[6:].isdigit() and int(spec[6:]) >= 1:
        return "local", int(spec[6:])
    if "://" in spec and spec.split("://", 1)[1]:
        return spec, 0
    raise ValueError(f"--cluster must be local:N (N worker processes here, N >= 1) or a Dask scheduler's address "
                     f"such as tcp://HOST:8786, got {spec!r}")


@lru_cache(maxsize=1)
def course_version() -> str:
    """A hash of the course package's files: what the sandbox runs and the learner's code imports."""
    root = Path(course.__file__).resolve().parent
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json", ".yaml", ".cpp")
                   and "__pycache__" not in p.parts)
    return sha(*(f"{p.relative_to(root)}\0".encode() + p.read_bytes() for p in files))


def probe() -> dict:
    """What a worker says about itself before it is given any submission."""
    return {"sandbox": sandbox.sandbox_problem(), "version": course_version(), "host": socket.gethostname()}


def run_one(job: dict, on_start=None) -> dict:
    """One submission in a fresh sandbox on this machine: the Outcome as plain data. Idempotent: it writes only
    in its own temporary folder (under job["scratch"] when given), removed at the end."""
    if job["version"] and job["version"] != course_version():  # a worker that joined after `connect` looked
        return dataclasses.asdict(sandbox.Outcome(infrastructure=(
            f"the worker on {socket.gethostname()} runs another version of the course than the grader")))
    with tempfile.TemporaryDirectory(prefix="kvcourse-task-", dir=job.get("scratch")) as tmp:
        notebook, checks = Path(tmp) / "submission.ipynb", Path(tmp) / f"{job['assignment']}.py"
        notebook.write_text(json.dumps(job["notebook"]))
        checks.write_text(job["checks"])
        outcome = sandbox.run_sealed(notebook, checks, Path(tmp) / "box", sandbox.Limits(**job["limits"]),
                                     sealed=job["sealed"], threads=job["threads"], on_start=on_start)
    return dataclasses.asdict(outcome)


def serial(jobs: list[dict], on_start=None):  # as Cluster.run, one job at a time in this process
    for i, job in enumerate(jobs):
        yield i, sandbox.Outcome(**run_one(job, on_start))


class Cluster:
    """A Dask client with workers that were checked; `run(jobs)` yields (index, Outcome) as results arrive."""

    def __init__(self, client, where: str, threads: int, version: str | None):
        self.client, self.where, self.threads, self.version = client, where, threads, version  # version None: local

    def run(self, jobs: list[dict], bar=None):
        from distributed import as_completed
        from distributed.scheduler import KilledWorker

        run_id = uuid.uuid4().hex[:8]  # keys unique to this run: another grader may share the scheduler
        futures = {self.client.submit(run_one, job, key=f"kvcourse-grade-{run_id}-{i:05d}", pure=False): i
                   for i, job in enumerate(jobs)}
        try:
            for future in as_completed(futures):
                i = futures.pop(future)
                try:
                    outcome = sandbox.Outcome(**future.result())
                except KilledWorker as exc:
                    outcome = sandbox.Outcome(infrastructure=(
                        f"its task took down every worker that ran it ({exc}); grade it alone, without --cluster"))
                except Exception as exc:  # the worker's own trouble (its disk, its Python): regraded next run
                    outcome = sandbox.Outcome(infrastructure=f"its task failed on a worker ({type(exc).__name__}: "
                                                             f"{str(exc)[:200]})")
                if bar is not None:
                    workers = len(self.client.scheduler_info(n_workers=-1)["workers"])
                    bar.set_postfix_str(f"{workers} worker(s)", refresh=False)
                yield i, outcome
        finally:
            self.client.cancel(list(futures))


@contextlib.contextmanager
def connect(where: tuple[str, int], sealed: bool = True):
    """A checked Cluster for ("local", N) or (address, 0); GradingError, before anything is graded, when the
    scheduler does not answer, has no workers, or a worker cannot sandbox or runs another course version."""
    import dask
    from distributed import Client, LocalCluster

    address, n = where
    local = address == "local"  # workers that read this very folder's files: no version to compare
    timeout = dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
    with contextlib.ExitStack() as stack:
        if local:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcourse-dask-"))
            stack.enter_context(dask.config.set({"temporary-directory": tmp}))
            try:
                local = stack.enter_context(LocalCluster(
                    n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                    local_directory=tmp, silence_logs=logging.ERROR))
            except (OSError, RuntimeError) as exc:
                raise GradingError(f"could not start {n} local Dask worker process(es): {exc}; nothing was graded. "
                                   "Grade one at a time (without --jobs/--cluster), or with fewer") from None
            address, threads = local.scheduler_address, max(1, (os.cpu_count() or 1) // n)
            where_text = f"a local Dask cluster of {n} worker process(es)"
        else:
            threads, where_text = 1, f"the Dask cluster at {address}"
        try:
            client = stack.enter_context(Client(address, timeout=timeout))
            client.wait_for_workers(1, timeout=timeout)
        except (OSError, TimeoutError) as exc:
            why = "it has no workers" if "worker" in str(exc).lower() else f"no answer within {timeout:g} s"
            raise GradingError(f"could not use the Dask scheduler at {address}: {why} ({exc}). Check the address, "
                               f"or {START_HINT}; nothing was graded") from None
        answers = client.run(probe, on_error="return")
        course_version.cache_clear()  # this process's files now, as the workers' are read now
        mine = None if local else course_version()
        for worker, said in sorted(answers.items()):
            if isinstance(said, BaseException):
                raise GradingError(f"the Dask worker {worker} cannot run the grader ({type(said).__name__}: {said}): "
                                   "install the course there, the same version as here; nothing was graded")
            if mine and said["version"] != mine:
                raise GradingError(
                    f"the Dask worker {worker} on {said['host']} runs another version of the course (package hash "
                    f"{said['version'][:12]}, here {mine[:12]}): install this one there (the same commit), or its "
                    "grades could differ from this machine's; nothing was graded")
            if sealed and said["sandbox"]:
                raise GradingError(f"the Dask worker {worker} on {said['host']} cannot start the sandbox: "
                                   f"{said['sandbox']}. Fix it there, or leave that worker out; nothing was graded")
        yield Cluster(client, where_text, threads, mine)
