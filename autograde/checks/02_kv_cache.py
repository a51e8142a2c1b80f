"""Checks for exercise 02 (the KV cache and attention over it): one list per test cell.

Each run builds fixed inputs (seeded), calls the learner's LayerCache / new_cache / cached_attention, and
returns tensors; the comparison with the reference's tensors happens outside the sandbox.
"""
import torch
import torch.nn.functional as F

from course.engine.config import ModelConfig
from course.engine.generate import generate
from course.engine.model import tiny_model
from course.grade.exercise_tools import attention_replaced
from course.grade.verdicts import Check, close, exact, raises


def randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def allocates(ns):
    c = ns["LayerCache"](batch=2, n_kv_heads=3, max_seq_len=16, head_dim=8)
    half = ns["LayerCache"](1, 1, 4, 2, dtype=torch.float16)
    caches = ns["new_cache"](ModelConfig.from_name("tiny"), 1, 32)
    return (c.k, c.v, half.k, len(caches), caches[0].k, caches[-1].v)


def update(ns):
    c = ns["LayerCache"](2, 3, 16, 8)
    k_buffer, v_buffer = c.k, c.v  # as __init__ allocated them: an update that swaps in new tensors misses them
    k1, v1, k2, v2 = randn(1, 2, 3, 5, 8), randn(2, 2, 3, 5, 8), randn(3, 2, 3, 1, 8), randn(4, 2, 3, 1, 8)
    first = c.update(0, k1, v1)
    first = (first[0].clone(), first[1].clone())
    second = c.update(5, k2, v2)
    return (first[0], first[1], second[0], second[1], k_buffer[:, :, :6].clone(), v_buffer[:, :, :6].clone())


def overflow(raise_at):
    def run(ns):
        c = ns["LayerCache"](1, 2, 8, 4)
        full = c.update(5, randn(5, 1, 2, 3, 4), randn(6, 1, 2, 3, 4))[0].clone()  # positions 5..7: exactly full
        if raise_at is None:
            return full
        return c.update(raise_at, randn(7, 1, 2, 3, 4), randn(8, 1, 2, 3, 4))
    return run


def rewind(ns):
    c = ns["LayerCache"](3, 2, 10, 4, dtype=torch.float16)
    k_buffer = c.k  # allocated once: the rewind must overwrite it in place
    a = randn(9, 3, 2, 6, 4, dtype=torch.float16)
    c.update(0, a, a * 2)
    b = randn(10, 3, 2, 2, 4, dtype=torch.float16)
    k_all, v_all = c.update(3, b, b * 2)  # positions 3, 4 overwritten, 5 forgotten
    return (k_all.clone(), v_all.clone(), k_buffer[:, :, :5].clone())


def new_cache_shapes(config, batch):
    """new_cache for another config than the notebook's, a small T_max: every layer sized from the config it is
    given, not from a config the notebook happens to define."""
    def run(ns):
        caches = ns["new_cache"](config, batch, 5)
        return (len(caches), [(tuple(c.k.shape), tuple(c.v.shape), str(c.k.dtype), str(c.v.dtype)) for c in caches])
    return run


def new_cache_dtype(ns):
    caches = ns["new_cache"](ModelConfig.from_name("tiny"), 1, 4, dtype=torch.float16)
    return (caches[0].k, caches[-1].v)


def inputs_after_attention(ns):
    """The caller's q, k_new, v_new after a prefill and a decode step: the model (and the notebook's own test)
    uses them again, so cached_attention must not scale or overwrite them in place."""
    q, k, v = randn(20, 1, 4, 4, 16), randn(21, 1, 2, 4, 16), randn(22, 1, 2, 4, 16)
    cache = ns["LayerCache"](1, 2, 8, 16)
    ns["cached_attention"](q[:, :, :3], k[:, :, :3], v[:, :, :3], cache, 0)
    ns["cached_attention"](q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], cache, 3)
    return (q, k, v)


