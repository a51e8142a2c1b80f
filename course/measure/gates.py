"""Physics gates: a measurement is checked against what physics allows before any sentence uses it.

    run = gates.measured(lambda: sweep(...), lambda s: [gates.batch_gain(8, s.gain(8))], figure="the batch sweep")
    if run.ok: ...use run.value...      else: run.notice is the one line the learner sees

Each rule returns None when the number is possible, or a short phrase saying which limit it broke:

    batch_gain        a batch of B can produce at most B times the tokens per second of one sequence
    not_below_floor   no step is faster than reading its bytes at the machine's memory bandwidth
    not_cheaper       a step does not get cheaper when it does more work (a larger batch, a longer context)
    at_least          a quantity physics bounds from below (TTFT of a long prompt ≥ one decode step)

A figure that breaks a rule is measured again (a burst of load from another program passes); if it still
breaks one, the learner sees one short notice, the figure is marked unreliable, and no recap, quiz or review card
quotes it (course.measure.results.record leaves it out). The notice names the cores other programs took; where
they were quiet it says so instead: then a timing, or a limit measured on this machine (a read probe slower than
the engine it bounds), was off, and calling the machine busy would be false.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from course.measure import threads

T = TypeVar("T")
NOISE = 0.10  # timings within 10 % of each other are the same time on a shared machine


def batch_gain(batch: int, gain: float, noise: float = NOISE) -> str | None:
    if gain > batch * (1 + noise):
        return f"B = {batch} gave {gain:.1f}× the tokens/s of B = 1, more than {batch}×"
    return None


def not_below_floor(ms: float, floor_ms: float, what: str = "a step", noise: float = NOISE) -> str | None:
    if ms < floor_ms * (1 - noise):
        return f"{what} took {ms:.1f} ms, under its {floor_ms:.1f} ms bandwidth floor"
    return None


def not_cheaper(small_ms: float, large_ms: float, small: str, large: str, noise: float = NOISE) -> str | None:
    if large_ms < small_ms * (1 - noise):
        return f"{large} took {large_ms:.1f} ms, less than {small} at {small_ms:.1f} ms"
    return None


def at_least(value: float, bound: float, what: str, bound_what: str, noise: float = NOISE) -> str | None:
    if value < bound * (1 - noise):
        return f"{what} ({value:.3g}) came out below {bound_what} ({bound:.3g})"
    return None


def busy_cores() -> float | None:
    """Cores' worth of CPU other programs are using right now (None where the system does not say)."""
    return threads.sample_others(0.5)


def busy_words(others: float | None, now: bool = False) -> str:
    cores, (be, were) = os.cpu_count() or 1, (("is", "are") if now else ("was", "were"))
    if others is None:
        return f"this machine {be} busy"
    return f"this machine {be} busy ({min(others, cores):.1f} of {cores} cores {were} taken by other programs)"


@dataclass
class Measured(Generic[T]):
    """A measurement after its gate: `value` (the last try), whether it passed, and what it broke if not."""
    value: T
    figure: str
    broken: list[str] = field(default_factory=list)
    tries: int = 1
    others: float | None = None

    @property
    def ok(self) -> bool:
        return not self.broken

    @property
    def quiet(self) -> bool:
        """Other programs were found not to be busy when the figure failed its gate."""
        return self.others is not None and self.others <= threads.BUSY_CORES

    @property
    def notice(self) -> str:
        """One short line for the learner; empty when the figure passed."""
        if self.ok:
            return ""
        why = self.broken[0]
        if self.quiet:
            return (f"{self.figure[0].upper()}{self.figure[1:]} is unreliable: {why}. Other programs were quiet, so "
                    f"a timing or a limit measured on this machine was off. Run this cell again.")
        return (f"{busy_words(self.others).capitalize()}: {self.figure} is unreliable. {why[0].upper()}{why[1:]}. "
                f"Close other programs and run this cell again.")

    def shown(self, value):
        """`value` when the figure passed its gate, else None (a Report shows "—": never quoted as if real)."""
        return value if self.ok else None

    def headline(self, text: str) -> str:
        """A Report's headline: `text` when the figure passed; else a short busy line (put .notice in the details)."""
        if self.ok:
            return text
        advice = "Re-run." if self.quiet else "Close other programs and re-run."
        return f"Not used: {self.figure} broke a physical limit. {advice}"

    def _repr_pretty_(self, p, cycle):
        p.text(self.notice or f"{self.figure}: passed its physics checks")


def measured(measure: Callable[[], T], rules: Callable[[T], list], figure: str, tries: int = 3) -> Measured[T]:
    """Measure, check the rules, and measure again (at most `tries` times in all) while any rule is broken."""
    for attempt in range(1, tries + 1):
        value = measure()
        broken = [r for r in rules(value) if r]
        if not broken:
            return Measured(value, figure, [], attempt)
    return Measured(value, figure, broken, tries, busy_cores())


_said = False


def busy_notice(reset: bool = False) -> str:
    """Before the timing sections: one short line if other programs keep the cores busy, said once per kernel."""
    global _said
    if reset:
        _said = False
    if _said:
        return ""
    others = busy_cores()
    if others is None or others <= threads.BUSY_CORES:
        return ""
    _said = True
    return (f"Note: {busy_words(others, now=True)}. Timings below will be slower and noisier; "
            f"a figure that breaks a physical limit is flagged, not used.")
