"""One attention layer written twice, without and with a KV cache, to read side by side: both compute the newest
token's attention output from a real course.engine.model.Attention's weights, and the cached one differs in the lines
marked ``# <-- cache``. Letters: B batch, T tokens so far, H query heads, H_kv key/value heads, D_h head dim, d width.
"""
from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass

import torch

from course.engine.kv_cache import LayerKVCache
from course.engine.model import apply_rope

MARK = "# <-- cache"


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ / √D_h)·v for one query per head (the newest token sees every earlier one: nothing to mask).
    q [B, H, 1, D_h]; k, v [B, H_kv, T, D_h] → [B, H, 1, D_h]."""
    group = q.shape[1] // k.shape[1]  # query heads per KV head (GQA)
    k = k.repeat_interleave(group, dim=1)  # [B, H, T, D_h]: each KV head serves `group` query heads
    v = v.repeat_interleave(group, dim=1)  # [B, H, T, D_h]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, 1, T]
    return torch.softmax(scores.float(), dim=-1).type_as(v) @ v  # [B, H, 1, D_h]


def attention_without_cache(attn, x_all, cos, sin):
    """Newest token's attention output. x_all: [B, T, d], EVERY token so far."""
    B, T, _ = x_all.shape
    H, H_kv, D_h = attn.n_heads, attn.n_kv_heads, attn.head_dim
    x_new = x_all[:, -1:]                                      # [B, 1, d]
    q = attn.wq(x_new).view(B, 1, H, D_h).transpose(1, 2)      # [B, H, 1, D_h]
    k = attn.wk(x_all).view(B, T, H_kv, D_h).transpose(1, 2)   # [B, H_kv, T, D_h] all T rows, again
    v = attn.wv(x_all).view(B, T, H_kv, D_h).transpose(1, 2)   # [B, H_kv, T, D_h] all T rows, again
    q = apply_rope(q, cos[T - 1:T], sin[T - 1:T])
    k = apply_rope(k, cos[:T], sin[:T])                        # rotate all T keys, again

    out = attend_one_query(q, k, v)                            # [B, H, 1, D_h]
    return attn.wo(out.transpose(1, 2).reshape(B, 1, H * D_h))  # [B, 1, d]


def attention_with_cache(attn, x_new, pos, cos, sin, cache):
    """Newest token's attention output. x_new: [B, 1, d], ONLY the token at position pos."""
    B, T = x_new.shape[0], pos + 1                              # <-- cache: T counted, not given
    H, H_kv, D_h = attn.n_heads, attn.n_kv_heads, attn.head_dim

    q = attn.wq(x_new).view(B, 1, H, D_h).transpose(1, 2)      # [B, H, 1, D_h]
    k = attn.wk(x_new).view(B, 1, H_kv, D_h).transpose(1, 2)   # <-- cache: [B, H_kv, 1, D_h] one row
    v = attn.wv(x_new).view(B, 1, H_kv, D_h).transpose(1, 2)   # <-- cache: [B, H_kv, 1, D_h] one row
    q = apply_rope(q, cos[T - 1:T], sin[T - 1:T])
    k = apply_rope(k, cos[T - 1:T], sin[T - 1:T])              # <-- cache: rotate the new key only
    k, v = cache.update(pos, k, v)                             # <-- cache: store it, read all T
    out = attend_one_query(q, k, v)                            # [B, H, 1, D_h]
    return attn.wo(out.transpose(1, 2).reshape(B, 1, H * D_h))  # [B, 1, d]


# ---------------------------------------------------------------------------------------------------
# Showing the two side by side (difflib lines them up and marks what changed within each line)

_INLINE = {'class="diff_add"': 'style="background:#c8f0c8"', 'class="diff_chg"': 'style="background:#fff0a0"',
           'class="diff_sub"': 'style="background:#f8c8c8"', 'class="diff_next"': 'style="display:none"',
           'class="diff_header"': 'style="color:#999;padding:0 4px"', 'nowrap="nowrap"': 'style="font:11px monospace"'}


