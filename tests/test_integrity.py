"""The instructor's notes on code that reaches past its exercise (course/grade/integrity.py): named, never scored."""
from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from course.grade import integrity
from course.paths import EXERCISES, SOLUTIONS

ASSIGNMENTS = sorted(p.name for p in SOLUTIONS.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def _release(assignment: str):
    (path,) = sorted((EXERCISES / assignment).glob("*.ipynb"))
    return nbformat.read(path, as_version=4)


def _with(release, code: str):
    nb = nbformat.from_dict(release)
    nb.cells.append(new_code_cell(code))
    return nb


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_the_solutions_and_the_releases_get_no_note(assignment):
    (solution,) = sorted((SOLUTIONS / assignment).glob("*.ipynb"))
    release = _release(assignment)
    assert integrity.flags(nbformat.read(solution, as_version=4), release) == []
    assert integrity.flags(release, release) == []


@pytest.mark.parametrize("code, shown", [
    ("from course.engine.sampling import sample as s", "course.engine.sampling.sample"),
    ("import course.engine.kv_cache as kc", "import course.engine.kv_cache"),
    ("import course\nf = course.engine.sampling.sample", "import course"),
])
def test_the_courses_own_implementation_is_named(code, shown):
    (note,) = integrity.flags(_with(_release("03_sampler"), code), _release("03_sampler"))
    assert "the course's own code" in note and shown in note


@pytest.mark.parametrize("code, shown", [
    ("import gc\nfor o in gc.get_objects():\n    pass", "gc"),
    ("import sys\nf = sys._getframe(1).f_back", "_getframe"),
    ("import torch\ntorch.allclose = lambda *a, **k: True", "torch.allclose = …"),
    ("import os\nos.dup2(1, 5)", "os.dup2"),
    ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)", "signal"),
    ("open('/proc/self/fd/4', 'w')", "/proc/self/fd/4"),
    ("get_ipython().input_transformers_post.append(str)", "get_ipython()"),
    ("%time x = 1\nimport ctypes", "ctypes"),  # a magic line does not hide the rest of the cell
])
def test_reaching_into_the_process_is_named(code, shown):
    notes = integrity.flags(_with(_release("01_memory_formula"), code), _release("01_memory_formula"))
    assert len(notes) == 1 and "reaches into the grading process" in notes[0] and shown in notes[0], notes


@pytest.mark.parametrize("code", [
    "import torch\nmodel = torch.nn.Linear(2, 2)\nlayers = list(model.modules())",  # not sys.modules
    "from course.config import ModelConfig\ncfg = ModelConfig.from_name('smollm2-135m')",
    "import math\nx = math.prod([1, 2])\nprint(f'{x} bytes')",
    "def f(x):\n    x.data = x.data * 2\n    return x",  # an attribute of a local, not of a module
])
def test_ordinary_code_gets_no_note(code):
    assert integrity.flags(_with(_release("01_memory_formula"), code), _release("01_memory_formula")) == []


def test_check_full_words_the_graders_notes_for_a_learner(monkeypatch):
    """`kvcourse check --full` printed the instructor's 'UNSANDBOXED: … (--unsandboxed)' to a learner who never
    passed that flag (the sandbox could not start: a second checkout), and not why."""
    from course.grade import check, grader, sandbox

    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: "bwrap is not installed")
    notes = check._notes_for_learner("; ".join([grader.UNSANDBOXED, "file named 'x (1).ipynb': graded as x.ipynb",
                                                 "check by hand: it reaches into the grading process (gc), which no "
                                                 "exercise needs"]))
    assert notes[0].startswith("your notebook ran without the grading sandbox") and "bwrap is not installed" in notes[0]
    assert "--unsandboxed" not in " ".join(notes)
    assert notes[1] == "file named 'x (1).ipynb': graded as x.ipynb"
    assert notes[2].startswith("a teacher grading this is shown: your code reaches into the grading process (gc)")


def test_a_full_check_saves_the_visible_tests_to_progress(tmp_path, monkeypatch):
    """After `check --full`, `kvcourse progress` still said tests 0/5 though the visible tests had passed in it."""
    from course.grade import check
    from course.paths import AUTOGRADE
    from course.teach import progress

    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    notebook = AUTOGRADE / "samples" / "reference" / "01_memory_formula" / "memory_formula.ipynb"
    nb = nbformat.read(notebook, as_version=4)
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells
           if c.get("metadata", {}).get("nbgrader", {}).get("grade") and not c.metadata["nbgrader"].get("solution")]
    cells = {gid: (1.0, not gid.startswith("test_max_batch"), "") for gid in ids}  # one visible test fails
    check._save_visible(notebook, cells)
    (saved,) = progress.ProgressStore(tmp_path / "progress.sqlite").exercise_checks()
    visible = [g for g in ids if not g.endswith("_hidden")]  # the hidden cells hold no test a learner can run
    assert saved["exercise"] == "memory_formula" and saved["total"] == len(visible) == 5
    assert saved["passed"] == len(visible) - 1 and set(saved["details"]) == set(visible)


