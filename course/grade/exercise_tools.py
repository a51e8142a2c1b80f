"""Helpers the exercise notebooks call, so their cells stay short: the course model with a learner's attention
in every layer, and an exercise's check repeated on SmolLM2, the real model (greedy tokens against the course's)."""
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


def _side_by_side(model, tok, prompt: str, n_tokens: int, yours, reference_cache: bool) -> dict:
    """Greedy tokens of the course's own decoding and of `yours(ids)`, printed one above the other."""
    from course.engine.generate import generate

    ids = tok.encode(prompt)
    started = time.perf_counter()
    reference = generate(model, ids, n_tokens, use_cache=reference_cache).tokens
    reference_s, started = time.perf_counter() - started, time.perf_counter()
    with torch.no_grad():
        mine = yours(ids)
    mine_s = time.perf_counter() - started
    print(f"prompt: {prompt!r}")
    print(f"{'the course' + (' (no cache)' if not reference_cache else ''):<19}: {tok.decode(reference)!r}  "
          f"({reference_s:.2f} s)")
    print(f"{'with your cache':<19}: {tok.decode(mine)!r}  ({mine_s:.2f} s)")
    print("identical tokens" if mine == reference else "the tokens differ: check your cache")
    return {"identical": mine == reference, "reference_s": reference_s, "yours_s": mine_s}


def real_model_demo(new_cache, attention_fn, prompt: str = "The capital of France is", n_tokens: int = 20) -> dict:
    """Exercise 02 on SmolLM2: greedy decoding with the learner's cache and attention vs without any cache."""
    from course import load
    from course.engine.generate import generate

    model, tok = load()

    def yours(ids):
        with attention_replaced(model, attention_fn):
            return generate(model, ids, n_tokens, cache=new_cache(model.config, 1, len(ids) + n_tokens)).tokens

    return _side_by_side(model, tok, prompt, n_tokens, yours, reference_cache=False)


def paged_exercise_demo(model, tokenizer, cache_class, view_class, fork_fn=None,
                        prompt: str = "The capital of France is", n_tokens: int = 24, block_size: int = 16) -> dict:
    """Exercise 05 on SmolLM2: greedy decoding with the learner's paged cache vs the course's contiguous cache;
    then (with fork_fn) the prompt forked into two continuations, counting the blocks they share."""
    from course.engine.generate import generate

    blocks = -(-(len(tokenizer.encode(prompt)) + n_tokens) // block_size) * 3 + 2  # three copies of the request
    cache = cache_class(model.config, num_blocks=blocks, block_size=block_size, dtype=model.dtype)
    out = _side_by_side(model, tokenizer, prompt, n_tokens,
                        lambda ids: generate(model, ids, n_tokens, cache=view_class(cache, 0)).tokens, True)
    c = model.config
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.empty((), dtype=model.dtype).element_size()
    held = len(cache.tables[0])
    print(f"{cache.lengths[0]} positions cached in {held} block(s) of {block_size}: "
          f"{held * block_size * per_token / 2**20:.2f} MiB reserved; a cache preallocated for the model's "
          f"{c.max_seq_len:,}-token context reserves {c.max_seq_len * per_token / 2**20:.0f} MiB per request")
    out["blocks"] = held
    if fork_fn is not None:
        free_before = cache.pool.num_free
        fork_fn(cache, 0, 1)
        fork_fn(cache, 0, 2)
        shared = sum(1 for b in cache.tables[1] if b in cache.tables[0])
        taken = free_before - cache.pool.num_free
        print(f"fork into two more continuations: {shared} block(s) shared three ways, {taken} new block(s) taken"
              + (" (a copy of the partly filled last block each)" if taken else
                 " (the last block was full, so nothing needed copying)"))
        for seq in (0, 1, 2):
            cache.free(seq)
        out.update(shared_blocks=shared, all_free=cache.pool.num_free == blocks)
        print("every block back in the pool after freeing all three:", out["all_free"])
    return out
