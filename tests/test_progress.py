"""Saved progress: round trip across processes, concurrent writers, corrupt-file recovery, `kvcourse progress`."""
from __future__ import annotations

import multiprocessing as mp
import sqlite3
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from course.teach.progress import LEVELS, ProgressFileWarning, ProgressStore, default_path, normalise_level
from course.teach.questions import load_questions

ROOT = Path(__file__).resolve().parent.parent


def test_round_trip_survives_a_new_process(tmp_path):
    path = tmp_path / "p.sqlite"
    # A separate Python process stands in for a kernel that is later restarted.
    script = textwrap.dedent(f"""
        from course.teach.progress import ProgressStore
        s = ProgressStore({str(path)!r})
        s.record_answer("02_kv_cache", "kv-70b", "B", False)
        s.record_answer("02_kv_cache", "kv-70b", "A", True)
        s.record_answer("02_kv_cache", "kv-1", "A", True)
        s.record_self_assessment("02_kv_cache", "getting there")
        s.record_card_view("02_kv_cache", "interview-3")
        s.record_exercise_check("kv_cache", 5, 7, {{"failed": ["test_overflow", "test_positions"]}})
        s.record_measurements("02_kv_cache", {{"cache_speedup": 7.5, "bad": object()}})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=120)

    store = ProgressStore(path)
    answers = store.answers("02_kv_cache")
    assert [(a["question_id"], a["choice"], a["correct"]) for a in answers] == [
        ("kv-70b", "B", False), ("kv-70b", "A", True), ("kv-1", "A", True)]
    assert store.latest_answers()["kv-70b"]["choice"] == "A"
    assert store.self_assessment("02_kv_cache") == "Getting there"
    assert store.self_assessment("03_sampling") is None
    assert store.cards_seen("02_kv_cache") == {"interview-3"}
    (check,) = store.exercise_checks()
    assert (check["exercise"], check["passed"], check["total"], check["runs"]) == ("kv_cache", 5, 7, 1)
    assert check["details"]["failed"] == ["test_overflow", "test_positions"]
    assert store.measurements("02_kv_cache") == {"cache_speedup": 7.5}  # the unserialisable one skipped

    summary = {s.lesson: s for s in store.summary(load_questions()).lessons}
    kv = summary["02_kv_cache"]
    assert (kv.answered, kv.right, kv.first_try, kv.cards_seen) == (2, 2, 1, 1)
    assert kv.questions >= 5 and kv.cards >= 3


def test_latest_self_assessment_wins_and_levels_are_normalised(tmp_path):
    store = ProgressStore(tmp_path / "p.sqlite")
    for level in ("New to it", "getting_there", 2):
        store.record_self_assessment("03_sampling", level)
    assert store.self_assessment("03_sampling") == "Confident"
    assert normalise_level("NEW TO IT") == LEVELS[0]


@pytest.mark.parametrize("call, match", [
    (lambda s: s.record_self_assessment("03_sampling", "expert"), "level must be one of"),
    (lambda s: s.record_answer("", "prefill-ab", "A", True), "lesson must be a non-empty string"),
    (lambda s: s.record_exercise_check("kv_cache", 8, 7), r"passed must be an integer in \[0, total=7\]"),
    (lambda s: s.record_exercise_check("kv_cache", 1, -1), "total must be an integer >= 0"),
])
def test_bad_input_is_a_clear_value_error(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(ProgressStore(tmp_path / "p.sqlite"))


def _writer(path: str, worker: int, n: int, start) -> None:
    start.wait()  # all writers begin together, on a file none of them has created yet
    store = ProgressStore(path)
    for i in range(n):
        store.record_answer("01_prefill_decode", f"q{worker}-{i}", "B", i % 2 == 0)
        if i % 10 == 0:
            store.record_self_assessment("01_prefill_decode", LEVELS[i % 3])


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "shared.sqlite"
    workers, n = 4, 100
    # Separate processes, like two notebook kernels. fork is safe here (no connection is open in
    # the parent) and spares each child re-importing torch; spawn where fork does not exist.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(path), w, n, start)) for w in range(workers)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * workers
    store = ProgressStore(path)
    ids = [a["question_id"] for a in store.answers()]
    assert len(ids) == workers * n
    assert set(ids) == {f"q{w}-{i}" for w in range(workers) for i in range(n)}
    assert store.counts()["self_assessments"] == workers * (n // 10)


def _aside_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(path.name + ".corrupt-*"))


def test_garbage_file_is_moved_aside_with_a_warning(tmp_path):
    path = tmp_path / "p.sqlite"
    garbage = b"this is not a database\x00" * 200
    path.write_bytes(garbage)
    store = ProgressStore(path)
    with pytest.warns(ProgressFileWarning, match="moved aside to"):
        store.record_answer("00_start_here", "start-1", "B", True)
    (aside,) = _aside_files(path)
    assert aside.read_bytes() == garbage  # the old file is kept, byte for byte
    assert [a["question_id"] for a in ProgressStore(path).answers()] == ["start-1"]


def test_damaged_pages_are_detected_and_kept_aside(tmp_path):
    path = tmp_path / "p.sqlite"
    store = ProgressStore(path)
    for i in range(60):
        store.record_answer("02_kv_cache", f"q{i}-" + "x" * 200, "A", True)
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # move everything into the main file
    con.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 3 * 4096
    data[4096:8192] = b"\xff" * 4096  # scribble over page 2, the root of the answers table
    path.write_bytes(bytes(data))
    damaged = bytes(data)
    with pytest.warns(ProgressFileWarning):
        fresh = ProgressStore(path)
        fresh.record_answer("02_kv_cache", "kv-1", "A", True)
    (aside,) = _aside_files(path)
    assert aside.read_bytes() == damaged
    assert len(fresh.answers()) == 1


def test_file_with_someone_elses_schema_is_left_untouched(tmp_path):
    """A table of ours by name but with other columns is another program's: read-only checked, never moved aside
    (it was renamed to .corrupt-* and called "your earlier progress")."""
    path = tmp_path / "p.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE answers (x TEXT)")
    con.execute("INSERT INTO answers VALUES ('keep me')")
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.warns(ProgressFileWarning, match="left untouched"):
        ProgressStore(path).record_card_view("01_prefill_decode", "interview-1")
    assert _aside_files(path) == [] and path.read_bytes() == before


def _another_programs_database(path: Path, kind: str) -> bytes:
    con = sqlite3.connect(path)
    if kind == "notes":
        con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        con.execute("INSERT INTO notes (text) VALUES ('mine')")
        con.execute("PRAGMA user_version = 42")
    elif kind == "anki":
        con.execute("CREATE TABLE cards (id INTEGER PRIMARY KEY, nid INTEGER, due INTEGER)")
        con.execute("INSERT INTO cards (nid, due) VALUES (7, 100)")
    else:  # only a user_version: an application that has not made its tables yet
        con.execute("PRAGMA user_version = 42")
    con.commit()
    con.close()
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["notes", "anki", "version"])
@pytest.mark.parametrize("argv", [["progress"], ["progress", "--reset", "--yes"], ["review", "--list"],
                                  ["progress", "--file", "{path}", "--reset", "--yes"]])
def test_another_programs_database_is_never_changed_or_moved(tmp_path, monkeypatch, capsys, kind, argv):
    """KVCOURSE_PROGRESS (or --file) naming another application's SQLite file: the read-only `progress` set its
    user_version to 1, WAL mode and added the course's tables; `--reset --yes` renamed it to .corrupt-* and put an
    empty progress file in its place. Now it is left byte for byte as it was, with no file beside it."""
    from course.cli import main

    path = tmp_path / "app.db"
    before = _another_programs_database(path, kind)
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    main([a.format(path=path) for a in argv])
    out, err = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]
    assert path.read_bytes() == before
    assert "another program's database" in out + err and "left untouched" in out + err
    assert "Traceback" not in out + err and "Progress cleared" not in out


def _close_leaving_the_wal(con: sqlite3.Connection, path: Path) -> None:
    """Close `con` but leave the database as it lay before: its newest rows still in the -wal (closing the last
    connection folds the -wal into the main file, so the two files are copied first and put back after)."""
    import shutil

    for suffix in ("", "-wal"):
        shutil.copyfile(f"{path}{suffix}", f"{path}.then{suffix}")
    con.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    for suffix in ("", "-wal"):
        Path(f"{path}.then{suffix}").rename(f"{path}{suffix}")


def _wal_database_in_use(path: Path, kind: str) -> None:
    """Another program's database as it lies while that program runs (or after it stopped without closing it):
    WAL mode, its tables and rows still in the -wal, not yet folded into the main file."""
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.commit()
    _another_programs_database_rows(con, kind)
    con.commit()
    _close_leaving_the_wal(con, path)


def _another_programs_database_rows(con, kind: str) -> None:
    if kind == "notes":
        con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        con.execute("INSERT INTO notes (text) VALUES ('mine')")
    else:  # only a user_version
        con.execute("PRAGMA user_version = 42")


@pytest.mark.parametrize("kind", ["notes", "version"])
@pytest.mark.parametrize("argv", [["progress"], ["review", "--list"], ["progress", "--reset", "--yes"]])
def test_another_programs_wal_database_is_checked_without_changing_it(tmp_path, monkeypatch, capsys, kind, argv):
    """A WAL-mode database whose tables were still in its -wal: the read-only check read the main file alone (empty),
    so the file was opened for writing, which folded the -wal into it (main file changed, -wal gone) and left a
    .lock beside it. Now the check reads a copy of the two: both files stay byte for byte, nothing is added."""
    from course.cli import main

    path = tmp_path / "app.db"
    _wal_database_in_use(path, kind)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["app.db", "app.db-wal"]
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    main(argv)
    out, err = capsys.readouterr()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert "another program's database" in out + err and "left untouched" in out + err
    assert "Traceback" not in out + err and "Progress cleared" not in out


def test_a_progress_file_with_a_wal_not_yet_folded_in_is_still_ours(tmp_path):
    """Our own file with a -wal left by a kernel that stopped mid-session is not taken for another program's."""

    path = tmp_path / "p.sqlite"
    ProgressStore(path).record_answer("02_kv_cache", "kv-1", "A", True)
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("INSERT INTO answers (lesson, question_id, choice, correct, at) VALUES ('02_kv_cache', 'kv-2', 'B', "
                "0, 5e9)")
    con.commit()
    _close_leaving_the_wal(con, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = ProgressStore(path)
        assert [a["question_id"] for a in store.answers()] == ["kv-1", "kv-2"]
    assert store.not_saved is None


def test_an_empty_database_and_an_older_progress_file_are_adopted(tmp_path):
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()  # a zero-byte file
    old = tmp_path / "old.sqlite"
    con = sqlite3.connect(old)  # an older progress file: some of the tables, user_version never set
    con.execute("CREATE TABLE answers (id INTEGER PRIMARY KEY, lesson TEXT NOT NULL, question_id TEXT NOT NULL, "
                "choice TEXT NOT NULL, correct INTEGER NOT NULL, at REAL NOT NULL)")
    con.execute("INSERT INTO answers (lesson, question_id, choice, correct, at) VALUES ('02_kv_cache', 'q', 'A', 1, 5)")
    con.commit()
    con.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path in (empty, old):
            store = ProgressStore(path)
            store.record_card_view("01_prefill_decode", "interview-1")
            assert store.path == path and store.not_saved is None
    assert len(ProgressStore(old).answers()) == 1


def test_file_corrupted_mid_session_recovers_on_next_write(tmp_path):
    path = tmp_path / "p.sqlite"
    store = ProgressStore(path)
    store.record_answer("03_sampling", "sampling-golden", "B", True)
    for side in ("-wal", "-shm"):
        Path(str(path) + side).unlink(missing_ok=True)
    path.write_bytes(b"\x00garbage" * 1000)
    with pytest.warns(ProgressFileWarning):
        store.record_answer("03_sampling", "sampling-1", "C", True)
    assert [a["question_id"] for a in store.answers()] == ["sampling-1"]
    assert len(_aside_files(path)) == 1


def test_unwritable_location_falls_back_to_a_temporary_file(tmp_path, monkeypatch):
    import tempfile

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where a folder should be")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    store = ProgressStore(blocker / "progress.sqlite")
    with pytest.warns(ProgressFileWarning, match="for this session only"):
        store.record_answer("00_start_here", "start-2", "C", True)
    assert tmp_path / "tmp" in store.path.parents  # in a private folder there (private_temp_folder)
    assert len(store.answers()) == 1


def test_default_path_follows_the_environment(tmp_path, monkeypatch):
    """(KVCOURSE_PROGRESS=/path/newdir/ made an SQLite file named newdir, not newdir/progress.sqlite.)"""
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "mine.sqlite"))
    assert default_path() == tmp_path / "mine.sqlite"
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path))  # a folder: the file goes inside
    assert default_path() == tmp_path / "progress.sqlite"
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "newdir") + "/")  # a folder not made yet
    assert default_path() == tmp_path / "newdir" / "progress.sqlite"
    monkeypatch.delenv("KVCOURSE_PROGRESS")
    assert default_path().parts[-2:] == ("kvcourse", "progress.sqlite")


