"""`kvcourse progress`: print the learner's saved progress per lesson, or clear it (``--reset``, asks first)."""
from __future__ import annotations

import time

from course.teach.progress import ENV_VAR, ProgressStore, Summary, default_store
from course.teach.questions import load_questions


def add_arguments(p) -> None:
    p.add_argument("--reset", action="store_true", help="delete all saved progress (asks first)")
    p.add_argument("--yes", "-y", action="store_true", help="with --reset: do not ask")
    p.add_argument("--file", default=None,
                   help=f"progress file to use (default: ${ENV_VAR} or the user data folder)")


def run(args) -> int:
    store = ProgressStore(args.file) if args.file else default_store()
    if args.reset:
        return _reset(store, assume_yes=args.yes)
    print(format_summary(store.summary(load_questions())))
    return 0


def _reset(store: ProgressStore, assume_yes: bool) -> int:
    counts = store.counts()
    what = ", ".join(f"{n} {t.replace('_', ' ')}" for t, n in counts.items() if n and t != "measurements")
    if not assume_yes:
        prompt = (f"Delete all saved progress in {store.path} ({what or 'nothing saved yet'})? "
                  "Type 'yes' to confirm: ")
        try:
            reply = input(prompt)
        except EOFError:
            reply = ""
        if reply.strip().lower() not in ("y", "yes"):
            print("Nothing deleted. (Use --yes to reset without this question.)")
            return 1
    store.reset()
    print(f"Progress cleared in {store.path}.")
    return 0


def format_summary(summary: Summary) -> str:
    lines = [f"Progress file: {summary.path}", ""]
    width = max([len(s.lesson) for s in summary.lessons] + [6])
    lines.append(f"{'lesson':<{width}}  {'answered':>8}  {'right':>6}  {'1st try':>7}  {'cards':>5}  "
                 "self-assessment")
    for s in summary.lessons:
        lines.append(
            f"{s.lesson:<{width}}  {f'{s.answered}/{s.questions}':>8}  {f'{s.right}/{s.questions}':>6}  "
            f"{f'{s.first_try}/{s.questions}':>7}  {f'{s.cards_seen}/{s.cards}':>5}  "
            f"{s.self_assessment or '—'}")
    total_q = sum(s.questions for s in summary.lessons)
    total_right = sum(s.right for s in summary.lessons)
    lines.append(f"{'total':<{width}}  {'':>8}  {f'{total_right}/{total_q}':>6}")
    lines.append("")
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
