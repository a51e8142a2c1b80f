"""The progress store keeps its guarantees, each shown once: a new process reads what was saved; concurrent writers lose
nothing; a damaged file is set aside, never overwritten; another program's file, a read-only file, an unreadable one
and a named pipe are left untouched, with one clear line; a full disk and a busy file too. And `kvcourse progress`."""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from course.paths import PROJECT_ROOT
from course.teach.progress import BUSY_MESSAGE, ProgressFileError, ProgressFileWarning, ProgressStore
from course.teach.questions import LEVELS, load_questions


def _saved(path: Path) -> Path:
    """A progress file with one answer, all of it in the main file (as a copied file would be)."""
    ProgressStore(path).record_answer("02_kv_cache", "kv-1", "A", True)
    sqlite3.connect(path).execute("PRAGMA wal_checkpoint(TRUNCATE)").connection.close()
    return path


def _aside(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.glob(path.name + ".corrupt-*") if not p.name.endswith(("-wal", "-shm")))


def _kvcourse(*argv, env: dict, limit_file_size: bool = False) -> subprocess.CompletedProcess:
    """`kvcourse ARGV` in a new process; limit_file_size: no file may grow past 8 KiB (RLIMIT_FSIZE), so every write
    SQLite makes fails as on a full disk."""
    script = textwrap.dedent("""
        import builtins, resource, sys
        sys.dont_write_bytecode = True
        builtins.input = lambda prompt="": print(prompt) or "A"
        if sys.argv[1] == "1":
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        from course.cli import main
        sys.exit(main(sys.argv[2:]))
    """)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(PROJECT_ROOT), "PYTHONDONTWRITEBYTECODE": "1", **env}
    return subprocess.run([sys.executable, "-c", script, str(int(limit_file_size)), *argv], env=env, text=True,
                          capture_output=True, timeout=120, cwd=str(PROJECT_ROOT))


