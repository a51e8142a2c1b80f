"""Lesson 02 runs end to end (tests/notebook_runner.py: lesson_run); its record()ed numbers are checked here,
and its printed prose against them."""
import pytest

from course.measure.costs import GB, GiB, MiB
from course.paths import LESSONS
from learner_text import assert_learner_output_clean, flat, notebook_text, check_run_time

pytestmark = pytest.mark.slow

QUOTED = {  # (model, T, B): bytes, the FP16 cache sizes usually quoted for these models
    ("llama-2-7b", 4096, 1): 2 * GiB,
    ("llama-2-7b", 4096, 8): 16 * GiB,
    ("gpt2-124m", 1024, 1): 36 * MiB,
    # past Llama-2-70B's 4,096-token context: quoted for it, shown for Llama-3.1-70B (same cache shape)
    ("llama-3.1-70b", 128_000, 1): 327_680 * 128_000,
    ("llama-3.1-70b", 131_072, 1): 327_680 * 131_072,
    ("llama-3.1-70b", 32_000, 4): 327_680 * 32_000 * 4,
}
PER_TOKEN = {"llama-2-7b": 524_288, "gpt2-124m": 36_864, "llama-2-70b": 327_680, "llama-3.1-70b": 327_680}


NOTEBOOK = LESSONS / "02_kv_cache.ipynb"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from notebook_runner import lesson_run

    # One OpenMP thread: on a shared 2-core machine, spinning extra threads make the uncached sweep many
    # times slower without changing what the test checks (ratios measured under the same conditions).
    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=1800, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def results(run):
    return run[0]


def test_runs_within_its_stated_time_with_a_recap_and_no_source_lesson_talk(run):
    results, nb, elapsed = run
    assert_learner_output_clean(nb, results, "02_kv_cache")
    assert results["recap"]["next"] == "03_sampling.ipynb"
    check_run_time(NOTEBOOK, elapsed, nb)


def test_the_printed_speed_report_quotes_the_recorded_speedup(run):
    results, nb, _ = run
    text = flat(notebook_text(nb))
    assert f"the cache is {results['cache_speedup']:.2f}× faster here" in text
    assert "Hugging Face" in text and "5.21×" in text


def test_crossover_places_the_cache_against_the_weights(results):
    from course.measure.costs import crossover_context, kv_bytes_per_token, weights_bytes

    for key, name in (("crossover_7b", "llama-2-7b"), ("crossover_70b", "llama-2-70b")):
        assert results[key] == crossover_context(name)
        n = results[key]
        assert n * kv_bytes_per_token(name) >= weights_bytes(name) > (n - 1) * kv_bytes_per_token(name)
    assert 25_000 < results["crossover_7b"] < 26_500 and 400_000 < results["crossover_70b"] < 440_000


def test_cache_by_hand_equals_uncached_and_the_model(results):
    assert results["walkthrough_max_diff"] < 1e-4
    assert results["walkthrough_vs_model_max_diff"] < 1e-4
    assert results["equivalence_max_logit_diff"] < 1e-3
    assert results["equivalence_tokens_identical"] is True
    assert results["speed_tokens_identical"] is True


def test_speedup_above_one_and_growing_with_length(results):
    lengths, speedups = results["speed_lengths"], results["speedups"]
    assert lengths == sorted(lengths) and len(lengths) >= 3 and lengths[-1] >= 96
    assert all(s > 1 for s in speedups[1:])
    assert speedups[-1] > speedups[0]
    assert speedups[-1] > max(speedups[:-1]) * 0.9  # the longest run keeps (about) the largest gain
    assert results["cache_speedup"] == speedups[-1]


def test_formula_equals_measured_bytes_exactly(results):
    T, elem = results["smollm2_cache_tokens"], results["smollm2_cache_dtype_bytes"]
    expected = 2 * 30 * 1 * T * 3 * 64 * elem  # SmolLM2: L=30, H_kv=3, D_h=64
    assert results["smollm2_cache_formula_bytes"] == expected
    assert results["smollm2_cache_measured_bytes"] == expected
    assert results["smollm2_cache_tensor_bytes"] == expected
    assert results["gpt2_cache_measured_bytes"] == 36 * MiB
    assert results["kv_bytes_per_token"] == 23_040


def test_quoted_table_exact(results):
    rows = {(r["model"], r["seq_len"], r["batch"]): r for r in results["published_table"]}
    assert set(rows) == set(QUOTED)
    for key, expected in QUOTED.items():
        assert rows[key]["total_bytes"] == expected == rows[key]["measured_bytes"]
        assert rows[key]["bytes_per_token"] == PER_TOKEN[key[0]]
    assert 39 <= rows[("llama-3.1-70b", 128_000, 1)]["GiB"] <= 43
    assert 39 <= rows[("llama-3.1-70b", 131_072, 1)]["GB"] <= 43
    assert abs(rows[("llama-3.1-70b", 32_000, 4)]["total_bytes"] / GB - 40) < 2.5


def test_no_quoted_row_past_its_models_context():
    from course.lessons.kv_lesson import published_table
    from course.measure.costs import _config

    table = published_table()
    for r in table.rows:
        assert r["seq_len"] <= _config(r["model"]).max_seq_len, r
    assert {r["quoted_for"] for r in table.rows if "quoted_for" in r} == {"llama-2-70b"}
    assert "whose context is 4,096 tokens" in str(table)


def test_paging_wastes_less_than_preallocation(results):
    assert results["paging_preallocated_waste"] > 0.5
    assert results["paging_paged_waste"] < 0.05
    block = results["paging_block_size"]
    for n, blocks in zip(results["paging_lengths"], results["paging_blocks"]):
        assert 0 <= blocks * block - n < block



def test_recap_crossover_carries_the_context_window_caveat():
    from course.lessons.recap import _kv_cache

    rows = [dict(model="llama-2-7b", crossover_b1=25_706, max_context=4_096),
            dict(model="llama-2-70b", crossover_b1=421_001, max_context=4_096)]
    v = dict(crossover_7b=25_706, crossover_70b=421_001, crossover_rows=rows)
    line = next(b for b in _kv_cache(v) if b and "outweighs" in b)
    assert "beyond the 4,096-token context window" in line and "both lie" in line
    rows_within = [dict(r, max_context=1_000_000) for r in rows]
    line = next(b for b in _kv_cache(dict(v, crossover_rows=rows_within)) if b and "outweighs" in b)
    assert "window" not in line and line.endswith("421,001.")
