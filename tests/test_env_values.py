"""Environment variables the course reads (KVCOURSE_THREADS, KVCOURSE_FULL, KVCOURSE_STATE): a bad value is refused
with a message that names the variable and what it may be, one reader per variable, and `kvcourse doctor` reports
them. Fast: nothing here loads a model or times anything."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from course import paths
from course.measure import bytes_line, results, threads


# --------------------------------------------------------------------------- KVCOURSE_THREADS
@pytest.fixture
def thread_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(threads.torch, "set_num_threads", calls.append)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "sample_others", lambda: 0.0)
    return calls


@pytest.mark.parametrize("value", ["abc", "1.5", "0", "-3", "2 threads"])
def test_bad_threads_value_names_the_variable_and_what_it_may_be(value, monkeypatch, thread_calls):
    monkeypatch.setenv("KVCOURSE_THREADS", value)
    with pytest.raises(ValueError) as exc:
        threads.steady_threads("cpu")
    message = str(exc.value)
    assert "KVCOURSE_THREADS" in message and repr(value) in message and "from 1 to 2" in message, message
    assert "invalid literal" not in message and thread_calls == []


def test_threads_above_the_cpus_are_capped_and_the_reason_says_so(monkeypatch, thread_calls):
    monkeypatch.setenv("KVCOURSE_THREADS", "999")
    note = threads.steady_threads("cpu")
    assert thread_calls == [2] and "999" in note and "capped to 2" in note, note
    monkeypatch.delenv("KVCOURSE_THREADS")
    assert "capped to 2" in threads.steady_threads("cpu", threads=64) and thread_calls[-1] == 2
    monkeypatch.setenv("KVCOURSE_THREADS", " ")  # empty: the automatic choice, as unset
    assert threads.asked_threads() == (None, "")


def _doctor(capsys) -> tuple[int, str]:
    from course.cli import doctor

    code = doctor.run(SimpleNamespace(quick=True, device="cpu"))
    return code, capsys.readouterr().out


def test_doctor_reports_a_bad_threads_or_full_value(monkeypatch, capsys):
    monkeypatch.setenv("KVCOURSE_THREADS", "abc")
    code, out = _doctor(capsys)
    assert "KVCOURSE_THREADS" in out and "all good" not in out, out
    monkeypatch.delenv("KVCOURSE_THREADS")
    monkeypatch.setenv("KVCOURSE_FULL", "maybe")
    code, out = _doctor(capsys)
    assert "KVCOURSE_FULL" in out and "'maybe'" in out and "all good" not in out, out
    monkeypatch.setenv("KVCOURSE_THREADS", str((os.cpu_count() or 1) + 7))
    monkeypatch.delenv("KVCOURSE_FULL")
    code, out = _doctor(capsys)
    assert "capped to" in out, out


# --------------------------------------------------------------------------- KVCOURSE_FULL
@pytest.mark.parametrize("value, full", [("1", True), ("true", True), ("YES", True), ("on", True),
                                         ("0", False), ("false", False), ("no", False), ("Off", False), ("", False)])
def test_full_size_and_the_bytes_line_agree(value, full, monkeypatch):
    monkeypatch.setenv("KVCOURSE_FULL", value)
    assert results.full_size() is full
    assert (bytes_line.default_shapes("cpu") == bytes_line.CPU_FULL_SHAPES) is full


@pytest.mark.parametrize("value", ["maybe", "2", "ja"])
def test_an_unknown_full_value_is_refused_not_read_as_on(value, monkeypatch):
    monkeypatch.setenv("KVCOURSE_FULL", value)
    for read in (results.full_size, lambda: bytes_line.default_shapes("cpu")):
        with pytest.raises(ValueError, match=f"KVCOURSE_FULL .*'{value}'"):
            read()


# --------------------------------------------------------------------------- KVCOURSE_STATE
def test_state_that_is_a_file_names_it_and_the_variable(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("KVCOURSE_STATE", str(blocker))
    with pytest.raises(ValueError) as exc:
        paths.jupyter_env()
    message = str(exc.value)
    assert f"{blocker} is a file, not a folder" in message and "KVCOURSE_STATE" in message, message
    assert "Errno" not in message


def test_state_that_cannot_be_written_says_so(tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("KVCOURSE_STATE", str(state))
    real_access = os.access
    monkeypatch.setattr(paths.os, "access",  # as for a non-root user in a read-only folder (root writes anyway)
                        lambda p, mode, **kw: False if str(p).startswith(str(state)) else real_access(p, mode, **kw))
    with pytest.raises(ValueError) as exc:
        paths.jupyter_env()
    message = str(exc.value)
    assert "not writable by you" in message and str(state) in message and "KVCOURSE_STATE" in message, message


def test_a_relative_state_is_made_absolute_where_it_was_given(tmp_path, monkeypatch):
    """`kvcourse lab` moves into the project before Jupyter starts: a relative path would name two folders."""
    from course.paths import jupyter_env, state_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCOURSE_STATE", "relstate")
    assert state_dir() == tmp_path / "relstate"
    assert jupyter_env()["JUPYTER_DATA_DIR"] == str(tmp_path / "relstate" / "data")
