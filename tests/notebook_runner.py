"""Execute a notebook headless, as a learner's 'Run all' would, and return what it record()ed.

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
