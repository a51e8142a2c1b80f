"""Helpers the exercise notebooks call, so their cells stay short.

`attention_replaced(model, fn)` runs the course model with a learner's attention in every layer: the model
still computes Q, K, V and RoPE, then calls fn(q, k_new, v_new, layer_cache, start_pos) -> [B, H, T, D_h].
`real_model_demo(...)` repeats the KV-cache exercise's check on SmolLM2 (the real model).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from course.engine.model import Transformer, apply_rope


@contextmanager
def attention_replaced(model: Transformer, attention_fn):
    """Inside the block, every layer's attention core is attention_fn(q, k_new, v_new, layer_cache, start_pos).

    q: [B, H, T, D_h] and k_new, v_new: [B, H_kv, T, D_h] for the T tokens of this call (RoPE applied);
    layer_cache is cache[i] of the cache given to the model (None without one).
    """
    originals = []
    for block in model.layers:
        attn = block.attention

        def forward(x, cos, sin, at, cache, attn=attn):
            B, T, _ = x.shape
            q = attn.wq(x).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)  # [B, H, T, D_h]
            k = attn.wk(x).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # [B, H_kv, T, D_h]
            v = attn.wv(x).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # [B, H_kv, T, D_h]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = attention_fn(q, k, v, cache, at.cache_pos)  # [B, H, T, D_h]; the int start_pos of a plain call
            if tuple(out.shape) != (B, attn.n_heads, T, attn.head_dim):
                raise ValueError(f"attention must return [B, H, T, D_h] = {[B, attn.n_heads, T, attn.head_dim]}, "
                                 f"got {list(out.shape)}")
            return attn.wo(out.transpose(1, 2).reshape(B, T, attn.n_heads * attn.head_dim))  # [B, T, d]

        originals.append((attn, attn.__dict__.get("forward")))
        attn.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield model
    finally:
        for attn, previous in originals:
            if previous is None:
                del attn.forward
            else:
                attn.forward = previous


def real_model_demo(new_cache, attention_fn, prompt: str = "The capital of France is", n_tokens: int = 20) -> dict:
    """Greedy decoding on SmolLM2 with the learner's cache + attention vs without any cache; prints both."""
    from course import load
    from course.engine.generate import generate

    model, tok = load()
    ids = tok.encode(prompt)
    started = time.perf_counter()
    reference = generate(model, ids, n_tokens, use_cache=False).tokens
    uncached_s = time.perf_counter() - started
    cache = new_cache(model.config, 1, len(ids) + n_tokens)
    started = time.perf_counter()
    with torch.no_grad(), attention_replaced(model, attention_fn):
        mine = generate(model, ids, n_tokens, cache=cache).tokens
    cached_s = time.perf_counter() - started
    print(f"prompt: {prompt!r}")
    print(f"without a cache   : {tok.decode(reference)!r}  ({uncached_s:.2f} s)")
    print(f"with your cache   : {tok.decode(mine)!r}  ({cached_s:.2f} s)")
    print("identical tokens" if mine == reference else "the tokens differ: check your cache and attention")
    return {"identical": mine == reference, "uncached_s": uncached_s, "cached_s": cached_s}
