"""Grading on Dask distributed (course/grade/cluster.py): `kvcourse grade --cluster tcp://HOST:8786 | local:N`.

Fast: the --cluster value, and an unreachable scheduler (a clear error before anything is written). Slow: a
worker without bubblewrap and a worker running another copy of the course are refused before any grade is
written; a small class graded serially and through a 2-worker cluster reached over TCP gives the same
grades.csv and report.csv (timing column apart); a worker killed mid-run loses nothing and grades nothing twice.
"""
from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course.grade import cluster, grader, sandbox
from course.grade.files import GradingError
from course.paths import AUTOGRADE

SAMPLES = AUTOGRADE / "samples"
ASSIGNMENT = "01_memory_formula"
CLASS = ["reference", "mem-bug-no-factor-2", "blank", "adv-edited-test"]  # correct, buggy, empty, hostile
needs_bwrap = pytest.mark.skipif(bool(sandbox.sandbox_problem()),
                                 reason="the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")


def _quiet(*_):
    pass


def _class(folder: Path) -> Path:
    for i, sample in enumerate(CLASS):
        shutil.copytree(SAMPLES / sample / ASSIGNMENT, folder / f"student-{i:02d}" / ASSIGNMENT)
    return folder


def _nothing_written(course: Path) -> bool:
    return not any((course / name).exists() for name in ("gradebook.db", "grades.csv", "report.csv", "feedback"))


def test_the_cluster_value_is_checked():
    assert cluster.parse(None) is None and cluster.parse(None, jobs=3) == ("local", 3)
    assert cluster.parse("local:2") == ("local", 2)
    assert cluster.parse("tcp://10.0.0.5:8786") == ("tcp://10.0.0.5:8786", 0)
    for bad in ("local:0", "local:x", "10.0.0.5:8786", "", "tcp://"):
        with pytest.raises(ValueError, match="--cluster must be local:N .* tcp://HOST:8786"):
            cluster.parse(bad)
    with pytest.raises(ValueError, match="not both"):
        cluster.parse("local:2", jobs=2)


def test_an_unreachable_scheduler_is_named_before_anything_is_written(tmp_path):
    import dask
    import distributed  # noqa: F401  (its defaults first: leaving a dask.config.set undoes what it found missing)

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    course = tmp_path / "course"
    started = time.monotonic()
    with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
        with pytest.raises(GradingError, match=f"could not use the Dask scheduler at tcp://127.0.0.1:{port}"
                                               r": no answer within 3 s.*dask scheduler.*nothing was graded"):
            grader.grade(_class(tmp_path / "subs"), course, cluster=f"tcp://127.0.0.1:{port}", progress=False,
                         log=_quiet)
    assert time.monotonic() - started < 30 and _nothing_written(course)


@pytest.mark.slow
def test_workers_without_bubblewrap_are_refused_before_any_grade(tmp_path):
    from distributed import LocalCluster

    course = tmp_path / "course"
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                      env={"PATH": str(tmp_path / "no-bin")}, local_directory=str(tmp_path / "dask")) as local:
        with pytest.raises(GradingError, match=r"the Dask worker tcp://.* cannot start the sandbox: .*bubblewrap"):
            grader.grade(_class(tmp_path / "subs"), course, cluster=local.scheduler_address, progress=False,
                         log=_quiet)
    assert _nothing_written(course)


@pytest.mark.slow
def test_a_worker_with_another_version_of_the_course_is_refused(tmp_path):
    """A `dask worker` whose Python imports a copy of the course with one file changed."""
    from distributed import LocalCluster

    copy = tmp_path / "other" / "course"
    shutil.copytree(Path(cluster.course.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "grade" / "harness.py", "a") as fh:
        fh.write("\n# another version\n")
    course = tmp_path / "course"
    with LocalCluster(n_workers=0, dashboard_address=None, processes=True) as scheduler:
        worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", scheduler.scheduler_address, "--nthreads", "1",
             "--no-dashboard", "--local-directory", str(tmp_path / "dask")],
            env={**os.environ, "PYTHONPATH": str(copy.parent)}, cwd=tmp_path, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            with pytest.raises(GradingError, match=r"runs another version of the course \(package hash"):
                grader.grade(_class(tmp_path / "subs"), course, cluster=scheduler.scheduler_address,
                             progress=False, log=_quiet)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
    assert _nothing_written(course)


