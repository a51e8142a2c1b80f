"""Lesson 03 runs from top to bottom (lesson_run), and the numbers it records say what its prose says."""
import math

import pytest

from course.paths import LESSONS

NOTEBOOK = LESSONS / "03_sampling.ipynb"


def test_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert max(len(c.source.splitlines()) for c in code) <= 8  # thin cells: the code lives in course/
    assert 'checkpoint("03_sampling")' in code[-1].source and 'self_assessment("03_sampling")' in code[-1].source
    assert nb.metadata.kernelspec.name == "python3"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from notebook_runner import lesson_run

    # One torch thread: on a shared CPU, two threads per process spin-wait on each other and the run
    # takes many times longer; the lesson's numbers do not depend on it (across_threads sets its own).
    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=900, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def recorded(run):
    return run[0]


@pytest.mark.slow
def test_runs_within_its_stated_time_with_a_recap_and_no_source_lesson_talk(run):
    import nbformat

    from learner_text import assert_learner_output_clean, check_run_time

    results, nb, elapsed = run
    assert_learner_output_clean(nb, results, "03_sampling")
    assert results["recap"]["next"] == "04_speculative_prefix.ipynb"
    assert any("04_checkpoint_quiz" in e for e in results["recap"]["exercises"])  # the quiz covers lessons 1-3
    outputs = " ".join(str(o.get("text", "")) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "(s) " not in outputs and "(es) " not in outputs, "counts take the noun in their own number"
    check_run_time(NOTEBOOK, elapsed, nb)


@pytest.mark.slow
def test_two_shapes_of_distribution(recorded):
    assert "Paris" in recorded["sampling_factual_top_token"]
    assert recorded["sampling_factual_top_prob"] > 0.5
    assert recorded["sampling_open_entropy_bits"] > recorded["sampling_factual_entropy_bits"] + 2
    kept = recorded["sampling_nucleus_p09"]
    assert kept["factual"] < 5 < kept["open-ended"]  # top-p adapts to the shape


@pytest.mark.slow
def test_redraw_latency_is_recorded(recorded):
    # Speed is not asserted (shared machine); the lesson must have measured and recorded it.
    median, slowest = recorded["sampling_redraw_ms_median"], recorded["sampling_redraw_ms_max"]
    assert 0 < median <= slowest and math.isfinite(slowest)
    print(f"redraw: median {median:.1f} ms, slowest {slowest:.1f} ms")
    assert recorded["sampling_button_samples"] == 3


@pytest.mark.slow
def test_composition_order_and_one_knob(recorded):
    t_first, p_first = recorded["sampling_nucleus_t_first"], recorded["sampling_nucleus_p_first"]
    assert t_first == sorted(t_first) and t_first[0] < t_first[-1]
    assert len(set(p_first)) == 1
    assert 0 < recorded["sampling_matching_top_p"] < 1


@pytest.mark.slow
def test_task_settings_examples(recorded):
    tasks = recorded["sampling_tasks"]
    cold, hot = tasks["extraction, T = 0.1"], tasks["extraction, T = 1.5"]
    assert cold["passed"] >= cold["n"] - 1  # semantic check: the answer names Tokyo
    assert hot["passed"] < cold["passed"]
    assert tasks["brainstorming, T = 1.0"]["distinct"] >= 2
    assert recorded["sampling_paris_pass"] >= 5


def test_task_labels_claim_only_what_the_run_showed():
    from course.lessons.sampling_demos import GUIDANCE, TaskResult

    hot, cold = GUIDANCE[1], GUIDANCE[4]
    assert hot.meant == "too hot" and cold.meant == "too cold" and "(" not in hot.name + cold.name
    assert TaskResult(cold, list("abcd")).label == "brainstorming, T = 0.2 (meant as too cold, but all 4 differ in this run)"
    assert TaskResult(cold, list("aacd")).label == "brainstorming, T = 0.2 (too cold: only 3 distinct of 4)"
    assert TaskResult(hot, ["Tokyo", "x", "Tokyo", "Tokyo"]).label == "extraction, T = 1.5 (too hot: 1 of 4 miss Tokyo)"
    assert "meant as too hot, but all 4 name Tokyo" in TaskResult(hot, ["Tokyo"] * 4).label
    assert TaskResult(GUIDANCE[0], ["Tokyo"] * 4).label == "extraction, T = 0.1"


@pytest.mark.slow
def test_determinism_numbers(recorded):
    print({k: v for k, v in recorded.items() if k.startswith("determinism")})
    assert recorded["determinism_sum_spread"] > 0
    noise = recorded["determinism_batch_max_abs_diff"]
    assert 0 < noise < 1e-2  # low bits moved; nothing like a real change of the logits
    assert recorded["determinism_batch_frac_differ"] > 0
    import torch

    threads = recorded["determinism_threads_max_abs_diff"]  # compared on a CPU only: a GPU's kernels ignore them
    assert (threads >= 0) if not torch.cuda.is_available() else threads is None
    assert recorded["determinism_near_tie_flipped"] is True
    assert recorded["determinism_near_tie_margin"] < noise
    assert recorded["determinism_min_gap"] > 0
    assert 0 < recorded["determinism_flip_rate_estimate"] < 1


def test_counted_puts_the_noun_in_the_number_it_takes():
    from course.lessons.wording import counted

    assert counted(1, "token") == "1 token" and counted(0, "token") == "0 tokens"
    assert counted(1_024, "token") == "1,024 tokens"
    assert counted(1, "miss", "misses") == "1 miss" and counted(2, "miss", "misses") == "2 misses"


def test_the_lesson_text_defines_top_p_as_at_least_p_and_cites_it():
    import nbformat

    intro = nbformat.read(NOTEBOOK, as_version=4).cells[0].source
    assert "at least p" in intro and "Holtzman et al." in intro and "arxiv.org/abs/1904.09751" in intro


def test_the_closing_text_sends_the_learner_to_the_graded_quiz_before_lesson_4():
    import re

    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    closing = " ".join(c.source for c in nb.cells[-3:] if c.cell_type == "markdown")
    links = re.findall(r"\]\(([^)#]+\.ipynb)\)", closing)
    quiz = "../exercises/04_checkpoint_quiz/checkpoint_quiz.ipynb"
    assert quiz in links and links.index(quiz) < links.index("04_speculative_prefix.ipynb")
    assert all((LESSONS / link).exists() for link in links)
