"""Signed wordings of a measured change, so a sentence never calls a loss a saving.

    lower_by(0.42, "time to first token")   'time to first token 42% lower'
    lower_by(-0.05, "time to first token")  'time to first token 5% higher, no saving in this run'
    times_faster(2.31, "the cache")         'the cache is 2.31× faster'
    speedup_trend([1.2, 2.5, 4.0])          'kept growing with length'
    counted(1, "token")                     '1 token'
    counted(3, "miss", "misses")            '3 misses'
"""
from __future__ import annotations

SAME = 0.01  # a change under 1 % (or a ratio within 1 % of 1) is called no change: timing noise


def lower_by(saved: float, what: str) -> str:
    """`what` after a change of `saved` (share of the old value removed: > 0 lower, < 0 higher)."""
    if saved >= SAME:
        return f"{what} {saved:.0%} lower"
    if saved <= -SAME:
        return f"{what} {-saved:.0%} higher, no saving in this run"
    return f"{what} about the same ({saved:+.1%}), no saving in this run"


def times_faster(ratio: float, subject: str) -> str:
    """`subject` at `ratio` = old time ÷ new time: faster above 1, slower below, no gain within SAME."""
    if ratio >= 1 + SAME:
        return f"{subject} is {ratio:.2f}× faster"
    if ratio <= 1 - SAME:
        return f"{subject} is SLOWER ({1 / ratio:.2f}× the time), no gain in this run"
    return f"{subject} is about as fast ({ratio:.2f}×), no gain in this run"


def speedup_trend(speedups: list[float]) -> str:
    """How a speedup moved along increasing lengths."""
    if all(b > a for a, b in zip(speedups, speedups[1:])):
        return "kept growing with length"
    if speedups[-1] > speedups[0]:
        return "grew overall with length, not at every step (timing noise)"
    return "did NOT grow with length here"


def duration(seconds: float) -> str:
    """A time with a unit that shows it: '1.42 s', '85 ms', '4.3 ms', '0.27 ms' (never '0.0 s' on a fast machine)."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def counted(n: int, singular: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: '1 token', '0 tokens', '1,024 tokens', '2 misses' (pass the
    plural when it is not the singular + 's')."""
    return f"{n:,} {singular if n == 1 else plural or singular + 's'}"
