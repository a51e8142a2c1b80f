"""`kvcourse review`: a spaced-repetition session in the terminal over what you missed, skipped or rated low.

    kvcourse review              answer the due items one by one (letters for questions, y/n for cards)
    kvcourse review --list       only list what is due, heaviest first (asks nothing)
    kvcourse review --reset      start the review schedule over (asks first; --yes does not)

The schedule (Leitner boxes) and the weighting are in course/teach/review.py; everything is saved in the
progress file that the notebooks use, at once, so a notebook can be open at the same time.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from course.cli.args import _typed, confirmed, existing_file, positive_int
from course.teach.progress import (ENV_VAR, ProgressFileDiskWarning, ProgressFileError, ProgressStore, default_store,
                                   notes_printed)
from course.teach.questions import load_questions
from course.teach.review import (DEFAULT_LIMIT, INTERVALS_DAYS, SCHEME, ReviewSession, due_items,
                                 nothing_due_text, when_text)


SQLITE_MAGIC = b"SQLite format 3\x00"


def _progress_file(text: str):
    """An existing progress file: an SQLite database (or an empty file). Anything else is refused, because
    the progress store would move a file it cannot use aside and start a new one in its place."""
    path = existing_file(text)
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head and head != SQLITE_MAGIC:
        raise argparse.ArgumentTypeError(f"{path} is not a progress file (not an SQLite database); "
                                         "leave --file out to use your own")
    return path


progress_file = _typed(_progress_file, "progress file", ["{missing}", "{dir}", "{unreadable}", "{file}", "{fifo}"])


class _Stop(Exception):
    """q typed, or the input ended."""


def add_arguments(p) -> None:
    p.add_argument("--list", action="store_true", help="list what is due now, without asking anything")
    p.add_argument("--limit", type=positive_int, default=DEFAULT_LIMIT, metavar="N",
                   help=f"at most N items in this session (default {DEFAULT_LIMIT})")
    p.add_argument("--lesson", default=None, help="only this lesson's items, e.g. 02_kv_cache")
    p.add_argument("--reset", action="store_true", help="start the review schedule over (asks first)")
    p.add_argument("--yes", "-y", action="store_true", help="with --reset: do not ask")
    p.add_argument("--file", type=progress_file, default=None,
                   help=f"progress file to use (default: ${ENV_VAR} or the user data folder)")


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    limit = args.limit
    bank = load_questions()
    if args.lesson is not None and args.lesson not in bank.lessons:
        return _error(f"--lesson must be one of {', '.join(bank.lessons)}; got {args.lesson!r}")
    if args.yes and not args.reset:
        return _error("--yes only goes with --reset")
    if args.reset and args.list:
        return _error("use either --reset or --list, not both")
    store = ProgressStore(args.file) if args.file is not None else default_store()
    try:
        with notes_printed():  # a file moved aside, or not writable: one "Note: ..." line, not a Python warning
            if args.list:  # only reads: on a full disk it still lists what is due (with a note saying so)
                return _list(store, bank, limit, args.lesson)
            # A reset and a session write: on a full disk they stop before asking anything (the error below), not
            # after a note that the file was read as it is.
            warnings.simplefilter("ignore", ProgressFileDiskWarning)
            if args.reset:
                return _reset(store, assume_yes=args.yes)
            session = ReviewSession(store, bank, limit=limit, lesson=args.lesson)
            store.check_writable()
            return _session(session)
    except ProgressFileError as exc:  # busy or disk full, before anything was answered (_session says what was saved once it started)
        print(f"kvcourse review: {exc}", file=sys.stderr)
        return 1


def _reset(store: ProgressStore, assume_yes: bool) -> int:
    store.review_reset_at()  # opens the file first: a note on it comes before the question
    store.check_writable()  # read as it is, from a full disk: nothing can be reset there
    if store.not_saved:  # only a session copy could be reset: say so instead of pretending
        print(f"Nothing changed: {store.not_saved}", file=sys.stderr)
        return 2
    if not assume_yes and not confirmed(
            f"Start the review schedule in {store.path} over? Every item goes back to box 0 "
            "(your answers and progress stay saved).", "Nothing changed."):
        return 1
    store.record_review_reset()
    if store.not_saved:  # the file could not be written after all (found only on writing)
        print(f"Nothing changed: {store.not_saved}", file=sys.stderr)
        return 2
    print(f"Review schedule started over in {store.path}.")
    return 0


def _list(store: ProgressStore, bank, limit: int, lesson: str | None) -> int:
    items = due_items(store, bank, lesson=lesson)
    if not items:
        print(nothing_due_text(store, bank))
        return 0
    print(f"{len(items)} item{'s' if len(items) != 1 else ''} due now (heaviest first; "
          f"`kvcourse review` asks the first {min(limit, len(items))}):")
    width = max(len(i.id) for i in items)
    for n, item in enumerate(items, 1):
        kind = "question" if item.kind == "question" else "card"
        print(f"  {n:>3}. {item.lesson:<22} {kind:<8} {item.id:<{width}}  box {item.box}  {item.describe()}")
    return 0


def _ask(prompt: str) -> str:
    try:
        reply = input(prompt)
    except EOFError:
        print()
        raise _Stop from None
    if reply.strip().lower() in ("q", "quit", "exit"):
        raise _Stop
    return reply.strip()


def _session(session: ReviewSession) -> int:
    if not session.items:
        print(nothing_due_text(session.store, session.bank))
        return 0
    print(f"Review — {session.due_total} due now; here are the {len(session.items)} that need it most.")
    print(f"Schedule: {SCHEME}; intervals {', '.join(f'{d:g}' for d in INTERVALS_DAYS)} days by box.")
    print("Type the letter of your answer (s skips, q stops).\n")
    try:
        while not session.done:
            item = session.current
            print(session.heading(item))
            print(session.front_text(item))
            if item.kind == "question":
                _question(session)
            else:
                _card(session)
            print()
    except (_Stop, KeyboardInterrupt):
        print("\nStopped; " + _saved_text(session))
    except ProgressFileError as exc:  # busy, or its disk full
        print(f"\nkvcourse review: {exc}. Stopped; " + _saved_text(session, before_this_one=True), file=sys.stderr)
        return 1
    else:
        if session.store.not_saved:
            print(_saved_text(session)[:1].upper() + _saved_text(session)[1:])
    print(session.summary_text())
    return 0


def _saved_text(session: ReviewSession, before_this_one: bool = False) -> str:
    """Where this session's answers are, in words that are true: saved, or kept for this session only."""
    answered = session.count("right") + session.count("missed")
    if session.store.not_saved:
        return (f"nothing answered in this session is saved in {session.store.saved_path} (see the note above); "
                "it was kept for this session only.")
    if before_this_one:
        return ("this answer may not be saved." if not answered else
                "everything answered before this one is saved; this one may not be.")
    return "everything answered so far is saved."


