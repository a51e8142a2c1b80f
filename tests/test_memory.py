"""course/memory.py: the KV-cache formula, the seed's table to the byte, helpers, and every bad input."""
import math

import pytest
import torch

from course.measure import costs as M
from course.engine.config import PRESETS, ModelConfig
from course.engine.kv_cache import KVCache

KiB, MiB, GiB, GB = 2 ** 10, 2 ** 20, 2 ** 30, 10 ** 9


# ------------------------------------------------------------------ the seed's table, exactly

def test_llama_2_7b_seed_numbers():
    assert M.kv_bytes_per_token("llama-2-7b") == 524_288 == 2 * 32 * 32 * 128 * 2
    assert M.kv_cache_bytes_for("llama-2-7b", 4096, batch=1) == 2 * GiB
    assert M.kv_cache_bytes_for("llama-2-7b", 4096, batch=8) == 16 * GiB


def test_gpt2_seed_numbers():
    assert M.kv_bytes_per_token("gpt2-124m") == 36_864 == 2 * 12 * 12 * 64 * 2
    assert M.kv_cache_bytes_for("gpt2-124m", 1024) == 36 * MiB


def test_llama_2_70b_seed_numbers():
    assert M.kv_bytes_per_token("llama-2-70b") == 327_680 == 2 * 80 * 8 * 128 * 2
    for t in (128_000, 128 * 1024):  # "128k" either way lands in the seed's ~39-43 GB band
        total = M.kv_cache_bytes_for("llama-2-70b", t)
        assert 39 <= total / GiB <= 43 and 39 <= total / GB <= 43
    assert M.kv_cache_bytes_for("llama-2-70b", 128_000) == 41_943_040_000  # 39.0625 GiB: the seed's "~39 GB"
    probe = M.kv_cache_bytes_for("llama-2-70b", 32_000, batch=4)  # the interview probe: ≈ 40 GB
    assert probe == 327_680 * 32_000 * 4 and abs(probe / GB - 40) < 2.5 and abs(probe / GiB - 40) < 1


def test_70b_has_fewer_kv_bytes_per_token_than_7b_because_of_gqa():
    b70, b7 = M.kv_bytes_per_token("llama-2-70b"), M.kv_bytes_per_token("llama-2-7b")
    assert b70 < b7 and b70 / b7 == (80 / 32) * (8 / 32)
    as_mha = PRESETS["llama-2-70b"].with_(n_kv_heads=64)
    assert M.kv_bytes_per_token(as_mha) == 8 * b70 > b7


def test_smollm2_bytes_per_token():
    assert M.kv_bytes_per_token("smollm2-135m") == 23_040
    assert M.kv_bytes_per_token("smollm2-135m", "fp32") == 46_080


def test_seed_kv_table_rows():
    rows = {(r["model"], r["seq_len"], r["batch"]): r for r in M.quoted_kv_table()}
    assert rows[("llama-2-7b", 4096, 1)]["total_bytes"] == 2 * GiB
    assert rows[("llama-2-7b", 4096, 8)]["GiB"] == 16.0
    assert rows[("gpt2-124m", 1024, 1)]["MiB"] == 36.0
    assert rows[("llama-3.1-70b", 131_072, 1)]["GiB"] == 40.0
    assert rows[("llama-3.1-70b", 32_000, 4)]["bytes_per_token"] == 327_680 == M.kv_bytes_per_token("llama-2-70b")
    assert len(rows) == len(M.QUOTED_KV_TABLE)
    for r in rows.values():
        assert r["total_bytes"] == r["bytes_per_token"] * r["seq_len"] * r["batch"] == r["measured_bytes"]
        assert r["seq_len"] <= M._config(r["model"]).max_seq_len  # no quoted length past its model's window
        if "quoted_for" in r:  # quoted for a model whose window is too short: shown for one with its cache shape
            short, shown = M._config(r["quoted_for"]), M._config(r["model"])
            assert r["seq_len"] > short.max_seq_len
            assert (short.n_layers, short.n_kv_heads, short.head_dim) == (shown.n_layers, shown.n_kv_heads, shown.head_dim)
    assert M.quoted_kv_table("int8")[0]["total_bytes"] == GiB