@pytest.mark.parametrize("argv", [["progress"], ["review", "--list"]])
def test_a_folder_path_that_names_a_file_says_so(tmp_path, monkeypatch, capsys, argv):
    """KVCOURSE_PROGRESS=notes.txt/ (a trailing slash names a folder) where notes.txt is a file: the note said the
    folder 'is not writable (File exists)', which sends the learner to chmod. Now it says the path names a file, not
    a folder, and how to set it; the file is left as it was."""
    from course.cli import main

    blocker = tmp_path / "notes.txt"
    blocker.write_text("my notes")
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(blocker) + "/")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    (note,) = [ln for ln in (out + err).splitlines() if ln.startswith("Note: ")]
    assert f"{blocker} is a file, not a folder (KVCOURSE_PROGRESS ends with a slash" in note, note
    assert f"set KVCOURSE_PROGRESS to {blocker} without the slash" in note and "not writable" not in note
    assert "This session's new progress is kept for this session only" in note
    assert blocker.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_file_in_the_middle_of_the_path_is_named(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("my notes")
    store = ProgressStore(blocker / "sub" / "p.sqlite")
    with pytest.warns(ProgressFileWarning, match="is a file, not a folder, so nothing can be saved under it"):
        store.record_answer("02_kv_cache", "kv-1", "A", True)
    assert f"{blocker} is a file, not a folder" in store.not_saved and len(store.answers()) == 1
    assert blocker.read_text() == "my notes"


# ---------------------------------------------------------------------- `kvcourse progress`
@pytest.fixture
def progress_file(tmp_path, monkeypatch):
    path = tmp_path / "cli.sqlite"
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    return path


def _row(out: str, lesson: str) -> list[str]:
    (line,) = [ln for ln in out.splitlines() if ln.startswith(lesson + " ")]
    return line.split()


def test_cli_prints_a_per_lesson_summary(progress_file, capsys):
    from course.cli import main
    from course.teach.quiz import load_questions

    store = ProgressStore(progress_file)
    store.record_answer("01_prefill_decode", "prefill-ab", "A", False)
    store.record_answer("01_prefill_decode", "prefill-ab", "B", True)
    store.record_answer("01_prefill_decode", "prefill-bound", "B", True)
    store.record_self_assessment("01_prefill_decode", "Confident")
    store.record_card_view("01_prefill_decode", "interview-2")
    store.record_exercise_check("memory_formula", 6, 6)

    assert main(["progress"]) == 0
    out = capsys.readouterr().out
    n = len(load_questions().for_lesson("01_prefill_decode"))
    cards = len(load_questions().cards_for("01_prefill_decode"))
    # lesson, right/seen, questions, cards due, due now (unanswered + unrated cards), tests, self-assessment
    assert _row(out, "01_prefill_decode") == ["01_prefill_decode", "2/2", f"{n}", f"{cards}/{cards}",
                                              f"{n - 2 + cards}", "—", "Confident"]
    assert _row(out, "02_kv_cache")[5] == "6/6"  # the memory-formula exercise follows lesson 02
    assert _row(out, "03_sampling")[1:3] == ["0/0", f"{len(load_questions().for_lesson('03_sampling'))}"]
    assert str(progress_file) in out
    assert "memory_formula" in out and "6/6 tests passed" in out


def test_cli_on_an_empty_file_says_nothing_is_saved(progress_file, capsys):
    from course.cli import main

    assert main(["progress"]) == 0
    assert "Nothing saved yet" in capsys.readouterr().out


@pytest.mark.parametrize("reply, deleted", [("yes", True), ("no", False), ("", False), (EOFError, False)])
def test_cli_reset_asks_first(progress_file, capsys, monkeypatch, reply, deleted):
    from course.cli import main

    ProgressStore(progress_file).record_answer("02_kv_cache", "kv-1", "A", True)
    asked = []

    def fake_input(prompt):
        asked.append(prompt)
        if reply is EOFError:
            raise EOFError
        return reply

    monkeypatch.setattr("builtins.input", fake_input)
    rc = main(["progress", "--reset"])
    assert asked and str(progress_file) in asked[0] and "1 answers" in asked[0]
    assert rc == (0 if deleted else 1)
    assert len(ProgressStore(progress_file).answers()) == (0 if deleted else 1)


def test_cli_reset_yes_skips_the_question(progress_file, capsys, monkeypatch):
    from course.cli import main

    ProgressStore(progress_file).record_self_assessment("02_kv_cache", "Confident")
    monkeypatch.setattr("builtins.input", lambda _p: pytest.fail("must not ask with --yes"))
    assert main(["progress", "--reset", "--yes"]) == 0
    assert ProgressStore(progress_file).self_assessment("02_kv_cache") is None
    assert main(["progress"]) == 0
    assert "Nothing saved yet" in capsys.readouterr().out


def test_warnings_are_not_raised_on_a_healthy_file(tmp_path):
    store = ProgressStore(tmp_path / "p.sqlite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.record_answer("00_start_here", "start-3", "A", True)
        ProgressStore(tmp_path / "p.sqlite").answers()
    assert _aside_files(tmp_path / "p.sqlite") == []


def test_a_file_that_is_not_progress_is_never_touched(tmp_path):
    """A mistyped KVCOURSE_PROGRESS (notes, a system file) is left byte for byte as it was: no rename, no lock
    file beside it; the session's progress goes to a temporary file and the warning says why."""
    import hashlib
    import warnings

    from course.teach.progress import ProgressFileWarning, ProgressStore

    notes = tmp_path / "notes.txt"
    notes.write_text("my own notes\n" * 20)
    digest = hashlib.sha256(notes.read_bytes()).hexdigest()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = ProgressStore(notes)
        store.record_answer("00_start_here", "start-1", "A", True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert hashlib.sha256(notes.read_bytes()).hexdigest() == digest
    assert any(issubclass(w.category, ProgressFileWarning) and "not a progress file" in str(w.message)
               for w in caught)
    assert store.not_saved and "left untouched" in store.not_saved


def test_answers_saved_under_a_renamed_question_read_back_under_its_new_id_and_letters(tmp_path):
    """Progress saved before the checkpoint questions were renamed (and three reordered) is not lost: it reads
    back under the new id, with the letter of the same option in the new order."""
    from course.teach.progress import RENAMED, ProgressStore
    from course.teach.quiz import answer, load_questions

    bank = load_questions()
    store = ProgressStore(tmp_path / "p.sqlite")
    old_id, (new_id, letters) = next((k, v) for k, v in RENAMED.items() if v[1] != {c: c for c in v[1]})
    q = bank.question(new_id)
    old_letter = next(o for o, n in letters.items() if n == q.answer)  # the right option, in the old order
    assert old_letter != q.answer
    store.record_answer(q.lesson, old_id, old_letter, True)
    got = store.latest_answers()
    assert old_id not in got and got[new_id]["choice"] == q.answer and got[new_id]["correct"] is True
    assert bank.question(old_id) is q  # an old notebook's answer("<old id>", …) still finds it
    assert answer(old_id, old_letter, store=store) is True  # … and its letter means the same option
    assert all(bank.question(n) for n, _ in RENAMED.values())


# ---------------------------------------------------------------------- a healthy file is never moved aside
def _saved_file(path: Path) -> Path:
    ProgressStore(path).record_answer("02_kv_cache", "kv-1", "A", True)
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # everything in the one file, as a copied file would be
    con.close()
    return path


def _answer_ids(path: Path) -> list[str]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [r[0] for r in con.execute("SELECT question_id FROM answers")]
    finally:
        con.close()


def test_a_read_only_file_is_read_and_never_moved_aside(tmp_path, monkeypatch):
    """chmod 444 (the folder writable): SQLite opens such a file read-only for anyone but root, and a write to it
    fails with SQLITE_READONLY. Simulated for root too: the learner's file is opened with mode=ro."""
    import tempfile

    path = _saved_file(tmp_path / "progress.sqlite")
    path.chmod(0o444)
    before = path.read_bytes()
    real_open = ProgressStore._open

    def open_read_only(self):
        if self.path != path:
            return real_open(self)
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=self.timeout, isolation_level=None)
        conn.row_factory = sqlite3.Row
        return conn

    monkeypatch.setattr(ProgressStore, "_open", open_read_only)
    monkeypatch.setattr("os.access", lambda p, mode, **kw: True)  # as root sees it: the write fails in SQLite
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    store = ProgressStore(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a read-only file is not worth a warning
        assert [a["question_id"] for a in store.answers()] == ["kv-1"]
    with pytest.warns(ProgressFileWarning, match="for this session only"):
        store.record_answer("02_kv_cache", "kv-2", "B", False)
    assert [a["question_id"] for a in store.answers()] == ["kv-1", "kv-2"]  # this session's copy
    assert store.not_saved and str(path) in store.not_saved
    assert _aside_files(path) == [] and path.read_bytes() == before


def test_a_file_the_learner_may_not_write_is_copied_not_moved_aside(tmp_path, monkeypatch):
    """The same chmod 444 file, seen by a learner who is not root (os.access says it cannot be written)."""
    import os
    import tempfile

    path = _saved_file(tmp_path / "progress.sqlite")
    path.chmod(0o444)
    before, files = path.read_bytes(), sorted(tmp_path.iterdir())
    if os.geteuid() == 0:  # root may write any file: ask the question a learner's process would get answered
        monkeypatch.setattr("os.access", lambda p, mode, **kw: not (mode & os.W_OK and Path(p) == path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    store = ProgressStore(path)
    with pytest.warns(ProgressFileWarning, match="read-only"):
        assert [a["question_id"] for a in store.answers()] == ["kv-1"]
    store.record_answer("02_kv_cache", "kv-2", "B", False)
    assert "chmod u+w" in store.not_saved
    assert _aside_files(path) == [] and path.read_bytes() == before
    assert sorted(tmp_path.iterdir()) == sorted(files + [tmp_path / "tmp"])  # nothing new beside it


def _hold_exclusive(path: Path) -> sqlite3.Connection:
    """Another process's `PRAGMA locking_mode=EXCLUSIVE`: no one else may read or write until it closes."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA locking_mode=EXCLUSIVE")
    con.execute("BEGIN EXCLUSIVE")
    con.execute("COMMIT")  # in exclusive locking mode the lock outlives the transaction
    return con


def test_a_busy_file_says_busy_and_is_never_moved_aside(tmp_path):
    from course.teach.progress import BUSY_MESSAGE, ProgressFileBusy

    path = _saved_file(tmp_path / "progress.sqlite")
    holder = _hold_exclusive(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ProgressFileBusy, match=r"busy \(another kernel or command is using it\); try again"):
                ProgressStore(path, timeout=0.2).answers()
            with pytest.raises(ProgressFileBusy) as exc:
                ProgressStore(path, timeout=0.2).record_answer("02_kv_cache", "kv-2", "B", True)
        assert BUSY_MESSAGE in str(exc.value)
        assert _aside_files(path) == []
    finally:
        holder.close()
    assert [a["question_id"] for a in ProgressStore(path).answers()] == ["kv-1"]


def test_reads_need_no_write_lock(tmp_path):
    """A notebook in the middle of a write (BEGIN IMMEDIATE) does not stop a read of a set-up file."""
    import time

    path = _saved_file(tmp_path / "progress.sqlite")
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        start = time.monotonic()
        assert [a["question_id"] for a in ProgressStore(path, timeout=3).answers()] == ["kv-1"]
        assert time.monotonic() - start < 2
    finally:
        writer.close()


def test_cli_progress_on_a_busy_file_says_busy_in_one_line(tmp_path, monkeypatch, capsys):
    import course.cli.progress as cli_progress
    from course.cli import main
    from course.teach.progress import BUSY_MESSAGE

    path = _saved_file(tmp_path / "progress.sqlite")
    monkeypatch.setattr(cli_progress, "default_store", lambda: ProgressStore(path, timeout=0.2))
    holder = _hold_exclusive(path)
    try:
        assert main(["progress"]) == 1
    finally:
        holder.close()
    out, err = capsys.readouterr()
    assert BUSY_MESSAGE in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _aside_files(path) == [] and _answer_ids(path) == ["kv-1"]


def _moved_aside(path: Path) -> Path:
    (aside,) = [p for p in _aside_files(path) if not p.name.endswith(("-wal", "-shm"))]
    return aside


def _truncated_progress_file(tmp_path: Path, name: str) -> Path:
    good = _saved_file(tmp_path / "good.sqlite")
    path = tmp_path / name
    path.write_bytes(good.read_bytes()[:3000])  # `head -c 3000 good.sqlite > progress.sqlite`
    return path


@pytest.mark.parametrize("argv", [["progress"], ["progress", "--reset", "--yes"]])
def test_cli_says_where_a_moved_aside_file_is(tmp_path, monkeypatch, capsys, argv):
    from course.cli import main

    path = _truncated_progress_file(tmp_path, "progress.sqlite")
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    assert main([a.format(path=path) for a in argv]) == 0
    out, err = capsys.readouterr()
    aside = _moved_aside(path)
    notes = [ln for ln in (out + err).splitlines() if ln.startswith("Note: ")]
    assert len(notes) == 1 and f"moved aside to {aside}; your earlier progress is in that file" in notes[0]
    assert "ProgressFileWarning" not in out + err


@pytest.mark.parametrize("argv", [["progress", "--file", "{path}"],
                                  ["progress", "--file", "{path}", "--reset", "--yes"]])
def test_a_damaged_file_given_with_file_is_reported_never_moved(tmp_path, monkeypatch, capsys, argv):
    """`progress --file notes.db` renamed it to notes.db.corrupt-... and made a fresh notes.db in its place."""
    from course.cli import main

    path = _truncated_progress_file(tmp_path, "X.db")
    before = path.read_bytes()
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    code = main([a.format(path=path) for a in argv])
    out, err = capsys.readouterr()
    assert code == (2 if "--reset" in argv else 0), out + err
    assert f"{path} is damaged" in out + err and "left as it is" in out + err, out + err
    assert _aside_files(path) == [] and path.read_bytes() == before


def test_kvcourse_check_says_where_a_moved_aside_file_is(tmp_path, monkeypatch, capsys):
    from course.teach.progress import record_exercise_check

    path = _truncated_progress_file(tmp_path, "progress.sqlite")
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # printed as a note, not raised as a Python warning
        record_exercise_check("kv_cache", 3, 4)
    err = capsys.readouterr().err
    aside = _moved_aside(path)
    assert err.startswith("Note: ") and f"moved aside to {aside}; your earlier progress" in err
    assert len(err.strip().splitlines()) == 1 and ".py:" not in err


# ---------------------------------------------------------------------- rows out of range
@pytest.mark.parametrize("passed, total", [(5, 3), (-1, 2), (0, -2)])
def test_an_exercise_check_out_of_range_is_skipped_like_other_bad_rows(progress_file, capsys, passed, total):
    """A hand-edited exercise_checks row with passed > total (or a negative count) was shown as it was: '5/3 tests
    passed (to fix)' in `kvcourse progress`, 5/3 in the lesson's tests column. record_exercise_check refuses such
    numbers, so they are skipped as other bad rows are, with the one note."""
    from course.cli import main

    store = ProgressStore(progress_file)
    store.record_exercise_check("memory_formula", 2, 6)
    con = sqlite3.connect(progress_file)
    con.execute("INSERT INTO exercise_checks (exercise, passed, total, details, at) VALUES ('memory_formula', ?, ?, "
                "NULL, 9e9)", (passed, total))
    con.commit()
    con.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told as a note, not raised
        assert main(["progress"]) == 0
    out, err = capsys.readouterr()
    assert f"{passed}/{total}" not in out
    assert "memory_formula" in out and "2/6 tests passed" in out and "1 run," in out  # the good row is shown
    assert _row(out, "02_kv_cache")[5] == "2/6"
    (note,) = [ln for ln in (out + err).splitlines() if "out of range" in ln]
    assert note.startswith("Note: ") and str(progress_file) in note and "1 in exercise_checks" in note


# ---------------------------------------------------------------------- a full disk under a read-only command
# `kvcourse ARGS` in a process that may write no file past 8 KiB (`ulimit -f 8`): every write SQLite makes fails, as on
# a full disk (tests/test_tool_faults.py does the same).
_RUN_ON_A_FULL_DISK = textwrap.dedent("""
    import builtins, resource, sys
    sys.dont_write_bytecode = True  # a .pyc cut off at 8 KiB would break every later import of that module
    from course.cli import main
    builtins.input = lambda prompt="": print(prompt) or "A"
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    sys.exit(main(sys.argv[1:]))
""")


def _on_a_full_disk(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    from course.paths import PROJECT_ROOT

    env = {"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "KVCOURSE_PROGRESS": str(tmp_path / "p.sqlite"),
           "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(tmp_path), "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.run([sys.executable, "-c", _RUN_ON_A_FULL_DISK, *argv], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))


def _six_missed(path: Path, newest_in_the_wal: bool = False) -> None:
    import time

    store = ProgressStore(path)
    for q in load_questions().for_lesson("02_kv_cache")[:6]:
        store.record_answer("02_kv_cache", q.id, "Z", False)
    if newest_in_the_wal:  # a right answer still in the -wal, as a kernel that stopped mid-session leaves it
        q = load_questions().for_lesson("02_kv_cache")[0]
        con = sqlite3.connect(path)
        con.execute("PRAGMA wal_autocheckpoint=0")
        con.execute("INSERT INTO answers (lesson, question_id, choice, correct, at) VALUES ('02_kv_cache', ?, ?, 1, ?)",
                    (q.id, q.correct.key, time.time() + 60))
        con.commit()
        _close_leaving_the_wal(con, path)


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE (ulimit -f) is POSIX")
@pytest.mark.parametrize("in_the_wal", [False, True], ids=["saved", "newest in the wal"])
@pytest.mark.parametrize("argv", [["progress"], ["review", "--list"]])
def test_read_only_commands_show_what_is_saved_on_a_full_disk(tmp_path, argv, in_the_wal):
    """On a full disk `kvcourse progress` and `kvcourse review --list` only said 'cannot write the progress file'
    (rc 1): opening the file needs a -shm beside it. Reading needs no write: they now read the file as it is (no
    lock, no -shm) and show it, with one note saying nothing new can be saved there until space is freed."""
    path = tmp_path / "p.sqlite"
    _six_missed(path, newest_in_the_wal=in_the_wal)
    run = _on_a_full_disk(tmp_path, *argv)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 0, run.stderr
    (note,) = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("Note: ")]
    assert "cannot write the progress file" in note.lower() and "free space" in note and "shown as it is" in note
    right = 1 if in_the_wal else 0
    if argv == ["progress"]:
        assert _row(run.stdout, "02_kv_cache")[1] == f"{right}/6", run.stdout
    else:
        listed = [ln for ln in run.stdout.splitlines() if "02_kv_cache" in ln and "missed last time" in ln]
        assert len(listed) == 6 - right, run.stdout
    answers = ProgressStore(path).answers()
    assert len(answers) == 6 + right  # nothing lost


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE (ulimit -f) is POSIX")
@pytest.mark.parametrize("argv", [["review"], ["review", "--reset", "--yes"], ["progress", "--reset", "--yes"]])
def test_commands_that_write_stop_before_asking_on_a_full_disk(tmp_path, argv):
    """A review session or a reset still stops at once with the one line (not after a note that the file was read as
    it is, nor after asking a question whose answer cannot be saved)."""
    path = tmp_path / "p.sqlite"
    _six_missed(path)
    run = _on_a_full_disk(tmp_path, *argv)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    (line,) = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert line.startswith(f"kvcourse {argv[0]}: cannot write the progress file {path}") and "free space" in line
    assert "Your answer" not in run.stdout and "Note:" not in run.stdout + run.stderr
    assert len(ProgressStore(path).answers()) == 6 and ProgressStore(path).review_reset_at() is None


def test_another_programs_wal_database_with_no_room_for_a_copy_is_still_never_changed(tmp_path, monkeypatch, capsys):
    """Where the copy for the check cannot be made (TMPDIR full or read-only), the file is read read-only in place:
    its main file and -wal stay byte for byte (a -shm, SQLite's index of the -wal, may appear beside them)."""
    import shutil

    from course.cli import main

    path = tmp_path / "app.db"
    _wal_database_in_use(path, "notes")
    before = {name: (tmp_path / name).read_bytes() for name in ("app.db", "app.db-wal")}

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", no_room)
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(path))
    main(["progress"])
    out, err = capsys.readouterr()
    assert {name: (tmp_path / name).read_bytes() for name in ("app.db", "app.db-wal")} == before
    assert not (tmp_path / "app.db.lock").exists()
    assert "another program's database" in out + err and "left untouched" in out + err