def test_what_is_saved_is_read_by_a_new_process(tmp_path):
    path = tmp_path / "p.sqlite"
    subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from course.teach.progress import ProgressStore
        s = ProgressStore({str(path)!r})
        s.record_answer("02_kv_cache", "kv-70b", "B", False)
        s.record_answer("02_kv_cache", "kv-70b", "A", True)
        s.record_self_assessment("02_kv_cache", "getting there")
        s.record_card_view("02_kv_cache", "interview-3")
        s.record_exercise_check("kv_cache", 5, 7, {{"failed": ["test_overflow"]}})
        s.record_measurements("02_kv_cache", {{"cache_speedup": 7.5, "bad": object()}})
        s.record_prediction("01_prefill_decode", "decode_ms", "ms per token", 20, 25, 0.3, "ms")
    """)], check=True, cwd=PROJECT_ROOT, timeout=120)
    store = ProgressStore(path)
    assert [(a["choice"], a["correct"]) for a in store.answers("02_kv_cache")] == [("B", False), ("A", True)]
    assert store.self_assessment("02_kv_cache") == "Getting there" and store.self_assessment("03_sampling") is None
    assert store.cards_seen() == {"interview-3"}
    (check,) = store.exercise_checks()
    assert (check["passed"], check["total"], check["runs"]) == (5, 7, 1)
    assert check["details"] == {"failed": ["test_overflow"]}
    assert store.measurements("02_kv_cache") == {"cache_speedup": 7.5}  # the one JSON cannot hold is left out
    (p,) = store.rows("predictions")
    assert (p["predicted"], p["measured"], p["tolerance"], p["correct"]) == (20, 25, 0.3, True)


@pytest.mark.parametrize("call, match", [
    (lambda s: s.record_self_assessment("03_sampling", "expert"), "level must be one of"),
    (lambda s: s.record_answer("", "prefill-ab", "A", True), "lesson must be a non-empty string"),
    (lambda s: s.record_exercise_check("kv_cache", 8, 7), r"0 <= passed <= total, got 8, 7"),
    (lambda s: s.record_prediction("01", "k", "p", float("nan"), 2.0, 0.3, "ms"), "predicted must be a finite number"),
    (lambda s: s.record_prediction("01", "k", "p", 1.0, 2.0, 0, "ms"), "tolerance must be a number > 0"),
])
def test_bad_input_is_a_clear_value_error(tmp_path, call, match):
    store = ProgressStore(tmp_path / "p.sqlite")
    with pytest.raises(ValueError, match=match):
        call(store)
    assert not (tmp_path / "p.sqlite").exists() or sum(store.counts().values()) == 0


def _writer(path: str, worker: int, n: int, start) -> None:
    start.wait()  # all writers begin together, on a file none of them has made yet
    store = ProgressStore(path)
    for i in range(n):
        store.record_answer("01_prefill_decode", f"q{worker}-{i}", "B", i % 2 == 0)
        if i % 10 == 0:
            store.record_self_assessment("01_prefill_decode", LEVELS[i % 3])


def test_four_writer_processes_lose_nothing(tmp_path):
    path, workers, n = tmp_path / "shared.sqlite", 4, 50
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")  # fork: no torch re-import
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(path), w, n, start)) for w in range(workers)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * workers
    store = ProgressStore(path)
    assert sorted(a["question_id"] for a in store.answers()) == sorted(f"q{w}-{i}" for w in range(workers)
                                                                        for i in range(n))
    assert store.counts()["self_assessments"] == workers * n // 10


def test_a_truncated_file_is_set_aside_never_overwritten(tmp_path, monkeypatch, capsys):
    path = tmp_path / "progress.sqlite"
    path.write_bytes(_saved(tmp_path / "good.sqlite").read_bytes()[:3000])  # `head -c 3000 good > progress.sqlite`
    damaged = path.read_bytes()
    store = ProgressStore(path)
    with pytest.warns(ProgressFileWarning, match="moved aside to") as caught:
        store.record_answer("00_start_here", "start-1", "B", True)
    (aside,) = _aside(path)
    assert aside.read_bytes() == damaged
    assert str(path) in str(caught[0].message) and str(aside) in str(caught[0].message)
    assert [a["question_id"] for a in ProgressStore(path).answers()] == ["start-1"]  # the fresh file

    # named with --file, a damaged file is reported and left where it is
    named = tmp_path / "named.db"
    named.write_bytes(damaged)
    from course.cli import main

    assert main(["progress", "--file", str(named)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvcourse progress: {named} is damaged") and "left as it is" in err
    assert named.read_bytes() == damaged and _aside(named) == []


def _another_programs(path: Path, in_the_wal: bool) -> dict:
    con = sqlite3.connect(path, isolation_level=None)
    if in_the_wal:  # as it lies while that program runs: its tables still in the -wal
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
    con.execute("INSERT INTO notes (text) VALUES ('mine')")
    if in_the_wal:  # closing would fold the -wal in: keep the two files as they were before closing
        before = {p: p.read_bytes() for p in (path, Path(f"{path}-wal"))}
        con.close()
        for p, data in before.items():
            p.write_bytes(data)
        Path(f"{path}-shm").unlink(missing_ok=True)
    else:
        con.close()
    return {p.name: p.read_bytes() for p in path.parent.iterdir()}


@pytest.mark.parametrize("in_the_wal", [False, True])
@pytest.mark.parametrize("argv", [["progress"], ["progress", "--reset", "--yes"], ["review", "--list"]])
def test_another_programs_database_is_never_touched(tmp_path, monkeypatch, capsys, argv, in_the_wal):
    from course.cli import main

    path = tmp_path / "app.db"
    before = _another_programs(path, in_the_wal)
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    main(argv)
    out, err = capsys.readouterr()
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith("-shm")}
    assert after == before  # byte for byte, nothing made beside it (but SQLite's -shm index of its -wal)
    assert "another program's database (tables notes)" in out + err and "left untouched" in out + err
    assert "Traceback" not in out + err and "Progress cleared" not in out


def test_a_file_that_is_not_sqlite_is_never_touched(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my own notes\n" * 20)
    store = ProgressStore(notes)
    for call in (lambda: store.record_answer("00_start_here", "start-1", "A", True), store.answers):
        with pytest.raises(ProgressFileError, match=f"{notes} is not a progress file .* left untouched; set "):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and notes.read_text() == "my own notes\n" * 20


@pytest.mark.parametrize("denied, says", [(os.W_OK, "it is not writable (`chmod u+w"),
                                          (os.R_OK, "cannot read the progress file")])
def test_a_file_we_may_not_write_or_read_is_left_as_it_is(tmp_path, monkeypatch, denied, says):
    """As a learner (not root) sees a chmod 444 file, or one that became root's after a `sudo` run."""
    path = _saved(tmp_path / "progress.sqlite")
    before, files = path.read_bytes(), sorted(tmp_path.iterdir())
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: real_access(p, mode) and not (
        mode & denied and Path(p) == path))
    store = ProgressStore(path)
    for call in (store.answers, lambda: store.record_answer("02_kv_cache", "kv-2", "B", False)):
        with pytest.raises(ProgressFileError, match=re.escape(says)) as caught:
            call()
        assert str(path) in str(caught.value)
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == files


def test_a_named_pipe_is_never_opened(tmp_path):
    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    run = _kvcourse("progress", env={"KVCOURSE_PROGRESS": str(pipe), "HOME": str(tmp_path)})  # would block if opened
    assert run.returncode == 1 and f"{pipe} is a named pipe, not a file" in run.stderr, run.stdout + run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE (ulimit -f) is POSIX")
