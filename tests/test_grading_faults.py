"""Faults of the grader itself: a second grader, a full disk, a truncated gradebook, a corrupt ledger, a
kernel killed from outside, the grader killed with -9, missing and renamed notebooks, and the sandbox's
walls (what a submission's process can see and reach). Each fault has its test; the slow ones grade the
memory-formula reference, whose sandbox starts fastest.
"""
from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from course.grade import files, grader, nbgrader_api, sandbox, submissions
from course.grade.files import GradingError
from course.paths import AUTOGRADE, PROJECT_ROOT

SAMPLES = AUTOGRADE / "samples"
ASSIGNMENT = "01_memory_formula"
needs_bwrap = pytest.mark.skipif(bool(sandbox.sandbox_problem()),
                                 reason="the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")


def _folder(tmp_path: Path, students: dict[str, str]) -> Path:
    """students: {name in the class: sample to copy}."""
    folder = tmp_path / "submissions"
    for name, sample in students.items():
        shutil.copytree(SAMPLES / sample / ASSIGNMENT, folder / name / ASSIGNMENT)
    return folder


def _quiet(*_):
    pass


# ----------------------------------------------------------------------------- fast

def test_a_second_grader_on_the_same_folder_stops_with_a_clear_message(tmp_path):
    course = tmp_path / "course"
    with files.course_lock(course):
        with pytest.raises(GradingError, match=r"another grader is already working on .*course \(pid \d+"):
            grader.grade(_folder(tmp_path, {"ann": "reference"}), course, progress=False, log=_quiet)
    with files.course_lock(course):  # released: the next one gets it
        pass


def test_a_second_course_folder_reuses_the_reference_run_of_this_process(tmp_path, monkeypatch):
    limits = sandbox.Limits()
    first = grader.reference_values(ASSIGNMENT, tmp_path / "a", limits)
    monkeypatch.setattr(sandbox, "run_sealed", lambda *a, **k: pytest.fail("the solution ran a second time"))
    assert repr(grader.reference_values(ASSIGNMENT, tmp_path / "b", limits)) == repr(first)  # a raise has no ==
    stored = tmp_path / "b" / "reference" / f"{ASSIGNMENT}.json"
    assert stored.read_bytes() == (tmp_path / "a" / "reference" / f"{ASSIGNMENT}.json").read_bytes()
    assert stored.stat().st_mode & 0o077 == 0  # the hidden checks' answers: private, as the first
    with pytest.raises(pytest.fail.Exception, match="a second time"):  # other limits (a smaller cap may not start)
        grader.reference_values(ASSIGNMENT, tmp_path / "c", sandbox.Limits(memory_mb=2048))


