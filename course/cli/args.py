"""Argument types for `kvcourse`: every bad value is refused while parsing, with a message that says what to pass.

Each type is a function argparse calls on the text; it raises argparse.ArgumentTypeError, which argparse turns
into `kvcourse generate: error: argument --max-new-tokens: ...` and exit status 2. Each also lists, in
`.bad_values`, inputs it must refuse; tests/test_cli_fuzz.py feeds them to every subcommand that uses it (path
types name placeholders the test fills in: {missing}, {dir}, {file}, {unreadable}, {unwritable}, {fifo}).

Subcommands below the cli layer (check, grade, classroom) cannot import this module; `harden(parser)` gives their
plain `type=int` / `type=float` options the checked versions instead (see there).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

HUGE = 2**31  # no count, size, time or port the course takes comes near it


def _typed(fn, name: str, bad_values: list[str]):
    fn.__name__ = name  # argparse names the type in "invalid <name> value" messages
    fn.bad_values = bad_values
    fn.is_path = "" in bad_values and "abc" not in bad_values  # tests/test_cli_fuzz.py hands these hostile files
    return fn


def int_range(lo: int, hi: int = HUGE, what: str = "a whole number"):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{what} is needed, not {text!r}") from None
        if not lo <= value <= hi:
            # the bound the value broke: "at least 0" for 99999999999 would send the user the wrong way
            bound = (f"at least {lo}" if value < lo else f"at most {hi}") if hi == HUGE else f"from {lo} to {hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    bad = ["abc", "1.5", "", "-1", str(lo - 1), str(hi + 1) if hi < HUGE else str(HUGE * 10**9)]
    return _typed(parse, f"int_from_{lo}", sorted(set(bad + (["0"] if lo > 0 else []))))


def float_range(lo: float, hi: float = math.inf, *, lo_open: bool = False, what: str = "a number"):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{what} is needed, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < lo or (lo_open and value == lo) or value > hi:
            left = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"must be in {left}{lo:g}, {hi:g}], got {value:g}")
        return value

    bad = ["abc", "nan", "inf", "-1e400", str(lo - 1)]
    if lo_open:
        bad.append(str(lo))
    if math.isfinite(hi):
        bad.append(str(hi + 1))
    return _typed(parse, f"number_from_{lo:g}", bad)


positive_int = int_range(1)
non_negative_int = int_range(0)
port = int_range(1, 65535, what="a port number")
seed = int_range(0, 2**32 - 1, what="a whole-number seed")
temperature = float_range(0.0, 100.0, what="a temperature")
top_p = float_range(0.0, 1.0, lo_open=True, what="a probability")


def _text(text: str) -> str:
    """Text that can be encoded: bytes that are not UTF-8 reach Python as lone surrogates ('caf\\udce9'), which a
    tokenizer refuses only after the model has loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise argparse.ArgumentTypeError(
            f"is not valid UTF-8 text (at character {exc.start} of "
            f"'{text.encode('utf-8', 'backslashreplace').decode()}'): type it again in a UTF-8 terminal "
            "(e.g. LANG=C.UTF-8) or convert it with iconv -t UTF-8") from None
    return text


utf8_text = _typed(_text, "text", ["caf\udce9"])


