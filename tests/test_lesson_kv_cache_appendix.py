"""Lesson 02's optional appendix (MHA/GQA/MQA, the INT8 cache, beam search) runs end to end (lesson_run); its
recorded numbers are checked here, and its INT8 verdict against the gap between the top two logits."""
import pytest

from course.paths import LESSONS
from learner_text import assert_learner_output_clean, flat, notebook_text, check_run_time

pytestmark = pytest.mark.slow
NOTEBOOK = LESSONS / "02b_kv_cache_appendix.ipynb"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from notebook_runner import lesson_run

    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=1200, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def results(run):
    return run[0]


def test_runs_within_its_stated_time_with_a_recap(run):
    results, nb, elapsed = run
    assert_learner_output_clean(nb, results, "02b_kv_cache_appendix", min_bullets=3)
    assert results["recap"]["next"] == "03_sampling.ipynb"
    check_run_time(NOTEBOOK, elapsed, nb)


def test_int8_error_is_judged_against_the_top_two_gap(run):
    results, nb, _ = run
    text = flat(notebook_text(nb))
    gap, err = results["int8_median_top2_gap"], results["int8_max_logit_diff"]
    assert 0 < results["int8_min_top2_gap"] <= gap
    assert f"median {gap:.2f}" in text and f"{err / gap:.0%} of the median gap" in text
    n, same = results["int8_n_tokens"], results["int8_free_run_same_prefix"]
    assert 0 <= same <= n
    if same < n:  # the report names the token where the free run first left the float run
        assert f"first differed at token {same + 1} of {n}" in text
        # a divergence needs a step where the error could reorder the top two, or a flip seen teacher-forced
        assert results["int8_at_risk_steps"] or results["int8_greedy_agreement"] < 1
    else:
        assert f"matched all {n} tokens" in text


def test_head_variants_scale_with_kv_heads(results):
    for name in ("smollm2-135m", "llama-2-7b"):
        rows = results[f"head_variants_{name}"]
        kinds = [r["kind"] for r in rows]
        assert kinds[0] == "MHA" and kinds[-1] == "MQA"
        mqa = rows[-1]["total_bytes"]
        for r in rows:
            assert r["total_bytes"] == r["n_kv_heads"] * mqa == r["measured_bytes"]


def test_int8_cache_half_of_fp16_and_close(results):
    assert results["int8_bytes_ratio"] <= 0.55
    assert results["int8_vs_fp32_ratio"] <= 0.28
    assert results["int8_bytes_measured"] == results["int8_bytes_formula"]
    assert results["int8_bytes_measured"] <= 0.55 * results["fp16_bytes_measured"]
    assert 0 < results["int8_max_logit_diff"] < 2.0
    assert results["int8_greedy_agreement"] >= 0.9


def test_beam_cache_is_width_times_single(results):
    w = results["beam_width"]
    assert w == 4
    assert results["beam_cache_bytes"] == w * results["beam_single_cache_bytes"]
    assert results["beam_cache_ratio"] == w




def test_int8_error_grade_follows_the_values():
    from course.lessons.kv_lesson import grade_int8_error

    assert grade_int8_error(0.05, 1.2, 1, 64) == "small"  # 4% of the median gap, 1 step of 64 at risk
    assert grade_int8_error(0.3, 1.2, 5, 64) == "moderate"  # 25%, 8% of the steps
    assert grade_int8_error(1.097, 1.2, 26, 64) == "large"  # the reviewed run: 91%, 26 of 64
    assert grade_int8_error(0.1, 1.2, 20, 64) == "large"  # a small max error, but a third of the steps at risk


def test_int8_grade_and_key_channels_are_printed_from_their_values(run):
    results, nb, _ = run
    text = flat(notebook_text(nb))
    assert f"a {results['int8_error_grade']} error" in text
    assert f"a {results['int8_error_grade']} error: " in flat(" ".join(results["recap"]["bullets"]))
    # post-RoPE keys have outlier channels; per-channel scales shrink their round-trip error (KIVI's choice)
    assert results["key_outlier_ratio"] > results["value_outlier_ratio"] > 1
    assert 0 < results["key_err_per_channel"] < results["key_err_per_token"] < 0.05
    assert f"{results['key_outlier_ratio']:.1f}× the median channel's in the keys" in text
    assert "2402.02750" in text


def test_int8_grade_phrase_counts_the_steps_at_risk():
    from course.lessons.kv_lesson import int8_grade_phrase

    large = int8_grade_phrase("large", 27, 64)
    assert large.startswith("a large error") and "27 of 64 steps were close enough to flip" in large
    assert "not only near-ties" in large
    small = int8_grade_phrase("small", 1, 64)
    assert "1 of 64 steps was" in small and "near-ties" in small and "not only" not in small
    assert "none of the 64 steps" in int8_grade_phrase("small", 0, 64)


def test_recap_bullet_follows_the_error_grade_not_the_smallest_gap():
    """The reviewed run: a smallest gap of 0.030 but a large error; the bullet must say large, with its count."""
    from course.lessons import recap as recap_mod

    v = {"int8_max_logit_diff": 1.097, "int8_median_top2_gap": 1.2, "int8_min_top2_gap": 0.030,
         "int8_error_grade": "large", "int8_at_risk_steps": list(range(27)), "int8_n_tokens": 64}
    text = "\n".join(recap_mod.recap("02b_kv_cache_appendix", v).bullets)
    assert "91% of the median top-two gap" in text and "a large error: 27 of 64 steps" in text
    assert "near-tied greedy choice" not in text
    small = "\n".join(recap_mod.recap("02b_kv_cache_appendix", {**v, "int8_max_logit_diff": 0.05,
                                                                 "int8_error_grade": "small",
                                                                 "int8_at_risk_steps": [3]}).bullets)
    assert "a small error: 1 of 64 steps was" in small and "all near-ties" in small


def test_kivi_paragraph_is_followed_by_its_cell_and_beam_search_heading_after():
    import nbformat

    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    kivi = next(i for i, c in enumerate(cells) if "KIVI" in c.source and c.cell_type == "markdown")
    assert "channel_report(" in cells[kivi + 1].source and cells[kivi + 1].cell_type == "code"
    beam = next(i for i, c in enumerate(cells) if "## 3. Beam search" in c.source)
    assert beam > kivi + 1
    assert len({c.id for c in cells}) == len(cells)