def test_a_full_disk_is_one_clear_line_and_reads_still_read(tmp_path):
    path = tmp_path / "p.sqlite"
    store = ProgressStore(path)
    for q in load_questions().for_lesson("02_kv_cache")[:6]:
        store.record_answer("02_kv_cache", q.id, "Z", False)
    env = {"KVCOURSE_PROGRESS": str(path), "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    review = _kvcourse("review", env=env, limit_file_size=True)
    assert review.returncode == 1 and "Traceback" not in review.stderr, review.stderr
    (line,) = review.stderr.strip().splitlines()
    assert line.startswith(f"kvcourse review: cannot write the progress file {path}") and "free space" in line
    listed = _kvcourse("progress", env=env, limit_file_size=True)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    (note,) = [ln for ln in listed.stdout.splitlines() if ln.startswith("Note: ")]
    assert "cannot write the progress file" in note and "shown as it is" in note
    assert "6 items in review" in listed.stdout
    assert len(ProgressStore(path).answers()) == 6  # nothing lost


def test_a_busy_file_says_busy_and_is_never_moved_aside(tmp_path, monkeypatch, capsys):
    import course.cli.progress as cli_progress
    from course.cli import main

    path = _saved(tmp_path / "progress.sqlite")
    holder = sqlite3.connect(path, isolation_level=None)  # another process's exclusive lock, held past the timeout
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("COMMIT")
    monkeypatch.setattr(cli_progress, "default_store", lambda: ProgressStore(path, timeout=0.2))
    try:
        with pytest.raises(ProgressFileError, match=r"busy \(another kernel or command is using it\); try again"):
            ProgressStore(path, timeout=0.2).record_answer("02_kv_cache", "kv-2", "B", True)
        assert main(["progress"]) == 1
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert BUSY_MESSAGE in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _aside(path) == [] and [a["question_id"] for a in ProgressStore(path).answers()] == ["kv-1"]


# ---------------------------------------------------------------------- `kvcourse progress`
@pytest.fixture
def progress_file(tmp_path, monkeypatch):
    path = tmp_path / "cli.sqlite"
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    return path


def _row(out: str, lesson: str) -> list[str]:
    (line,) = [ln for ln in out.splitlines() if ln.startswith(lesson + " ")]
    return line.split()


def test_cli_prints_a_per_lesson_table(progress_file, capsys):
    from course.cli import main

    bank = load_questions()
    store = ProgressStore(progress_file)
    assert main(["progress"]) == 0 and "Nothing saved yet" in capsys.readouterr().out
    store.record_answer("01_prefill_decode", "prefill-ab", "A", False)
    store.record_answer("01_prefill_decode", "prefill-ab", "B", True)
    store.record_answer("01_prefill_decode", "prefill-bound", "B", True)
    store.record_self_assessment("01_prefill_decode", "Confident")
    store.record_card_view("01_prefill_decode", "interview-2")
    store.record_prediction("01_prefill_decode", "decode_ms", "ms per token", 20, 40, 0.3, "ms")
    store.record_exercise_check("memory_formula", 6, 6)
    assert main(["progress"]) == 0
    out = capsys.readouterr().out
    n, cards = len(bank.for_lesson("01_prefill_decode")), len(bank.cards_for("01_prefill_decode"))
    # lesson, right/answered, questions, cards seen, predicted, in review (the wrong-then-right one and the
    # prediction), tests, self-assessment
    assert _row(out, "01_prefill_decode") == ["01_prefill_decode", "2/2", str(n), f"1/{cards}", "0/1", "2", "—",
                                              "Confident"]
    assert _row(out, "02_kv_cache")[6] == "6/6"  # the memory-formula exercise follows lesson 02
    assert "2 items in review" in out and "memory_formula" in out and "6/6 tests passed" in out


@pytest.mark.parametrize("reply, deleted", [("yes", True), ("no", False), (EOFError, False)])
def test_cli_reset_asks_first(progress_file, capsys, monkeypatch, reply, deleted):
    from course.cli import main

    ProgressStore(progress_file).record_answer("02_kv_cache", "kv-1", "A", True)
    asked = []

    def answer(prompt):
        asked.append(prompt)
        if reply is EOFError:
            raise EOFError
        return reply

    monkeypatch.setattr("builtins.input", answer)
    assert main(["progress", "--reset"]) == (0 if deleted else 1)
    assert str(progress_file) in asked[0] and "1 answers" in asked[0]
    assert len(ProgressStore(progress_file).answers()) == (0 if deleted else 1)
    monkeypatch.setattr("builtins.input", lambda _p: pytest.fail("must not ask with --yes"))
    assert main(["progress", "--reset", "--yes"]) == 0 and ProgressStore(progress_file).answers() == []


def test_a_healthy_file_is_not_worth_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProgressStore(tmp_path / "p.sqlite").record_answer("00_start_here", "start-3", "A", True)
        assert len(ProgressStore(tmp_path / "p.sqlite").answers()) == 1