def _question(session: ReviewSession) -> None:
    q = session.bank.question(session.current.id)
    letters = [o.key for o in q.options]
    while True:
        reply = _ask(f"Your answer ({'/'.join(letters)}, s to skip, q to stop): ")
        if reply.lower() == "s":
            session.skip()
            return
        if reply.upper() in letters:
            break
        print(f"  Type one of {', '.join(letters)} (or s to skip, q to stop).")
    item = session.current
    result = session.answer(reply)
    mark = "✓" if result.correct else "✗"
    print(f"{mark} {result.choice}: {result.explanation}")
    if not result.correct:
        right = q.correct
        print(f"  The right answer is {right.key}: {result.others[right.key]}")
    print(f"  {item.id} comes back {when_text(session.outcomes[-1].next_due_at)}.")


def _card(session: ReviewSession) -> None:
    reply = _ask("Answer it aloud (or in your head), then press Enter for the model answer (s to skip, q to stop): ")
    if reply.lower() == "s":
        session.skip()
        return
    print("  " + session.reveal())
    while True:
        reply = _ask("Did you know it? (y/n, q to stop): ").lower()
        if reply in ("y", "yes", "n", "no"):
            break
        print("  Type y if your answer had the mechanism and the number, n if not.")
    item = session.current
    outcome = session.rate(reply.startswith("y"))
    print(f"  {item.id} comes back {when_text(outcome.next_due_at)}.")


if __name__ == "__main__":  # pragma: no cover
    import argparse

    parser = argparse.ArgumentParser(prog="kvcourse review")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
