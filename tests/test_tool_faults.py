"""Faults from outside the course's own code: a full disk under the progress file, rows of the progress file edited
by hand or by another tool. Each says what happened and what to do, in one line, instead of a traceback."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import warnings

import pytest

from course.paths import PROJECT_ROOT
from course.teach.progress import ProgressFileWarning, ProgressStore
from course.teach.questions import load_questions

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE (ulimit -f) is POSIX")

# Runs `kvcourse ARGS` with input() answering "A" each time; before answer number FULL_AT the process may write no
# file past 8 KiB (`ulimit -f 8`): every write SQLite makes after that fails, as on a full disk.
_RUN_WITH_A_FULL_DISK = textwrap.dedent("""
    import builtins, resource, sys
    sys.dont_write_bytecode = True  # a .pyc cut off at 8 KiB would break every later import of that module
    from course.cli import main
    full_at = int(sys.argv[1])
    asked = [0]
    def answer(prompt=""):
        asked[0] += 1
        if asked[0] == full_at:
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        print(prompt)
        return "A"
    builtins.input = answer
    if full_at == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    sys.exit(main(sys.argv[2:]))
""")


def _missed_questions(path, n=6):
    bank = load_questions()
    store = ProgressStore(path)
    for q in bank.for_lesson("02_kv_cache")[:n]:
        store.record_answer("02_kv_cache", q.id, "Z", False)
    return store


def _kvcourse_on_a_full_disk(tmp_path, full_at: int, *argv: str) -> subprocess.CompletedProcess:
    env = {"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "KVCOURSE_PROGRESS": str(tmp_path / "p.sqlite"),
           "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(tmp_path), "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.run([sys.executable, "-c", _RUN_WITH_A_FULL_DISK, str(full_at), *argv], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))


def test_a_full_disk_under_the_progress_file_is_one_line_not_a_traceback(tmp_path):
    """It was `sqlite3.OperationalError: disk I/O error` (at PRAGMA synchronous=NORMAL) and a traceback."""
    _missed_questions(tmp_path / "p.sqlite")
    run = _kvcourse_on_a_full_disk(tmp_path, 0, "review")
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 1
    assert "kvcourse review: cannot write the progress file" in run.stderr and "free space" in run.stderr


@pytest.mark.parametrize("argv", [["progress"], ["review", "--list"]])
def test_a_full_disk_still_shows_what_is_saved_to_the_read_only_commands(tmp_path, argv):
    """They said only "cannot write the progress file" (rc 1): reading what is saved needs no space."""
    _missed_questions(tmp_path / "p.sqlite")
    run = _kvcourse_on_a_full_disk(tmp_path, 0, *argv)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 0, run.stderr
    assert "02_kv_cache" in run.stdout and ("kv-70b" in run.stdout or "0/6" in run.stdout), run.stdout


def test_a_disk_that_fills_during_review_stops_it_saying_what_is_saved(tmp_path):
    """It printed a raw `UserWarning: could not save your answer` line, then a traceback."""
    path = tmp_path / "p.sqlite"
    _missed_questions(path)
    run = _kvcourse_on_a_full_disk(tmp_path, 2, "review")  # the first answer is saved, the second is not
    assert "Traceback" not in run.stderr and "UserWarning" not in run.stderr, run.stderr
    assert run.returncode == 1
    (line,) = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert line.startswith("kvcourse review: cannot write the progress file") and "free space" in line
    assert "everything answered before this one is saved" in line
    assert len(ProgressStore(path).answers()) == 6 and len(ProgressStore(path).rows("reviews")) == 1  # the first


# ---------------------------------------------------------------------- rows of the wrong type
_BAD_ROWS = {
    "answer at='abc'": "INSERT INTO answers (lesson, question_id, choice, correct, at) "
                       "VALUES ('02_kv_cache', 'kv-70b', 'A', 1, 'abc')",
    "review reset at='x'": "INSERT INTO review_resets (at) VALUES ('x')",
    "exercise total='x'": "INSERT INTO exercise_checks (exercise, passed, total, details, at) "
                          "VALUES ('paged_cache', 1, 'x', NULL, 5)",
    "latest details not JSON": "INSERT INTO exercise_checks (exercise, passed, total, details, at) "
                               "VALUES ('kv_cache', 1, 2, '{not json', 9e9)",
    "card rating at=NULL-ish blob": "INSERT INTO card_ratings (lesson, card_id, knew, at) "
                                    "VALUES ('02_kv_cache', 'interview-1', 1, x'00')",
    "self-assessment at text": "INSERT INTO self_assessments (lesson, level, at) VALUES ('02_kv_cache', 'got it', 'y')",
    "exercise at=1e300": "INSERT INTO exercise_checks (exercise, passed, total, details, at) "
                         "VALUES ('sampler', 1, 3, NULL, 1e300)",  # a number, but no date: OverflowError
}


@pytest.mark.parametrize("bad", sorted(_BAD_ROWS))
@pytest.mark.parametrize("argv", [["progress"], ["review", "--list"]])
def test_rows_of_the_wrong_type_are_skipped_with_one_note(tmp_path, monkeypatch, capsys, bad, argv):
    """A hand-edited row (at='abc', total='x', details not JSON) made `progress` and `review` fail with
    TypeError: '>' not supported between 'str' and 'float' (or a JSON error naming no file)."""
    from course.cli import main

    path = tmp_path / "p.sqlite"
    store = _missed_questions(path, n=2)
    store.record_exercise_check("kv_cache", 3, 4, {"test_shapes": "passed"})
    con = sqlite3.connect(path)
    con.execute(_BAD_ROWS[bad])
    con.commit()
    con.close()
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told as a note, not raised
        assert main(argv) == 0
    out, err = capsys.readouterr()
    notes = [ln for ln in (out + err).splitlines() if "values of the wrong type" in ln]
    if argv[0] == "review" and ("exercise" in bad or "latest details" in bad or "self-assessment" in bad):
        assert notes == []  # review does not read the exercise checks or the self-assessments
    else:
        assert len(notes) == 1 and notes[0].startswith("Note: ") and str(path) in notes[0]
    assert "Traceback" not in out + err


def test_the_good_rows_beside_a_bad_one_are_all_read(tmp_path):
    path = tmp_path / "p.sqlite"
    store = _missed_questions(path, n=3)
    store.record_exercise_check("kv_cache", 3, 4, {"test_shapes": "passed"})
    con = sqlite3.connect(path)
    for sql in _BAD_ROWS.values():
        con.execute(sql)
    con.commit()
    con.close()
    fresh = ProgressStore(path)
    with pytest.warns(ProgressFileWarning, match="values of the wrong type"):
        assert len(fresh.answers()) == 3
    assert fresh.rows("review_resets") == []
    (check,) = fresh.exercise_checks()  # the latest check has unreadable details: shown without them
    assert (check["passed"], check["total"], check["details"], check["runs"]) == (1, 2, None, 2)
    assert fresh.rows("card_ratings") == [] and fresh.self_assessment("02_kv_cache") is None
    assert any("values of the wrong type" in n for n in fresh.notes)


# ---------------------------------------------------------------------- `kvcourse doctor --quick` (`make setup`)
def _doctor_quick(capsys) -> tuple[int, str]:
    from types import SimpleNamespace

    from course.cli import doctor

    code = doctor.run(SimpleNamespace(quick=True, device="cpu"))
    return code, capsys.readouterr().out


def _course_gguf():
    from course.engine.weights import default_gguf_path

    try:
        return default_gguf_path()
    except FileNotFoundError:
        pytest.skip("the course model is not installed")


@pytest.mark.parametrize("model, says", [
    ("passwd", "is not a GGUF file (it starts with b'root', not b'GGUF')"),
    ("cut in the tensors", "is cut off: it holds"),
    ("cut in the header", "is cut off inside its GGUF header"),
    ("folder", "is a folder, not a GGUF file"),
])
def test_doctor_quick_refuses_a_model_file_that_cannot_load(tmp_path, monkeypatch, capsys, model, says):
    """KVCOURSE_MODEL=/etc/passwd or a truncated GGUF: `doctor --quick` said "all good" (rc 0); a folder gave only
    `[Errno 21] Is a directory`. The header is checked (fast: no model load)."""
    path = tmp_path / "model.gguf"
    if model == "passwd":
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    elif model == "folder":
        path.mkdir()
    else:
        whole = _course_gguf().read_bytes()
        path.write_bytes(whole[:len(whole) - 4096] if model == "cut in the tensors" else whole[:200])
    monkeypatch.setenv("KVCOURSE_MODEL", str(path))
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path / "cache"))
    code, out = _doctor_quick(capsys)
    assert code == 1 and "all good" not in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("model ")]
    assert line.startswith("model       WRONG — ") and f"{path} {says}" in line, line


def test_doctor_quick_refuses_a_cache_path_that_is_a_file(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVCOURSE_MODEL", str(_course_gguf()))
    monkeypatch.setenv("KVCOURSE_CACHE", str(blocker))
    code, out = _doctor_quick(capsys)
    assert code == 1 and "all good" not in out
    assert f"cache       WRONG — {blocker} is a file, not a folder: set KVCOURSE_CACHE to a folder" in out, out


def test_doctor_quick_passes_the_course_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCOURSE_MODEL", str(_course_gguf()))
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path / "cache"))
    code, out = _doctor_quick(capsys)
    assert code == 0 and "all good" in out and "WRONG" not in out, out


def test_relative_paths_reach_the_lab_as_the_command_meant_them(tmp_path, monkeypatch):
    """KVCOURSE_PROGRESS=myprog.sqlite from the project: a notebook's kernel (started in lessons/) wrote
    lessons/myprog.sqlite while `kvcourse progress` read ./myprog.sqlite; the model path failed the same way."""
    import os

    from course.cli.lab import lab_env

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCOURSE_PROGRESS", "myprog.sqlite")
    monkeypatch.setenv("KVCOURSE_MODEL", "models/m.gguf")
    monkeypatch.setenv("KVCOURSE_CACHE", "cache/")
    env = lab_env()
    assert env["KVCOURSE_PROGRESS"] == str(tmp_path / "myprog.sqlite")
    assert env["KVCOURSE_MODEL"] == str(tmp_path / "models" / "m.gguf")
    assert env["KVCOURSE_CACHE"] == str(tmp_path / "cache") + os.sep


def test_doctor_refuses_a_named_pipe_as_the_model_without_waiting(tmp_path):
    import os

    from course.cli.doctor import gguf_problem

    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    assert "not a regular file" in gguf_problem(fifo)


# --------------------------------------------------------------------------- fault injector, second round
def _kvcourse(*argv: str, env: dict, prefix: tuple = (), timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    full = {"HOME": env.get("HOME", "/nonexistent"), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": str(PROJECT_ROOT), **env}
    return subprocess.run([*prefix, sys.executable, "-m", "course.cli", *argv], env=full, capture_output=True,
                          text=True, timeout=timeout, cwd=str(PROJECT_ROOT), **kw)


def _without_dac_override() -> tuple[str, ...]:
    """A prefix under which chmod binds this process (root drops CAP_DAC_OVERRIDE); () for a normal user."""
    import os
    import shutil

    if os.geteuid() != 0:
        return ()
    if not shutil.which("setpriv") or subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all", "true"],
                                                      capture_output=True).returncode != 0:
        pytest.skip("running as root without setpriv: chmod cannot stop this process")
    return ("setpriv", "--inh-caps=-all", "--bounding-set=-all")


def test_an_unreadable_progress_file_is_the_learners_and_says_chmod(tmp_path):
    """It was "not a progress file ... set KVCOURSE_PROGRESS to a file of its own": advice that abandons it."""
    prefix = _without_dac_override()
    path = tmp_path / "progress.sqlite"
    _missed_questions(path)
    before = path.read_bytes()
    path.chmod(0)
    (tmp_path / "tmp").mkdir()
    env = {"KVCOURSE_PROGRESS": str(path), "TMPDIR": str(tmp_path / "tmp")}
    try:
        r = _kvcourse("progress", env=env, prefix=prefix)
        reset = _kvcourse("progress", "--reset", "--yes", env=env, prefix=prefix)
    finally:
        path.chmod(0o644)
    for run in (r, reset):  # one line, naming the file and what to do
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        (line,) = run.stderr.strip().splitlines()
        assert line.startswith(f"kvcourse progress: cannot read the progress file {path} (Permission denied)"), line
        assert f"chmod u+rw {path}" in line and "not a progress file" not in line
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "progress.sqlite", "tmp"]  # nothing moved aside
    assert [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()] == []  # no session copy left behind


@pytest.mark.slow
def test_a_named_pipe_is_refused_without_waiting(tmp_path):
    """Each of these waited forever for a writer to the pipe."""
    import os

    pipe = tmp_path / "p.ipynb"
    os.mkfifo(pipe)
    env = {"TMPDIR": str(tmp_path), "KVCOURSE_PROGRESS": str(tmp_path / "progress.sqlite")}
    for argv, says in ((("check", str(pipe)), "is not a regular file"),
                       (("progress", "--file", str(pipe)), "is not a regular file"),
                       (("review", "--list", "--file", str(pipe)), "is not a regular file")):
        r = _kvcourse(*argv, env=env, timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    r = _kvcourse("progress", env={**env, "KVCOURSE_PROGRESS": str(pipe)}, timeout=60)
    assert r.returncode == 1 and f"{pipe} is a named pipe, not a file" in r.stderr, r.stdout + r.stderr
    assert pipe.exists() and not list(tmp_path.glob("p.ipynb.corrupt*"))


def test_output_closed_early_is_not_an_error(tmp_path):
    """`kvcourse progress | head -1` said "error: [Errno 32] Broken pipe" and exited 2 (review --list: 0)."""
    _missed_questions(tmp_path / "p.sqlite")
    env = {"KVCOURSE_PROGRESS": str(tmp_path / "p.sqlite"), "TMPDIR": str(tmp_path), "HOME": str(tmp_path),
           "PATH": "/usr/bin:/bin", "PYTHONPATH": str(PROJECT_ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    for argv in (("progress",), ("review", "--list")):
        proc = subprocess.Popen([sys.executable, "-m", "course.cli", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=str(PROJECT_ROOT))
        proc.stdout.close()  # the reader is gone before the first line is written, as after `head -1`
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 0, (argv, err)
        assert err == "", (argv, err)


@pytest.mark.parametrize("code, says, not_says", [
    ("ENOSPC", "the disk is full", "permission"), ("EDQUOT", "quota", "permission"),
    ("EACCES", "permission denied in", "Free some space"), ("EPERM", "chmod u+rwx", "Free some space"),
    ("EROFS", "read-only file system", "Free some space"), ("EISDIR", "it is a folder", "Free some space"),
    ("ENOENT", "does not exist", "Free some space"), ("ENOTDIR", "is a file, not a folder", "Free some space")])
def test_a_failed_write_is_explained_by_its_cause(tmp_path, code, says, not_says):
    """Every OSError was "... Free some space and run the same command again"."""
    import errno
    import os

    from course.grade.files import disk_error

    target = {"EISDIR": tmp_path / "report.csv", "ENOENT": tmp_path / "missing" / "grades.csv",
              "ENOTDIR": tmp_path / "a-file" / "grades.csv"}.get(code, tmp_path / "grades.csv")
    if code == "EISDIR":
        target.mkdir()
    elif code == "ENOTDIR":
        (tmp_path / "a-file").write_text("x")
    elif code != "ENOENT":
        target.write_text("old")
    err = str(disk_error(OSError(getattr(errno, code), os.strerror(getattr(errno, code))), target))
    assert says in err and not_says not in err and str(target) in err, err
    assert ("the previous version of the file is intact" in err) == target.is_file(), err
    assert "\n" not in err


def test_a_course_folder_the_grader_cannot_use_says_what_to_give(tmp_path, monkeypatch):
    """`grade` printed "[Errno 17] File exists: '.../work'" and "[Errno 13] Permission denied: ...grade.lock"."""
    from course.grade import files

    course = tmp_path / "c"
    course.mkdir()
    (course / "work").write_text("x")
    with pytest.raises(files.GradingError, match=r"c/work is a file, not a folder .*--course DIR") as exc:
        with files.course_lock(course):
            pass
    assert "Errno" not in str(exc.value)
    (course / "work").unlink()

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(files, "open", refuse, raising=False)
    with pytest.raises(files.GradingError, match=r"cannot write in the course folder .*denied.*--course DIR"):
        with files.course_lock(course):
            pass


def test_a_missing_submissions_folder_is_told_first(tmp_path, capsys):
    """`grade MISSING` reported a sandbox problem (when there was one) before the missing folder."""
    from course.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["grade", str(tmp_path / "nope"), "--course", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{tmp_path / 'nope'} does not exist" in err and "sandbox" not in err, err
    assert not (tmp_path / "c").exists()


def test_an_unknown_option_names_the_subcommand_it_was_given_to(capsys):
    from course.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--model", "X"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "kvcourse doctor: error: unrecognized arguments: --model X" in err, err
    assert "see `kvcourse doctor --help`" in err


def test_a_missing_cuda_device_is_named_with_its_index(monkeypatch):
    """`generate --device cuda:7` said "device 'cuda' was asked for", dropping the index."""
    import torch

    from course.engine.device import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda:7' was asked for but this PyTorch sees no CUDA GPU"):
        pick_device("cuda:7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device 'cuda:7' was asked for but this machine has 2 CUDA GPU\(s\)"):
        pick_device("cuda:7")
    assert pick_device("cuda:1") == torch.device("cuda:1")
