"""Every `kvcourse` subcommand refuses bad input the same way: exit status 2, one line on stderr, no traceback.

The cases are generated from the parser itself, so a subcommand added to course.cli.COMMANDS later is covered
without touching this file: every option with a type gets that type's bad values (negative, zero, huge, wrong
type, a missing path, a folder, an unreadable or a non-model file, a folder that cannot be written; see
course/cli/args.py), and every path positional gets a missing path. These run in-process (fast); a few of the
cases the issue reported run as real `python -m course.cli` processes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import course.cli as cli
from course.cli import COMMANDS, build_parser
from course.paths import PROJECT_ROOT


def _subcommands(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subcommands(sub, prefix + (name,))


PARSER, AVAILABLE = build_parser()
SUBCOMMANDS = dict(_subcommands(PARSER))


def _leaves():
    """Subcommands that take arguments themselves (not only a further subcommand)."""
    for prefix, sub in SUBCOMMANDS.items():
        if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            yield prefix, sub


def _positionals(sub):
    return [a for a in sub._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


def _bad_values(action) -> list[str]:
    t = action.type
    if t is None or action.nargs == 0:
        return []
    if hasattr(t, "bad_values"):
        return list(t.bad_values)
    if t is Path and not action.option_strings:
        return ["{missing}"]  # an input path given on the command line must exist
    return []


def _cases():
    for prefix, sub in _leaves():
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            for value in _bad_values(action):
                yield pytest.param(prefix, action.dest, value, id=f"{' '.join(prefix)} {action.dest}={value or '<empty>'}")


@pytest.fixture
def paths(tmp_path):
    """What the path placeholders stand for. Chosen so that they stay bad even for root."""
    (tmp_path / "a-folder").mkdir()
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01 not a notebook, a model or a database")
    unreadable = tmp_path / "unreadable.gguf"
    unreadable.write_bytes(b"\x00 junk")
    unreadable.chmod(0)  # root can still read it, and finds junk
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where a folder should be")
    fifo = tmp_path / "a-pipe"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    return {"{missing}": str(tmp_path / "missing" / "nothing.ipynb"), "{dir}": str(tmp_path / "a-folder"),
            "{file}": str(junk), "{unreadable}": str(unreadable), "{unwritable}": str(blocker / "out"),
            "{fifo}": str(fifo)}


def _argv(prefix, sub, dest, value) -> list[str]:
    """The subcommand with `value` for `dest` and a harmless filler for every other positional."""
    action = next(a for a in sub._actions if a.dest == dest)
    args = list(prefix)
    if action.option_strings:
        args += [action.option_strings[0], value]
    for pos in _positionals(sub):
        if pos is action:
            args.append(value)
        elif pos.nargs not in ("?", "*"):
            args.append(pos.choices and next(iter(pos.choices)) or "filler")
    return args


@pytest.fixture(autouse=True)
def _never_exec(monkeypatch):
    """In-process runs must never become JupyterLab (`kvcourse lab` execs it)."""
    def refuse(*args):
        raise AssertionError(f"kvcourse lab would have started JupyterLab: {args[1]}")

    monkeypatch.setattr(os, "execvpe", refuse)


def _run_main(argv, capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(code, out, err, argv):
    assert code == 2, f"kvcourse {' '.join(argv)} exited {code}, not 2\nstdout: {out[-500:]}\nstderr: {err[-1500:]}"
    assert "Traceback" not in err + out, f"kvcourse {' '.join(argv)} printed a traceback:\n{err[-1500:]}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"kvcourse {' '.join(argv)}: the message is not one line:\n{err}"
    assert "error" in lines[0], lines[0]


def test_every_command_is_reached_and_every_typed_option_has_bad_values():
    missing = set(COMMANDS) - {p[0] for p in SUBCOMMANDS}
    importable = {n for n in missing if __import__("importlib").util.find_spec(COMMANDS[n][0]) is not None}
    assert not importable, f"commands in COMMANDS that the parser lost: {importable}"
    untested = [f"{' '.join(p)} {a.option_strings or a.dest} (type {getattr(a.type, '__name__', a.type)})"
                for p, sub in _leaves() for a in sub._actions
                if a.type not in (None, str, Path) and not hasattr(a.type, "bad_values")]
    assert not untested, ("options whose type says nothing about bad input: use a type from course/cli/args.py "
                          f"(or give yours a .bad_values list): {untested}")
    assert len(list(_cases())) > 40  # the generator really produced the cases below


@pytest.mark.parametrize("prefix, dest, value", list(_cases()))
def test_bad_argument_is_one_line_exit_2(prefix, dest, value, paths, capsys, monkeypatch):
    """Parsing alone must refuse the value: a command that started running on it fails this test."""
    sub = SUBCOMMANDS[prefix]
    action = next(a for a in sub._actions if a.dest == dest)
    value = paths.get(value, value)
    argv = _argv(prefix, sub, dest, value)
    parse_time = action.option_strings or hasattr(action.type, "bad_values")
    if parse_time:
        parser, available = build_parser()

        def refuse(args):
            raise AssertionError(f"kvcourse {' '.join(argv)} was accepted and started running")

        monkeypatch.setattr(cli, "build_parser", lambda *_: (parser, {name: refuse for name in available}))
    code, out, err = _run_main(argv, capsys)
    _assert_one_line_error(code, out, err, argv)
    if action.option_strings:
        assert action.option_strings[0] in err, f"the message does not name {action.option_strings[0]}: {err}"


@pytest.mark.parametrize("prefix", [p for p, sub in _leaves()
                                    if any(a.required and a.nargs not in ("*", "?") for a in _positionals(sub))],
                         ids=lambda p: " ".join(p))
def test_missing_required_argument_is_one_line_exit_2(prefix, capsys):
    code, out, err = _run_main(list(prefix), capsys)
    _assert_one_line_error(code, out, err, list(prefix))


def test_unknown_command_and_option(capsys):
    for argv in (["no-such-command"], ["doctor", "--no-such-option"], ["generate", "hi", "--max-new-tokens"]):
        code, out, err = _run_main(argv, capsys)
        _assert_one_line_error(code, out, err, argv)


# --------------------------------------------------------------------------- the reported cases, end to end
def _kvcourse(*args, env=None, prefix=(), timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "course.cli", *args], cwd=PROJECT_ROOT, timeout=timeout,
                          capture_output=True, text=True, env=dict(os.environ, **(env or {})))


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-1500:])
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_generate_with_a_folder_as_model(tmp_path):
    line = _one_line_error(_kvcourse("generate", "--model", str(tmp_path), "hi"))
    assert "is a folder" in line and "--model" in line


def test_bench_checks_its_output_folder_before_running(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _kvcourse("bench", "--quick", "--out", str(blocker / "results"))
    line = _one_line_error(r)
    assert "cannot write into" in line and "[bench]" not in r.stdout + r.stderr  # the suite never started


@pytest.mark.slow
def test_generate_zero_new_tokens_is_an_empty_answer():
    r = _kvcourse("generate", "--max-new-tokens", "0", "--device", "cpu", "hi")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "0 new tokens" in r.stdout and "TTFT" not in r.stdout and "no time to first token" in r.stdout


def _read_only(folder: Path) -> tuple[str, ...]:
    """A command prefix under which `folder` cannot be written: chmod for a normal user; for root (whom chmod does
    not stop) a read-only bind mount in a private mount namespace, gone when the command ends."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return ()
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("running as root without mount namespaces: no way to make a read-only folder here")
    return ("unshare", "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"',
            str(folder))


