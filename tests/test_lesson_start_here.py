import re

import nbformat
import pytest

from course.measure.display import HEADLINE_WORDS
from course.measure.gates import NOISE
from course.paths import LESSONS
from learner_text import assert_learner_output_clean, check_run_time, deferrals, flat, long_sentences, printed_text

NOTEBOOK = LESSONS / "00_start_here.ipynb"


def test_the_course_map_says_after_which_lesson_each_exercise_comes_as_the_recaps_link_it():
    from course.lessons.recap import COURSE

    text = " ".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown")
    text = re.sub(r"\s+", " ", text)
    pairs = re.findall(r"(\d(?:, \d)*(?: and \d)?) after lesson (\d)", text)  # '3 and 4 after lesson 3'
    stated = {int(n): int(lesson) for numbers, lesson in pairs for n in re.findall(r"\d", numbers)}
    linked = {int(path[:2]): int(lesson[:2]) for lesson, _, paths in COURSE for path in paths}
    assert stated == linked
    assert not re.search(r"exercises/<\w+>", text), "a path a learner can paste, not a placeholder"
    pasted = re.findall(r"`kvcourse check (\S+\.ipynb)`", text)
    assert pasted and all((LESSONS.parent / p).exists() for p in pasted)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from notebook_runner import lesson_run

    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=600)


@pytest.mark.slow
def test_start_here_streams_an_answer_and_reads_cleanly(run):
    results, nb, elapsed = run
    assert "Paris" in results["start_answer"] and results["start_n_tokens"] >= 1
    assert long_sentences(nb, 35) == [] and deferrals(nb) == []
    assert_learner_output_clean(nb, results, "00_start_here", min_bullets=1)
    for key in ("first_calls", "long_prompt"):
        assert len(results["headlines"][key].split()) <= HEADLINE_WORDS
    prof = results["profile"]
    assert f"memory {prof['bandwidth_gb_s']:.1f} GB/s" in flat("\n".join(printed_text(nb)))
    check_run_time(NOTEBOOK, elapsed, nb)


@pytest.mark.slow
def test_its_timings_obey_physics_or_are_flagged(run):
    r, nb, _ = run
    slack = 1 - NOISE
    unreliable = set(r.get("unreliable", []))
    assert not unreliable & set(r)
    text = flat("\n".join(printed_text(nb)))
    assert all(flat(n) in text for n in r.get("busy_notices", []))
    if "start_ttft_ms" in r:  # a cold first call is never faster than a warm one, a later token never beats its floor
        assert r["start_cold_ttft_ms"] >= slack * r["start_ttft_ms"]
        assert "the same time within noise" in r["headlines"]["first_calls"] or \
            f"took {r['start_cold_ttft_ms'] / r['start_ttft_ms']:.1f}× a warm one" in r["headlines"]["first_calls"]
    if "start_long_ttft_ms" in r:  # a long prompt's first token: prefill clearly dominates
        assert r["start_long_ttft_ms"] >= slack * r["start_long_itl_ms"]
        ratio = r["start_long_ttft_ms"] / r["start_long_itl_ms"]
        assert f"took {ratio:.0f}× a later one" in r["headlines"]["long_prompt"]
    assert not {k.split(".")[0] for k in r["recap"]["keys"]} & unreliable
