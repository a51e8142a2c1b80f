import time

import nbformat
import pytest

from course.paths import LESSONS
from learner_text import assert_learner_output_clean, executed, check_run_time

pytestmark = pytest.mark.slow
NOTEBOOK = LESSONS / "00_start_here.ipynb"


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