def test_progress_in_a_read_only_folder_is_one_clear_line_and_left_as_it_is(tmp_path):
    from course.teach.progress import ProgressStore
    from course.teach.questions import load_questions

    folder = tmp_path / "ro"
    folder.mkdir()
    question = load_questions().for_lesson("00_start_here")[0]
    saved = ProgressStore(folder / "progress.sqlite")
    saved.record_answer("00_start_here", question.id, "A", True)
    saved.record_exercise_check("01_memory_formula", 3, 5)
    for leftover in folder.glob("progress.sqlite.lock"):
        leftover.unlink()
    before = sorted(p.name for p in folder.iterdir())
    prefix = _read_only(folder)
    env = {"KVCOURSE_PROGRESS": str(folder / "progress.sqlite")}
    r = _kvcourse("progress", env=env, prefix=prefix)
    reset = _kvcourse("progress", "--reset", "--yes", env=env, prefix=prefix)
    for run in (r, reset):  # one line naming the file and what to do
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        (line,) = run.stderr.strip().splitlines()
        assert line.startswith(f"kvcourse progress: progress cannot be saved in {folder / 'progress.sqlite'}: "), line
        assert "is not writable (`chmod u+w" in line
    if os.geteuid() != 0:
        folder.chmod(0o755)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written where the file lies
    assert ProgressStore(folder / "progress.sqlite").counts()["exercise_checks"] == 1


# --------------------------------------------------------------------------- reported by the fault injector
def test_generate_refuses_a_prompt_that_is_not_utf8_before_loading(capsys, monkeypatch):
    monkeypatch.setattr("course.load", lambda *a, **k: pytest.fail("the model was loaded for a prompt it cannot take"))
    argv = ["generate", b"caf\xe9".decode("utf-8", "surrogateescape")]  # what Python makes of the bytes in argv
    code, out, err = _run_main(argv, capsys)
    _assert_one_line_error(code, out, err, argv)
    assert "not valid UTF-8" in err and "prompt" in err and "TextInputSequence" not in err, err


def test_a_huge_count_names_the_upper_bound(capsys):
    argv = ["generate", "hi", "--max-new-tokens", "99999999999"]
    code, out, err = _run_main(argv, capsys)
    _assert_one_line_error(code, out, err, argv)
    assert "at most 2147483648" in err and "at least" not in err, err


def test_bench_refuses_an_item_both_only_and_skipped(tmp_path, capsys):
    argv = ["bench", "--only", "notebooks", "--skip", "notebooks", "--out", str(tmp_path / "out")]
    code, out, err = _run_main(argv, capsys)
    _assert_one_line_error(code, out, err, argv)
    assert "--only" in err and "--skip" in err and "notebooks" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "no report was written"


