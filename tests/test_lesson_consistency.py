"""Across the lessons run in this test session: every lesson quotes the same machine profile (one bandwidth, one
FLOP/s, one eager time per token), and no lesson's recap shows a figure that lesson flagged as unreliable.

It reads what the runs left under pytest's base temp (the browser suite's Run All, or each lesson test's headless
run: tests/notebook_runner.py), so it costs nothing of its own; tests/conftest.py puts it after the lesson tests.
Runs with a progress file of their own (the busy-machine runs) are not lesson runs and are not read."""
from __future__ import annotations

import json

import pytest

from course.lessons.recap import COURSE
from notebook_runner import BROWSER_RUNS

pytestmark = pytest.mark.slow
SAME = ("bandwidth_gb_s", "gflop_s", "threads", "measured_at")


def lesson_runs(base) -> dict[str, dict]:
    """lesson id → what its run record()ed: the browser suite's run where there is one, else lesson_run's."""
    runs = {}
    for lesson, _, _ in COURSE:
        found = sorted(base.glob(f"{BROWSER_RUNS}/{lesson}-results.json")) or sorted(
            base.glob(f"{lesson}[0-9]*/{lesson}-results.json"))
        if found:
            runs[lesson] = json.loads(found[-1].read_text())
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = lesson_runs(tmp_path_factory.getbasetemp())
    if len([r for r in runs.values() if "profile" in r]) < 2:
        pytest.skip(f"lessons run in this session: {sorted(runs) or 'none'}; run the lesson tests (or the browser "
                    "suite) in the same session for a comparison")
    return runs


def test_every_lesson_quotes_one_machine_profile(runs):
    profiles = {lesson: r["profile"] for lesson, r in runs.items() if "profile" in r}
    by_kind: dict[tuple, dict] = {}
    for lesson, p in profiles.items():
        by_kind.setdefault((p["device"], p["dtype"]), {})[lesson] = p
    for kind, group in by_kind.items():
        figures = {lesson: ({k: p[k] for k in SAME}, p["decode_ms"].get("eager")) for lesson, p in group.items()}
        assert len({json.dumps(f, sort_keys=True) for f in figures.values()}) == 1, \
            f"the lessons quote different machine profiles for {kind}: {figures}"


def test_no_recap_shows_a_flagged_figure(runs):
    for lesson, r in runs.items():
        unreliable = set(r.get("unreliable", []))
        assert not unreliable & set(r), f"{lesson} recorded a figure it flagged: {unreliable & set(r)}"
        recap = r.get("recap") or {}
        shown = {k.split(".")[0] for k in recap.get("keys", [])}
        assert not shown & unreliable, f"{lesson}'s recap shows a flagged figure: {shown & unreliable}"
