"""Hostile submissions against the sealed grader (autograde/THREAT_MODEL.md): forged events, a sandbox that
kills itself or rewrites what the grader gave it, nbgrader metadata edits, reaching for the hidden checks or the
course's reference, filling the disk. Each attack has its test; the sandboxed ones run a three-cell notebook
against a small checks file (fast to start), the last grades memory-formula submissions built from the
reference sample.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from course.grade import grader, sandbox
from course.grade.verdicts import Check, exact
from course.paths import AUTOGRADE

pytestmark = pytest.mark.slow  # end to end (JupyterHub, sealed sandboxes by the dozen): out of make test-fast

needs_bwrap = pytest.mark.skipif(bool(sandbox.sandbox_problem()),
                                 reason="the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")
SECRET = "HIDDEN-INPUT-4242"
CHECKS_SOURCE = f'''
from course.grade.verdicts import Check, exact

SECRET = "{SECRET}"
CHECKS = {{
    "test_double": [Check("double 21", lambda ns: ns["double"](21), exact, "hint: twice"),
                    Check("double the secret's length", lambda ns: ns["double"](len(SECRET)), exact, "hint: twice")],
}}
'''


def _tiny(tmp_path: Path, hostile: str) -> tuple[Path, Path]:
    """(notebook, checks): a correct answer, then the hostile cell, then the (never run) test cell."""
    test = new_code_cell("assert double(2) == 4")
    test.metadata["nbgrader"] = {"grade": True, "solution": False, "locked": True, "points": 1,
                                 "grade_id": "test_double", "schema_version": 3}
    nb = new_notebook(cells=[new_code_cell("def double(x):\n    return 2 * x"), new_code_cell(hostile), test])
    path, checks = tmp_path / "tiny.ipynb", tmp_path / "tiny_checks.py"
    nbformat.write(nb, str(path))
    checks.write_text(CHECKS_SOURCE)
    return path, checks


def _run(tmp_path: Path, hostile: str, limits: sandbox.Limits | None = None) -> sandbox.Outcome:
    nb, checks = _tiny(tmp_path, hostile)
    return sandbox.run_sealed(nb, checks, tmp_path / "box", limits or sandbox.Limits(cell_timeout=20, wall_s=120))


def _values(outcome) -> dict:
    return {(e["gid"], e["k"]): e["value"] for e in outcome.events if e["ev"] == "check"}


def _printed(outcome, i: int) -> str:
    (done,) = [e for e in outcome.events if e["ev"] == "cell_done" and e["i"] == i]
    return "".join(o.get("text", "") + str(o.get("evalue", "")) for o in done["outputs"])


ALL_CORRECT = {("test_double", 0): {"t": "int", "v": "42"}, ("test_double", 1): {"t": "int", "v": str(2 * len(SECRET))}}


# ----------------------------------------------------------------------------- 1, 2: forged events

def test_forged_check_indices_cost_the_grader_nothing():
    checks = {"test_double": [Check("a", lambda ns: 1, exact), Check("b", lambda ns: 2, exact)]}
    forged = [{"ev": "check", "gid": "test_double", "k": 10 ** 8, "value": {"t": "none"}},
              {"ev": "check", "gid": "test_bonus", "k": 0, "value": {"t": "none"}},
              {"ev": "check", "gid": "test_double", "k": -1, "value": {"t": "none"}},
              {"ev": "check", "gid": "test_double", "k": 1, "value": {"t": "int", "v": "2"}}]
    values = grader._values(forged, checks)
    assert values == {"test_double": [{"t": "rejected", "why": "not run"}, {"t": "int", "v": "2"}]}
    run = sandbox._accept([{"ev": "cells_done"}, {"ev": "check_start", "gid": "test_double", "k": 10 ** 8},
                           {"ev": "check", "gid": "test_double", "k": 10 ** 8, "value": {"t": "none"}}],
                          set(), {"test_double": 2}, None)
    assert run.checks == {} and run.last == ("cells_done",)


def test_forged_events_are_read_in_linear_time():
    fake = [{"ev": "cell_done", "i": 10 ** 6 + j, "outputs": []} for j in range(200_000)]
    events = [{"ev": "cell_start", "i": 0}, {"ev": "cell_done", "i": 0, "outputs": []},
              {"ev": "cell_start", "i": 1}, *fake, {"ev": "cell_start", "i": 10 ** 9}]
    started = time.perf_counter()
    run = sandbox._accept(events, {0, 1}, {"test_double": 2}, None)
    assert time.perf_counter() - started < 5
    assert list(run.cells) == [0] and run.last == ("cell", 1), "the rerun stops at the real cell, not a forged one"


def test_a_forged_cell_start_cannot_replace_an_earlier_cells_output():
    """A cell that writes cell_start/cell_done for earlier cells (or jumps ahead) put forged text in their
    feedback; only the next cell in order may start."""
    def done(i, text):
        return {"ev": "cell_done", "i": i, "outputs": [{"output_type": "stream", "name": "stdout", "text": text}]}

    events = [{"ev": "cell_start", "i": 1}, done(1, "real 1"), {"ev": "cell_start", "i": 3},
              {"ev": "cell_start", "i": 1}, done(1, "FORGED 1"), {"ev": "cell_start", "i": 9}, done(9, "FORGED 9"),
              done(3, "real 3"), {"ev": "cell_start", "i": 7}, done(7, "real 7")]
    run = sandbox._accept(events, {1, 3, 7, 9}, {}, None)
    assert {i: e["outputs"][0]["text"] for i, e in run.cells.items()} == {1: "real 1", 3: "real 3", 7: "real 7"}
    assert run.last == ("cell", 7)


def test_the_feedback_of_one_notebook_has_a_size_limit():
    big = [{"output_type": "stream", "name": "stdout", "text": "x" * (grader.OUTPUT_LIMIT + 10)}] * 40
    budget = [grader.NOTEBOOK_OUTPUT_LIMIT]
    kept = [grader._clean_outputs(big, budget) for _ in range(5)]
    assert all(len(cell) <= grader.OUTPUTS_PER_CELL for cell in kept)
    total = sum(len(o["text"]) for cell in kept for o in cell)
    assert total < grader.NOTEBOOK_OUTPUT_LIMIT + 200 * grader.OUTPUTS_PER_CELL * 5, total
    assert "the notebook's outputs reached their limit" in kept[-1][0]["text"]


@needs_bwrap
def test_a_sandbox_that_forges_events_is_graded_on_its_code(tmp_path):
    outcome = _run(tmp_path, "import json, os\n"
                             "line = b''.join(json.dumps({'ev': 'cell_done', 'i': 10**6 + j, 'outputs': []}).encode()"
                             " + b'\\n' for j in range(40000))\n"
                             "for f in os.listdir('/proc/self/fd'):\n"
                             "    try:\n"
                             "        os.write(int(f), line + json.dumps({'ev': 'check', 'gid': 'test_double', "
                             "'k': 10**8, 'value': None}).encode() + b'\\n' + json.dumps({'ev': 'cell_start', "
                             "'i': 10**9}).encode() + b'\\n')\n"
                             "    except OSError:\n"
                             "        pass\n"
                             "os._exit(3)\n")
    assert not outcome.infrastructure and outcome.attempts == 2, outcome
    assert [e["i"] for e in outcome.events if e["ev"] == "cell_done"] == [0, 1]
    assert _values(outcome) == ALL_CORRECT
    assert outcome.seconds < 90, "forged events must not slow the grader down (it was quadratic)"


EARLY_CHECKS = """
import json, os, stat, sys
fd = next(f for f in range(3, 256) if os.path.exists(f"/proc/self/fd/{f}") and stat.S_ISFIFO(os.fstat(f).st_mode)
          and f != 0)