@pytest.mark.parametrize("code, shown", [
    ("%time import course.engine.sampling as _S", "course.engine.sampling"),  # a magic runs its argument
    ("import course.config\nc = course.engine.kv_cache.LayerKVCache", "course.engine.kv_cache"),
    ("import importlib\n_m = importlib.util.resolve_name\nx = 'course.engine.kv_cache'", "course.engine.kv_cache"),
])
def test_delegation_behind_a_magic_or_a_harmless_import_is_named(code, shown):
    notes = integrity.flags(_with(_release("02_kv_cache"), code), _release("02_kv_cache"))
    assert any("the course's own code" in n and shown in n for n in notes), notes


@pytest.mark.parametrize("code, shown", [
    ("import gc\n%time n = len(gc.get_objects())", "gc.get_objects"),
    ("import pkgutil\nf = pkgutil.resolve_name('course.engine.sampling:sample')", "pkgutil"),
    ("imp = getattr(__builtins__, '__imp' + 'ort__')", "__builtins__"),
    ("import torch\nm = torch.importlib.import_module('x')", ".import_module()"),
    ("import sys\nf = getattr(sys, '_get' + 'frame')", "getattr(…, <a name built in code>)"),
    ("open('_helpers.py', 'w').write('x = 1')", "writes _helpers.py"),
    ("import sys\ng = getattr(type(sys.stdout).write, '__globals__')", "__globals__"),  # a constant name, too
    ("import sys\nf = getattr(sys, '_getframe')(0)", "_getframe"),
    ("import gc\nobjs = getattr(gc, 'get_objects')()", "gc.get_objects"),
    ("import importlib\nm = getattr(importlib, 'import_module')('x')", ".import_module()"),
    ("from importlib import import_module as im\nm = im('x')", ".import_module()"),
])
def test_evasions_of_the_scan_are_named(code, shown):
    notes = integrity.flags(_with(_release("03_sampler"), code), _release("03_sampler"))
    assert any(shown in n for n in notes), notes


@pytest.mark.parametrize("code", [
    "import gc\ngc.collect()",
    "import inspect\nprint(inspect.signature(print))",
    "import torch\ntorch.backends.cudnn.deterministic = True",
    "x = 1\nprint('x' in globals(), vars(x) if hasattr(x, '__dict__') else None)",
    "print(open('/proc/meminfo').read()[:10])",
    "t = %timeit -o sum(range(10))\n# compile the numbers, then model.eval()",
])
def test_more_ordinary_code_gets_no_note(code):
    assert integrity.flags(_with(_release("01_memory_formula"), code), _release("01_memory_formula")) == []


@pytest.mark.parametrize("code", [  # honest code a review found noted (round 4)
    "from types import SimpleNamespace\ntoy = SimpleNamespace(n_layers=2)",
    "import sys\nIN_COLAB = 'google.colab' in sys.modules",
    "DEBUG = False\nif DEBUG:\n    breakpoint()",
    "import multiprocessing\nprint(multiprocessing.cpu_count())",
    "from importlib.metadata import version\nprint(version('torch'))",
    "import threading\nlock = threading.Lock()",
    "from course.memory import human_bytes\nprint(human_bytes(2 ** 30))",
    "import torch\ntorch._dynamo.config.suppress_errors = True",
    "import getpass\nname = 'n_heads'\nimport types\nx = getattr(types.SimpleNamespace(n_heads=1), name)",
])
def test_honest_code_from_the_review_gets_no_note(code):
    assert integrity.flags(_with(_release("05_paged_cache"), code), _release("05_paged_cache")) == []


@pytest.mark.parametrize("code, shown", [  # evasions a review found unnoted (round 4)
    ("import pydoc\n_S = pydoc.locate('course.engine.sampling')", "pydoc"),
    ("from IPython.utils.importstring import import_item\n_S = import_item('course.engine.sampling')", "import_item"),
    ("import pickle\n_S = pickle.loads(b'x')", "pickle.loads"),
    ("%run -m course.engine.sampling", "%run"),
    ("%%writefile _helpers.py\nfrom course.engine.sampling import *", "%writefile"),
    ("import logging\nf = logging.currentframe()\nf = getattr(f, 'f_' + 'back')", ".currentframe()"),
    ("import course\nc = course.engine.kv_cache.LayerKVCache", "course.engine.kv_cache"),
])
def test_more_evasions_are_named(code, shown):
    notes = integrity.flags(_with(_release("05_paged_cache"), code), _release("05_paged_cache"))
    assert any(shown in n for n in notes), notes


