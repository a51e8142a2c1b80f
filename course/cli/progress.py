"""`kvcourse progress`: print the learner's saved progress per lesson, or clear it (``--reset``, asks first)."""
from __future__ import annotations

import sys
import time
import warnings

from course.cli.args import confirmed
from course.cli.review import progress_file
from course.teach.progress import ENV_VAR, ProgressFileError, ProgressFileWarning, ProgressStore, Summary, default_store
from course.teach.questions import load_questions
from course.teach.review import progress_text


def add_arguments(p) -> None:
    p.add_argument("--reset", action="store_true", help="delete all saved progress (asks first)")
    p.add_argument("--yes", "-y", action="store_true", help="with --reset: do not ask")
    p.add_argument("--file", type=progress_file, default=None,  # never moved aside (keep_damaged): reported
                   help=f"progress file to use (default: ${ENV_VAR} or the user data folder)")


def run(args) -> int:
    store = ProgressStore(args.file, keep_damaged=True) if args.file else default_store()
    try:
        if args.reset:
            return _reset(store, assume_yes=args.yes)
        bank = load_questions()
        with warnings.catch_warnings():  # each ProgressFileWarning is one of the summary's notes instead
            warnings.simplefilter("ignore", ProgressFileWarning)
            summary, table = store.summary(bank), progress_text(store, bank)
            summary.notes = store.notes  # with what progress_text found too (e.g. rows skipped)
    except ProgressFileError as exc:  # busy, or a full disk: nothing was changed; the same command works later
        print(f"kvcourse progress: {exc}", file=sys.stderr)
        return 1
    print(format_summary(summary, table))
    return 0


def _reset(store: ProgressStore, assume_yes: bool) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProgressFileWarning)
        counts = store.counts()
    store.check_writable()  # read as it is, from a full disk: nothing can be deleted there
    if store.not_saved:  # only a session copy could be cleared: say so instead of pretending
        print(f"Nothing deleted: {store.not_saved}", file=sys.stderr)
        return 2
    for note in store.moved_aside:  # before the question: the file about to be cleared is a fresh one
        print(f"Note: {note}")
    what = ", ".join(f"{n} {t.replace('_', ' ')}" for t, n in counts.items() if n and t != "measurements")
    if not assume_yes and not confirmed(
            f"Delete all saved progress in {store.path} ({what or 'nothing saved yet'})?", "Nothing deleted."):
        return 1
    store.reset()
    print(f"Progress cleared in {store.path}.")
    return 0


def format_summary(summary: Summary, lessons_table: str) -> str:
    """`lessons_table`: the one-screen per-lesson view (course.teach.review.progress_text: questions right/seen,
    cards due, items due for review, the lesson's exercise tests passing, self-assessment)."""
    lines = [f"Progress file: {summary.path}", "", lessons_table, ""]
    # e.g. a damaged file moved aside (and where it is now), or a read-only folder: why nothing new is saved there
    notes = summary.notes or ([summary.note] if summary.note else [])
    lines[1:1] = [f"Note: {note}" for note in notes]
    width = max([len(s.lesson) for s in summary.lessons] + [6])
    if summary.exercises:
        lines.append("Exercises (latest `kvcourse check`):")
        for e in summary.exercises:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["at"]))
            status = "all passed" if e["passed"] == e["total"] else "to fix"
            lines.append(f"  {e['exercise']:<{width}}  {e['passed']}/{e['total']} tests passed  "
                         f"({status}; {e['runs']} run{'s' if e['runs'] != 1 else ''}, last {when})")
    else:
        lines.append("Exercises: no self-check yet (run `kvcourse check NOTEBOOK`).")
    if summary.empty:
        lines.append("")
        lines.append("Nothing saved yet: answer a checkpoint at the end of a lesson to start.")
    return "\n".join(lines)