# ------------------------------------------------------------------ kv_cache_bytes and dtype_bytes

def test_kv_cache_bytes_is_the_product():
    assert M.kv_cache_bytes(2, 3, 5, 7, 11, 2) == 2 * 2 * 3 * 5 * 7 * 11 * 2
    assert M.kv_cache_bytes(2, 3, 5, 7, 11, "fp32") == 2 * 2 * 3 * 5 * 7 * 11 * 4
    assert M.kv_cache_bytes(2, 3, 5, 7, 11, 0.5) == 2 * 3 * 5 * 7 * 11  # int4: half a byte
    assert isinstance(M.kv_cache_bytes(2, 3, 5, 7, 11, 0.5), int)
    assert M.kv_cache_bytes(1, 1, 1, 1, 1, 0.5) == 1
    assert M.kv_cache_bytes(1, 1, 1, 1, 3, 0.5 / 3) == pytest.approx(1.0)


def test_kv_cache_bytes_linear_in_every_size():
    base = M.kv_cache_bytes(4, 2, 100, 8, 64, 2)
    for i in range(5):
        args = [4, 2, 100, 8, 64]
        args[i] *= 3
        assert M.kv_cache_bytes(*args, 2) == 3 * base


def test_dtype_bytes():
    assert [M.dtype_bytes(d) for d in ("fp32", "FP16", "bf16", "bfloat16", "int8", "fp8")] == [4, 2, 2, 2, 1, 1]
    assert M.dtype_bytes(0.5) == 0.5 and M.dtype_bytes(2) == 2


@pytest.mark.parametrize("bad", ["int3", "", 0, -1, True, None, [2]])
def test_dtype_bytes_rejects(bad):
    with pytest.raises(ValueError, match="dtype"):
        M.dtype_bytes(bad)


@pytest.mark.parametrize("name,index", [("n_layers", 0), ("batch", 1), ("seq_len", 2), ("n_kv_heads", 3),
                                        ("head_dim", 4)])
@pytest.mark.parametrize("value", [0, -4])
def test_kv_cache_bytes_rejects_zero_and_negative_sizes(name, index, value):
    args = [2, 1, 16, 4, 8]
    args[index] = value
    with pytest.raises(ValueError, match=f"{name} must be positive"):
        M.kv_cache_bytes(*args, 2)


@pytest.mark.parametrize("name,index", [("n_layers", 0), ("batch", 1), ("seq_len", 2), ("n_kv_heads", 3),
                                        ("head_dim", 4)])
@pytest.mark.parametrize("value", [2.5, 4.0, "4", True, None])
def test_kv_cache_bytes_rejects_non_integers(name, index, value):
    args = [2, 1, 16, 4, 8]
    args[index] = value
    with pytest.raises(ValueError, match=f"{name} must be a whole number"):
        M.kv_cache_bytes(*args, 2)


def test_kv_cache_bytes_checks_that_kv_heads_divide_query_heads():
    assert M.kv_cache_bytes(1, 1, 1, 8, 1, 1, n_heads=64) == 16
    with pytest.raises(ValueError, match=r"n_kv_heads \(3\) must divide n_heads \(8\)"):
        M.kv_cache_bytes(1, 1, 1, 3, 1, 1, n_heads=8)
    with pytest.raises(ValueError, match="n_heads must be a whole number"):
        M.kv_cache_bytes(1, 1, 1, 2, 1, 1, n_heads=8.5)
    with pytest.raises(ValueError, match="n_heads must be positive"):
        M.kv_cache_bytes(1, 1, 1, 2, 1, 1, n_heads=-8)


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    assert M.kv_cache_bytes(np.int64(2), 1, 1, 1, 1, 2) == 8


# ------------------------------------------------------------------ per-preset helpers

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_per_token_times_tokens_equals_total_for_every_preset(name):
    c = PRESETS[name]
    per = M.kv_bytes_per_token(c)
    assert per == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
    assert M.kv_bytes_per_token(name) == per  # preset name or config, same answer
    assert M.kv_cache_bytes_for(c, 1000, batch=3) == 3000 * per


