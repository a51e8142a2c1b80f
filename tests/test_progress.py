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
    with pytest.warns(ProgressFileWarning, match="kept as"):
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


def test_file_with_someone_elses_schema_is_moved_aside(tmp_path):
    path = tmp_path / "p.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE answers (x TEXT)")
    con.execute("INSERT INTO answers VALUES ('keep me')")
    con.commit()
    con.close()
    with pytest.warns(ProgressFileWarning):
        ProgressStore(path).record_card_view("01_prefill_decode", "interview-1")
    (aside,) = _aside_files(path)
    assert sqlite3.connect(aside).execute("SELECT x FROM answers").fetchall() == [("keep me",)]


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
    assert store.path.parent == tmp_path / "tmp"
    assert len(store.answers()) == 1


def test_default_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "mine.sqlite"))
    assert default_path() == tmp_path / "mine.sqlite"
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path))  # a folder: the file goes inside
    assert default_path() == tmp_path / "progress.sqlite"
    monkeypatch.delenv("KVCOURSE_PROGRESS")
    assert default_path().parts[-2:] == ("kvcourse", "progress.sqlite")


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
