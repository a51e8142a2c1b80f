"""Execute a notebook headless, as a learner's 'Run all' would, and return what it record()ed.

A lesson runs once per test session where it can: the browser suite (tests/e2e, collected first) clicks
Run All on every lesson in real JupyterLab and, when the run came out clean, leaves what the run recorded,
the notebook with its outputs and its run time under pytest's base temp (`keep_browser_run`). The lesson
tests then check that run (`lesson_run`) and execute the notebook themselves only when there is none:
the browser suite skipped or deselected, its run failed, or KVCOURSE_STRICT_TIMES=1 (which times each
lesson alone).

Its own module (not conftest) so test files can import it: tests/e2e has a conftest.py too, and two
modules named `conftest` cannot both be imported by that name.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


BROWSER_RUNS = "browser-lesson-runs"  # folder under pytest's base temp


def _run_files(base: Path, stem: str) -> tuple[Path, Path, Path]:
    folder = Path(base) / BROWSER_RUNS
    return folder / f"{stem}-results.json", folder / f"{stem}-executed.ipynb", folder / f"{stem}-run.json"


def keep_browser_run(base: Path, path, results: dict, notebook: dict, seconds: float, where: str) -> None:
    """Leave a clean browser Run All of lesson `path` for its lesson test: what it record()ed, the notebook
    with its outputs (JupyterLab's model), and how long Run All took and beside what."""
    import nbformat

    results_path, nb_path, run_path = _run_files(base, Path(path).stem)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    notebook = {**notebook, "cells": [{k: v for k, v in cell.items() if not (k == "attachments" and v is None)}
                                      for cell in notebook["cells"]]}  # JupyterLab writes null, nbformat wants none
    nbformat.validate(notebook)
    for target, value in ((results_path, results), (nb_path, notebook),
                          (run_path, {"seconds": seconds, "where": where})):  # the run file last: it says complete
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, target)


def browser_run(base: Path, path) -> tuple[dict, object, float, str] | None:
    """The browser suite's clean run of lesson `path` in this session, if it left one."""
    import nbformat

    results_path, nb_path, run_path = _run_files(base, Path(path).stem)
    if not run_path.exists():
        return None
    run = json.loads(run_path.read_text())
    nb = nbformat.reads(nb_path.read_text(), as_version=4)
    return json.loads(results_path.read_text()), nb, float(run["seconds"]), run["where"]


def lesson_run(path: Path, tmp_path_factory, timeout: int = 900, env: dict | None = None) -> tuple[dict, object, float]:
    """(what the lesson record()ed, the executed notebook, seconds Run All took) for a lesson test.

    The browser suite's run of this session when there is one, else a headless run with `env` here."""
    import time

    import nbformat

    strict = os.environ.get("KVCOURSE_STRICT_TIMES", "0") not in ("", "0")
    kept = None if strict else browser_run(tmp_path_factory.getbasetemp(), path)
    if kept is not None:
        results, nb, seconds, where = kept
        print(f"\n{Path(path).name}: checking the browser suite's Run All ({where}, {seconds:.0f} s)")
        return results, nb, seconds
    tmp = tmp_path_factory.mktemp(Path(path).stem)
    start = time.perf_counter()
    results = execute_notebook(Path(path), tmp, timeout=timeout, env=env)
    seconds = time.perf_counter() - start
    return results, nbformat.read(tmp / f"{Path(path).stem}-executed.ipynb", as_version=4), seconds