def test_a_lock_left_by_a_killed_grader_is_taken_once_the_process_it_forked_ends(tmp_path):
    lock = tmp_path / "course" / "work" / "grade.lock"
    lock.parent.mkdir(parents=True)
    code = ("import fcntl, os, time\n"
            f"fh = open({str(lock)!r}, 'a+')\n"
            "fcntl.flock(fh, fcntl.LOCK_EX)\n"
            "fh.write(f'pid {os.getpid()}, started now')\n"
            "fh.flush()\n"
            "if os.fork() == 0:  # a sandbox being started: it shares the lock until it ends\n"
            "    time.sleep(2)\n"
            "    os._exit(0)\n"
            "os._exit(0)  # the grader itself, killed\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    started = time.monotonic()
    with files.course_lock(tmp_path / "course"):  # the named grader is gone: wait for its child, not refuse
        waited = time.monotonic() - started
    assert 0.5 < waited < 10, waited


def test_atomic_writes_leave_the_previous_file_on_a_full_disk(tmp_path, monkeypatch):
    target = tmp_path / "grades.csv"
    target.write_text("student,score\nann,14\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError):
        files.atomic_write(target, "student,score\n")
    assert target.read_text() == "student,score\nann,14\n"
    assert [p.name for p in tmp_path.iterdir()] == ["grades.csv"], "no temp file left behind"


def test_atomic_writes_keep_the_files_permissions(tmp_path):
    """mkstemp's 0600 replaced a grades.csv the teaching assistants could read with one only its writer could."""
    path = tmp_path / "grades.csv"
    files.atomic_write(path, "a,b\n")
    old = os.umask(0)
    os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~old
    path.chmod(0o640)
    files.atomic_write(path, "a,b\n1,2\n")
    with files.atomic_output(path) as tmp:
        tmp.write_text("c\n")
    assert path.stat().st_mode & 0o777 == 0o640 and path.read_text() == "c\n"


def test_a_new_gradebook_is_stamped_with_the_schema_version_alembic_itself_reports(tmp_path):
    import sqlite3

    from nbgrader import dbutil
    from nbgrader.api import Gradebook

    ini = tmp_path / "alembic.ini"
    dbutil.write_alembic_ini(str(ini), "sqlite:///" + str(tmp_path / "unused.db"))
    heads = subprocess.run([str(Path(sys.executable).with_name("alembic")), "-c", str(ini), "heads"],
                           capture_output=True, text=True, check=True).stdout
    nbgrader_api.schema_version_here()
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}", "kvcourse"):
        pass
    with sqlite3.connect(tmp_path / "gradebook.db") as con:
        (stamped,), = con.execute("SELECT version_num FROM alembic_version").fetchall()
    assert heads.split()[0] == stamped and "(head)" in heads


def test_csv_export_on_a_full_disk_keeps_the_previous_grades(tmp_path, monkeypatch):
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    cfg = nbgrader_api.load_config(tmp_path)
    nbgrader_api.schema_version_here()
    with Gradebook(cfg.CourseDirectory.db_url, "kvcourse") as gb:
        gb.update_or_create_student("ann")
    previous = "assignment,duedate,timestamp,student_id,last_name,first_name,email,raw_score,late_submission_penalty,score,max_score\nx\n"
    (tmp_path / "grades.csv").write_text(previous)

    def export_until_the_disk_fills(self, gradebook):
        with open(self.to, "w") as fh:
            fh.write("assignment,dued")  # half a header, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CsvExportPlugin, "export", export_until_the_disk_fills)
    with pytest.raises(GradingError, match="disk is full; the previous version of the file is intact"):
        nbgrader_api.export_csv(cfg, tmp_path / "grades.csv")
    assert (tmp_path / "grades.csv").read_text() == previous


def test_a_corrupt_ledger_is_named(tmp_path):
    course = tmp_path / "course"
    (course / "work").mkdir(parents=True)
    (course / "work" / "ledger.json").write_text('{"sources": {"01_memory_formula": "ab')
    with pytest.raises(GradingError, match=r"ledger\.json \(the grading ledger\) is corrupt"):
        grader.Ledger(course / "work" / "ledger.json")
    out = subprocess.run([sys.executable, "-m", "course.cli", "grade", str(_folder(tmp_path, {"ann": "reference"})),
                          "--course", str(course), "--quiet"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2 and str(course / "work" / "ledger.json") in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_truncated_gradebook_is_detected_and_named(tmp_path):
    db = tmp_path / "gradebook.db"
    assert nbgrader_api.gradebook_problem(db) == "", "no gradebook yet is fine"
    db.write_bytes(b"SQLite format 3\x00" + b"\x10\x00" + b"\x00" * 80)  # a header, then nothing
    assert nbgrader_api.gradebook_problem(db)
    db.write_bytes(b"not a database at all" * 10)
    assert "not a readable SQLite database" in nbgrader_api.gradebook_problem(db)


def test_a_gradebook_left_by_a_killed_writer_is_rolled_back_not_moved_aside(tmp_path):
    """A writer killed mid-commit leaves gradebook.db-journal: read-only SQLite then called the sound gradebook
    unreadable, the grader moved it aside without its journal, and every grade was lost."""
    import sqlite3

    db = tmp_path / "gradebook.db"
    con = sqlite3.connect(db)
    for table in nbgrader_api.NBGRADER_TABLES:
        con.execute(f"CREATE TABLE {table}(x)")
    con.execute("CREATE TABLE scores(student, score)")
    con.execute("INSERT INTO scores VALUES ('ann', 14)")
    con.commit()
    con.close()
    killed = subprocess.run([sys.executable, "-c", (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA cache_size=1'); c.execute('BEGIN IMMEDIATE')\n"
        "c.execute('DELETE FROM scores'); c.execute('CREATE TABLE junk(x)')\n"
        "c.executemany('INSERT INTO junk VALUES (?)', [('x' * 1000,)] * 500)\n"
        "os.kill(os.getpid(), 9)"), str(db)], timeout=60)
    assert killed.returncode != 0 and db.with_name("gradebook.db-journal").exists()
    assert nbgrader_api.gradebook_problem(db) == ""
    con = sqlite3.connect(db)
    assert con.execute("SELECT student, score FROM scores").fetchall() == [("ann", 14)], "the grades are kept"
    con.close()


def test_missing_notebooks_get_rows_and_renamed_downloads_are_accepted(tmp_path):
    known = {ASSIGNMENT: ["memory_formula"], "02_kv_cache": ["kv_cache"]}
    (tmp_path / "ann" / ASSIGNMENT).mkdir(parents=True)
    shutil.copy(SAMPLES / "reference" / ASSIGNMENT / "memory_formula.ipynb",
                tmp_path / "ann" / ASSIGNMENT / "memory_formula (1).ipynb")
    (tmp_path / "bob").mkdir()  # a student who handed in nothing
    (tmp_path / "cat" / ASSIGNMENT).mkdir(parents=True)  # an empty assignment folder
    found = {(s.student, s.assignment): s for s in submissions.discover(tmp_path, known)}
    ann = found["ann", ASSIGNMENT]
    assert ann.problem == "" and ann.notebook == "memory_formula"
    assert ann.problems == ["file named 'memory_formula (1).ipynb': graded as memory_formula.ipynb"]
    assert found["bob", ASSIGNMENT].missing and found["bob", ASSIGNMENT].problem.startswith("missing")
    assert found["cat", ASSIGNMENT].missing
    assert ("bob", "02_kv_cache") not in found, "missing rows only for the assignments being graded"


def test_plain_data_refuses_subclasses_and_objects():
    import numpy as np
    import torch

    from course.grade.plain import Array, Rejected, decode, encode
    from course.grade.verdicts import close, exact

    class Always(int):
        def __eq__(self, other):
            return True

    for value, ok in ((3, True), (2.5, True), (True, True), ("B", True), ([1, (2, 3.0)], True), ({"a": 1}, True),
                      (np.int64(3), True), (Always(3), False), (torch.nn.Parameter(torch.ones(2)), False),
                      (object(), False), ({1: 2}, False)):
        back = decode(json.loads(json.dumps(encode(value))))
        assert (not isinstance(back, Rejected)) == ok, value
    t = torch.tensor([1.0, float("-inf"), 2.0])
    assert isinstance(decode(encode(t)), Array)
    assert close(0.0)(decode(encode(t.clone())), decode(encode(t)))
    assert not close(0.0)(decode(encode(torch.tensor([1.0, 0.0, 2.0]))), decode(encode(t)))
    assert not close(1e-3)(decode(encode(t.double())), decode(encode(t))), "dtype counts"
    assert not exact(decode(encode(torch.tensor([1, 2]))), decode(encode(np.array([1, 2])))), "a tensor is asked"
    assert isinstance(decode({"t": "tensor", "dtype": "float32", "shape": [5], "b64": ""}), Rejected)


def _judged(got, ref, compare="exact") -> tuple[bool, str]:
    from course.grade.plain import decode, encode
    from course.grade.verdicts import close, exact, mismatch

    g, r = decode(json.loads(json.dumps(encode(got)))), decode(encode(ref))
    return (exact if compare == "exact" else close(1e-9))(g, r), mismatch(g, r)


@pytest.mark.parametrize("got, ref, compare, passes, named", [
    # a right answer in any type that carries the number exactly: full marks
    ("np.int64(524288)", "524288", "exact", True, ""), ("np.uint16(7)", "7", "exact", True, ""),
    ("Fraction(12, 1)", "12", "exact", True, ""), ("torch.tensor(12)", "12", "exact", True, ""),
    ("np.array(12)", "12", "exact", True, ""), ("[np.int32(1), Fraction(4, 2)]", "[1, 2]", "exact", True, ""),
    ("Fraction(8, 1)", "8.0", "close", True, ""), ("np.float32(0.5)", "0.5", "close", True, ""),
    ("torch.tensor(8.0)", "8.0", "close", True, ""), ("np.int64(3)", "3.0", "close", True, ""),
    ("Fraction(1, 3)", "1 / 3", "close", True, ""),
    # a wrong type: no marks, and the hint names the type
    ("524288.0", "524288", "exact", False, "a float where an integer is asked"),
    ("np.float64(6.0)", "6", "exact", False, "a numpy.float64 where an integer is asked"),
    ("torch.tensor(6.0)", "6", "exact", False, "a float32 tensor where an integer is asked"),
    ("Fraction(1, 2)", "1", "exact", False, "a Fraction where an integer is asked"),
    ("True", "1", "exact", False, "a bool where an integer is asked"),
    ("'8'", "8.0", "close", False, "a str where a number is asked"),
    ("(1, 2.0)", "(1, 2)", "exact", False, "a float where an integer is asked"),
    ("torch.ones(2, dtype=torch.float64)", "torch.ones(2)", "exact", False, "a float64 tensor where a float32"),
])
def test_a_number_is_judged_by_its_value_and_a_wrong_type_is_named(got, ref, compare, passes, named):
    """The grader's comparison, which `kvcourse check`'s visible tests share (verdicts.expect)."""
    from fractions import Fraction  # noqa: F401 (the table's expressions use it)

    import numpy as np  # noqa: F401
    import torch  # noqa: F401

    ok, why = _judged(eval(got), eval(ref), compare)
    assert ok == passes and named in why and (why == "") == passes, (ok, why)


def test_the_verdict_names_types_from_a_fixed_list():
    """A hidden check's hint may name the kind of value that failed it, never text the learner's code chose: its
    class's name, an exception's name or message, a refusal's reason forged in the pipe, a shape."""
    import torch

    from course.grade.plain import decode, error
    from course.grade.verdicts import describe, mismatch

    Secret = type("Secret_30_1_1", (int,), {})
    leak = type("Leak_30_1_1", (ValueError,), {})("30, 1, 1, 3, 64, 2")
    for got in (Secret(5), leak, torch.zeros(30, 1, 1, 3, 64, 2)):
        from course.grade.plain import encode

        value = encode(got) if not isinstance(got, BaseException) else error(got)
        text = mismatch(decode(json.loads(json.dumps(value))), decode(encode(7)))
        assert "30" not in text and "Secret" not in text and "Leak" not in text, text
    forged = [{"t": "rejected", "why": "30, 1, 1, 3, 64, 2"}, {"t": "raised", "builtin_bases": ["Leak_30", "KeyError"]},
              {"t": "int", "v": "1", "type": "Leak_30_1_1"}, {"t": "float", "v": "1.5", "type": "numpy.float64"}]
    texts = [describe(decode(v)) for v in forged]
    assert texts == ["malformed", "an exception (KeyError)",
                     "an object of its own class, not plain data", "a numpy.float64"], texts


# ----------------------------------------------------------------------------- the sandbox's walls

SNOOP = r"""
import json, os, socket, sys
import course, course.paths
out = {"uid": os.getuid(), "listing": sorted(os.listdir(str(course.paths.PROJECT_ROOT))),
       "solutions": str(course.paths.SOLUTIONS), "solutions_exist": os.path.exists(str(course.paths.SOLUTIONS)),
       "secret": os.path.exists(sys.argv[1]), "root": sorted(os.listdir("/"))}
try:
    import course.teach.questions
    out["bank"] = "importable"
except ImportError:
    out["bank"] = "absent"
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=2)
    out["network"] = "connected"
except OSError as exc:
    out["network"] = type(exc).__name__
try:
    open(os.path.join(os.path.dirname(course.__file__), "written-by-a-submission"), "w")
    out["write_outside"] = True
except OSError:
    out["write_outside"] = False
print(json.dumps(out))
"""


@needs_bwrap
def test_inside_the_sandbox_a_submission_sees_only_the_course_package(tmp_path):
    secret = tmp_path / "gradebook.db"
    secret.write_text("grades")
    server = __import__("socket").create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    (tmp_path / "box").mkdir()
    (tmp_path / "box" / "snoop.py").write_text(SNOOP)
    cmd = sandbox.bwrap_command(tmp_path / "box", [sys.executable, "/sub/snoop.py", str(secret), str(port)],
                                sandbox._sandbox_env(1))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    server.close()
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not seen["secret"], "files outside the submission's folder are invisible"
    assert not seen["solutions_exist"] and "solutions" not in seen["listing"] and "autograde" not in seen["listing"]
    assert set(seen["listing"]) <= {"course", ".venv"}, seen["listing"]
    assert seen["solutions"].startswith("/nonexistent"), "course.paths names no place for the solutions"
    assert seen["network"] != "connected", "no network, not even the host's loopback"
    assert not seen["write_outside"], "the course package is read-only"
    assert not (PROJECT_ROOT / "course" / "written-by-a-submission").exists()
    assert seen["bank"] == "absent", "the question bank (course.teach) is not in the grading sandbox's package"


@needs_bwrap
def test_the_sandbox_caps_memory(tmp_path):
    box = tmp_path / "box"
    box.mkdir()
    (box / "hog.py").write_text("x = bytearray(3 * 2**30)\nprint('allocated')\n")
    limits = sandbox.Limits(memory_mb=1024)
    proc = subprocess.run(sandbox.bwrap_command(box, [sys.executable, "/sub/hog.py"], sandbox._sandbox_env(1)),
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=sandbox._limiter(limits, sandbox._user_tasks() + 64))
    assert "MemoryError" in proc.stderr and "allocated" not in proc.stdout


@needs_bwrap
def test_the_sandbox_caps_processes(tmp_path):
    box = tmp_path / "box"
    box.mkdir()
    (box / "forks.py").write_text(
        "import os, time\nn = 0\ntry:\n    for _ in range(2000):\n        if os.fork() == 0:\n"
        "            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n")
    limits = sandbox.Limits(extra_processes=64)
    cgroup = sandbox._pids_cgroup(limits.extra_processes)
    try:
        proc = subprocess.run(sandbox.bwrap_command(box, [sys.executable, "/sub/forks.py"], sandbox._sandbox_env(1)),
                              capture_output=True, text=True, timeout=120,
                              preexec_fn=sandbox._limiter(limits, sandbox._user_tasks() + 64, [cgroup]))
    finally:
        time.sleep(3.5)
        sandbox._remove_cgroups([cgroup])
    assert int(proc.stdout.strip()) < 200, "a fork bomb stops at the process cap"


def test_grading_stops_when_the_sandbox_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: "the grading sandbox needs bubblewrap (`bwrap`)")
    with pytest.raises(GradingError, match=r"needs bubblewrap.*nothing was graded.*--unsandboxed"):
        grader.grade(_folder(tmp_path, {"ann": "reference"}), tmp_path / "course", progress=False, log=_quiet)
    assert not (tmp_path / "course" / "grades.csv").exists()


# ----------------------------------------------------------------------------- slow: faults while grading

def _descendants(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids + [g for k in kids for g in _descendants(k)]


@pytest.mark.slow
@needs_bwrap
def test_a_kernel_killed_from_outside_is_regraded_not_zeroed(tmp_path):
    folder, course = _folder(tmp_path, {"ann": "reference"}), tmp_path / "course"
    killed = []

    def kill_soon(proc):
        def kill():  # as soon as the sandboxed harness is running (bwrap and imports take a while)
            deadline = time.monotonic() + 120
            while not killed and time.monotonic() < deadline and proc.poll() is None:
                for pid in _descendants(proc.pid):
                    try:
                        if b"course.grade.harness" in Path(f"/proc/{pid}/cmdline").read_bytes():
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
                            break
                    except OSError:
                        pass
                time.sleep(0.1)
        if not killed:
            threading.Thread(target=kill, daemon=True).start()

    (row,) = grader.grade(folder, course, progress=False, log=_quiet, on_sandbox_start=kill_soon)
    assert killed, "the test killed the sandboxed harness"
    # a first SIGKILL may come from outside: the same job runs again at once, and nothing is lost
    assert row.status == "graded" and row.score == row.max_score > 0, row
    assert "SIGKILL" in row.problems and "run again" in row.problems and "kernel died" not in row.problems


@pytest.mark.slow
@needs_bwrap
def test_kill_9_of_the_grader_takes_its_sandboxes_with_it(tmp_path):
    folder, course = _folder(tmp_path, {"ann": "adv-infinite-loop", "bob": "adv-infinite-loop"}), tmp_path / "course"
    proc = subprocess.Popen([sys.executable, "-m", "course.cli", "grade", str(folder), "--course", str(course),
                             "--jobs", "2", "--quiet"], cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def sandboxed():  # this grader's own sandboxes (other graders may run on the machine; the reference run is not one)
        return [p for p in _descendants(proc.pid)
                if b"--unshare-all" in _cmdline(p) and b"course.grade.harness" in _cmdline(p)]

    deadline, seen = time.monotonic() + 300, []
    while time.monotonic() < deadline and not (seen := sandboxed()):  # read once: a sandbox may end between two reads
        time.sleep(0.5)
    assert seen, "sandboxes were running"
    running = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the grader only, not its process group
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_pid_alive(p) for p in running):
        time.sleep(0.2)
    assert not [p for p in running if _pid_alive(p)], "sandboxes outlived the grader"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@needs_bwrap
def test_a_truncated_gradebook_is_rebuilt_by_regrading(tmp_path):
    folder, course = _folder(tmp_path, {"ann": "reference", "bob": "blank"}), tmp_path / "course"
    first = {r.student: r.score for r in grader.grade(folder, course, progress=False, log=_quiet)}
    db = course / "gradebook.db"
    db.write_bytes(db.read_bytes()[:4096])  # cut off, as by a crash or a full disk
    messages = []
    rows = grader.grade(folder, course, progress=False, log=messages.append)
    assert any(str(db) in m and "rebuilt" in m for m in messages), messages
    assert {r.student: r.score for r in rows} == first and all(r.status == "graded" for r in rows)
    assert list(course.glob("gradebook.db.corrupt-*")), "the broken file is kept aside, not deleted"
    exported = {r["student_id"]: float(r["score"]) for r in csv.DictReader(open(course / "grades.csv"))}
    assert exported == first


@pytest.mark.slow
@needs_bwrap
def test_missing_students_appear_in_both_csvs(tmp_path):
    folder, course = _folder(tmp_path, {"ann": "reference"}), tmp_path / "course"
    (folder / "bob").mkdir()
    rows = {r.student: r for r in grader.grade(folder, course, progress=False, log=_quiet)}
    assert rows["bob"].status == "missing"
    report = {r["student"]: r for r in csv.DictReader(open(course / "report.csv"))}
    assert report["bob"]["status"] == "missing" and report["ann"]["status"] == "graded"
    exported = {r["student_id"]: r for r in csv.DictReader(open(course / "grades.csv"))}
    assert float(exported["bob"]["score"]) == 0.0 and float(exported["ann"]["score"]) == rows["ann"].score


@pytest.mark.slow
@needs_bwrap
def test_the_ledger_is_trusted_only_while_the_gradebook_and_feedback_hold_the_grade(tmp_path):
    """With gradebook.db deleted (or an old backup restored) a rerun said 14/14 from the ledger while grades.csv
    held only its header; with feedback/ deleted it was never written again; a ledger entry in another layout
    ended the run with an AttributeError."""
    folder, course = _folder(tmp_path, {"ann": "reference"}), tmp_path / "course"
    (first,) = grader.grade(folder, course, progress=False, log=_quiet)
    assert first.score == first.max_score > 0

    def exported():
        return {r["student_id"]: float(r["score"]) for r in csv.DictReader(open(course / "grades.csv"))}

    (course / "gradebook.db").unlink()
    (row,) = grader.grade(folder, course, progress=False, log=_quiet)
    assert row.score == first.score and exported() == {"ann": first.score}
    shutil.rmtree(course / "feedback")
    grader.grade(folder, course, progress=False, log=_quiet)
    assert list((course / "feedback" / "ann" / ASSIGNMENT).glob("*.html")), "the feedback is written again"
    ledger = course / "work" / "ledger.json"
    data = json.loads(ledger.read_text())
    data["graded"]["ann/" + ASSIGNMENT] = "oops"
    ledger.write_text(json.dumps(data))
    (row,) = grader.grade(folder, course, progress=False, log=_quiet)
    assert row.status == "graded" and row.score == first.score and exported() == {"ann": first.score}
    # an older gradebook restored: its 14/14 belongs to another file than the one the ledger graded last
    backup = (course / "gradebook.db").read_bytes()
    shutil.copy(SAMPLES / "blank" / ASSIGNMENT / "memory_formula.ipynb", folder / "ann" / ASSIGNMENT)
    (blank,) = grader.grade(folder, course, progress=False, log=_quiet)
    assert blank.score == 0
    (course / "gradebook.db").write_bytes(backup)
    for page in (course / "feedback" / "ann" / ASSIGNMENT).glob("*.html"):
        page.unlink()  # and its feedback page deleted: written again
    (row,) = grader.grade(folder, course, progress=False, log=_quiet)
    assert row.score == 0 and exported() == {"ann": 0.0} and "manual" not in row.problems, row
    assert list((course / "feedback" / "ann" / ASSIGNMENT).glob("*.html"))


def test_a_course_folder_inside_the_submissions_folder_is_refused(tmp_path):
    folder = _folder(tmp_path, {"ann": "reference"})
    with pytest.raises(GradingError, match="inside the submissions folder"):
        grader.grade(folder, folder / "_course", progress=False, log=_quiet)
    assert not (folder / "_course").exists(), "refused before anything was written"


@pytest.mark.slow
@needs_bwrap
def test_an_instructors_manual_grade_survives_a_forced_regrade_and_a_broken_resubmission_is_named(tmp_path):
    """The instructor's score on a test cell (formgrader's manual_score) is theirs: a rerun reports it, --force
    keeps it; and when a graded student's file no longer opens, the report says grades.csv still has the old grade."""
    from nbgrader.api import Gradebook

    folder, course = _folder(tmp_path, {"ann": "blank"}), tmp_path / "course"
    (first,) = grader.grade(folder, course, progress=False, log=_quiet)
    assert first.status == "graded" and first.score < first.max_score
    db_url = f"sqlite:///{course / 'gradebook.db'}"
    with Gradebook(db_url, "kvcourse") as gb:
        nb = gb.find_submission_notebook("memory_formula", ASSIGNMENT, "ann")
        cell = next(g for g in nb.grades if g.auto_score == 0 and g.max_score > 0)
        cell.manual_score = cell.max_score  # the instructor gives the points
        gb.db.commit()
        gid, points = cell.name, float(cell.max_score)
    (again,) = grader.grade(folder, course, progress=False, log=_quiet)  # cached: the gradebook's score, said so
    assert again.score == first.score + points and "manual grades" in again.problems
    (forced,) = grader.grade(folder, course, force=True, progress=False, log=_quiet)
    assert forced.score == first.score + points, "a forced regrade wiped the instructor's grade"
    assert f"{gid}: the instructor's manual score" in forced.problems
    exported = {r["student_id"]: float(r["score"]) for r in csv.DictReader(open(course / "grades.csv"))}
    assert exported["ann"] == forced.score
    (folder / "ann" / ASSIGNMENT / "memory_formula.ipynb").write_text('{"cells": [')  # the resubmission breaks
    (broken,) = grader.grade(folder, course, progress=False, log=_quiet)
    assert broken.status == "invalid" and "grades.csv still has the earlier grade" in broken.problems


@needs_bwrap
def test_a_second_checkout_sharing_the_environment_is_named_before_grading(tmp_path):
    """A copy of the course imported from elsewhere than the virtual environment's checkout: inside the sandbox
    Python would import the other copy, so every submission failed; the start-up check now says why."""
    copy = tmp_path / "checkout"
    shutil.copytree(PROJECT_ROOT / "course", copy / "course", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import course; "
            "assert course.__file__.startswith(sys.argv[1]); "
            "from course.grade import sandbox; print(sandbox.sandbox_problem())")
    out = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cannot import this copy of the course" in out.stdout and "make setup" in out.stdout


@pytest.mark.slow
@needs_bwrap
def test_a_memory_cap_too_small_to_start_python_is_named_as_such(tmp_path):
    """An exercise whose notebook needs torch (exercise 01's does not, and grades within 256 MiB)."""
    folder, course = tmp_path / "submissions", tmp_path / "course"
    shutil.copytree(SAMPLES / "reference" / "02_kv_cache", folder / "ann" / "02_kv_cache")
    with pytest.raises(GradingError) as err:
        grader.grade(folder, course, memory_mb=256, progress=False, log=_quiet)
    text = str(err.value)
    assert "could not start" in text and "--memory-mb 256" in text and "does not run cleanly" not in text


@pytest.mark.slow
@needs_bwrap
def test_a_gradebook_held_by_another_program_is_named_busy_never_moved_aside(tmp_path):
    """A gradebook another program holds (formgrader writing, a stuck process) is in use, not broken: it used to be
    moved aside as 'not a readable SQLite database (database is locked)' and rebuilt, losing manual grades."""
    folder, course = _folder(tmp_path, {"ann": "reference"}), tmp_path / "course"
    (first,) = grader.grade(folder, course, progress=False, log=_quiet)
    db = course / "gradebook.db"
    before = db.read_bytes()
    hold = ("import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(GradingError, match="is busy"):
            grader.grade(folder, course, force=True, progress=False, log=_quiet)
    finally:
        holder.kill()
        holder.wait()
    assert not list(course.glob("gradebook.db.corrupt-*")) and db.read_bytes() == before
    exported = {r["student_id"]: float(r["score"]) for r in csv.DictReader(open(course / "grades.csv"))}
    assert exported["ann"] == first.score


def _gradebook(path: Path) -> bytes:
    """A small SQLite file with nbgrader's tables (their columns do not matter to the check)."""
    import sqlite3

    con = sqlite3.connect(str(path))
    for table in sorted(nbgrader_api.NBGRADER_TABLES):
        con.execute(f'CREATE TABLE "{table}" (id INTEGER)')
    con.commit()
    con.close()
    return path.read_bytes()


@pytest.mark.parametrize("cause", ["unable to open database file", "database or disk is full", "disk I/O error"])
def test_a_gradebook_this_user_cannot_open_is_not_called_damaged(tmp_path, monkeypatch, cause):
    """A fault injector found a sound gradebook with no read permission (after a run with sudo), or on a full disk,
    called 'not a readable SQLite database': `kvcourse grade` moved it aside and rebuilt it, so the manual grades
    in it were gone from the live gradebook and grades.csv; the classroom told the teacher to rm it."""
    import sqlite3

    db = tmp_path / "course" / "gradebook.db"
    db.parent.mkdir()
    before = _gradebook(db)
    assert nbgrader_api.gradebook_problem(db) == ""

    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError(cause)

    monkeypatch.setattr(nbgrader_api.sqlite3, "connect", refuse)
    with pytest.raises(GradingError, match="cannot be opened") as err:
        nbgrader_api.gradebook_problem(db)
    assert cause in str(err.value) and "not moved" in str(err.value) and "permissions" in str(err.value)
    with pytest.raises(GradingError, match="cannot be opened"):  # the grader stops before it touches anything
        grader.grade(_folder(tmp_path, {"ann": "reference"}), db.parent, progress=False, log=_quiet)
    assert db.read_bytes() == before and not list(db.parent.glob("gradebook.db.corrupt-*"))


def test_a_gradebook_without_permission_is_named_before_sqlite_opens_it(tmp_path, monkeypatch):
    db = tmp_path / "gradebook.db"
    _gradebook(db)
    monkeypatch.setattr(nbgrader_api.os, "access", lambda path, mode: Path(path) != db)
    with pytest.raises(GradingError, match="cannot be opened .*permission denied"):
        nbgrader_api.gradebook_problem(db, retry="run the command again")
