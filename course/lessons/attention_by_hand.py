"""One attention layer written twice, without and with a KV cache, to read side by side.

Both functions compute the attention output of the *newest* token, from the weights of a real
course.engine.model.Attention (the lesson uses SmolLM2's layer 0). The cached version differs in the few
lines marked ``# <-- cache``: it computes K and V for the new token only and reads the earlier ones
from the cache, instead of recomputing K and V for every token so far.

Letters: B batch, T tokens so far, H query heads, H_kv key/value heads, D_h head dim, d hidden size.
"""
from __future__ import annotations

import difflib
import html
import inspect
import math
from dataclasses import dataclass

import torch

from course.engine.kv_cache import KVCache, LayerKVCache
from course.engine.model import apply_rope

MARK = "# <-- cache"


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ / √D_h)·v for one query per head. q [B, H, 1, D_h]; k, v [B, H_kv, T, D_h] → [B, H, 1, D_h].

    The newest token may look at every earlier one, so there is nothing to mask.
    """
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
# Showing the two side by side

@dataclass
class SideBySide:
    """Two functions' source aligned line by line; lines that differ are highlighted (HTML) or flagged (text)."""
    left_title: str
    right_title: str
    rows: list[tuple[str, str, bool]]  # (left line, right line, differs)

    @property
    def changed_lines(self) -> int:
        return sum(1 for _, right, differs in self.rows if differs and right.strip())

    def text(self, width: int | None = None) -> str:
        width = width or max(len(left) for left, _, _ in self.rows) + 2
        head = f"  {self.left_title:<{width}}| {self.right_title}"
        body = [f"{'>' if d else ' '} {left:<{width}}| {right}" for left, right, d in self.rows]
        return "\n".join([head, "-" * len(head)] + body)

    def __str__(self) -> str:
        return self.text()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        cell = "font-family:monospace;font-size:11px;white-space:pre;padding:0 6px;text-align:left"
        out = [f"<table style='border-collapse:collapse'><tr><th style='{cell}'>{html.escape(self.left_title)}</th>"
               f"<th style='{cell}'>{html.escape(self.right_title)}</th></tr>"]
        for left, right, differs in self.rows:
            lbg = "background:#fde2e2;" if differs and left.strip() else ""
            rbg = "background:#dff5df;" if differs and right.strip() else ""
            out.append(f"<tr><td style='{cell}{lbg}'>{html.escape(left)}</td>"
                       f"<td style='{cell}{rbg}'>{html.escape(right)}</td></tr>")
        return "".join(out) + "</table>"


def side_by_side(left=attention_without_cache, right=attention_with_cache) -> SideBySide:
    """Align two functions' source with difflib and mark the lines that differ."""
    a = inspect.getsource(left).rstrip("\n").split("\n")
    b = inspect.getsource(right).rstrip("\n").split("\n")
    rows: list[tuple[str, str, bool]] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "equal":
            rows += [(x, y, False) for x, y in zip(a[i1:i2], b[j1:j2])]
        else:
            n = max(i2 - i1, j2 - j1)
            left_part = a[i1:i2] + [""] * (n - (i2 - i1))
            right_part = b[j1:j2] + [""] * (n - (j2 - j1))
            rows += [(x, y, True) for x, y in zip(left_part, right_part)]
    return SideBySide(left.__name__, right.__name__, rows)


# ---------------------------------------------------------------------------------------------------
# Running both on the real model's layer 0

@dataclass
class Layer0Walkthrough:
    T: int
    max_diff_cached_vs_uncached: float  # largest |Δ| between the two functions' outputs over all steps
    max_diff_vs_model: float  # largest |Δ| between the cached function and the model's own Attention layer
    kv_rows_uncached: int  # K/V rows computed by the uncached loop: 1 + 2 + ... + T
    kv_rows_cached: int  # ... and by the cached loop: T
    cache_k_shape: tuple  # the layer cache's K buffer after the loop, [B, H_kv, T_max, D_h]
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    scale: float = 0.0  # largest |output| of the model's layer: what one rounding is relative to

    def agreement(self) -> str:
        """Both differences, each read against the dtype's rounding at this layer's output size."""
        from course.measure.cache_speed import rounding_verdict

        pair = rounding_verdict(self.max_diff_cached_vs_uncached, self.scale, self.dtype, self.device)
        model = rounding_verdict(self.max_diff_vs_model, self.scale, self.dtype, self.device)
        return (f"cached vs uncached: {self.max_diff_cached_vs_uncached:.1e}, {pair}.\n"
                f"cached vs the model's own layer: {self.max_diff_vs_model:.1e}, {model}.")