@pytest.mark.slow
def test_check_runs_a_notebook_saved_with_another_kernel(tmp_path):
    """A notebook last saved from VS Code or a conda env names its own kernel: `kvcourse check` ended in
    NoSuchKernel ('julia-1.9') instead of running it with the course's Python."""
    from course.grade.grading import check

    nb = _release("01_memory_formula")
    nb.metadata["kernelspec"] = {"name": "julia-1.9", "display_name": "Julia 1.9", "language": "julia"}
    path = tmp_path / "memory_formula.ipynb"
    nbformat.write(nb, path)
    results, _ = check(path, timeout=120)
    visible = [t for t in results if t.status != "hidden"]
    assert visible and all(t.status == "fail" and "NotImplementedError" in t.message for t in visible)


def test_another_exercise_saved_under_an_exercises_name_is_checked_as_what_it_holds(tmp_path):
    """kv_cache.ipynb saved as memory_formula.ipynb was checked as memory_formula: four notes about deleted and
    renamed cells, and 'memory_formula 0/5' in progress. Its cells decide, and the learner is told."""
    import shutil

    from course.grade.check import exercise_of, restored

    path = tmp_path / "memory_formula.ipynb"
    shutil.copy(EXERCISES / "02_kv_cache" / "kv_cache.ipynb", path)
    assert exercise_of(path) == "kv_cache"
    _, notes = restored(path)
    assert notes == [f"this file is named memory_formula.ipynb but holds the cells of kv_cache.ipynb: it was checked "
                     f"as kv_cache (save it as kv_cache.ipynb)"]
    shutil.copy(EXERCISES / "01_memory_formula" / "memory_formula.ipynb", path)
    assert exercise_of(path) == "memory_formula" and restored(path)[1] == []


@pytest.mark.parametrize("release, code, shown", [  # routes an adversarial review took past the scan (2026-12-04)
    ("03_sampler", "import importlib\n_e = importlib.__import__('course.engine.' + 'sampling', fromlist=['x'])",
     ".__import__()"),
    ("01_memory_formula", "import course.config\nb = course.memory.kv_cache_bytes(1, 1, 1, 1, 1, 2)",
     "course.memory.kv_cache_bytes"),  # the release's `from course.memory import GiB` allows GiB, not this
    ("03_sampler", "import course.config\ne = course.engine\nf = e.sampling.sample", "course.engine.sampling.sample"),
    ("01_memory_formula", "import traceback\nframes = list(traceback.walk_stack(None))", "traceback.walk_stack"),
    ("01_memory_formula", "import operator\nloc = operator.attrgetter('f_' + 'locals')", "attrgetter(…)"),
    ("01_memory_formula", "from operator import attrgetter\nloc = attrgetter('f_locals')", "attrgetter(…)"),
    ("01_memory_formula", "import operator\nc = operator.attrgetter('__clo' 'sure__')", "attrgetter(…)"),
])
def test_more_evasions_of_the_scan_are_named(release, code, shown):
    notes = integrity.flags(_with(_release(release), code), _release(release))
    assert any(shown in n for n in notes), notes


@pytest.mark.parametrize("code", [
    "from operator import attrgetter\nrows = sorted([], key=attrgetter('n_layers'))",
    "import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError as e:\n    traceback.print_exc()\n"
    "    last = traceback.extract_tb(e.__traceback__)[-1]\ntraceback.print_stack(limit=2)",
    "import course.config\nprint(course.memory.GiB, course.memory.human_bytes(3))",  # what the release imports
])
def test_honest_uses_of_the_same_tools_get_no_note(code):
    assert integrity.flags(_with(_release("01_memory_formula"), code), _release("01_memory_formula")) == []


@pytest.mark.parametrize("code, shown", [  # a second adversarial review (2026-12-04)
    ("import course.config\nf = g.__getattribute__('__clo' + 'sure__')", "__getattribute__"),
    ("from importlib.machinery import SourceFileLoader\nm = SourceFileLoader('m', 'x.py').load_module()",
     ".SourceFileLoader()"),
    ("import code\ncode.InteractiveInterpreter(globals()).runsource('x = 1', '<checks x>', 'exec')", "code"),
    ("import types\nf = types.FunctionType(g.__code__, {})", ".FunctionType()"),
])
def test_evasions_from_a_second_review_are_named(code, shown):
    notes = integrity.flags(_with(_release("03_sampler"), code), _release("03_sampler"))
    assert any(shown in n for n in notes), notes