os.write(fd, json.dumps({"ev": "cells_done"}).encode() + b"\\n")  # the grader now writes the checks to stdin
checks = sys.stdin.buffer.readline().decode()
print("STOLEN", checks)
sys.stderr.write("STOLEN " + checks)
"""

LEAK_AT_CHECK_TIME = """
import json, os, sys
def double(x):
    secret = [str(c) for c in sys._getframe(1).f_code.co_consts]  # the checks' own code, calling this
    for fd in range(3, 256):
        for i in (0, 1, 2):  # cell outputs, forged for every cell: the grader takes none after "cells_done"
            try:
                os.write(fd, json.dumps({"ev": "cell_done", "i": i, "outputs": [
                    {"output_type": "stream", "name": "stdout", "text": "STOLEN " + repr(secret)}]}).encode() + b"\\n")
            except OSError:
                pass
    print("STOLEN", secret)
    sys.stderr.write("STOLEN " + repr(secret))
    raise type("STOLEN_" + str(x), (ValueError,), {})(repr(secret))  # its name and message carry the input
"""


def _cell_text(outcome) -> str:
    return json.dumps([e for e in outcome.events if e["ev"] == "cell_done"])


@needs_bwrap
def test_nothing_written_once_the_checks_are_in_the_sandbox_reaches_anyone(tmp_path):
    """A cell that says "cells_done" itself gets the checks early and prints them: the grader takes no cell output
    from that point on. A function the checks call prints, forges cell outputs and raises an exception named after
    its input: none of it reaches the outputs, and the value says only what kind of exception came back."""
    outcome = _run(tmp_path, EARLY_CHECKS)
    assert SECRET not in _cell_text(outcome) and "STOLEN" not in _cell_text(outcome), _cell_text(outcome)[:500]
    assert _values(outcome) == {}, "the checks it read never ran: its own loss"
    (tmp_path / "b").mkdir()
    outcome = _run(tmp_path / "b", LEAK_AT_CHECK_TIME)
    assert "STOLEN" not in _cell_text(outcome) and SECRET not in json.dumps(outcome.events), outcome.events
    assert {json.dumps(v) for v in _values(outcome).values()} == {
        json.dumps({"t": "raised", "builtin_bases": ["ValueError", "Exception", "BaseException"]})}


def test_events_are_json_lines_and_nothing_else():
    data = b"\n".join([b'{"ev": "cell_start", "i": 0}', b"not json", b'["ev"]', b'{"ev": 3}', b"{\"ev\": \"done\"}"])
    assert sandbox._parse(data) == [{"ev": "cell_start", "i": 0}, {"ev": "done"}]


def test_after_cells_done_no_cell_output_counts():
    def done(i, text):
        return {"ev": "cell_done", "i": i, "outputs": [{"output_type": "stream", "name": "stdout", "text": text}]}

    events = [{"ev": "cell_start", "i": 0}, {"ev": "cells_done"}, done(0, "after"), {"ev": "cell_start", "i": 1},
              done(1, "after"), {"ev": "check_start", "gid": "test_double", "k": 0},
              {"ev": "check", "gid": "test_double", "k": 0, "value": {"t": "int", "v": "42"}}]
    run = sandbox._accept(events, {0, 1}, {"test_double": 2}, None)
    assert run.cells == {} and run.checks == {("test_double", 0): {"t": "int", "v": "42"}}


@needs_bwrap
def test_a_cell_that_swallows_its_timeout_is_stopped_when_it_goes_silent(tmp_path):
    """A loop that catches the timeout's interrupt held each attempt until the wall-clock limit (300 s, up to
    four attempts); a run silent for stall_s is now stopped and the rest graded."""
    hostile = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
    outcome = _run(tmp_path, hostile, sandbox.Limits(cell_timeout=2, wall_s=300, stall_s=20))
    assert any("went on 20 s without finishing" in p for p in outcome.problems), outcome.problems
    assert outcome.seconds < 100, outcome.seconds
    assert _values(outcome) == ALL_CORRECT


@needs_bwrap
def test_a_submission_that_keeps_the_pipe_busy_gets_at_most_twice_the_wall_clock_limit(tmp_path):
    """A function that swallows its timeout and writes a byte to the events pipe every half second is never
    silent, so only the wall-clock limit stops it, at each check it hangs (up to four attempts: 20 min at the
    default 300 s). A submission's runs now stop at twice the wall-clock limit."""
    keepalive = ("import os, time\nfds = [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]\n"
                 "def double(x):\n    while True:\n        try:\n            for f in fds:\n                try:\n"
                 "                    os.write(f, b'\\n')\n                except OSError:\n                    pass\n"
                 "            time.sleep(0.5)\n        except BaseException:\n            pass\n")
    outcome = _run(tmp_path, keepalive, sandbox.Limits(cell_timeout=2, wall_s=30, stall_s=20))  # stall_s: the
    assert any("no further run" in p for p in outcome.problems), outcome.problems  # start on a busy machine
    assert outcome.seconds < 2 * 30 + 15, outcome.seconds