def bad_position(pos):
    def run(ns):
        c = ns["LayerCache"](3, 2, 10, 4, dtype=torch.float16)
        b = randn(10, 3, 2, 2, 4, dtype=torch.float16)
        return c.update(pos, b, b)
    return run


def one_token_at(pos):
    """A cache filled exactly (T_max = 4), then a single token (a decode step) at `pos`: past the end (4) or
    negative (-1). The notebook: writing past T_max, or at a negative position, must raise ValueError."""
    def run(ns):
        c = ns["LayerCache"](1, 2, 4, 3)
        x = randn(31, 1, 2, 4, 3)
        c.update(0, x, -x)
        return c.update(pos, x[:, :, :1], x[:, :, :1])
    return run


def bfloat16(ns):
    """The buffers keep the dtype they are given, bfloat16 too (a tensor leaves the sandbox as float32 when it is
    bfloat16, so the dtypes come back as names)."""
    c = ns["LayerCache"](2, 1, 6, 4, dtype=torch.bfloat16)
    a = randn(32, 2, 1, 3, 4, dtype=torch.bfloat16)
    k_all, v_all = c.update(1, a, -a)
    caches = ns["new_cache"](TINY, 1, 4, dtype=torch.bfloat16)
    return [str(c.k.dtype), str(c.v.dtype), str(k_all.dtype), k_all.clone(), v_all.clone(),
            [(str(layer.k.dtype), str(layer.v.dtype)) for layer in caches]]


def attention_chunks(seed, B, H, H_kv, T, D, chunks, capacity):
    def run(ns):
        q, k, v = randn(seed, B, H, T, D), randn(seed + 1, B, H_kv, T, D), randn(seed + 2, B, H_kv, T, D)
        cache = ns["LayerCache"](B, H_kv, capacity, D)
        return torch.cat([ns["cached_attention"](q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cache, a)
                          for a, b in chunks], dim=2)
    return run


def model_logits(seed, config, B, T, chunks, capacity):
    def run(ns):
        model = tiny_model(seed=seed, config=config)
        ids = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed + 100))
        with torch.no_grad():
            cache = ns["new_cache"](model.config, B, capacity)
            with attention_replaced(model, ns["cached_attention"]):
                return torch.cat([model(ids[:, a:b], start_pos=a, cache=cache) for a, b in chunks], dim=1)
    return run


def greedy(seed, config, prompt, n, own_attention=False):
    def run(ns):
        model = tiny_model(seed=seed, config=config)
        with torch.no_grad():
            cache = ns["new_cache"](model.config, 1, len(prompt) + n)
            if own_attention:  # the course model's attention, the learner's cache
                return generate(model, prompt, n, cache=cache).tokens
            with attention_replaced(model, ns["cached_attention"]):
                return generate(model, prompt, n, cache=cache).tokens
    return run


TINY = ModelConfig.from_name("tiny")
SMOLLM = ModelConfig.from_name("smollm2-135m")  # the course model: 30 layers, H_kv = 3, D_h = 64
MQA = TINY.with_(n_kv_heads=1)
WIDE_HEADS = TINY.with_(head_dim=24)  # D_h = 24, not dim // n_heads = 16
EXACT_TOL = close(1e-5)
BAD_POSITION = "hint: positions outside 0 .. max_seq_len-1 must raise ValueError"

# The course's own KV cache: left out of the sandbox (course.grade.sandbox.course_tree).
ABSENT = ["course.engine.kv_cache"]