@pytest.mark.parametrize("command", [("grade", "{dir}"), ("classroom", "status")])
def test_course_that_is_a_file_is_refused_while_parsing(command, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for course in (blocker, blocker / "class"):
        argv = [command[0], "--course", str(course), *[str(tmp_path) if a == "{dir}" else a for a in command[1:]]]
        code, out, err = _run_main(argv, capsys)
        _assert_one_line_error(code, out, err, argv)
        assert f"{blocker}" in err and "is a file" in err and "--course" in err and "Errno" not in err, err


def test_check_maps_a_renamed_copy_to_its_exercise(tmp_path):
    from course.grade.check import exercise_of
    from course.paths import EXERCISES

    original = EXERCISES / "01_memory_formula" / "memory_formula.ipynb"
    assert exercise_of(original) == "memory_formula"
    for name in ("memory_formula-Copy1.ipynb", "Untitled.ipynb"):  # Jupyter's Duplicate and Save As names
        shutil.copyfile(original, tmp_path / name)
        assert exercise_of(tmp_path / name) == "memory_formula", name
    folder = tmp_path / "01_memory_formula"  # by its folder, when its content says nothing
    folder.mkdir()
    (folder / "scratch.ipynb").write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    assert exercise_of(folder / "scratch.ipynb") == "memory_formula"
    (tmp_path / "notes.ipynb").write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    assert exercise_of(tmp_path / "notes.ipynb") is None  # not recorded as an exercise the course does not have


# --------------------------------------------------------------------------- every path argument, hostile files
# Issue 43: an empty path meant the current folder, /dev/zero was read whole, a named pipe hung the grader,
# --to /dev/full became a CSV file. Every path argument of every subcommand, found in the parser (so a new one is
# covered), gets each of these; parsing may refuse it, else the command runs here, under a time limit.
HOSTILE = ("", "/dev/zero", "/dev/full", "{fifo}", "{dir}", "{huge}")
RUNS_FOR_LONG = {("bench",)}  # given a folder it can use, it would measure for real: parsing is checked only


def _is_path(action) -> bool:
    return action.type is Path or getattr(action.type, "is_path", False) or any(
        str(v).startswith("{") for v in getattr(action.type, "bad_values", []))


def _path_cases():
    for prefix, sub in _leaves():
        for action in sub._actions:
            if _is_path(action):
                for value in HOSTILE:
                    yield pytest.param(prefix, action.dest, value,
                                       id=f"{' '.join(prefix)} {action.dest}={value or '<empty>'}")


def test_every_path_argument_is_fuzzed():
    fuzzed = {(p, d) for p, d, _ in (c.values for c in _path_cases())}
    for must in ((("grade",), "folder"), (("grade",), "course"), (("check",), "notebook"),
                 (("classroom", "export"), "to"), (("classroom", "init"), "roster"), (("classroom", "status"), "course"),
                 (("generate",), "model")):
        assert must in fuzzed, (must, sorted(fuzzed))


@pytest.mark.parametrize("prefix, dest, value", list(_path_cases()))
def test_a_hostile_path_never_hangs_or_shows_a_traceback(prefix, dest, value, paths, tmp_path, capsys, monkeypatch):
    import signal

    huge = tmp_path / "huge.ipynb"
    with open(huge, "wb") as fh:
        fh.truncate(20 * 2**30)  # sparse: 20 GiB that take no disk
    value = {**paths, "{huge}": str(huge)}.get(value, value)
    monkeypatch.setenv("KVCOURSE_CLASS_DIR", str(tmp_path / "class"))  # never the home folder
    monkeypatch.setenv("KVCOURSE_EXCHANGE", str(tmp_path / "exchange"))
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "progress.sqlite"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "filler").mkdir()  # the other positionals' value: a folder that exists (grade's submissions)
    sub = SUBCOMMANDS[prefix]
    argv = _argv(prefix, sub, dest, value)
    if prefix == ("grade",) and dest != "course":
        argv += ["--course", str(tmp_path / "course")]  # not autograde/
    try:
        PARSER.parse_args(argv)
        parsed = True
    except SystemExit:
        parsed = False
    capsys.readouterr()
    if parsed and prefix in RUNS_FOR_LONG:
        return

    def hung(signum, frame):
        raise TimeoutError(f"kvcourse {' '.join(argv)} still running after 60 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        code, out, err = _run_main(argv, capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert "Traceback" not in out + err, f"kvcourse {' '.join(argv)} printed a traceback:\n{err[-1500:]}"
    action = next(a for a in sub._actions if a.dest == dest)
    if not (value == paths["{dir}"] and "{dir}" not in getattr(action.type, "bad_values", ["{dir}"])):  # folders work
        assert code not in (0, None), f"kvcourse {' '.join(argv)} exited {code}:\n{out[-500:]}\n{err[-500:]}"
        assert "error" in err.lower() and len(err.strip()) < 2000, err
    assert Path("/dev/full").is_char_device() and Path("/dev/zero").is_char_device()
