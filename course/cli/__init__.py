"""`kvcourse`: the course's command line, the top layer. Each subcommand lives in its own module.

May import: every layer of `course`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import select
import signal
import sys
import threading

from course.cli.args import harden

# name → (module, help). Each module defines add_arguments(parser) and run(args) -> int exit code.
COMMANDS = {
    "doctor": ("course.cli.doctor", "check the set-up: versions, device, model file, memory bandwidth"),
    "generate": ("course.cli.generate", "stream an answer from the model, then print TTFT and ITL"),
    "lab": ("course.cli.lab", "open the course in JupyterLab"),
    "check": ("course.grade.check", "run the visible tests of your exercise notebook, with hints"),
    "grade": ("course.grade.grader", "autograde a folder of submitted notebooks (instructors)"),
    "classroom": ("course.grade.classroom", "teach a class on JupyterHub: release, collect, grade, feedback, export"),
    "progress": ("course.cli.progress", "show (or --reset) your saved quiz and exercise progress"),
    "review": ("course.cli.review", "answer again what you missed: questions, interview cards, predictions"),
    "bench": ("bench.cli", "measure the engine against the hardware limits; writes JSON + Markdown"),
}


class Parser(argparse.ArgumentParser):
    """argparse, with every usage error on one line: what was wrong, and where to read the options."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(only: str | None = None) -> tuple[Parser, dict]:
    """The `kvcourse` parser and {command: its run function}. only: import that command's module alone, so a command
    does not pay for the others' imports (torch, nbgrader: seconds each); "" imports none (all are listed)."""
    parser = Parser(prog="kvcourse", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # subcommand parsers are Parsers too
    available = {}
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # a command whose module is not part of this version of the course
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(module, f"add_arguments_{name}", getattr(module, "add_arguments", lambda _p: None))(p)
        available[name] = getattr(module, f"run_{name}", getattr(module, "run", None))
    harden(parser)
    return parser, available


def _exit_on_sigterm() -> None:
    """SIGTERM (what `timeout`, systemd, a CI cancel or a hub's culler send) ends the command as an exception would:
    `finally` blocks and atexit clean-ups run (temporary copies of the learner's files, locks), which the default
    action skips. Only where nothing else has set a handler, and only in a command (a notebook kernel keeps its own
    behaviour: its temporary folders are swept by the next process instead)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def terminated(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, terminated)


def _deepest_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand `args` came through (`kvcourse classroom release`), for its error."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[chosen]


def _stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (poll says POLLERR on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _user_error(command: str, exc: BaseException) -> int:
    """An input that cannot work (a missing file, a folder for a file, a value out of range): one line on stderr and
    exit status 2, as a usage error. KVCOURSE_DEBUG=1 shows the traceback instead."""
    if os.environ.get("KVCOURSE_DEBUG"):
        raise exc
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"kvcourse {command}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    command = next((w for w in (sys.argv[1:] if argv is None else argv) if not str(w).startswith("-")), "")
    parser, available = build_parser(command if command in COMMANDS else "")
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the (sub)command they were given to, not by the top-level `kvcourse --help`
        _deepest_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    if argv is None:  # run as the `kvcourse` command (tests call main(argv) in their own process)
        _exit_on_sigterm()
    try:
        code = int(available[args.command](args) or 0)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is "Exception ignored ..." and status 120
        return code
    except BrokenPipeError as exc:
        if not _stdout_closed():  # e.g. a child process's pipe: an error like any other
            return _user_error(args.command, exc)
        # stdout's reader went away (`kvcourse progress | head -1`): not an error of this command. Quiet, and exit 0
        # as a command whose output fits the pipe does; stdout goes to devnull so the flush at exit fails no more
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as exc:
        return _user_error(args.command, exc)
    except KeyboardInterrupt:
        print(f"kvcourse {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
