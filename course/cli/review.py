"""`kvcourse review`: answer again, in the terminal, what you missed in the lessons.

    kvcourse review              answer the items one by one (a letter, a number, or y/n after a card)
    kvcourse review --list       only list what is in review, most missed first (asks nothing)
    kvcourse review --reset      empty the review (asks first; --yes does not); everything stays saved

What is in review, and when it leaves, is course/teach/review.py's RULE. Every answer is saved at once in the
progress file the notebooks use, so a notebook can be open at the same time.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from course.cli.args import _typed, confirmed, existing_file, positive_int
from course.paths import PROGRESS_VAR
from course.teach.predict import as_number
from course.teach.progress import ProgressFileError, ProgressFileWarning, ProgressStore, default_store
from course.teach.questions import load_questions
from course.teach.review import DEFAULT_LIMIT, KIND_TEXT, RULE, ReviewSession, NOTHING_DUE, due_items


def _progress_file(text: str):
    """An existing progress file: an SQLite database (or an empty file). Anything else is refused: it is not one."""
    path = existing_file(text)
    with open(path, "rb") as f:
        head = f.read(16)
    if head and head != b"SQLite format 3\x00":
        raise argparse.ArgumentTypeError(f"{path} is not a progress file (not an SQLite database); "
                                         "leave --file out to use your own")
    return path


progress_file = _typed(_progress_file, "progress file", ["{missing}", "{dir}", "{unreadable}", "{file}", "{fifo}"])


def say_notes(store: ProgressStore, said: list) -> None:
    """Print what was found about the progress file since the last call, one "Note: ..." line each (stderr)."""
    for note in store.notes[len(said):]:
        said.append(note)
        print(f"Note: {note}", file=sys.stderr)


class _Stop(Exception):
    """q typed, or the input ended."""


def add_arguments(p) -> None:
    p.add_argument("--list", action="store_true", help="list what is in review, without asking anything")
    p.add_argument("--limit", type=positive_int, default=DEFAULT_LIMIT, metavar="N",
                   help=f"at most N items in this sitting (default {DEFAULT_LIMIT})")
    p.add_argument("--lesson", default=None, help="only this lesson's items, e.g. 02_kv_cache")
    p.add_argument("--reset", action="store_true", help="empty the review (asks first); everything stays saved")
    p.add_argument("--yes", "-y", action="store_true", help="with --reset: do not ask")
    p.add_argument("--file", type=progress_file, default=None,
                   help=f"progress file to use (default: ${PROGRESS_VAR} or the user data folder)")


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    bank = load_questions()
    if args.lesson is not None and args.lesson not in bank.lessons:
        return _error(f"--lesson must be one of {', '.join(bank.lessons)}; got {args.lesson!r}")
    if args.yes and not args.reset:
        return _error("--yes only goes with --reset")
    if args.reset and args.list:
        return _error("use either --reset or --list, not both")
    store, said = (ProgressStore(args.file) if args.file is not None else default_store()), []
    try:
        with warnings.catch_warnings():  # said as "Note: ..." lines instead
            warnings.simplefilter("ignore", ProgressFileWarning)
            if args.list:  # only reads: on a full disk it still lists (with a note saying so)
                items = due_items(store, bank, lesson=args.lesson)
                say_notes(store, said)
                return _list(items, args.limit)
            session = None if args.reset else ReviewSession(store, bank, limit=args.limit, lesson=args.lesson)
            store.rows("review_resets")  # the file is read before anything is asked
            if store.disk_error is not None:  # a full disk: stop before asking what cannot be saved
                raise store.disk_error
            say_notes(store, said)
            code = _reset(store, args.yes) if args.reset else _session(session)
            if code == 0:  # (a sitting stopped by the file has said why in its one line)
                say_notes(store, said)
            return code
    except ProgressFileError as exc:  # busy or disk full before anything was answered (_session says what was saved)
        print(f"kvcourse review: {exc}", file=sys.stderr)
        return 1


def _reset(store: ProgressStore, assume_yes: bool) -> int:
    if not assume_yes and not confirmed(f"Empty the review in {store.path}? Your answers and progress stay saved.",
                                        "Nothing changed."):
        return 1
    store.record("review_resets", {})  # what was missed before is not asked again; everything stays saved
    print(f"Review emptied in {store.path}.")
    return 0


def _list(items, limit: int) -> int:
    if not items:
        print(NOTHING_DUE)
        return 0
    print(f"{len(items)} item{'s' if len(items) != 1 else ''} to review, most missed first (`kvcourse review` asks the "
          f"first {min(limit, len(items))}). {RULE}")
    width = max(len(i.id) for i in items)
    for n, item in enumerate(items, 1):
        print(f"  {n:>3}. {item.lesson:<22} {KIND_TEXT[item.kind]:<14} {item.id:<{width}}  {item.describe()}")
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
        print(NOTHING_DUE)
        return 0
    print(f"Review: {session.due_total} to review; here are the {len(session.items)} that need it most. {RULE}")
    print("Type your answer (s skips, q stops).\n")
    try:
        while not session.done:
            item = session.current
            print(session.heading(item))
            print(session.front_text(item))
            {"question": _question, "card": _card, "prediction": _prediction}[item.kind](session)
            print()
    except (_Stop, KeyboardInterrupt):
        print("\nStopped; everything answered so far is saved.")
    except ProgressFileError as exc:  # busy, or its disk full: say truly what of the sitting is saved
        saved = ("everything answered before this one is saved; this one may not be."
                 if session.count("right") + session.count("missed") else "this answer may not be saved.")
        print(f"\nkvcourse review: {exc}. Stopped; {saved}", file=sys.stderr)
        return 1
    print(session.summary_text())
    return 0


def _reply(prompt: str, ok, again: str, session: ReviewSession) -> str | None:
    """Ask until `ok(reply)`; None when the learner skips (s)."""
    while True:
        reply = _ask(prompt)
        if reply.lower() == "s":
            session.skip()
            return None
        if ok(reply):
            return reply
        print(f"  {again}")


def _question(session: ReviewSession) -> None:
    q = session.bank.question(session.current.id)
    letters = [o.key for o in q.options]
    reply = _reply(f"Your answer ({'/'.join(letters)}, s to skip, q to stop): ", lambda r: r.upper() in letters,
                   f"Type one of {', '.join(letters)} (or s to skip, q to stop).", session)
    if reply is not None:
        result = session.answer(reply)
        print(f"{'✓' if result.correct else '✗'} {result.choice}: {result.explanation}")
        if not result.correct:
            print(f"  The right answer is {q.answer}: {result.others[q.answer]}")
        print(f"  {'It leaves review.' if result.correct else 'It stays in review.'}")


def _card(session: ReviewSession) -> None:
    if _ask("Answer it aloud, then press Enter for the model answer (s to skip, q to stop): ").lower() == "s":
        session.skip()
        return
    print("  " + session.reveal())
    reply = _reply("Did you know it? (y/n, q to stop): ", lambda r: r.lower() in ("y", "yes", "n", "no"),
                   "Type y if your answer had the mechanism and the number, n if not.", session)
    if reply is not None:
        knew = reply.lower().startswith("y")
        session.rate(knew)
        print(f"  {'It leaves review.' if knew else 'It stays in review.'}")


def _prediction(session: ReviewSession) -> None:
    def number(reply: str) -> bool:
        try:
            return as_number(reply) is not None
        except ValueError:
            return False

    reply = _reply(f"Your prediction, in {session.current.prediction['unit']} (s to skip, q to stop): ", number,
                   "Type a number, e.g. 20 or 0.5 (or s to skip, q to stop).", session)
    if reply is not None:
        print(f"  {session.answer(reply).explanation}")

