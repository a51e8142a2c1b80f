"""Cache variants: INT8 cache, beam search with a reordered cache, paging, attention by hand, and the
formula against transformers' own cache."""
import pytest
import torch

from course.lessons.attention_by_hand import attend_one_query, attention_with_cache, attention_without_cache, layer0_walkthrough
from course.engine.beam import beam_search, sequence_logprob
from course.measure.cache_speed import SpeedComparison, check_equivalence
from course.engine.config import PRESETS
from course.engine.generate import generate
from course.engine.kv_cache import KVCache, LayerKVCache
from course.engine.positions import Positions
from course.engine.kv_quant import (Int8KVCache, cache_bytes_by_dtype, compare_int8_cache, dequantize_int8,
                             int8_bytes_per_token, quantize_int8)
from course.measure.costs import kv_cache_bytes, tensor_bytes


# ------------------------------------------------------------------ INT8 cache

def test_quantize_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 64) * torch.logspace(-3, 2, 7).view(1, 1, 7, 1)  # vectors of very different sizes
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 7, 1) and scale.dtype == torch.float16
    assert q.abs().max() <= 127
    err = (dequantize_int8(q, scale) - x).abs()
    assert (err <= scale.float() * 0.5 + 1e-7).all()  # round to nearest: at most half a step per value
    absmax = x.abs().amax(-1, keepdim=True)
    relative = err.amax(-1, keepdim=True) / absmax
    assert relative[absmax > 0.01].max() < 0.005  # 1/254 of the largest value, plus fp16 rounding of the scale
    assert err[(absmax <= 0.01).expand_as(err)].max() <= 3.1e-5  # tiny vectors: the scale's floor bounds the error
    zq, zs = quantize_int8(torch.zeros(1, 4))
    assert (zq == 0).all() and (zs > 0).all()  # no zero scale, no NaN


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int8_cache_bytes_are_about_half_of_fp16(dtype):
    for name in ("smollm2-135m", "llama-2-7b", "llama-2-70b", "tiny"):
        c = PRESETS[name]
        sizes = cache_bytes_by_dtype(c, batch=2, max_seq_len=64)
        assert sizes["fp16"] == kv_cache_bytes(c.n_layers, 2, 64, c.n_kv_heads, c.head_dim, 2)
        assert sizes["int8"] == int8_bytes_per_token(c) * 2 * 64
        # D_h int8 values + one 2-byte scale per vector, against 2·D_h bytes in fp16
        assert sizes["int8"] / sizes["fp16"] == (c.head_dim + 2) / (2 * c.head_dim)
        if c.head_dim >= 64:  # every real model: the scale's overhead is at most 2/128
            assert sizes["int8"] <= 0.55 * sizes["fp16"] and sizes["int8"] <= 0.28 * sizes["fp32"]
    cache = Int8KVCache(PRESETS["tiny"], batch=2, max_seq_len=64, dtype=dtype)
    assert tensor_bytes(cache) == cache.nbytes  # nbytes counts every buffer, scales included


def test_int8_cache_matches_float_cache_on_tiny_model(tiny):
    tokens = torch.randint(0, 256, (2, 24))
    ref = KVCache(tiny.config, 2, 24)
    q = Int8KVCache(tiny.config, 2, 24)
    a = [tiny(tokens[:, :8], 0, ref)]
    b = [tiny(tokens[:, :8], 0, q)]
    for t in range(8, 24):
        a.append(tiny(tokens[:, t:t + 1], t, ref))
        b.append(tiny(tokens[:, t:t + 1], t, q))
    a, b = torch.cat(a, 1), torch.cat(b, 1)
    diff = (a - b).abs().max().item()
    assert 0 < diff < 0.05 * a.abs().max().item()  # close, but really quantized (not a float copy)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_int8_cache_overflow_and_bad_sizes(tiny):
    cache = Int8KVCache(tiny.config, 1, 4)
    k = torch.zeros(1, tiny.config.n_kv_heads, 3, tiny.config.head_dim)
    cache[0].update(0, k, k)
    with pytest.raises(ValueError, match="overflow"):
        cache[0].update(2, k, k)
    with pytest.raises(ValueError, match="positive"):
        Int8KVCache(tiny.config, 0, 4)


def test_int8_cache_plugs_into_generate(tiny):
    size = 5 + 10
    out = generate(tiny, [1, 2, 3, 4, 5], 10, cache=Int8KVCache(tiny.config, 1, size))
    assert len(out.tokens) == 10


# ------------------------------------------------------------------ beam search

def test_beam_width_1_is_greedy(tiny):
    prompt = [5, 17, 3, 99, 42]
    assert beam_search(tiny, prompt, width=1, max_new_tokens=12).tokens == generate(tiny, prompt, 12).tokens


@pytest.mark.parametrize("width", [2, 4])
def test_cached_beam_search_equals_recomputing_every_beam(tiny, width):
    """Reordering cache rows must give exactly what recomputing each beam's whole sequence gives."""
    prompt = [7, 8, 9, 200, 3, 3]
    cached = beam_search(tiny, prompt, width=width, max_new_tokens=14)
    uncached = beam_search(tiny, prompt, width=width, max_new_tokens=14, use_cache=False)
    assert cached.tokens == uncached.tokens
    assert [b[0] for b in cached.beams] == [b[0] for b in uncached.beams]
    assert cached.score == pytest.approx(uncached.score, abs=1e-3)
    assert cached.score == pytest.approx(sequence_logprob(tiny, prompt, cached.tokens), abs=1e-3)