def test_kv_cache_bytes_for_beam_width_multiplies():
    one = M.kv_cache_bytes_for("llama-2-7b", 4096)
    assert M.kv_cache_bytes_for("llama-2-7b", 4096, beam_width=4) == 4 * one == 8 * GiB
    assert M.kv_cache_bytes_for("llama-2-7b", 4096, batch=2, beam_width=4) == 8 * one


@pytest.mark.parametrize("kwargs,name", [(dict(seq_len=0), "seq_len"), (dict(seq_len=-5), "seq_len"),
                                         (dict(batch=0), "batch"), (dict(beam_width=0), "beam_width"),
                                         (dict(beam_width=1.5), "beam_width"), (dict(seq_len=10.5), "seq_len")])
def test_kv_cache_bytes_for_rejects(kwargs, name):
    args = dict(seq_len=128, batch=1, beam_width=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        M.kv_cache_bytes_for("llama-2-7b", **args)


@pytest.mark.parametrize("bad", ["llama-9", 42, None])
def test_unknown_model_rejected_with_the_choices(bad):
    with pytest.raises(ValueError, match="llama-2-7b"):
        M.kv_bytes_per_token(bad)


def test_config_with_kv_heads_not_dividing_heads_is_rejected():
    with pytest.raises(ValueError, match="must divide"):
        PRESETS["llama-2-7b"].with_(n_kv_heads=5)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive integer"):
        PRESETS["llama-2-7b"].with_(n_kv_heads=2.0)


def test_weights_bytes():
    c = PRESETS["llama-2-7b"]
    assert M.weights_bytes(c) == 2 * c.n_params == 2 * 6_738_415_616
    assert M.weights_bytes("llama-2-7b", "fp32") == 4 * c.n_params
    assert M.weights_bytes("llama-2-7b", "int8") == c.n_params
    assert M.weights_bytes("gpt2-124m", "fp16") == 2 * 124_439_808
    assert 135e9 < M.weights_bytes("llama-2-70b") < 140e9  # the seed's "~140 GB in FP16"


def test_max_context_and_max_batch():
    c, mem = "llama-2-7b", 24 * GiB
    free = mem - M.weights_bytes(c)
    t = M.max_context(c, mem)
    assert t == free // 524_288
    assert M.kv_cache_bytes_for(c, t) + M.weights_bytes(c) <= mem < M.kv_cache_bytes_for(c, t + 1) + M.weights_bytes(c)
    assert M.max_context(c, mem, batch=4) == free // (4 * 524_288)
    b = M.max_batch(c, mem, seq_len=4096)
    assert b == free // (2 * GiB) == 5
    assert M.max_context(c, 1 * GiB) == 0 and M.max_batch(c, 1 * GiB, 4096) == 0  # the weights alone don't fit
    # weights in int8, cache in fp16: more room for the cache
    assert M.max_context(c, mem, dtype="fp16", weights_dtype="int8") > t


@pytest.mark.parametrize("call", [lambda: M.max_context("llama-2-7b", 0), lambda: M.max_context("llama-2-7b", -1),
                                  lambda: M.max_context("llama-2-7b", GiB, batch=0),
                                  lambda: M.max_batch("llama-2-7b", GiB, seq_len=0),
                                  lambda: M.max_batch("llama-2-7b", 1.5, seq_len=10)])
def test_max_context_and_max_batch_reject(call):
    with pytest.raises(ValueError):
        call()


def test_crossover_context():
    c = "llama-2-7b"
    t = M.crossover_context(c)
    assert M.kv_cache_bytes_for(c, t) >= M.weights_bytes(c) > M.kv_cache_bytes_for(c, t - 1)
    assert 25_000 < t < 26_000
    assert M.crossover_context(c, batch=8) == math.ceil(M.weights_bytes(c) / (8 * 524_288))
    assert M.crossover_context(c, dtype="int8") == t  # both halve: the crossing stays put
    with pytest.raises(ValueError, match="batch"):
        M.crossover_context(c, batch=0)


def test_human_bytes():
    assert M.human_bytes(512) == "512 B"
    assert M.human_bytes(1536) == "1.50 KiB"
    assert M.human_bytes(2 * GiB) == "2.00 GiB"
    assert M.human_bytes(36 * MiB) == "36.00 MiB"
    assert M.human_bytes(41_943_040_000, binary=False) == "41.94 GB"
    assert M.human_bytes(3 * 2 ** 50) == "3,072.00 TiB"  # the largest unit absorbs the rest


def test_kv_formula_string():
    s = M.kv_formula("llama-2-70b", 32_000, batch=4)
    for part in ("L=80", "B=4", "T=32,000", "H_kv=8", "D_h=128", "41,943,040,000 B", "39.06 GiB", "41.94 GB"):
        assert part in s
    assert "beams=4" in M.kv_formula("llama-2-7b", 4096, beam_width=4)
    with pytest.raises(ValueError, match="seq_len"):
        M.kv_formula("llama-2-7b", 0)


def test_kv_head_variants():
    rows = M.kv_head_variants("llama-2-7b", seq_len=4096)
    assert [r["n_kv_heads"] for r in rows] == [32, 16, 8, 4, 2, 1]
    assert [r["kind"] for r in rows] == ["MHA", "GQA", "GQA", "GQA", "GQA", "MQA"]
    assert rows[0]["total_bytes"] == 2 * GiB and rows[-1]["total_bytes"] == 2 * GiB // 32
    assert [r["is_original"] for r in rows] == [True] + [False] * 5
    small = M.kv_head_variants("smollm2-135m", seq_len=100, batch=2, dtype="fp32")
    assert [(r["kind"], r["n_kv_heads"], r["group_size"]) for r in small] == [("MHA", 9, 1), ("GQA", 3, 3),
                                                                              ("MQA", 1, 9)]
    assert all(r["total_bytes"] == 2 * 30 * 2 * 100 * r["n_kv_heads"] * 64 * 4 for r in small)
    with pytest.raises(ValueError, match="batch"):
        M.kv_head_variants("smollm2-135m", 100, batch=-1)


def test_tensor_bytes_counts_each_storage_once():
    c = ModelConfig.from_name("tiny")
    cache = KVCache(c, batch=2, max_seq_len=10)
    assert M.tensor_bytes(cache) == cache.nbytes == 2 * c.n_layers * 2 * 10 * c.n_kv_heads * c.head_dim * 4
    k = torch.zeros(2, c.n_kv_heads, 3, c.head_dim)
    k_all, v_all = cache[0].update(0, k, k)
    assert M.tensor_bytes([cache, k_all, v_all]) == cache.nbytes  # views add nothing
    assert M.tensor_bytes({"a": torch.zeros(10, dtype=torch.float16), "b": [torch.zeros(3, dtype=torch.int8)]}) == 23
    assert M.tensor_bytes(None) == 0 and M.tensor_bytes([]) == 0
    meta = KVCache(c, batch=2, max_seq_len=10, device="meta")
    assert M.tensor_bytes(meta) == cache.nbytes


def test_measure_kv_cache_bytes_equals_formula():
    assert M.measure_kv_cache_bytes("llama-2-70b", 131_072) == 40 * GiB  # on the meta device: no memory used
    assert M.measure_kv_cache_bytes("gpt2-124m", 1024, device="cpu") == 36 * MiB
    for dtype in ("fp32", "fp16", "int8"):
        assert M.measure_kv_cache_bytes("smollm2-135m", 50, 3, dtype) == M.kv_cache_bytes_for("smollm2-135m", 50, 3,
                                                                                               dtype)
    with pytest.raises(ValueError, match="dtype"):
        M.measure_kv_cache_bytes("tiny", 10, dtype=0.5)
    with pytest.raises(ValueError, match="batch"):
        M.measure_kv_cache_bytes("tiny", 10, batch=0)
    with pytest.raises(ValueError, match="seq_len"):
        M.measure_kv_cache_bytes("tiny", -10)