def _path(text: str) -> Path:
    """A path that names something: '' would be the current folder to Path (`grade ""` graded everything in it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names no file or folder: give one")
    return Path(text).expanduser()


path = _typed(_path, "path", [""])


def _existing_file(text: str) -> Path:
    path = _path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; give a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{path} does not exist")
    if not path.is_file():  # a named pipe (or a device): the read below would wait for a writer, forever
        raise argparse.ArgumentTypeError(f"{path} is not a regular file (a named pipe or a device?); give a file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{path} cannot be read ({exc.strerror or exc})") from None
    return path


existing_file = _typed(_existing_file, "file", ["", "{missing}", "{dir}", "{unreadable}", "{fifo}"])
# a roster: any bytes the grader can read may be text, so an unreadable file (root reads it) is not refused here
text_file = _typed(lambda text: _existing_file(text), "file", ["", "{missing}", "{dir}", "{fifo}"])


def _gguf_file(text: str) -> Path:
    path = _existing_file(text)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise argparse.ArgumentTypeError(f"{path} is not a GGUF model file (it starts with {magic!r}, not b'GGUF')")
    return path


gguf_file = _typed(_gguf_file, "GGUF file", ["", "{missing}", "{dir}", "{unreadable}", "{file}", "{fifo}"])


def check_writable_dir(path: Path) -> Path:
    """Create `path` if needed and prove a file can be written there (a temporary one, removed), so a long job
    never runs only to lose its results. Raises ValueError naming the folder and the reason."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".kvcourse-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"cannot write into {path} ({exc.strerror or exc}): choose a folder you can write to"
                         ) from None
    return path


def _writable_dir(text: str) -> Path:
    try:
        return check_writable_dir(_path(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


writable_dir = _typed(_writable_dir, "folder", ["", "{unwritable}", "{file}"])


def _folder(text: str) -> Path:
    """A folder that exists or can be created: neither it nor anything above it is a file. (Whether it can be
    written is the command's business: `status` only reads.)"""
    path = _path(text)
    for above in (path, *path.parents):
        if above.exists():
            if not above.is_dir():
                inside = "" if above == path else f"{path} cannot be a folder: "
                raise argparse.ArgumentTypeError(f"{inside}{above} is a file, not a folder: give a folder (it is "
                                                 "created if missing)")
            break
    return path


folder = _typed(_folder, "folder", ["", "{file}", "{unwritable}", "{fifo}"])


def _existing_folder(text: str) -> Path:
    """A folder that exists (what a command reads, e.g. the submissions `kvcourse grade` grades)."""
    path = _path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{path} does not exist: give the folder of submissions")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file, not a folder: give the folder of submissions")
    return path


existing_folder = _typed(_existing_folder, "folder", ["", "{missing}", "{file}", "{fifo}"])


def _output_file(text: str) -> Path:
    """A file to write: new, or a plain file it replaces; never a folder, a device (/dev/full), a pipe or a socket."""
    path = _path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder: give the file to write, e.g. {path / 'grades.csv'}")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} is a device, named pipe or socket, not a file: give a new file or a "
                                         "plain file to replace")
    _folder(str(path.parent))  # not below a file
    return path


output_file = _typed(_output_file, "file", ["", "{dir}", "{fifo}", "{unwritable}"])


# ------------------------------------------------------------------ options of the layers below
def harden(parser: argparse.ArgumentParser) -> None:
    """Swap plain `type=int` / `type=float` for the checked types, in `parser` and its subcommands."""
    for action in parser._actions:
        if action.type is int:  # a count, seconds, MiB or a port: never negative or near 2**31, 0 only as default
            action.type = int_range(0 if action.default == 0 else 1)
        elif action.type is float:
            action.type = float_range(0.0)
        elif action.type is Path and action.dest == "course":  # the class folder of grade and classroom
            action.type = folder
        elif action.type is Path and action.dest == "folder" and not action.option_strings:  # grade's submissions
            action.type = existing_folder  # told before a sandbox problem or a course-folder problem
        elif action.type is Path:  # classroom's --exchange, --roster, export --to; check's notebook
            action.type = {"exchange": folder, "roster": text_file, "to": output_file}.get(action.dest, path)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                harden(sub)


def confirmed(question: str, declined: str) -> bool:
    """Ask `question` on the terminal; True only for 'y'/'yes'. Otherwise print `declined` and return False
    (end of input counts as no, so a script without a terminal never deletes anything by accident)."""
    try:
        reply = input(question + " Type 'yes' to confirm: ")
    except EOFError:
        reply = ""
    if reply.strip().lower() in ("y", "yes"):
        return True
    print(f"{declined} (Use --yes to skip this question.)")
    return False