CHECKS = {
    "test_cache_allocates": [
        Check("shapes, dtypes and zeros", allocates, exact,
              "hint: allocate both buffers once, as zeros of shape [B, H_kv, T_max, D_h] and the given dtype"),
        Check("new_cache passes its dtype on", new_cache_dtype, exact,
              "hint: new_cache must build every LayerCache with the dtype it is given"),
        Check("new_cache for the course model's shape", new_cache_shapes(SMOLLM, 2), exact,
              "hint: new_cache must size every LayerCache from the config it is given (config.n_layers, "
              "config.n_kv_heads, config.head_dim), not from the notebook's own cfg"),
        Check("new_cache when D_h is not dim / n_heads", new_cache_shapes(WIDE_HEADS, 1), exact,
              "hint: size every LayerCache with config.head_dim: D_h is not always config.dim // config.n_heads"),
    ],
    "test_cache_update": [
        Check("prefill then decode", update, exact,
              "hint: write at start_pos .. start_pos+T_new-1 into the buffers allocated in __init__ (in place, not a "
              "new tensor each update) and return every position so far"),
    ],
    "test_cache_overflow": [
        Check("exactly full is fine", overflow(None), exact, "hint: positions up to max_seq_len - 1 fit"),
        Check("one too many", overflow(6), raises, "hint: writing past max_seq_len must raise ValueError"),
    ],
    "test_cache_hidden": [
        Check("rewind and overwrite (float16)", rewind, exact,
              "hint: overwrite the preallocated buffers in place, return positions 0 .. start_pos+T_new-1 only, "
              "keep the dtype"),
        Check("negative position", bad_position(-1), raises, BAD_POSITION),
        Check("past the end", bad_position(9), raises, BAD_POSITION),
        Check("one token past a full cache", one_token_at(4), raises,
              "hint: a single token (a decode step) past max_seq_len must raise ValueError too: do not grow the "
              "buffers"),
        Check("one token at position -1", one_token_at(-1), raises,
              "hint: a single token at a negative position must raise ValueError too (no wrap-around)"),
        Check("bfloat16 buffers", bfloat16, exact,
              "hint: allocate the buffers in exactly the dtype you are given (bfloat16 too), in LayerCache and "
              "new_cache"),
    ],
    "test_attention_prefill": [
        Check("6-token prefill", attention_chunks(1, 1, 4, 2, 6, 16, [(0, 6)], 16), EXACT_TOL,
              "hint: scores = q @ k^T / sqrt(D_h); mask key j for query i when j > start_pos + i"),
    ],
    "test_attention_decode": [
        Check("prefill 6, decode 3", attention_chunks(2, 2, 4, 2, 9, 16, [(0, 6), (6, 7), (7, 8), (8, 9)], 16),
              EXACT_TOL, "hint: in a decode step the one query at start_pos sees every cached key 0 .. start_pos"),
    ],
    "test_attention_hidden": [
        Check("chunks, 3 queries per KV head, D_h 32",
              attention_chunks(3, 2, 6, 2, 10, 32, [(0, 4), (4, 7), (7, 8), (8, 10)], 12), EXACT_TOL,
              "hint: check the causal range for T > 1 after start_pos > 0, the head grouping and the scale"),
        Check("leaves q, k_new, v_new alone", inputs_after_attention, exact,
              "hint: do not change the caller's tensors in place (no mul_ or /= on q, k_new or v_new): "
              "scale the scores instead"),
    ],
    "test_model_logits": [
        Check("prefill 8, decode 4", model_logits(0, TINY, 1, 12, [(0, 8)] + [(t, t + 1) for t in range(8, 12)], 16),
              close(1e-4), "hint: if the cache and attention pass but this fails, check that update() returns "
                           "every position so far"),
    ],
    "test_greedy_32": [
        Check("32 greedy tokens", greedy(0, TINY, [169, 163, 192, 95], 32), exact,
              "hint: greedy decoding must pick the same token at every step"),
    ],
    "test_model_hidden": [
        Check("MQA, batch 2, chunks", model_logits(7, MQA, 2, 20, [(0, 5), (5, 11), (11, 12), (12, 20)], 24),
              close(1e-4), "hint: chunked prefill on a batch must match"),
        Check("the model's attention, your cache", greedy(7, MQA, [1, 2, 3], 32, own_attention=True), exact,
              "hint: the course model's attention with your cache must decode the same tokens"),
    ],
}
