"""Conceptual diagrams for the lessons, drawn by code (nothing here is measured).

Each function draws one picture a lesson points at and returns the matplotlib Figure:

    prefill_decode_timeline   lesson 00: one call = one parallel prefill pass, then one decode pass per token
    mask_vs_decode_row        lesson 01: prefill's T×T causal mask next to decode's single row
    cache_layout              lesson 02: the [B, H_kv, T, D_h] buffers per layer, and where a new token lands
    sampling_pipeline         lesson 03: logits → temperature → top-k / top-p → renormalise → draw
    speculative_round         lesson 04: a draft proposes k tokens, one target pass keeps a prefix of them
    kv_head_sharing           lesson 02b: which query heads read which K/V head, for MHA, GQA and MQA

The letters are the course's glossary: T prompt tokens, C cached tokens, L layers, H_kv KV heads, D_h head dim.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from course.lessons.wording import counted

PREFILL, DECODE, CACHE, NEW, GREY = "tab:orange", "tab:blue", "#c6dbef", "tab:red", "#d9d9d9"


def _box(ax, x, y, w, h, color, text="", fontsize=8, text_color="black", **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.6, **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _arrow(ax, start, end, color="black", style="-|>", **kw):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, linewidth=0.9, **kw))


def _check_positive(**values):
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def prefill_decode_timeline(n_prompt: int = 6, n_out: int = 5):
    """Time runs left to right: one prefill pass takes all `n_prompt` tokens at once and yields token 1;
    each decode pass takes the previous output token and yields the next one."""
    _check_positive(n_prompt=n_prompt, n_out=n_out)
    fig, ax = plt.subplots(figsize=(9, 2.9))
    prefill_w, step_w, gap = 2.6, 0.9, 0.25
    rows = max(n_prompt, 1)
    h = 2.2 / rows
    for i in range(n_prompt):  # the prompt tokens, stacked: they go through together
        _box(ax, -1.1, 0.3 + i * h, 0.8, h * 0.9, "white", f"t{i + 1}", fontsize=7)
    _box(ax, 0, 0.3, prefill_w, 2.2, PREFILL, f"prefill\nall {n_prompt} prompt tokens\nin ONE parallel pass",
         fontsize=9)
    _arrow(ax, (-0.3, 1.4), (0, 1.4))
    x = prefill_w + gap
    for j in range(n_out):
        label = "decode\n1 token" if j else "token 1\n(end of\nprefill)"
        color = DECODE if j else "white"
        _box(ax, x, 0.9, step_w, 1.0, color, label, fontsize=7, text_color="white" if j else "black")
        if j:
            _arrow(ax, (x - gap - step_w / 2, 1.9), (x + step_w / 2, 1.9), color="grey",
                   connectionstyle="arc3,rad=-0.5")
        x += step_w + gap
    ax.annotate("", (0, 0.1), (prefill_w + gap + step_w, 0.1), arrowprops=dict(arrowstyle="<->"))
    ax.text((prefill_w + gap + step_w) / 2, -0.15, "time to first token (TTFT)", ha="center", fontsize=8)
    x2 = prefill_w + gap + step_w + gap
    ax.annotate("", (x2, 0.1), (x2 + step_w, 0.1), arrowprops=dict(arrowstyle="<->"))
    ax.text(x2 + step_w / 2, -0.15, "one ITL", ha="center", fontsize=8)
    ax.text(x - gap, 2.75, "each new token is fed back in (grey arrows)", ha="right", fontsize=8, color="grey")
    ax.set_xlim(-1.3, x + 0.1); ax.set_ylim(-0.4, 3.0); ax.axis("off")
    ax.set_title("One call: a parallel prefill, then one sequential decode pass per output token", fontsize=10)
    fig.tight_layout()
    return fig


def mask_vs_decode_row(T: int = 8):
    """Left: prefill's T×T causal attention (query i sees keys 0..i). Right: a decode step at position T:
    one query row over the T cached keys plus its own."""
    _check_positive(T=T)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [T, T + 1]})
    for i in range(T):
        for j in range(T):
            _box(left, j, T - 1 - i, 1, 1, PREFILL if j <= i else "white")
    left.set(xlim=(0, T), ylim=(0, T), title=f"prefill: T×T = {T}×{T} scores, {T * (T + 1) // 2} kept\n"
             "(query i sees keys 0…i)", xlabel="key position", ylabel="query position")
    left.set_xticks([]); left.set_yticks([]); left.set_aspect("equal")
    for j in range(T + 1):
        _box(right, j, T // 2, 1, 1, DECODE if j == T else CACHE)
    right.text(T / 2, T // 2 + 1.4, f"{T} keys read from the KV cache", ha="center", fontsize=8)
    right.text(T + 0.5, T // 2 - 0.5, "new\ntoken", ha="center", va="top", fontsize=8)
    right.set(xlim=(0, T + 1), ylim=(0, T), title=f"decode at position {T}: ONE query row\n"
              f"over {T} cached keys + its own", xlabel="key position")
    right.set_xticks([]); right.set_yticks([]); right.set_aspect("equal")
    for ax in (left, right):
        for s in ax.spines.values():
            s.set_visible(False)
    fig.tight_layout()
    return fig


def cache_layout(n_layers: int = 3, n_kv_heads: int = 3, T: int = 6, head_dim_label: str = "D_h"):
    """K and V buffers per layer, each [B, H_kv, T_max, D_h]; filled positions in blue, the position a
    decode step writes in red, free slots (preallocated up to T_max) in white."""
    _check_positive(n_layers=n_layers, n_kv_heads=n_kv_heads, T=T)
    t_max = T + 3
    fig, ax = plt.subplots(figsize=(9, 1.1 + 1.05 * n_layers))
    y = 0.0
    for layer in reversed(range(n_layers)):
        for kv_i, kv in enumerate("KV"):
            x0 = kv_i * (t_max + 2.5)
            for h in range(n_kv_heads):
                for t in range(t_max):
                    color = CACHE if t < T else (NEW if t == T else "white")
                    _box(ax, x0 + t, y + h * 0.28, 1, 0.28, color)
            ax.text(x0 - 0.3, y + n_kv_heads * 0.14, f"{kv}[{layer}]", ha="right", va="center", fontsize=8)
        y += n_kv_heads * 0.28 + 0.45
    ax.text(T + 0.5, y + 0.05, "new token\nwrites here", ha="center", va="bottom", fontsize=7, color=NEW)
    ax.text(t_max / 2, -0.35, f"positions 0 … T_max−1  (one row per KV head; each cell holds {head_dim_label} "
            "numbers)", ha="center", va="top", fontsize=8)
    ax.set_xlim(-2, 2 * t_max + 2.7); ax.set_ylim(-0.8, y + 0.8); ax.axis("off")
    ax.set_title(f"The KV cache: 2 tensors × {n_layers} layers, each [B, H_kv={n_kv_heads}, T_max, "
                 f"{head_dim_label}]\nbytes = 2 · L · B · T · H_kv · D_h · dtype bytes", fontsize=10)
    fig.tight_layout()
    return fig


def sampling_pipeline():
    """The order a sampler applies its knobs in (transformers and vLLM; llama.cpp orders them differently)."""
    steps = [("logits", "one score per\nvocabulary token", "white"),
             ("÷ temperature", "T<1 sharpens\nT>1 flattens", CACHE),
             ("softmax", "probabilities", CACHE),
             ("top-k / top-p", "drop the tail", CACHE),
             ("renormalise", "kept tokens\nsum to 1", CACHE),
             ("draw", "one token id\n(argmax if T=0)", DECODE)]
    fig, ax = plt.subplots(figsize=(10, 1.9))
    w, gap = 1.45, 0.35
    for i, (name, note, color) in enumerate(steps):
        x = i * (w + gap)
        _box(ax, x, 0.45, w, 0.8, color, name, fontsize=9, text_color="white" if color == DECODE else "black")
        ax.text(x + w / 2, 0.3, note, ha="center", va="top", fontsize=7)
        if i:
            _arrow(ax, (x - gap, 0.85), (x, 0.85))
    ax.set_xlim(-0.1, len(steps) * (w + gap)); ax.set_ylim(-0.35, 1.45); ax.axis("off")
    ax.set_title("One sampling step: every knob reshapes the same softmax", fontsize=10)
    fig.tight_layout()
    return fig


def speculative_round(k: int = 4, accepted: int = 2):
    """One round: the draft proposes k tokens, the target checks them in ONE pass over k + 1 positions;
    the first `accepted` are kept, the next is replaced by the target's own token, the rest are dropped.
    With accepted == k every draft survives and the target adds a bonus token."""
    _check_positive(k=k)
    if not 0 <= accepted <= k:
        raise ValueError(f"accepted must be between 0 and k={k}, got {accepted}")
    fig, ax = plt.subplots(figsize=(9, 3.0))
    for i in range(k):
        _box(ax, i * 1.2, 2.0, 1, 0.6, CACHE, f"x{i + 1}", fontsize=9)
    ax.text(-0.3, 2.3, "draft: k cheap steps", ha="right", va="center", fontsize=8)
    _box(ax, -0.1, 1.0, (k + 1) * 1.2 - 0.1, 0.6, PREFILL, f"target: ONE pass over [last token, x1 … x{k}] "
         f"→ its p at {k + 1} positions", fontsize=8)
    ax.text(-0.3, 1.3, "verify", ha="right", va="center", fontsize=8)
    for i in range(k + 1):
        x = i * 1.2
        if i < accepted:
            color, label = "tab:green", f"x{i + 1} kept"
        elif i == accepted and accepted < k:
            color, label = NEW, "target's\ntoken"
        elif i == k and accepted == k:
            color, label = "tab:green", "bonus"
        else:
            color, label = GREY, "dropped"
        _box(ax, x, 0.0, 1, 0.6, color, label, fontsize=7, text_color="white" if color in (NEW, "tab:green")
             else "black")
        if i < k:
            _arrow(ax, (x + 0.5, 2.0), (x + 0.5, 1.6), color="grey")
    emitted = accepted + 1
    ax.text(-0.3, 0.3, "emitted", ha="right", va="center", fontsize=8)
    ax.set_xlim(-2.6, (k + 1) * 1.2 + 0.2); ax.set_ylim(-0.3, 2.9); ax.axis("off")
    ax.set_title(f"One speculative round (k = {k}): {counted(emitted, 'token')} for one read of the target's weights",
                 fontsize=10)
    fig.tight_layout()
    return fig


def kv_head_sharing(n_heads: int = 9, n_kv_heads: int = 3):
    """Query heads (top) and the K/V heads they read (bottom), for MHA (one K/V head per query head), GQA
    (n_heads / n_kv_heads query heads per K/V head) and MQA (one K/V head for all), as in Ainslie et al.,
    "GQA" (2023), figure 2. Only the bottom row is cached: its width is the cache's H_kv."""
    _check_positive(n_heads=n_heads, n_kv_heads=n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}), as in the model's config")
    variants = [("MHA", n_heads), ("GQA", n_kv_heads), ("MQA", 1)]
    fig, axes = plt.subplots(1, 3, figsize=(11, 2.4))
    for ax, (name, kv) in zip(axes, variants):
        group = n_heads // kv
        for q in range(n_heads):
            _box(ax, q, 2, 0.8, 0.6, "white", f"q{q}", fontsize=6)
            k = q // group
            kx = k * (n_heads / kv) + (n_heads / kv - 0.8) / 2
            _arrow(ax, (q + 0.4, 2), (kx + 0.4, 0.6), color="grey", style="-")
        for k in range(kv):
            kx = k * (n_heads / kv) + (n_heads / kv - 0.8) / 2
            _box(ax, kx, 0, 0.8, 0.6, CACHE, "KV", fontsize=6)
        ax.set_xlim(-0.5, n_heads + 0.2); ax.set_ylim(-0.6, 3.0); ax.axis("off")
        ax.set_title(f"{name}: {n_heads} query heads, {kv} K/V head{'s' if kv > 1 else ''} cached", fontsize=9)
    fig.suptitle("Only the K/V heads (blue) are cached: bytes per token = 2 · L · H_kv · D_h · dtype bytes", fontsize=10)
    fig.tight_layout()
    return fig