@torch.inference_mode()
def layer0_walkthrough(model, ids, layer: int = 0) -> Layer0Walkthrough:
    """Feed the tokens one at a time through one layer's attention, both ways, and compare.

    Input to the layer is the real one: token embeddings after the layer's RMSNorm (for layer 0).
    Each step t computes the newest token's output; the model's own layer, run once over the whole
    sequence with its causal mask, gives the reference for every position.
    """
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.device).view(1, -1)  # [B=1, T]
    T = ids.shape[1]
    block = model.layers[layer]
    x = model.tok_embeddings(ids)
    for earlier in model.layers[:layer]:
        x = earlier(x, model.rope_cos[:T], model.rope_sin[:T], 0, None)
    h = block.attention_norm(x)  # [B, T, d]: what the attention layer reads
    attn, cos, sin = block.attention, model.rope_cos.to(h.dtype), model.rope_sin.to(h.dtype)
    reference = attn(h, cos[:T], sin[:T], 0, None)  # [B, T, d], the model's own layer, all positions
    cache = LayerKVCache(1, attn.n_kv_heads, T, attn.head_dim, h.dtype, h.device)
    d_pair = d_model = 0.0
    for t in range(1, T + 1):
        uncached = attention_without_cache(attn, h[:, :t], cos, sin)  # recomputes t rows of K and V
        cached = attention_with_cache(attn, h[:, t - 1:t], t - 1, cos, sin, cache)  # computes 1 row
        d_pair = max(d_pair, (uncached - cached).abs().max().item())
        d_model = max(d_model, (cached - reference[:, t - 1:t]).abs().max().item())
    return Layer0Walkthrough(T, d_pair, d_model, T * (T + 1) // 2, T, tuple(cache.k.shape), h.dtype, str(h.device),
                             reference.abs().max().item())


def _letters(t: torch.Tensor) -> str:
    """A [B, H_kv, T, D_h] tensor's shape in the lesson's letters: '[B=1, H_kv=3, T=37, D_h=64]'."""
    return "[" + ", ".join(f"{n}={s}" for n, s in zip(("B", "H_kv", "T", "D_h"), t.shape)) + "]"


def cache_shapes(cache: KVCache, seq_len: int, layers=(0, 1, -1)) -> str:
    """Lines like 'layer  0  K [B=1, H_kv=3, T=37, D_h=64]  V [...]' for the filled part of a cache."""
    lines = []
    for i in layers:
        i = i % len(cache)
        k, v = cache[i].k[:, :, :seq_len], cache[i].v[:, :, :seq_len]
        lines.append(f"layer {i:>2}  K {_letters(k)}  V {_letters(v)}  {str(k.dtype).replace('torch.', '')}")
    if len(layers) < len(cache):
        lines.insert(len(layers) - 1, f"   ... {len(cache) - len(layers)} more layers of the same shapes ...")
    return "\n".join(lines)


@torch.inference_mode()
def new_query_attention(model, ids, layer: int = 0) -> torch.Tensor:
    """Attention weights of the newest token over every cached position: [H, T] (each row sums to 1).

    Prefills all but the last token into a cache, then runs the last one through the layers up to
    `layer`, as a decode step would, and returns softmax(q·kᵀ/√D_h) of that layer.
    """
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.device).view(1, -1)
    T = ids.shape[1]
    cache = KVCache(model.config, 1, T, dtype=model.dtype, device=model.device)
    model(ids[:, :-1], 0, cache, last_only=True)  # prefill: positions 0..T-2 into the cache
    captured = {}
    attn = model.layers[layer].attention

    def grab(module, args):
        x, cos, sin, start_pos, layer_cache = args
        B = x.shape[0]
        q = attn.wq(x).view(B, 1, attn.n_heads, attn.head_dim).transpose(1, 2)
        captured["q"] = apply_rope(q, cos, sin)  # [B, H, 1, D_h]

    handle = attn.register_forward_pre_hook(grab)
    try:
        model(ids[:, -1:], T - 1, cache, last_only=True)  # decode the newest token
    finally:
        handle.remove()
    q = captured["q"]
    k = cache[layer].k[:, :, :T].repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # [B, H, T, D_h]
    scores = q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)  # [B, H, 1, T]
    return torch.softmax(scores.float(), dim=-1)[0, :, 0]  # [H, T]
