"""Shared fixtures. Tests keep every bit of state (model cache, Jupyter dirs, progress) out of the home folder."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".state" / "tests"
os.environ.setdefault("KVCOURSE_CACHE", str(ROOT / ".state" / "model-cache"))
os.environ.setdefault("KVCOURSE_STATE", str(STATE / "jupyter"))
os.environ.setdefault("KVCOURSE_PROGRESS", str(STATE / "progress.sqlite"))
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # notebook_runner


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32 on the CPU, loaded once per test run."""
    import course

    return course.load(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def real_model(real):
    return real[0]


@pytest.fixture(scope="session")
def tokenizer(real):
    return real[1]


@pytest.fixture
def one_thread():
    """One torch thread for the test. Tiny-model tests run thousands of microsecond-sized ops; on a busy
    2-core machine two threads waiting on a descheduled partner run ~10x slower. Nothing here is timed."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_reads_seen(monkeypatch):
    """Every test starts with no read probe seen (course.measure.timing.fastest_read lowers the floors of gates)."""
    timing = sys.modules.get("course.measure.timing")  # not imported yet: nothing seen
    if timing is not None:
        monkeypatch.setattr(timing, "_fastest", {})


@pytest.fixture
def tiny():
    from course.engine.model import tiny_model

    return tiny_model(seed=0)


@pytest.fixture
def run_notebook(tmp_path):
    from notebook_runner import execute_notebook

    def run(path, timeout: int = 900, env: dict | None = None) -> dict:
        return execute_notebook(Path(path), tmp_path, timeout=timeout, env=env)

    return run


@pytest.fixture
def store(tmp_path):
    """An empty progress store of the test's own."""
    from course.teach.progress import ProgressStore

    return ProgressStore(tmp_path / "progress.sqlite")


@pytest.fixture
def fresh_progress(monkeypatch, tmp_path):
    """Nothing record()ed in this process, and the default progress file is the test's own."""
    from course.measure import results

    monkeypatch.setattr(results, "_recorded", {})
    monkeypatch.delenv("KVCOURSE_RESULTS", raising=False)
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "default-progress.sqlite"))


@pytest.fixture
def cpu_burner():
    """Keep every core busy with other programs while the test runs (a learner's busy machine): one spinning
    process per core, started before the test and killed after it, whatever happens. Under pytest-xdist the
    busy-machine tests start together, one per worker (pytest_collection_modifyitems), so each worker's burner
    spins its share of the cores: one spinner per core in all, as when such a test runs by itself."""
    import subprocess

    share = (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(1, share))]
    try:
        yield len(spinners)
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def pytest_collection_modifyitems(items):
    """tests/test_lesson_consistency.py compares what the lesson tests' runs left behind: it runs after them.

    The browser suite and the lesson tests are marked `alone` (as is a test that reads the machine's load): they
    time what they teach, so `make test` runs them alone on the machine, then everything else on two workers
    (pytest-xdist, `-n 2 --dist loadfile --no-loadscope-reorder`: one file's tests on one worker, its module
    fixtures built once, files in this order). First the lesson runs under the CPU burner (a busy machine is what
    they test), then the longest files."""
    def order(item):
        return (item.path.name == "test_lesson_consistency.py",
                0 if "cpu_burner" in getattr(item, "fixturenames", ()) else
                1 if item.path.name in ("test_grading.py", "test_classroom.py") else 2)

    for item in items:
        lesson = item.path.parent.name == "e2e" or item.path.name.startswith("test_lesson_")
        if lesson and "cpu_burner" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.alone)
    items.sort(key=order)  # stable: within each rank, the collection's order
