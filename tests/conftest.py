"""Shared fixtures. Tests keep every bit of state (model cache, Jupyter dirs, progress) out of the home folder."""
from __future__ import annotations

import json
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
def tiny():
    from course.model import tiny_model

    return tiny_model(seed=0)


def execute_notebook(path: Path, tmp_path: Path, timeout: int = 900, env: dict | None = None) -> dict:
    """Run a notebook headless (as a learner's 'Run all' would) and return what it record()ed.

    Raises nbclient's CellExecutionError, with the failing cell and traceback, on any error.
    """
    import nbformat
    from nbclient import NotebookClient

    from course.paths import jupyter_env

    results = tmp_path / f"{Path(path).stem}-results.json"
    results.unlink(missing_ok=True)
    kernel_env = jupyter_env(state=tmp_path / "jupyter")
    kernel_env.update({"KVCOURSE_RESULTS": str(results), "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)})
    kernel_env.update(env or {})
    nb = nbformat.read(path, as_version=4)
    old = dict(os.environ)
    os.environ.update(kernel_env)  # nbclient starts the kernel with this process's environment
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(Path(path).parent)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    out = tmp_path / f"{Path(path).stem}-executed.ipynb"
    nbformat.write(nb, out)
    return json.loads(results.read_text()) if results.exists() else {}


@pytest.fixture
def run_notebook(tmp_path):
    def run(path, timeout: int = 900, env: dict | None = None) -> dict:
        return execute_notebook(Path(path), tmp_path, timeout=timeout, env=env)

    return run
