"""Lesson 03 runs from top to bottom (lesson_run), and the numbers it records say what its prose says: no demo
claims what its run did not show, no printed sentence runs long, no word is used before it is defined."""
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

    from learner_text import assert_reads_cleanly, check_run_time

    results, nb, elapsed = run
    assert_reads_cleanly(nb, results, "03_sampling", "04_speculative_prefix.ipynb")
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
def test_composition_order_and_one_knob(recorded):
    t_first, p_first = recorded["sampling_nucleus_t_first"], recorded["sampling_nucleus_p_first"]
    assert t_first == sorted(t_first) and t_first[0] < t_first[-1]
    assert len(set(p_first)) == 1
    assert 0 < recorded["sampling_matching_top_p"] < 1


@pytest.mark.slow
def test_task_settings_show_what_the_text_claims(recorded):
    tasks = recorded["sampling_tasks"]
    greedy, hot = tasks["extraction, T = 0"], tasks["extraction, T = 1.5"]
    assert greedy["distinct"] == 1 and greedy["passed"] == greedy["n"]  # no dice: one answer, and it names Tokyo
    assert hot["passed"] <= greedy["passed"]
    assert tasks["brainstorming, T = 0"]["distinct"] == 1  # too cold: four requests, one idea
    assert tasks["brainstorming, T = 1.0"]["distinct"] >= 2
    assert recorded["sampling_paris_pass"] >= 5


def test_task_results_print_what_the_run_did_and_claim_nothing_else():
    from course.lessons.sampling_demos import GUIDANCE, TaskResult

    assert [t.temperature for t in GUIDANCE if t.name.startswith("brainstorming")] == [1.0, 0.0]
    hot = str(TaskResult(GUIDANCE[1], ["Tokyo", "x", "Tokyo", "tokyo."]))
    assert hot.startswith("extraction, T = 1.5: 3 distinct of 4, 3 name Tokyo") and "meant" not in hot
    assert str(TaskResult(GUIDANCE[4], ["a"] * 4)).startswith("brainstorming, T = 0: 1 distinct of 4\n")


@pytest.mark.slow
def test_determinism_numbers(recorded):
    print({k: v for k, v in recorded.items() if k.startswith("determinism")})
    assert recorded["determinism_sum_spread"] > 0
    noise = recorded["determinism_batch_max_abs_diff"]
    assert 0 < noise < 1e-2  # low bits moved; nothing like a real change of the logits
    assert recorded["determinism_batch_frac_differ"] > 0
    assert recorded["determinism_near_tie_flipped"] is True
    assert recorded["determinism_near_tie_margin"] < noise
    assert recorded["determinism_min_gap"] > 0
    assert 0 < recorded["determinism_flip_rate_estimate"] < 1


def test_the_lesson_text_defines_top_p_as_at_least_p_and_cites_it():
    import nbformat

    intro = nbformat.read(NOTEBOOK, as_version=4).cells[0].source
    assert "at least p" in intro and "Holtzman et al." in intro and "arxiv.org/abs/1904.09751" in intro
    assert intro.index("[logit](glossary.ipynb#Logits)") < intro.index("logits")  # linked where it first appears


def test_the_closing_text_sends_the_learner_to_the_graded_quiz_before_lesson_4():
    import re

    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    closing = " ".join(c.source for c in nb.cells[-3:] if c.cell_type == "markdown")
    links = re.findall(r"\]\(([^)#]+\.ipynb)\)", closing)
    quiz = "../exercises/04_checkpoint_quiz/checkpoint_quiz.ipynb"
    assert quiz in links and links.index(quiz) < links.index("04_speculative_prefix.ipynb")
    assert all((LESSONS / link).exists() for link in links)