class SideBySide:
    """Two functions' source: HTML side by side in a notebook, a unified diff as plain text."""

    def __init__(self, left=attention_without_cache, right=attention_with_cache):
        self.names = left.__name__, right.__name__
        self.a, self.b = (inspect.getsource(f).rstrip("\n").split("\n") for f in (left, right))

    def _repr_html_(self) -> str:
        table = difflib.HtmlDiff(tabsize=4).make_table(self.a, self.b, *self.names)
        for cls, style in _INLINE.items():  # inline styles: a saved notebook drops <style> blocks, not these
            table = table.replace(cls, style)
        return table

    def __repr__(self) -> str:
        return "\n".join(difflib.unified_diff(self.a, self.b, *self.names, lineterm="", n=len(self.a)))


side_by_side = SideBySide


# ---------------------------------------------------------------------------------------------------
# Running both on the real model's layer

@torch.inference_mode()
def layer_input(model, ids, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the layer's attention reads, what it returns) for every position of one uncached pass: [B, T, d] each."""
    attn, seen = model.layers[layer].attention, {}
    hooks = [attn.register_forward_pre_hook(lambda m, args: seen.update(h=args[0])),
             attn.register_forward_hook(lambda m, args, out: seen.update(out=out))]
    try:
        model(torch.as_tensor(ids, dtype=torch.long, device=model.device).view(1, -1))  # [B=1, T]
    finally:
        for hook in hooks:
            hook.remove()
    return seen["h"], seen["out"]


@dataclass
class Layer0Walkthrough:
    T: int
    max_diff_cached_vs_uncached: float  # largest |Δ| between the two functions' outputs over all steps
    max_diff_vs_model: float  # largest |Δ| between the cached function and the model's own Attention layer
    rounding: tuple[str, str]  # each difference read against one rounding of the dtype at the layer's output size
    kv_rows_uncached: int  # K/V rows the uncached loop computes: 1 + 2 + ... + T (the cached one: T)

    def __str__(self) -> str:
        return (f"{self.T} steps. Cached vs uncached: largest difference {self.max_diff_cached_vs_uncached:.1e}, "
                f"{self.rounding[0]}.\nCached vs the model's own layer: {self.max_diff_vs_model:.1e}, "
                f"{self.rounding[1]}.\nK/V rows computed: uncached {self.kv_rows_uncached:,}, cached {self.T}.")


@torch.inference_mode()
def layer0_walkthrough(model, ids, layer: int = 0) -> Layer0Walkthrough:
    """Feed the tokens one at a time through one layer's attention, both ways, and compare them with each other and
    with the model's own layer (run once over the whole sequence with its causal mask) at every position."""
    from course.measure.cache_speed import rounding_verdict

    h, reference = layer_input(model, ids, layer)  # [B, T, d] each
    T, attn = h.shape[1], model.layers[layer].attention
    cos, sin = model.rope_cos.to(h.dtype), model.rope_sin.to(h.dtype)
    cache = LayerKVCache(1, attn.n_kv_heads, T, attn.head_dim, h.dtype, h.device)
    d_pair = d_model = 0.0
    for t in range(1, T + 1):
        uncached = attention_without_cache(attn, h[:, :t], cos, sin)  # recomputes t rows of K and V
        cached = attention_with_cache(attn, h[:, t - 1:t], t - 1, cos, sin, cache)  # computes 1 row
        d_pair = max(d_pair, (uncached - cached).abs().max().item())
        d_model = max(d_model, (cached - reference[:, t - 1:t]).abs().max().item())
    scale = reference.abs().max().item()
    return Layer0Walkthrough(T, d_pair, d_model, tuple(rounding_verdict(d, scale, h.dtype, h.device)
                                                       for d in (d_pair, d_model)), T * (T + 1) // 2)


@torch.inference_mode()
def new_query_attention(model, ids, layer: int = 0) -> torch.Tensor:
    """The newest token's attention weights over every position in `layer`, softmax(q·kᵀ/√D_h): [H, T]."""
    h, _ = layer_input(model, ids, layer)  # [1, T, d]
    attn, T = model.layers[layer].attention, h.shape[1]
    cos, sin = model.rope_cos.to(h.dtype), model.rope_sin.to(h.dtype)
    q = apply_rope(attn.wq(h[:, -1:]).view(1, 1, attn.n_heads, attn.head_dim).transpose(1, 2),
                   cos[T - 1:T], sin[T - 1:T])  # [1, H, 1, D_h]
    k = apply_rope(attn.wk(h).view(1, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2), cos[:T], sin[:T])
    k = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # [1, H, T, D_h]
    return torch.softmax((q @ k.transpose(-2, -1)).float() / math.sqrt(attn.head_dim), dim=-1)[0, :, 0]  # [H, T]
