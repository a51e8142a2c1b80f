"""`kvcourse`: the course's command line, the top layer. Each subcommand lives in its own module.

May import: every layer of `course`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# name → (module, help). Each module defines add_arguments(parser) and run(args) -> int exit code.
COMMANDS = {
    "doctor": ("course.cli.doctor", "check the set-up: versions, device, model file, memory bandwidth"),
    "generate": ("course.cli.generate", "stream an answer from the model, then print TTFT and ITL"),
    "lab": ("course.cli.lab", "open the course in JupyterLab"),
    "check": ("course.grade.grading", "run the visible tests of your exercise notebook, with hints"),
    "grade": ("course.grade.grading", "autograde a folder of submitted notebooks (instructors)"),
    "classroom": ("course.grade.classroom", "teach a class on JupyterHub: release, collect, grade, feedback, export"),
    "progress": ("course.cli.progress", "show (or --reset) your saved quiz and exercise progress"),
    "review": ("course.cli.review", "review what you missed: due questions and interview cards (spaced repetition)"),
    "bench": ("course.cli.bench", "measure the engine against the hardware limits; writes JSON + Markdown"),
}


class Parser(argparse.ArgumentParser):
    """argparse, with every usage error on one line: what was wrong, and where to read the options."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> tuple[Parser, dict]:
    """The `kvcourse` parser and {command name: its run function}, for every command this checkout has."""
    from course.cli.args import harden

    parser = Parser(prog="kvcourse", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # subcommand parsers are Parsers too
    available = {}
    for name, (module_name, help_text) in COMMANDS.items():
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


# Errors that mean "this input cannot work" (a missing file, a folder for a file, a value out of range): one line on
# stderr and exit status 2, like a usage error. KVCOURSE_DEBUG=1 shows the traceback instead.
USER_ERRORS = (ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    parser, available = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(available[args.command](args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("KVCOURSE_DEBUG"):
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"kvcourse {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvcourse {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
