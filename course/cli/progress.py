"""`kvcourse progress`: print the learner's saved progress per lesson, or clear it (``--reset``, asks first)."""
from __future__ import annotations

import sys
import time
import warnings

from course.cli.args import confirmed
from course.cli.review import progress_file, say_notes
from course.paths import PROGRESS_VAR
from course.teach.progress import ProgressFileError, ProgressFileWarning, ProgressStore, default_store
from course.teach.questions import load_questions
from course.teach.review import progress_text


def add_arguments(p) -> None:
    p.add_argument("--reset", action="store_true", help="delete all saved progress (asks first)")
    p.add_argument("--yes", "-y", action="store_true", help="with --reset: do not ask")
    p.add_argument("--file", type=progress_file, default=None,  # never moved aside (keep_damaged): reported
                   help=f"progress file to use (default: ${PROGRESS_VAR} or the user data folder)")


def run(args) -> int:
    store = ProgressStore(args.file, keep_damaged=True) if args.file else default_store()
    try:
        with warnings.catch_warnings():  # said as "Note: ..." lines instead
            warnings.simplefilter("ignore", ProgressFileWarning)
            if args.reset:
                return _reset(store, assume_yes=args.yes)
            table, exercises = progress_text(store, load_questions()), store.exercise_checks()
    except ProgressFileError as exc:  # busy, or a full disk: nothing was changed; the same command works later
        print(f"kvcourse progress: {exc}", file=sys.stderr)
        return 1
    print(f"Progress file: {store.path}")
    for note in store.notes:
        print(f"Note: {note}")
    print(f"\n{table}\n")
    print("Exercises (latest `kvcourse check`):" if exercises else
          "Exercises: no self-check yet (run `kvcourse check NOTEBOOK`).")
    for e in exercises:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["at"]))
        status = "all passed" if e["passed"] == e["total"] else "to fix"
        print(f"  {e['exercise']:<18}  {e['passed']}/{e['total']} tests passed  ({status}; {e['runs']} "
              f"run{'s' if e['runs'] != 1 else ''}, last {when})")
    if not exercises and not any(store.counts().values()):
        print("\nNothing saved yet: answer a checkpoint at the end of a lesson to start.")
    return 0


def _reset(store: ProgressStore, assume_yes: bool) -> int:
    counts = store.counts()
    if store.disk_error is not None:  # read as it is, from a full disk: nothing can be deleted there
        raise store.disk_error
    say_notes(store, [])  # e.g. a damaged file moved aside: the file about to be cleared is a fresh one
    what = ", ".join(f"{n} {t.replace('_', ' ')}" for t, n in counts.items() if n and t != "measurements")
    if not assume_yes and not confirmed(
            f"Delete all saved progress in {store.path} ({what or 'nothing saved yet'})?", "Nothing deleted."):
        return 1
    store.reset()
    print(f"Progress cleared in {store.path}.")
    return 0
