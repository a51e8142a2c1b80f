import pytest

from course.paths import LESSONS

pytestmark = pytest.mark.slow


def test_start_here_streams_an_answer_with_timings(run_notebook):
    results = run_notebook(LESSONS / "00_start_here.ipynb", timeout=600)
    assert "Paris" in results["start_answer"]
    assert results["start_ttft_ms"] > 0 and results["start_itl_ms"] > 0