def test_a_task_carries_the_submission_not_its_path(tmp_path):
    """Workers on other machines do not mount the class folder: a task holds the notebook and its checks as data."""
    import json
    import pickle
    from types import SimpleNamespace

    from course.grade import submissions, verdicts

    folder = _class(tmp_path / "subs")
    path = folder / "student-00" / ASSIGNMENT / "memory_formula.ipynb"
    nb = submissions.read_notebook(path)
    remote = SimpleNamespace(version=cluster.course_version(), threads=1)
    job = grader.task(ASSIGNMENT, nb, sandbox.Limits(), remote, False, tmp_path / "scratch")
    assert job["notebook"] == nb and json.loads(json.dumps(job["notebook"])) == nb
    assert job["checks"] == verdicts.checks_path(ASSIGNMENT).read_text() and job["scratch"] is None
    assert str(tmp_path).encode() not in pickle.dumps(job), "no path of this machine travels in a task"


# ----------------------------------------------------------------------------- a small class, serial and on workers

def _report(course: Path) -> list[dict]:
    """report.csv without its timing column."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(open(course / "report.csv"))]


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    if sandbox.sandbox_problem():
        pytest.skip("the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")
    root = tmp_path_factory.mktemp("serial")
    folder = _class(root / "subs")
    rows = grader.grade(folder, root / "course", progress=False, log=_quiet)
    assert all(r.status == "graded" for r in rows), rows
    return folder, root / "course"


def _seeded(tmp_path: Path, serial_course: Path) -> Path:
    """A fresh course folder holding only the reference values' cache (a cache: the same for every run)."""
    shutil.copytree(serial_course / "work" / "reference", tmp_path / "course" / "work" / "reference")
    return tmp_path / "course"


@pytest.mark.slow
def test_two_workers_over_tcp_give_the_same_files_as_serial(serial, tmp_path):
    from distributed import LocalCluster

    folder, serial_course = serial
    course = _seeded(tmp_path, serial_course)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      local_directory=str(tmp_path / "dask")) as local:
        assert local.scheduler_address.startswith("tcp://")
        grader.grade(folder, course, cluster=local.scheduler_address, progress=False, log=_quiet)
    assert (course / "grades.csv").read_bytes() == (serial_course / "grades.csv").read_bytes()
    assert _report(course) == _report(serial_course)


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_nothing_and_grades_nothing_twice(serial, tmp_path, monkeypatch):
    from distributed import Client, LocalCluster

    folder, serial_course = serial
    course = _seeded(tmp_path, serial_course)
    merged, killed = [], []
    merge = grader._merge

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      local_directory=str(tmp_path / "dask")) as local, Client(local) as client:
        def merge_then_kill(sub, *args, **kwargs):
            merged.append(sub.key)
            if not killed:  # after the first result: a worker that holds a submission now is SIGKILLed
                busy = [w for w, keys in client.processing().items() if keys]
                pids = client.run(os.getpid)
                if busy:
                    os.kill(pids[busy[0]], signal.SIGKILL)
                    killed.append(busy[0])
            return merge(sub, *args, **kwargs)

        monkeypatch.setattr(grader, "_merge", merge_then_kill)
        rows = grader.grade(folder, course, cluster=local.scheduler_address, progress=False, log=_quiet)
    assert killed, "a worker was killed while it held a submission"
    assert sorted(merged) == sorted(f"student-{i:02d}/{ASSIGNMENT}" for i in range(len(CLASS))), merged
    assert all(r.status == "graded" for r in rows), [r for r in rows if r.status != "graded"]
    assert (course / "grades.csv").read_bytes() == (serial_course / "grades.csv").read_bytes()
    assert _report(course) == _report(serial_course)
