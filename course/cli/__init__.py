"""`kvcourse`: the course's command line, the top layer. Each subcommand lives in its own module.

May import: every layer of `course`.
"""
from __future__ import annotations

import argparse
import importlib
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcourse", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(available[args.command](args) or 0)


if __name__ == "__main__":
    sys.exit(main())