def test_beam_cache_is_width_times_single(tiny):
    r = beam_search(tiny, [1, 2, 3], width=4, max_new_tokens=6)
    assert r.cache_bytes == 4 * r.single_cache_bytes and r.cache_ratio == 4
    assert r.cache_shape[0] == 4
    assert r.single_cache_bytes == kv_cache_bytes(tiny.config.n_layers, 1, 3 + 6, tiny.config.n_kv_heads,
                                                  tiny.config.head_dim, 4)


def test_beam_search_stops_at_eos_and_scores_best_first(tiny):
    prompt = [5, 17, 3, 99, 42]
    free = beam_search(tiny, prompt, width=4, max_new_tokens=12)
    eos = free.tokens[2]  # a token the beams are known to reach
    r = beam_search(tiny, prompt, width=4, max_new_tokens=12, eos_id=eos)
    scores = [s for _, s in r.beams]
    assert scores == sorted(scores, reverse=True)
    assert any(tokens[-1] == eos for tokens, _ in r.beams)
    assert all(eos not in tokens[:-1] for tokens, _ in r.beams)  # nothing continues past its EOS


@pytest.mark.parametrize("kwargs", [dict(width=0), dict(width=2.0), dict(max_new_tokens=0)])
def test_beam_search_rejects(tiny, kwargs):
    with pytest.raises(ValueError):
        beam_search(tiny, [1, 2], **kwargs)


# ------------------------------------------------------------------ attention by hand

def test_by_hand_attention_equals_the_model_layer(tiny):
    attn = tiny.layers[0].attention
    x = torch.randn(2, 9, tiny.config.dim)
    cos, sin = tiny.rope_cos, tiny.rope_sin
    ref = attn(x, cos[:9], sin[:9], Positions.at(0, 9), None)  # [B, T, d]
    cache = LayerKVCache(2, attn.n_kv_heads, 9, attn.head_dim)
    for t in range(1, 10):
        a = attention_without_cache(attn, x[:, :t], cos, sin)
        b = attention_with_cache(attn, x[:, t - 1:t], t - 1, cos, sin, cache)
        torch.testing.assert_close(a, ref[:, t - 1:t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b, ref[:, t - 1:t], atol=1e-5, rtol=1e-5)


def test_attend_one_query_is_sdpa():
    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(attend_one_query(q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_speed_comparison_arithmetic():
    s = SpeedComparison([1, 3], cached_times=[1.0, 1.5, 2.0], uncached_times=[1.0, 3.0, 6.0], prompt_tokens=4,
                        tokens_identical=True)
    assert s.speedups == [1.0, 3.0]
    assert s.cached_step_times == [1.0, 0.5, 0.5] and s.uncached_step_times == [1.0, 2.0, 3.0]


# ------------------------------------------------------------------ on the real model

@pytest.mark.slow
def test_real_model_int8_logits_close_and_greedy_agrees(real, ):
    model, tok = real
    q = compare_int8_cache(model, tok.chat_ids("What is the capital of France?"), n_tokens=32)
    assert 0 < q.max_abs_logit_diff < 0.1 * q.max_abs_logit
    assert q.greedy_agreement >= 0.9
    assert q.free_run_same_prefix >= 8


@pytest.mark.slow
def test_real_model_cached_equals_uncached(real):
    model, tok = real
    eq = check_equivalence(model, tok.chat_ids("Name a colour."), n_tokens=12)
    assert eq.tokens_identical and eq.max_abs_logit_diff < 1e-3


@pytest.mark.slow
def test_real_model_beam_search_cache_reorder(real):
    model, tok = real
    prompt = tok.chat_ids("Name a colour.")
    cached = beam_search(model, prompt, width=3, max_new_tokens=6)
    uncached = beam_search(model, prompt, width=3, max_new_tokens=6, use_cache=False)
    assert cached.tokens == uncached.tokens and cached.cache_ratio == 3


@pytest.mark.slow
def test_layer0_walkthrough_on_the_real_model(real):
    model, tok = real
    w = layer0_walkthrough(model, tok.chat_ids("Hi"))
    assert w.max_diff_cached_vs_uncached < 1e-4 and w.max_diff_vs_model < 1e-4
    assert w.kv_rows_uncached == w.T * (w.T + 1) // 2


@pytest.mark.slow
def test_formula_equals_transformers_dynamic_cache_bytes(real):
    """transformers' own cache for the same GGUF holds exactly the formula's bytes."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from course.engine.weights import default_gguf_path

    model, tok = real
    p = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    ids = torch.tensor([tok.chat_ids("Explain the KV cache in one sentence.")])
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    c, T = model.config, ids.shape[1]
    formula = kv_cache_bytes(c.n_layers, 1, T, c.n_kv_heads, c.head_dim, 4, n_heads=c.n_heads)
    assert tensor_bytes(out.past_key_values) == formula
    ours = KVCache(c, 1, T)
    model(ids, 0, ours, last_only=True)
    assert ours.nbytes == formula
