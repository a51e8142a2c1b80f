"""Lesson 02 runs headless, end to end; its record()ed numbers are checked here, not its printed text."""
import pytest

from course.measure.costs import GB, GiB, MiB
from course.paths import LESSONS

pytestmark = pytest.mark.slow

SEED = {  # (model, T, B): bytes, straight from the seed lesson's table
    ("llama-2-7b", 4096, 1): 2 * GiB,
    ("llama-2-7b", 4096, 8): 16 * GiB,
    ("gpt2-124m", 1024, 1): 36 * MiB,
    ("llama-2-70b", 128_000, 1): 327_680 * 128_000,
    ("llama-2-70b", 131_072, 1): 327_680 * 131_072,
    ("llama-2-70b", 32_000, 4): 327_680 * 32_000 * 4,
}
PER_TOKEN = {"llama-2-7b": 524_288, "gpt2-124m": 36_864, "llama-2-70b": 327_680}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from notebook_runner import execute_notebook

    # One OpenMP thread: on a shared 2-core machine, spinning extra threads make the uncached sweep many
    # times slower without changing what the test checks (ratios measured under the same conditions).
    return execute_notebook(LESSONS / "02_kv_cache.ipynb", tmp_path_factory.mktemp("kv"), timeout=1800,
                            env={"OMP_NUM_THREADS": "1"})


def test_cache_by_hand_equals_uncached_and_the_model(results):
    assert results["walkthrough_max_diff"] < 1e-4
    assert results["walkthrough_vs_model_max_diff"] < 1e-4
    assert results["equivalence_max_logit_diff"] < 1e-3
    assert results["equivalence_tokens_identical"] is True
    assert results["speed_tokens_identical"] is True


def test_speedup_above_one_and_growing_with_length(results):
    lengths, speedups = results["speed_lengths"], results["speedups"]
    assert lengths == sorted(lengths) and len(lengths) >= 3 and lengths[-1] >= 128
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


def test_seed_table_exact(results):
    rows = {(r["model"], r["seq_len"], r["batch"]): r for r in results["seed_table"]}
    assert set(rows) == set(SEED)
    for key, expected in SEED.items():
        assert rows[key]["total_bytes"] == expected == rows[key]["measured_bytes"]
        assert rows[key]["bytes_per_token"] == PER_TOKEN[key[0]]
    assert 39 <= rows[("llama-2-70b", 128_000, 1)]["GiB"] <= 43
    assert 39 <= rows[("llama-2-70b", 131_072, 1)]["GB"] <= 43
    assert abs(rows[("llama-2-70b", 32_000, 4)]["total_bytes"] / GB - 40) < 2.5


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


def test_paging_wastes_less_than_preallocation(results):
    assert results["paging_preallocated_waste"] > 0.5
    assert results["paging_paged_waste"] < 0.05
    block = results["paging_block_size"]
    for n, blocks in zip(results["paging_lengths"], results["paging_blocks"]):
        assert 0 <= blocks * block - n < block

