"""Lesson 02's optional appendix (MHA/GQA/MQA, the INT8 cache, beam search): its helpers (fast) and the notebook run
as a learner runs it (slow): bytes exact, the INT8 error judged against the gap between the top two logits by a
stated rule, words defined where they first appear, text that reads cleanly."""
import nbformat
import pytest

from course.lessons.kv_lesson import channel_text, grade_int8_error, int8_text
from course.paths import LESSONS
from learner_text import assert_reads_cleanly, check_run_time, flat, notebook_text, printed_text

NOTEBOOK = LESSONS / "02b_kv_cache_appendix.ipynb"


def test_int8_error_grade_follows_the_stated_rule():
    assert grade_int8_error(0.05, 1.2, 1, 64) == "small"  # 4 % of the median gap, 1 step of 64 at risk
    assert grade_int8_error(0.3, 1.2, 5, 64) == "moderate"  # 25 %, 8 % of the steps
    assert grade_int8_error(1.097, 1.2, 26, 64) == "large"  # 91 %, 26 of 64
    assert grade_int8_error(0.1, 1.2, 20, 64) == "large"  # a small max error, but a third of the steps at risk


def test_int8_and_channel_tables_print_their_values():
    v = {"int8_n_tokens": 64, "int8_free_run_same_prefix": 12, "int8_max_logit_diff": 1.097,
         "int8_median_top2_gap": 1.2, "int8_at_risk_steps": list(range(26)), "int8_greedy_agreement": 0.97,
         "int8_error_grade": "large"}
    text = int8_text(v)
    assert "26 of 64" in text and "the first 12 tokens" in text and "a large error" in text and "97%" in text
    assert "all 64 tokens" in int8_text({**v, "int8_free_run_same_prefix": 64})
    ch = channel_text({"key_outlier_ratio": 8.4, "value_outlier_ratio": 2.1, "key_err_per_token": 0.012,
                       "key_err_per_channel": 0.004, "value_err_per_token": 0.006, "value_err_per_channel": 0.007})
    assert "8.4×" in ch and "1.20%" in ch and "0.40%" in ch


def test_the_kivi_paragraph_is_followed_by_its_cell_and_words_are_defined():
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    kivi = next(i for i, c in enumerate(cells) if "KIVI" in c.source and c.cell_type == "markdown")
    assert "channel_report(" in cells[kivi + 1].source and cells[kivi + 1].cell_type == "code"
    assert next(i for i, c in enumerate(cells) if "## 3. Beam search" in c.source) > kivi + 1
    assert len({c.id for c in cells}) == len(cells)
    prose = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    for word, anchor in (("RoPE", "RoPE"), ("teacher forcing", "Teacher-forcing"), ("Beam search", "Beam-search")):
        first = prose.index(word)
        assert f"(glossary.ipynb#{anchor})" in prose[first: first + 200], f"{word} is not linked where it first appears"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from notebook_runner import lesson_run

    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=1200, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_reads_as_a_learner_would(run):
    r, nb, elapsed = run
    assert_reads_cleanly(nb, r, "02b_kv_cache_appendix", "03_sampling.ipynb")
    check_run_time(NOTEBOOK, elapsed, nb)


@pytest.mark.slow
def test_head_variants_scale_with_kv_heads(run):
    r = run[0]
    for name in ("smollm2-135m", "llama-2-7b"):
        rows = r[f"head_variants_{name}"]
        assert rows[0]["kind"] == "MHA" and rows[-1]["kind"] == "MQA"
        for row in rows:
            assert row["total_bytes"] == row["n_kv_heads"] * rows[-1]["total_bytes"] == row["measured_bytes"]


@pytest.mark.slow
def test_int8_cache_bytes_and_error_against_the_top_two_gap(run):
    r, nb, _ = run
    assert r["int8_bytes_measured"] == r["int8_bytes_formula"]
    assert r["int8_bytes_ratio"] == pytest.approx(66 / 128, abs=0.01) and r["int8_vs_fp32_ratio"] <= 0.28
    gaps, diffs, n = r["int8_top2_gaps"], r["int8_per_step_max_diff"], r["int8_n_tokens"]
    assert len(gaps) == len(diffs) == n and 0 < r["int8_min_top2_gap"] <= r["int8_median_top2_gap"]
    assert r["int8_at_risk_steps"] == [i for i in range(n) if 2 * diffs[i] >= gaps[i]]
    assert r["int8_error_grade"] == grade_int8_error(r["int8_max_logit_diff"], r["int8_median_top2_gap"],
                                                     len(r["int8_at_risk_steps"]), n)
    assert 0 < r["int8_max_logit_diff"] < 2.0 and r["int8_greedy_agreement"] >= 0.9
    if r["int8_free_run_same_prefix"] < n:  # a divergence needs a step at risk, or a flip seen teacher-forced
        assert r["int8_at_risk_steps"] or r["int8_greedy_agreement"] < 1
    assert flat(int8_text(r)) in flat("\n".join(printed_text(nb)))


@pytest.mark.slow
def test_keys_carry_outlier_channels_and_beam_search_multiplies_the_cache(run):
    r, nb, _ = run
    assert r["key_outlier_ratio"] > r["value_outlier_ratio"] > 1
    assert 0 < r["key_err_per_channel"] < r["key_err_per_token"] < 0.05
    assert "2402.02750" in notebook_text(nb)
    assert r["beam_width"] == 4 and r["beam_cache_bytes"] == 4 * r["beam_single_cache_bytes"]
    assert r["beam_cache_ratio"] == 4