# ----------------------------------------------------------------------------- 3: a sandbox that kills itself

@needs_bwrap
def test_a_submission_that_sigkills_itself_is_graded(tmp_path):
    outcome = _run(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert not outcome.infrastructure, outcome
    assert _values(outcome) == ALL_CORRECT, "the cells before it count, the checks ran"
    assert any("SIGKILL" in p for p in outcome.problems)
    assert "DeadKernelError" in json.dumps([e for e in outcome.events if e.get("i") == 1])


@needs_bwrap
def test_a_submission_cannot_corrupt_the_checks_for_its_rerun(tmp_path):
    outcome = _run(tmp_path, "import os\nfor p in ('/sub/checks.py', '/sub/job.json', '/sub/submission.ipynb'):\n"
                             "    open(p, 'w').write(\"raise SystemExit('no checks today')\\n\")\nos._exit(1)")
    assert not outcome.infrastructure, outcome
    assert _values(outcome) == ALL_CORRECT
    assert any("kernel died" in p for p in outcome.problems)


# ----------------------------------------------------------------------------- 5: hidden checks

PROBE = f"""
import glob, os
seen = []
for path in glob.glob('/sub/**', recursive=True) + glob.glob('/tmp/**', recursive=True):
    try:
        seen.append(open(path, errors='replace').read())
    except OSError:
        pass
for fd in os.listdir('/proc/self/fd'):
    try:
        os.lseek(int(fd), 0, 0)
    except OSError:
        pass
    try:
        os.set_blocking(int(fd), False)
        seen.append(os.read(int(fd), 1 << 20).decode(errors='replace'))
    except (OSError, TypeError):
        pass
print('LEAKED' if '{SECRET[:6]}' + '{SECRET[6:]}' in ''.join(seen) else 'nothing on disk', sorted(os.listdir('/sub')))
"""


@needs_bwrap
def test_the_hidden_checks_are_not_on_the_sandboxs_disk(tmp_path):
    outcome = _run(tmp_path, PROBE)
    printed = _printed(outcome, 1)
    assert "nothing on disk" in printed and "LEAKED" not in printed, printed
    assert _values(outcome) == ALL_CORRECT


# ----------------------------------------------------------------------------- 5b: no capabilities

# Run as root, bwrap kept nearly every capability in the sandbox (CAP_SYS_ADMIN among them), so a
# submission could remount the read-only bind of the course package writable and rewrite the grader itself.
ESCAPE = """
import ctypes, os
import course
pkg = os.path.dirname(course.__file__)
libc = ctypes.CDLL(None, use_errno=True)
caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]
print('capabilities', caps)
print('remount', libc.mount(None, pkg.encode(), None, 32 | 4096, None))  # MS_REMOUNT | MS_BIND: read-write
try:
    open(os.path.join(pkg, 'grade', 'ESCAPED_FROM_SANDBOX.py'), 'w').write('x = 1')
    print('WROTE INTO THE PACKAGE')
except OSError as exc:
    print('write refused:', exc)
"""


@needs_bwrap
def test_the_sandbox_has_no_capabilities_and_cannot_remount_the_package(tmp_path):
    import course

    planted = Path(course.__file__).parent / "grade" / "ESCAPED_FROM_SANDBOX.py"
    try:
        outcome = _run(tmp_path, ESCAPE)
        printed = _printed(outcome, 1)
        assert "capabilities 0000000000000000" in printed, printed
        assert "remount -1" in printed and "write refused" in printed, printed
        assert not planted.exists()
        assert _values(outcome) == ALL_CORRECT
    finally:
        planted.unlink(missing_ok=True)


def test_root_only_system_files_are_not_readable_in_the_sandbox(tmp_path):
    """/etc is bound in and a root grader's sandbox runs as root: /etc/shadow and private keys were readable
    and a print put them in the student's feedback."""
    files, folders = sandbox._private_system_files()
    if not files and not folders:
        pytest.skip("this machine has no file under /etc that only root may read")
    probe = ("import os\nfor p in %r:\n    try:\n        data = open(p, 'rb').read() if os.path.isfile(p) "
             "else os.listdir(p)\n        print('READ', p, len(data))\n    except OSError as exc:\n"
             "        print('refused', p, type(exc).__name__)\n" % (files[:5] + folders[:3]))
    if not sandbox.sandbox_problem():
        outcome = _run(tmp_path, probe)
        printed = _printed(outcome, 1)
        for line in printed.splitlines():
            assert not line.startswith("READ") or line.endswith(" 0"), printed  # an empty file or folder at most
        assert _values(outcome) == ALL_CORRECT
    cmd = sandbox.bwrap_command(None, ["true"], {})
    for path in files:
        assert cmd[cmd.index(path) - 2:cmd.index(path)] == ["--ro-bind", "/dev/null"], path
    for path in folders:
        assert cmd[cmd.index(path) - 1] == "--tmpfs", path


REACH_FOR_THE_REFERENCE = """
import glob, importlib, os, sys
import course
package = os.path.dirname(course.__file__)
tries = {}
for name in ("course.engine.sampling", "course.lessons.sampling_demos", "course.widgets.sampling_explorer"):
    try:
        importlib.import_module(name)
        tries[name] = "IMPORTED"
    except ImportError as exc:
        tries[name] = type(exc).__name__
found = [p for top in (package, "/sub", "/tmp") for p in glob.glob(top + "/**/*sampling*", recursive=True)]
print("TRIES", tries, "FOUND", found, "PACKAGE", sorted(os.listdir(package)))
"""


@needs_bwrap
def test_the_exercises_reference_is_not_in_the_sandbox(tmp_path):
    """The course package inside holds what the harness, the checks and the released notebook import, minus the
    checks' ABSENT: the reference is neither importable nor readable nor findable on disk (a copy of the package,
    marshal of its bytecode, a gc walk: nothing to reach)."""
    nb, checks = _tiny(tmp_path, REACH_FOR_THE_REFERENCE)
    checks.write_text(CHECKS_SOURCE + '\nABSENT = ["course.engine.sampling"]\n')
    outcome = sandbox.run_sealed(nb, checks, tmp_path / "box", sandbox.Limits(cell_timeout=60, wall_s=180))
    printed = _printed(outcome, 1)
    assert "IMPORTED" not in printed and "FOUND []" in printed, printed
    listed = printed.split("PACKAGE")[1]
    assert "'engine'" in listed and not {"'lessons'", "'measure'", "'teach'", "'widgets'", "'cli'"} & set(
        listed.strip(" []\n").split(", ")), printed
    assert _values(outcome) == ALL_CORRECT


def test_a_module_that_needs_the_reference_at_import_stops_grading_with_its_name(tmp_path):
    from course.grade.files import GradingError

    checks = tmp_path / "x_checks.py"
    checks.write_text(CHECKS_SOURCE + "\nABSENT = ['course.engine.config']\n")
    tree = sandbox._tree(frozenset({"course.grade.harness"}), ("course.engine.sampling",))
    assert not (tree / "engine" / "sampling.py").exists() and not list(tree.rglob("__pycache__"))
    with pytest.raises(GradingError, match=r"^course\.[\w.]+ imports course\.engine\.config when it is loaded"):
        sandbox.course_tree(checks)


# ----------------------------------------------------------------------------- 6: disk and tmpfs caps

def test_the_tmpfs_are_sized_from_the_memory_cap():
    limits = sandbox.Limits(memory_mb=2048)
    cmd = sandbox.bwrap_command(None, ["true"], {}, limits.tmpfs_bytes())
    for mount in ("/tmp", "/sub"):
        at = cmd.index(mount)
        assert cmd[at - 1] == "--tmpfs" and cmd[at - 3] == "--size", (mount, cmd)
        assert int(cmd[at - 2]) == 512 * 2 ** 20, "half the memory cap in all, half of it each"


def _can_cap_memory() -> bool:
    group = sandbox._memory_cgroup(2 ** 30)
    sandbox._remove_cgroups([group])
    return group is not None


MEMFD_HOG = """
import os
held = []
for i in range(24):  # 3 GiB in memfd files: RLIMIT_AS does not count them
    fd = os.memfd_create(f"m{i}")
    with open(fd, "r+b", closefd=False) as f:
        for _ in range(128):
            f.write(b"\\1" * (1 << 20))
    held.append(fd)
print("HELD", 128 * len(held), "MiB")
"""


@needs_bwrap
@pytest.mark.skipif(not _can_cap_memory(), reason="a memory cgroup needs root and cgroup access")
def test_memory_outside_the_address_space_counts_against_the_cap(tmp_path):
    """memfd files are RAM that RLIMIT_AS does not see: 2.5 GiB was held under a 2 GiB cap."""
    outcome = _run(tmp_path, MEMFD_HOG, sandbox.Limits(cell_timeout=60, wall_s=120, memory_mb=1024))
    assert "HELD" not in _printed(outcome, 1)
    assert any("more memory than its cap (1024 MiB" in p for p in outcome.problems), outcome.problems
    assert outcome.attempts == 2, "over its own cap is the submission's doing: no rerun"
    assert _values(outcome) == ALL_CORRECT


@needs_bwrap
def test_dev_shm_is_small(tmp_path):
    hog = ("n = 0\ntry:\n    for i in range(8):\n        with open(f'/dev/shm/f{i}', 'wb') as f:\n"
           "            f.write(b'\\1' * (32 << 20))\n        n += 32\nexcept OSError as exc:\n"
           "    print('refused at', n, 'MiB', type(exc).__name__)\n")
    outcome = _run(tmp_path, hog)
    printed = _printed(outcome, 1)
    assert "refused at" in printed, printed
    assert int(printed.split("refused at")[1].split()[0]) <= sandbox.SHM_BYTES // 2 ** 20, printed


@needs_bwrap
def test_writing_past_the_disk_cap_fails_and_is_reported(tmp_path):
    hog = ("chunk = b'\\1' * (16 << 20)\nfor where in ('/tmp', '/sub'):\n    n = 0\n    try:\n"
           "        for i in range(40):\n            with open(f'{where}/fill{i}', 'wb') as f:\n"
           "                f.write(chunk)\n            n += 16\n    except OSError as e:\n"
           "        print(where, 'stopped at', n, 'MiB:', e)\n")
    outcome = _run(tmp_path, hog, sandbox.Limits(memory_mb=1024, cell_timeout=20, wall_s=120))
    printed = _printed(outcome, 1)
    assert "/tmp stopped at" in printed and "/sub stopped at" in printed, printed
    for where in ("/tmp", "/sub"):
        stopped = int(printed.split(f"{where} stopped at ")[1].split()[0])
        assert stopped <= 256, f"{where}: 1 GiB of memory cap gives 256 MiB each, it wrote {stopped} MiB"
    assert any("filled its scratch space" in p and "256 MiB" in p for p in outcome.problems), outcome.problems
    assert _values(outcome) == ALL_CORRECT


# ----------------------------------------------------------------------------- 3, 4: whole submissions

SAMPLE = AUTOGRADE / "samples" / "reference" / "01_memory_formula" / "memory_formula.ipynb"


def _gid(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def _hostile_submissions(folder: Path) -> None:
    def save(student: str, nb) -> None:
        (folder / student / "01_memory_formula").mkdir(parents=True)
        nbformat.write(nb, str(folder / student / "01_memory_formula" / "memory_formula.ipynb"))

    ref = nbformat.read(str(SAMPLE), as_version=4)
    nb = copy.deepcopy(ref)  # kills itself after its last answer
    nb.cells.append(new_code_cell("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"))
    save("sigkill-self", nb)

    nb = copy.deepcopy(ref)  # rewrites the checks file, then dies so that the grader reruns it
    nb.cells.append(new_code_cell(
        "import os\nopen('/sub/checks.py', 'w').write(\"raise SystemExit('no checks today')\\n\")\nos._exit(1)"))
    save("corrupt-checks", nb)

    nb = copy.deepcopy(ref)  # an extra test cell with an id nobody knows
    extra = new_code_cell("print('bonus')")
    extra.metadata["nbgrader"] = {"grade": True, "grade_id": "test_bonus", "locked": True, "points": 50,
                                  "schema_version": 3, "solution": False, "task": False}
    nb.cells.append(extra)
    save("extra-test-cell", nb)

    nb = copy.deepcopy(ref)  # an answer cell marked graded, with points
    (cell,) = [c for c in nb.cells if _gid(c) == "gqa_saving"]
    cell.metadata["nbgrader"].update(grade=True, points=25)
    save("answer-graded", nb)

    nb = copy.deepcopy(ref)  # correct code under a renamed answer id
    (cell,) = [c for c in nb.cells if _gid(c) == "kv_cache_bytes"]
    cell.metadata["nbgrader"]["grade_id"] = "my_kv_cache_bytes"
    save("renamed-answer-id", nb)

    # metadata and code that the grader reads before any sandbox starts: each once stopped the whole class
    for student, meta in (("meta-list", []), ("meta-gid-list", {"grade_id": ["x"], "solution": True}),
                          ("meta-gid-dict", {"grade_id": {"a": 1}, "grade": True, "points": 9})):
        nb = copy.deepcopy(ref)
        extra = new_code_cell("x = 1")
        extra.metadata["nbgrader"] = meta
        nb.cells.append(extra)
        save(student, nb)
    nb = copy.deepcopy(ref)  # too deeply nested for Python's parser (RecursionError) and a MemoryError in it
    nb.cells.append(new_code_cell("total = " + " + ".join(["1"] * 10_000) + "\ny = " + "-" * 200_000 + "1"))
    save("deep-expression", nb)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if sandbox.sandbox_problem():
        pytest.skip("the sealed grader needs bubblewrap")
    from course.grade import grader

    root = tmp_path_factory.mktemp("hostile")
    _hostile_submissions(root / "subs")
    rows = grader.grade(root / "subs", root / "course", jobs=1, progress=False, log=lambda *_: None)
    return {r.student: r for r in rows}


@pytest.mark.slow  # grades nine submissions
def test_a_sandbox_killed_by_its_own_code_is_graded_not_left_ungraded(graded):
    row = graded["sigkill-self"]
    assert row.status == "graded" and row.score == row.max_score > 0, row
    assert "SIGKILL" in row.problems and "kernel died" in row.problems


@pytest.mark.slow  # grades nine submissions
def test_a_submission_that_corrupts_the_checks_is_graded(graded):
    row = graded["corrupt-checks"]
    assert row.status == "graded" and row.score == row.max_score > 0, row
    assert "kernel died" in row.problems


@pytest.mark.slow  # grades nine submissions
def test_an_unknown_test_cell_is_ignored_and_reported(graded):
    row, full = graded["extra-test-cell"], graded["sigkill-self"].max_score
    assert row.status == "graded" and row.score == row.max_score == full, row
    assert "test_bonus" in row.problems and "ordinary code" in row.problems


@pytest.mark.slow  # grades nine submissions
def test_an_answer_cell_marked_graded_gets_the_released_metadata(graded):
    row = graded["answer-graded"]
    assert row.status == "graded" and row.score == row.max_score == graded["sigkill-self"].max_score, row
    assert "cell metadata restored as released: gqa_saving" in row.problems


@pytest.mark.slow  # grades nine submissions
@pytest.mark.parametrize("student", ["meta-list", "meta-gid-list", "meta-gid-dict", "deep-expression"])
def test_odd_metadata_or_deep_code_is_graded_and_stops_no_one(graded, student):
    """Parsed outside the sandbox before any ran: an AttributeError, TypeError or RecursionError there ended
    `kvcourse grade` for the class, with no report.csv."""
    row, full = graded[student], graded["sigkill-self"].max_score
    assert row.status == "graded" and row.score == row.max_score == full, row


@pytest.mark.slow  # grades nine submissions
def test_a_renamed_answer_id_is_graded_on_its_code(graded):
    row = graded["renamed-answer-id"]
    assert row.status == "graded" and row.score == row.max_score > 0, row
    assert "my_kv_cache_bytes -> kv_cache_bytes" in row.problems
