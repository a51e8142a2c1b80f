import re
import time

import nbformat
import pytest

from course.paths import LESSONS
from learner_text import assert_learner_output_clean, executed, check_run_time

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


@pytest.mark.slow
def test_start_here_streams_an_answer_with_timings(run_notebook, tmp_path):
    start = time.perf_counter()
    results = run_notebook(NOTEBOOK, timeout=600)
    elapsed = time.perf_counter() - start
    assert "Paris" in results["start_answer"]
    assert results["start_ttft_ms"] > 0 and results["start_itl_ms"] > 0
    # the cold start is measured on its own; the warm first token is what the quiz and recap quote
    assert results["start_cold_ttft_ms"] > 0
    assert results["start_n_tokens"] >= 1 and results["start_stop_reason"] in ("eos", "length")
    nb = executed(tmp_path, "00_start_here")
    assert_learner_output_clean(nb, results, "00_start_here")
    recap = "\n".join(results["recap"]["bullets"])
    assert f"{results['start_ttft_ms']:.0f} ms" in recap and f"{results['start_cold_ttft_ms']:.0f} ms" in recap
    check_run_time(NOTEBOOK, elapsed, nb)
