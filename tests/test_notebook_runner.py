"""A lesson runs once per test session where it can: the lesson tests check the browser suite's clean Run All
(tests/notebook_runner.py) and run the notebook themselves only when there is none."""
from __future__ import annotations

import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from notebook_runner import browser_run, keep_browser_run, lesson_run


class Factory:
    """The two calls lesson_run makes on pytest's tmp_path_factory, inside one test's folder."""

    def __init__(self, base):
        self.base, self.made = base, []

    def getbasetemp(self):
        return self.base

    def mktemp(self, name):
        path = self.base / f"{name}{len(self.made)}"
        path.mkdir()
        self.made.append(path)
        return path


def tiny_lesson(folder, value) -> object:
    nb = new_notebook(cells=[new_code_cell(f"from course.measure.results import record\nrecord('answer', {value})")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "09_tiny.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_kept_browser_run_is_checked_instead_of_running_the_lesson_again(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCOURSE_STRICT_TIMES", raising=False)
    factory = Factory(tmp_path)
    shown = json.loads(nbformat.writes(new_notebook(cells=[
        new_code_cell("print('hi')", outputs=[new_output("stream", text="hi\n")]), new_code_cell("")])))
    shown["cells"].append({"cell_type": "markdown", "id": "m1", "metadata": {}, "source": "# Hi", "attachments": None})
    missing = tmp_path / "lessons" / "09_tiny.ipynb"  # never written: running it would fail
    assert browser_run(tmp_path, missing) is None
    keep_browser_run(tmp_path, "lessons/09_tiny.ipynb", {"answer": 41}, shown, 12.5, "JupyterLab")
    results, nb, seconds = lesson_run(missing, factory)
    assert results == {"answer": 41} and seconds == 12.5 and not factory.made
    assert nb.cells[0].outputs[0]["text"] == "hi\n"  # the notebook as JupyterLab held it: valid, with its outputs
    assert nb.cells[1].execution_count is None and "attachments" not in nb.cells[2]
    # a run whose last file never arrived (the browser test failed while keeping it) is not used
    (tmp_path / "browser-lesson-runs" / "09_tiny-run.json").unlink()
    assert browser_run(tmp_path, missing) is None


@pytest.mark.slow
def test_strict_times_run_the_lesson_here_even_when_the_browser_kept_one(tmp_path, monkeypatch):
    path = tiny_lesson(tmp_path, 42)
    keep_browser_run(tmp_path, path, {"answer": 41}, json.loads(nbformat.writes(new_notebook())), 1.0, "JupyterLab")
    monkeypatch.setenv("KVCOURSE_STRICT_TIMES", "1")
    factory = Factory(tmp_path)
    results, nb, seconds = lesson_run(path, factory, timeout=120)
    assert results == {"answer": 42} and len(factory.made) == 1 and seconds > 0
    assert nb.cells[0].execution_count == 1
