"""Prefill vs decode, measured: the machinery behind lessons/01_prefill_decode.ipynb.

    stream_call         one chat call, streamed, with the time each token arrived
    prefill_sweep       seconds to prefill T prompt tokens, for several T
    decode_sweep        seconds per decode step with C tokens already cached, for several C
    prefill_cost        FLOPs and bytes of one prefill, from the config alone
    decode_cost         FLOPs and bytes of one decode step (weights + KV cache read)
    measure_machine     this machine's memory bandwidth and matmul FLOP/s (course.measure.timing probes)
    compare             predicted (roofline) vs measured seconds, point by point
    decode_breakdown    where a decode step's time goes: matrix-vector products vs everything else
    fit_latency_model   total ≈ TTFT(T_prompt) + (n_out − 1) · ITL(context), fitted to the sweeps

Counts use the lesson's letters: L layers, H query heads, H_kv KV heads, D_h head dim, d hidden
size, V vocabulary, T prompt tokens, C context tokens already in the cache. Seconds, bytes, FLOPs.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from course.engine.config import ModelConfig
from course.engine.generate import Generation, decode_one_token, generate, prefill
from course.engine.kv_cache import KVCache
from course.measure.costs import kv_cache_bytes
from course.measure.results import full_size
from course.measure.timing import Stopwatch, Timing, matmul_flops, measure, memory_bandwidth

# The seed's checkpoint: (A) a long prompt and a short answer, (B) a short prompt and a long answer.
CHECKPOINT_REQUESTS = {"A": (4000, 50), "B": (400, 2000)}


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sizes:
    """What the lesson measures. The default fits in a few minutes on 2 CPU cores."""
    prefill: tuple[int, ...]  # prompt lengths T, tokens
    decode: tuple[int, ...]  # context lengths C, tokens already in the cache
    held_out_prompt: int  # prompt tokens of the run the latency fit never saw
    held_out_new: int  # tokens it generates
    held_out_repeats: int
    full: bool


def default_sizes(full: bool | None = None) -> Sizes:
    """Quick sweeps by default; the full sweep to 2048 tokens when KVCOURSE_FULL=1 (or full=True)."""
    full = full_size() if full is None else full
    if full:
        return Sizes(prefill=(16, 32, 64, 128, 256, 512, 1024, 2048), decode=(16, 64, 256, 512, 1024, 2048),
                     held_out_prompt=768, held_out_new=64, held_out_repeats=3, full=True)
    return Sizes(prefill=(16, 64, 256, 1024), decode=(16, 256, 1024),
                 held_out_prompt=512, held_out_new=32, held_out_repeats=3, full=False)


def steady_threads(device="cpu", threads: int | None = None) -> str:
    """Choose PyTorch's CPU thread count for timing, and say why.

    PyTorch splits each operation across its threads and waits for the slowest. When other programs
    already keep every core busy (load average >= cores), a descheduled thread stalls every operation,
    and timings balloon by several times; one thread is then far steadier. `threads` (or the
    environment variable KVCOURSE_THREADS) overrides the choice.
    """
    if torch.device(device).type != "cpu":
        return f"timing on {device}; CPU threads left at {torch.get_num_threads()}"
    if threads is None and os.environ.get("KVCOURSE_THREADS"):
        threads = int(os.environ["KVCOURSE_THREADS"])
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
        return f"{threads} CPU thread(s), as asked (load average {load:.1f} on {cores} cores)"
    if load >= cores and torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        return (f"this machine is busy (load average {load:.1f} on {cores} cores): timing with 1 CPU thread, "
                f"since threads waiting on each other would distort every number; expect slower but steadier timings")
    return f"{torch.get_num_threads()} CPU threads (load average {load:.1f} on {cores} cores)"


def _check_lengths(name: str, lengths: Sequence[int], limit: int) -> list[int]:
    lengths = list(lengths)
    if not lengths:
        raise ValueError(f"{name} is empty: give at least one length, e.g. [16, 256]")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
            raise ValueError(f"{name} must hold whole numbers in 1..{limit} (the model's context), got {n!r}")
    return lengths


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------
# One call, streamed
# ---------------------------------------------------------------------------------------------

def stream_call(model, tokenizer, prompt, max_new_tokens: int = 48, write: Callable[[str], None] | None = None,
                system: str | None = None) -> Generation:
    """Run one chat call, writing the answer as it is produced; returns the Generation with its clock.

    `prompt` is the user's text (wrapped in the chat template) or a list of token ids.
    Greedy decoding; stops at the tokenizer's end-of-turn token or after max_new_tokens.
    """
    from course.engine.streaming import TokenStreamer

    ids = tokenizer.chat_ids(prompt, system=system) if isinstance(prompt, str) else list(prompt)
    write = write or (lambda text: print(text, end="", flush=True))
    streamer = TokenStreamer(tokenizer, write)
    gen = generate(model, ids, max_new_tokens, eos_id=tokenizer.eos_id, on_token=streamer)
    streamer.flush()
    return gen


def token_latencies(gen: Generation) -> list[float]:
    """Seconds each token waited: token 1 waits for the whole prefill (TTFT), the rest one decode step."""
    if not gen.token_times:
        raise ValueError("this Generation has no tokens: ask for max_new_tokens >= 1")
    return [gen.token_times[0]] + gen.inter_token_latencies


def call_values(gen: Generation) -> dict:
    """The streamed call's clock, for course.measure.results.record."""
    return dict(call_prompt_tokens=len(gen.prompt_ids), call_new_tokens=len(gen.tokens),
                call_ttft_ms=gen.time_to_first_token * 1e3, call_itl_ms=gen.mean_inter_token_latency * 1e3,
                call_stop_reason=gen.stop_reason)


def record_all(values: dict) -> dict:
    """course.measure.results.record every key of a values() dict; returns it."""
    from course.measure.results import record

    for key, value in values.items():
        record(key, value)
    return values


def plot_token_timeline(gen: Generation, tokenizer=None, ax=None):
    """Bar per token: how long it took to arrive. The first bar is the prefill; the rest are decode steps."""
    import matplotlib.pyplot as plt

    lat_ms = [s * 1e3 for s in token_latencies(gen)]
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(10, 3.2))
    colors = ["tab:orange"] + ["tab:blue"] * (len(lat_ms) - 1)
    ax.bar(range(1, len(lat_ms) + 1), lat_ms, color=colors)
    ax.set_xlabel("answer tokens, in the order they arrived")
    ax.set_ylabel("ms waited for this token")
    T = len(gen.prompt_ids)
    itl = gen.mean_inter_token_latency
    ax.set_title(f"Prompt of {T} tokens: first token after {lat_ms[0]:.0f} ms (prefill, orange), "
                 f"then one every {itl * 1e3:.0f} ms (decode, blue)", fontsize=10)
    if tokenizer is not None and len(lat_ms) <= 64:
        ax.set_xticks(range(1, len(lat_ms) + 1))
        ax.set_xticklabels([tokenizer.token_text(t) for t in gen.tokens], rotation=90, fontsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Sweeps
# ---------------------------------------------------------------------------------------------

@dataclass
class Sweep:
    """Median seconds per call at each length. Prefill: one call = T prompt tokens. Decode: one call = one token."""
    phase: str  # "prefill" or "decode"
    lengths: list[int]  # prompt tokens T (prefill) or context tokens C (decode)
    timings: list[Timing]
    device: str = "cpu"
    dtype: str = "float32"

    @property
    def seconds(self) -> list[float]:
        return [t.median for t in self.timings]

    @property
    def ms(self) -> list[float]:
        return [s * 1e3 for s in self.seconds]

    @property
    def tokens_per_s(self) -> list[float]:
        if self.phase == "prefill":
            return [n / s for n, s in zip(self.lengths, self.seconds)]
        return [1.0 / s for s in self.seconds]

    def at(self, length: int) -> float:
        """Median seconds at one of the measured lengths."""
        if length not in self.lengths:
            raise ValueError(f"{length} was not measured; measured lengths are {self.lengths}")
        return self.seconds[self.lengths.index(length)]

    def values(self) -> dict:
        """Plain numbers for course.measure.results.record, keyed by phase."""
        if self.phase == "prefill":
            out = dict(prefill_lengths=self.lengths, prefill_ms=self.ms, prefill_tokens_per_s=self.tokens_per_s,
                       prefill_tokens_per_s_max=max(self.tokens_per_s))
            if 256 in self.lengths:
                out["prefill_tokens_per_s_256"] = self.tokens_per_s[self.lengths.index(256)]
            return out
        return dict(decode_contexts=self.lengths, decode_ms_per_token=self.ms, decode_tokens_per_s=self.tokens_per_s)

    def __repr__(self) -> str:
        unit = "ms per prompt" if self.phase == "prefill" else "ms per token"
        pairs = ", ".join(f"{n}: {ms:.1f}" for n, ms in zip(self.lengths, self.ms))
        return f"Sweep({self.phase}, {unit} {{{pairs}}})"


def random_prompt(model, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """[1, n_tokens] random token ids. Speed does not depend on which tokens, only on how many."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, n_tokens), generator=g).to(model.device)


def _measure_within(fn, device, budget_s: float, max_repeats: int, min_repeats: int = 1) -> Timing:
    """One warm-up call that also says how long a call takes, then as many repeats as fit the budget."""
    with Stopwatch(device) as sw:
        fn()
    repeats = max(min_repeats, min(max_repeats, int(budget_s / max(sw.seconds, 1e-9))))
    return measure(fn, device, warmup=0, repeats=repeats)


def prefill_sweep(model, lengths: Sequence[int], budget_s: float = 2.0, max_repeats: int = 5,
                  progress: bool = True, seed: int = 0) -> Sweep:
    """Median seconds to prefill T random prompt tokens into a fresh-size KV cache, for each T."""
    from tqdm.auto import tqdm

    lengths = _check_lengths("lengths", lengths, model.config.max_seq_len)
    timings = []
    for T in tqdm(lengths, desc="prefill sweep", unit="length", disable=not progress):
        ids = random_prompt(model, T, seed)
        cache = KVCache(model.config, batch=1, max_seq_len=T, dtype=model.dtype, device=model.device)
        timings.append(_measure_within(lambda: prefill(model, ids, cache), model.device, budget_s, max_repeats))
    return Sweep("prefill", lengths, timings, str(model.device), str(model.dtype).split(".")[-1])


def prepare_context(model, context: int, seed: int = 0) -> tuple[KVCache, torch.Tensor]:
    """Prefill `context` random tokens into a cache with room for one more; returns (cache, ids [1, C])."""
    _check_lengths("context", [context], model.config.max_seq_len - 1)
    ids = random_prompt(model, context, seed)
    cache = KVCache(model.config, batch=1, max_seq_len=context + 1, dtype=model.dtype, device=model.device)
    prefill(model, ids, cache)
    return cache, ids


def decode_step(model, context: int, budget_s: float = 1.0, max_repeats: int = 10, min_repeats: int = 3,
                seed: int = 0) -> Timing:
    """Seconds of one decode step with `context` tokens in the cache (the new token sees C + 1 keys).

    Every repeat decodes at the same position, overwriting it, so each one reads the same cache.
    """
    cache, _ = prepare_context(model, context, seed)
    token = torch.ones(1, 1, dtype=torch.long, device=model.device)
    return _measure_within(lambda: decode_one_token(model, token, context, cache), model.device, budget_s,
                           max_repeats, min_repeats)


def decode_sweep(model, contexts: Sequence[int], budget_s: float = 1.0, max_repeats: int = 20,
                 min_repeats: int = 3, progress: bool = True, seed: int = 0) -> Sweep:
    """Median seconds per decode step at each context length C.

    First prefill C random tokens into one cache per context (untimed), then time steps in rounds,
    one step per context per round, so a change in the machine's load hits every context alike.
    `budget_s` is the timing budget per context.
    """
    from tqdm.auto import tqdm

    contexts = _check_lengths("contexts", contexts, model.config.max_seq_len - 1)
    token = torch.ones(1, 1, dtype=torch.long, device=model.device)
    steps = []
    for C in tqdm(contexts, desc="decode sweep: prefilling contexts", unit="context", disable=not progress):
        cache, _ = prepare_context(model, C, seed)
        steps.append(lambda cache=cache, C=C: decode_one_token(model, token, C, cache))
    warm = []
    for step in steps:  # warm-up step per context, which also says how long a step takes
        with Stopwatch(model.device) as sw:
            step()
        warm.append(sw.seconds)
    rounds = max(min_repeats, min(max_repeats, int(budget_s * len(steps) / max(sum(warm), 1e-9))))
    timings = [Timing() for _ in steps]
    for _ in tqdm(range(rounds), desc="decode sweep: timing steps", unit="round", disable=not progress):
        for step, timing in zip(steps, timings):
            timing.times.extend(measure(step, model.device, warmup=0, repeats=1).times)
    return Sweep("decode", contexts, timings, str(model.device), str(model.dtype).split(".")[-1])


def plot_sweeps(prefill_: Sweep, decode_: Sweep):
    """Left: milliseconds per call of each phase. Right: tokens per second of each phase."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.plot(prefill_.lengths, prefill_.ms, "o-", color="tab:orange", label="prefill: ms for the whole prompt")
    left.plot(decode_.lengths, decode_.ms, "s-", color="tab:blue", label="decode: ms for one token")
    left.set(xscale="log", yscale="log", xlabel="tokens (prompt length T, or context C for decode)", ylabel="ms")
    left.legend(fontsize=8)
    right.plot(prefill_.lengths, prefill_.tokens_per_s, "o-", color="tab:orange", label="prefill tokens/s")
    right.plot(decode_.lengths, decode_.tokens_per_s, "s-", color="tab:blue", label="decode tokens/s")
    right.set(xscale="log", yscale="log", xlabel="tokens (T or C)", ylabel="tokens per second")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"Prefill vs decode on {prefill_.device} ({prefill_.dtype})")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Costs on paper
# ---------------------------------------------------------------------------------------------

def layer_matmul_params(config: ModelConfig) -> int:
    """Weights every token multiplies through in the L blocks: wq wk wv wo + w_gate w_up w_down."""
    d, D_h = config.dim, config.head_dim
    attention = d * config.n_heads * D_h + 2 * d * config.n_kv_heads * D_h + config.n_heads * D_h * d
    return config.n_layers * (attention + 3 * d * config.ffn_dim)


def weights_read_bytes(config: ModelConfig, dtype_bytes: float) -> float:
    """Bytes of weights one forward pass reads: all of them (a tied embedding is the output head too).

    An untied input embedding is only looked up (one row per token), so it is not counted.
    """
    params = config.n_params - (0 if config.tie_embeddings else config.vocab_size * config.dim)
    return params * dtype_bytes


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of one call of a phase, from the config alone (activations ignored)."""
    phase: str
    length: int  # T for prefill, C for decode
    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved."""
        return self.flops / self.bytes

    def __str__(self) -> str:
        letter = "T" if self.phase == "prefill" else "C"
        return (f"{self.phase:7} {letter}={self.length:<5} {self.flops / 1e9:8.2f} GFLOP, reads "
                f"{self.bytes / 1e6:7.1f} MB (weights {self.weight_bytes / 1e6:.1f} + KV {self.kv_bytes / 1e6:.2f})"
                f" → {self.intensity:7.2f} FLOP/byte")


def prefill_cost(config: ModelConfig, prompt_len: int, dtype_bytes: float = 4) -> Cost:
    """Prefill of T tokens: 2 FLOPs per weight per token in the blocks, the output head once (last
    position only), causal attention 2·D_h·T(T+1) per head per layer; reads the weights once and
    writes T tokens of K and V."""
    T = _check_lengths("prompt_len", [prompt_len], config.max_seq_len)[0]
    c = config
    flops = (2 * layer_matmul_params(c) * T + 2 * c.vocab_size * c.dim
             + 2 * c.head_dim * T * (T + 1) * c.n_heads * c.n_layers)
    kv = kv_cache_bytes(c.n_layers, 1, T, c.n_kv_heads, c.head_dim, dtype_bytes)
    return Cost("prefill", T, float(flops), float(weights_read_bytes(c, dtype_bytes)), float(kv))


def decode_cost(config: ModelConfig, context: int, dtype_bytes: float = 4) -> Cost:
    """One decode step with C tokens cached: 2 FLOPs per weight, attention 4·D_h·(C+1) per head per
    layer; reads every weight and the K and V of all C + 1 positions."""
    C = _check_lengths("context", [context], config.max_seq_len - 1)[0]
    c = config
    flops = 2 * layer_matmul_params(c) + 2 * c.vocab_size * c.dim + 4 * c.head_dim * (C + 1) * c.n_heads * c.n_layers
    kv = kv_cache_bytes(c.n_layers, 1, C + 1, c.n_kv_heads, c.head_dim, dtype_bytes)
    return Cost("decode", C, float(flops), float(weights_read_bytes(c, dtype_bytes)), float(kv))


# ---------------------------------------------------------------------------------------------
# The machine and the roofline
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Machine:
    """What this machine can do: bytes per second from memory, FLOPs per second in a big matmul."""
    device: str
    dtype: str
    bytes_per_s: float
    flops_per_s: float

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the two roofs meet: below it, memory is the limit."""
        return self.flops_per_s / self.bytes_per_s

    def seconds(self, cost: Cost) -> float:
        """Roofline time: the slower of moving the bytes and doing the FLOPs."""
        return max(cost.bytes / self.bytes_per_s, cost.flops / self.flops_per_s)

    def bound(self, cost: Cost) -> str:
        return "memory" if cost.intensity < self.ridge else "compute"

    def values(self) -> dict:
        return dict(bandwidth_gb_s=self.bytes_per_s / 1e9, matmul_gflop_s=self.flops_per_s / 1e9,
                    ridge_flop_per_byte=self.ridge)

    def __str__(self) -> str:
        return (f"{self.device} ({self.dtype}): memory {self.bytes_per_s / 1e9:.1f} GB/s, "
                f"matmul {self.flops_per_s / 1e9:.1f} GFLOP/s, ridge {self.ridge:.1f} FLOP/byte")


def measure_machine(device="cpu", dtype: torch.dtype = torch.float32, bandwidth_bytes: int = 256 << 20,
                    matmul_n: int | None = None) -> Machine:
    """Run the course.measure.timing probes: a 256 MiB streaming read/copy and an n×n matmul in `dtype`."""
    device = torch.device(device)
    n = matmul_n or (1024 if device.type == "cpu" else 4096)
    bw = memory_bandwidth(device, nbytes=bandwidth_bytes)
    flops = matmul_flops(device, n=n, dtype=dtype)
    return Machine(str(device), str(dtype).split(".")[-1], bw.bytes_per_s, flops)


@dataclass
class Comparison:
    """Predicted (roofline) vs measured seconds for every swept point."""
    rows: list[dict]

    def ratios(self, phase: str) -> list[float]:
        return [r["predicted_over_measured"] for r in self.rows if r["phase"] == phase]

    def values(self) -> dict:
        decode = [r for r in self.rows if r["phase"] == "decode"]
        first, last = decode[0], decode[-1]
        return dict(prefill_predicted_over_measured=self.ratios("prefill"),
                    decode_predicted_over_measured=self.ratios("decode"),
                    decode_floor_ms=first["predicted_s"] * 1e3, decode_gflop=first["flops"] / 1e9,
                    decode_intensity=first["intensity"], decode_bytes_mb=first["bytes"] / 1e6,
                    kv_mb_at_max_context=last["kv_bytes"] / 1e6, weight_mb=first["weight_bytes"] / 1e6,
                    decode_bound=first["bound"], prefill_bounds=[r["bound"] for r in self.rows if r["phase"] == "prefill"])

    def __str__(self) -> str:
        head = f"{'phase':8} {'tokens':>6} {'GFLOP':>8} {'MB read':>8} {'FLOP/B':>7} {'bound':>8} " \
               f"{'predicted ms':>13} {'measured ms':>12} {'pred/meas':>9}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['phase']:8} {r['tokens']:>6} {r['flops'] / 1e9:>8.2f} {r['bytes'] / 1e6:>8.1f} "
                         f"{r['intensity']:>7.1f} {r['bound']:>8} {r['predicted_s'] * 1e3:>13.1f} "
                         f"{r['measured_s'] * 1e3:>12.1f} {r['predicted_over_measured']:>9.2f}")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def compare(config: ModelConfig, prefill_: Sweep, decode_: Sweep, machine: Machine,
            dtype_bytes: float | None = None) -> Comparison:
    """Each measured point next to its roofline prediction: max(bytes ÷ bandwidth, FLOPs ÷ FLOP/s)."""
    b = dtype_bytes or _dtype_bytes(getattr(torch, prefill_.dtype))
    rows = []
    for sweep, cost_of in ((prefill_, prefill_cost), (decode_, decode_cost)):
        for n, measured in zip(sweep.lengths, sweep.seconds):
            cost = cost_of(config, n, b)
            predicted = machine.seconds(cost)
            rows.append(dict(phase=sweep.phase, tokens=n, flops=cost.flops, bytes=cost.bytes,
                             weight_bytes=cost.weight_bytes, kv_bytes=cost.kv_bytes,
                             intensity=cost.intensity, bound=machine.bound(cost), predicted_s=predicted,
                             measured_s=measured, predicted_over_measured=predicted / measured,
                             achieved_flops_per_s=cost.flops / measured))
    return Comparison(rows)


def plot_roofline(machine: Machine, comparison: Comparison):
    """Log-log roofline: the memory slope and the matmul ceiling, with every measured point placed
    at its arithmetic intensity (x) and the FLOP/s it achieved (y)."""
    import matplotlib.pyplot as plt
    import numpy as np

    xs = [r["intensity"] for r in comparison.rows]
    lo, hi = min(min(xs), machine.ridge) / 4, max(max(xs), machine.ridge) * 4
    x = np.logspace(math.log10(lo), math.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.plot(x, np.minimum(machine.flops_per_s, machine.bytes_per_s * x) / 1e9, "k-", lw=2,
            label=f"roof: min({machine.bytes_per_s / 1e9:.0f} GB/s × intensity, {machine.flops_per_s / 1e9:.0f} GFLOP/s)")
    ax.axvline(machine.ridge, color="gray", ls=":", lw=1)
    ax.text(machine.ridge, machine.flops_per_s / 1e9 * 0.5, f" ridge: {machine.ridge:.1f} FLOP/byte", fontsize=8,
            color="gray")
    for phase, marker, color in (("prefill", "o", "tab:orange"), ("decode", "s", "tab:blue")):
        rows = [r for r in comparison.rows if r["phase"] == phase]
        ax.scatter([r["intensity"] for r in rows], [r["achieved_flops_per_s"] / 1e9 for r in rows],
                   marker=marker, color=color, zorder=3, label=f"{phase} (measured)")
        for r in rows:
            ax.annotate(f"{'T' if phase == 'prefill' else 'C'}={r['tokens']}",
                        (r["intensity"], r["achieved_flops_per_s"] / 1e9), fontsize=7,
                        xytext=(4, -10 if phase == "decode" else 4), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte moved)",
           ylabel="achieved GFLOP/s", title=f"Roofline of this machine: {machine.device}, {machine.dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Where a decode step's time goes
# ---------------------------------------------------------------------------------------------

def count_ops(model, context: int = 16) -> tuple[int, int]:
    """(all tensor operations, matrix products) one decode step dispatches, counted at the ATen level."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total = self.matmuls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.total += 1
            self.matmuls += func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "matmul", "linear")
            return func(*args, **(kwargs or {}))

    cache, _ = prepare_context(model, context)
    token = torch.ones(1, 1, dtype=torch.long, device=model.device)
    counter = Counter()
    with torch.inference_mode(), counter:
        model(token, start_pos=context, cache=cache, last_only=True)
    return counter.total, counter.matmuls


def linear_weights(model) -> list[torch.Tensor]:
    """The weight of every nn.Linear, in forward order (a tied output head appears once)."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def linears_pass(model, budget_s: float = 1.0, max_repeats: int = 10) -> Timing:
    """Time only the matrix-vector products of a decode step: one row through every weight matrix, in
    order, so all the weights stream from memory just as they do in a real step."""
    weights = linear_weights(model)
    inputs = {w.shape[1]: torch.ones(1, w.shape[1], dtype=model.dtype, device=model.device) for w in weights}

    @torch.inference_mode()
    def run():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return _measure_within(run, model.device, budget_s, max_repeats, min_repeats=3)


@dataclass(frozen=True)
class DecodeBreakdown:
    """A decode step split by measurement into matrix-vector products and everything else."""
    context: int
    step_s: float  # one real decode step, median
    linears_s: float  # the same weights through F.linear alone, median
    linear_weight_bytes: float
    floor_s: float  # bytes read per step ÷ measured bandwidth
    n_ops: int  # tensor operations dispatched in one step
    n_matmuls: int

    @property
    def gemv_bytes_per_s(self) -> float:
        """Bandwidth the matrix-vector products achieved on their own."""
        return self.linear_weight_bytes / self.linears_s

    @property
    def other_s(self) -> float:
        return max(self.step_s - self.linears_s, 0.0)

    @property
    def other_us_per_op(self) -> float:
        return self.other_s / max(self.n_ops - self.n_matmuls, 1) * 1e6

    def values(self) -> dict:
        return dict(breakdown_context=self.context, breakdown_step_ms=self.step_s * 1e3,
                    breakdown_linears_ms=self.linears_s * 1e3, breakdown_floor_ms=self.floor_s * 1e3,
                    breakdown_gemv_gb_s=self.gemv_bytes_per_s / 1e9, breakdown_n_ops=self.n_ops,
                    breakdown_n_matmuls=self.n_matmuls, breakdown_other_ms=self.other_s * 1e3,
                    breakdown_other_us_per_op=self.other_us_per_op)

    def __str__(self) -> str:
        return (f"decode step at C={self.context}: {self.step_s * 1e3:.1f} ms measured vs "
                f"{self.floor_s * 1e3:.1f} ms bandwidth floor\n"
                f"  {self.n_matmuls} matrix-vector products alone: {self.linears_s * 1e3:.1f} ms "
                f"({self.gemv_bytes_per_s / 1e9:.1f} GB/s of weights)\n"
                f"  the other {self.n_ops - self.n_matmuls} ops (norms, RoPE, cache writes, attention, "
                f"adds, views): {self.other_s * 1e3:.1f} ms, {self.other_us_per_op:.1f} µs each")

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def decode_breakdown(model, machine: Machine, context: int = 16, budget_s: float = 1.0) -> DecodeBreakdown:
    """Measure a decode step, the matrix-vector products on their own, and count the step's ops."""
    step = decode_step(model, context, budget_s)
    linears = linears_pass(model, budget_s)
    n_ops, n_mm = count_ops(model, context)
    b = _dtype_bytes(model.dtype)
    weight_bytes = sum(w.numel() for w in linear_weights(model)) * b
    floor = decode_cost(model.config, context, b).bytes / machine.bytes_per_s
    return DecodeBreakdown(context, step.median, linears.median, float(weight_bytes), floor, n_ops, n_mm)


@dataclass(frozen=True)
class DtypeComparison:
    """The same decode step (and its matrix-vector products alone) in two dtypes on one machine."""
    context: int
    dtypes: tuple[str, str]
    step_s: tuple[float, float]
    linears_s: tuple[float, float]
    bytes_read: tuple[float, float]
    cpu_bf16: bool | None
    device: str

    @property
    def slowdown(self) -> float:
        """Second dtype's step time ÷ the first's (> 1: the smaller dtype was slower)."""
        return self.step_s[1] / self.step_s[0]

    @property
    def bandwidth_prediction(self) -> float:
        """What a purely bandwidth-bound step would do: time scales with bytes read."""
        return self.bytes_read[1] / self.bytes_read[0]

    def values(self) -> dict:
        a, b = self.dtypes
        return {f"{a}_decode_ms": self.step_s[0] * 1e3, f"{b}_decode_ms": self.step_s[1] * 1e3,
                f"{a}_linears_ms": self.linears_s[0] * 1e3, f"{b}_linears_ms": self.linears_s[1] * 1e3,
                f"{b}_over_{a}_decode": self.slowdown, "cpu_has_bf16": self.cpu_bf16}

    def __str__(self) -> str:
        a, b = self.dtypes
        flag = {True: "advertises", False: "does not advertise", None: "may or may not have"}[self.cpu_bf16]
        where = f"this CPU {flag} bfloat16 instructions" if self.device == "cpu" else f"device {self.device}"
        return (f"decode step at C={self.context} on {self.device} ({where})\n"
                f"{'':10}{a:>12}{b:>12}\n"
                f"{'MB read':10}{self.bytes_read[0] / 1e6:>12.1f}{self.bytes_read[1] / 1e6:>12.1f}\n"
                f"{'step ms':10}{self.step_s[0] * 1e3:>12.1f}{self.step_s[1] * 1e3:>12.1f}\n"
                f"{'GEMVs ms':10}{self.linears_s[0] * 1e3:>12.1f}{self.linears_s[1] * 1e3:>12.1f}\n"
                f"bytes predict {b} at {self.bandwidth_prediction:.2f}× the {a} time; measured "
                f"{self.slowdown:.2f}×: " + self.verdict)

    @property
    def verdict(self) -> str:
        a, b = self.dtypes
        if self.slowdown > 1.05:
            return (f"{b} was SLOWER although it reads {1 / self.bandwidth_prediction:.0f}× fewer bytes - "
                    f"its kernels here cost more than the bytes they save")
        if self.slowdown > self.bandwidth_prediction * 1.25:
            return f"{b} was faster, but by less than the bytes alone predict - the step is not purely bandwidth-bound"
        return f"{b} was faster by about what the bytes predict - the step behaves as bandwidth-bound"

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def dtype_side_by_side(model_a, model_b, context: int = 16, budget_s: float = 1.0) -> DtypeComparison:
    """Time one decode step and the bare matrix-vector products of two copies of a model (e.g. fp32, bf16)."""
    steps, linears, reads, names = [], [], [], []
    for m in (model_a, model_b):
        steps.append(decode_step(m, context, budget_s, max_repeats=5).median)
        linears.append(linears_pass(m, budget_s, max_repeats=5).median)
        reads.append(decode_cost(m.config, context, _dtype_bytes(m.dtype)).bytes)
        names.append(str(m.dtype).split(".")[-1])
    return DtypeComparison(context, tuple(names), tuple(steps), tuple(linears), tuple(reads), cpu_has_bf16(),
                           str(model_a.device))


def cpu_has_bf16() -> bool | None:
    """Does this CPU advertise bfloat16 instructions (avx512_bf16 / amx_bf16 / Arm bf16)? None if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


# ---------------------------------------------------------------------------------------------
# The latency model: total ≈ TTFT(T_prompt) + (n_out − 1) · ITL(context)
# ---------------------------------------------------------------------------------------------

def nonnegative_fit(features: Sequence[Sequence[float]], y: Sequence[float], relative: bool = True) -> list[float]:
    """Least squares y ≈ features · coef with every coef >= 0 (a time never shrinks as work grows).

    With relative=True each row is weighted by 1/y, so a 50 ms point counts as much as a 5 s one.
    Few coefficients, so we try every subset of them and keep the best feasible fit.
    """
    import numpy as np

    A, y = np.asarray(features, dtype=float), np.asarray(y, dtype=float)
    if A.ndim != 2 or A.shape[0] != y.shape[0] or A.shape[0] == 0:
        raise ValueError(f"features must be [n_points, n_coef] with one y per point, got {A.shape} and {y.shape}")
    w = 1 / y if relative else np.ones_like(y)
    best, best_err = np.zeros(A.shape[1]), math.inf
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            coef, *_ = np.linalg.lstsq(A[:, cols] * w[:, None], y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(A.shape[1])
            full[list(cols)] = coef
            err = float(np.sum(((A @ full - y) * w) ** 2))
            if err < best_err - 1e-15:
                best, best_err = full, err
    return best.tolist()


@dataclass(frozen=True)
class LatencyModel:
    """TTFT(T) = a + b·T + c·T²   (fixed cost, per-token matmuls, attention over the prompt)
    ITL(C)  = d + e·C           (read the weights, plus the K and V of C cached tokens)
    Seconds; fitted on prompts up to `max_prompt` and contexts up to `max_context` tokens."""
    ttft_coef: tuple[float, float, float]
    itl_coef: tuple[float, float]
    max_prompt: int
    max_context: int

    def ttft(self, prompt_len: float) -> float:
        a, b, c = self.ttft_coef
        return a + b * prompt_len + c * prompt_len ** 2

    def itl(self, context: float) -> float:
        d, e = self.itl_coef
        return d + e * context

    def decode_time(self, prompt_len: int, n_out: int) -> float:
        """Tokens 2..n_out each take one decode step; step s runs with C = T + s − 1 tokens cached."""
        steps = max(n_out - 1, 0)
        return steps * self.itl(prompt_len + (steps - 1) / 2) if steps else 0.0

    def total(self, prompt_len: int, n_out: int) -> float:
        if prompt_len < 1 or n_out < 1:
            raise ValueError(f"prompt_len and n_out must be >= 1, got {prompt_len} and {n_out}")
        return self.ttft(prompt_len) + self.decode_time(prompt_len, n_out)

    def extrapolates(self, prompt_len: int, n_out: int) -> bool:
        """True when the question reaches beyond the lengths the fit was measured on."""
        return prompt_len > self.max_prompt or prompt_len + n_out > self.max_context

    def values(self) -> dict:
        return dict(fit_ttft_coef=list(self.ttft_coef), fit_itl_coef=list(self.itl_coef),
                    fit_max_prompt=self.max_prompt, fit_max_context=self.max_context)

    def __str__(self) -> str:
        a, b, c = self.ttft_coef
        d, e = self.itl_coef
        return (f"TTFT(T) = {a * 1e3:.1f} ms + {b * 1e3:.3f} ms·T + {c * 1e6:.4f} µs·T²\n"
                f"ITL(C)  = {d * 1e3:.2f} ms + {e * 1e6:.3f} µs·C")


def fit_latency_model(prefill_: Sweep, decode_: Sweep) -> LatencyModel:
    """Fit TTFT to the prefill sweep and ITL to the decode sweep (non-negative, relative least squares)."""
    if len(prefill_.lengths) < 2 or len(decode_.lengths) < 2:
        raise ValueError("fitting needs at least 2 prefill lengths and 2 decode contexts; sweep more lengths")
    ttft = nonnegative_fit([[1.0, T, T * T] for T in prefill_.lengths], prefill_.seconds)
    itl = nonnegative_fit([[1.0, C] for C in decode_.lengths], decode_.seconds)
    return LatencyModel(tuple(ttft), tuple(itl), max(prefill_.lengths), max(decode_.lengths))


@dataclass(frozen=True)
class HeldOut:
    """A real generate() call at sizes the fit never saw, against the fit's prediction."""
    prompt_len: int
    n_out: int
    measured_s: float  # median total over the repeats
    measured_ttft_s: float
    measured_itl_s: float
    predicted_s: float
    predicted_ttft_s: float
    predicted_itl_s: float

    @property
    def error(self) -> float:
        """predicted ÷ measured − 1 (0.1 = the fit said 10 % too long)."""
        return self.predicted_s / self.measured_s - 1

    def values(self) -> dict:
        return dict(heldout_prompt=self.prompt_len, heldout_new=self.n_out, heldout_measured_s=self.measured_s,
                    heldout_predicted_s=self.predicted_s, heldout_error=self.error,
                    heldout_ttft_ms=self.measured_ttft_s * 1e3, heldout_itl_ms=self.measured_itl_s * 1e3)

    def __str__(self) -> str:
        return (f"held-out run: {self.prompt_len}-token prompt, {self.n_out} tokens out\n"
                f"             predicted   measured\n"
                f"  TTFT      {self.predicted_ttft_s * 1e3:9.0f} ms {self.measured_ttft_s * 1e3:7.0f} ms\n"
                f"  ITL       {self.predicted_itl_s * 1e3:9.1f} ms {self.measured_itl_s * 1e3:7.1f} ms\n"
                f"  total     {self.predicted_s:9.2f} s  {self.measured_s:7.2f} s   "
                f"(fit off by {self.error:+.0%})")

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def held_out_check(model, latency: LatencyModel, prompt_len: int, n_out: int, repeats: int = 3,
                   seed: int = 1, progress: bool = True) -> HeldOut:
    """Run the whole loop (generate(), greedy, no early stop) and compare its clock with the fit."""
    from statistics import median

    from tqdm.auto import tqdm

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    _check_lengths("prompt_len + n_out", [prompt_len + n_out], model.config.max_seq_len)
    ids = random_prompt(model, prompt_len, seed)[0].tolist()
    runs = [generate(model, ids, n_out) for _ in tqdm(range(repeats), desc="held-out runs", disable=not progress)]
    run = sorted(runs, key=lambda g: g.total_time)[len(runs) // 2]
    mid_context = prompt_len + (n_out - 2) / 2
    return HeldOut(prompt_len, n_out, median(g.total_time for g in runs), run.time_to_first_token,
                   run.mean_inter_token_latency, latency.total(prompt_len, n_out), latency.ttft(prompt_len),
                   latency.itl(mid_context))


def checkpoint_ab(latency: LatencyModel, requests: dict | None = None) -> dict:
    """The seed's checkpoint answered with the fit: seconds of prefill, decode and total per request."""
    out = {}
    for name, (prompt_len, n_out) in (requests or CHECKPOINT_REQUESTS).items():
        ttft = latency.ttft(prompt_len)
        out[name] = dict(prompt_tokens=prompt_len, output_tokens=n_out, ttft_s=ttft,
                         decode_s=latency.decode_time(prompt_len, n_out), total_s=latency.total(prompt_len, n_out),
                         extrapolated=latency.extrapolates(prompt_len, n_out))
    out["slower"] = max((k for k in out), key=lambda k: out[k]["total_s"])
    return out


def format_ab(ab: dict) -> str:
    lines = [f"{'request':8} {'prompt':>7} {'output':>7} {'TTFT s':>8} {'decode s':>9} {'total s':>8}"]
    for name, r in ab.items():
        if name == "slower":
            continue
        lines.append(f"{name:8} {r['prompt_tokens']:>7} {r['output_tokens']:>7} {r['ttft_s']:>8.2f} "
                     f"{r['decode_s']:>9.2f} {r['total_s']:>8.2f}" + ("  (extrapolated)" if r["extrapolated"] else ""))
    return "\n".join(lines) + f"\n→ {ab['slower']} is slower end to end"


def ab_values(ab: dict) -> dict:
    out = {"ab_slower": ab["slower"]}
    for name in CHECKPOINT_REQUESTS:
        out[f"ab_{name}_total_s"] = ab[name]["total_s"]
        out[f"ab_{name}_ttft_s"] = ab[name]["ttft_s"]
        out[f"ab_{name}_decode_s"] = ab[name]["decode_s"]
        out[f"ab_{name}_extrapolated"] = ab[name]["extrapolated"]
    return out


def explain_ab(ab: dict, latency: LatencyModel) -> str:
    """Why the slower request is slower, in seconds of prefill and decode the fit predicts."""
    A, B = ab["A"], ab["B"]
    extra_prefill = A["ttft_s"] - B["ttft_s"]
    extra_decode = B["decode_s"] - A["decode_s"]
    T = (A["prompt_tokens"] + B["prompt_tokens"]) / 2
    per_prompt_token = (latency.ttft(A["prompt_tokens"]) - latency.ttft(B["prompt_tokens"])) / \
        (A["prompt_tokens"] - B["prompt_tokens"])
    per_output_token = latency.itl(T)
    return (f"A's {A['prompt_tokens'] - B['prompt_tokens']:,} extra prompt tokens add {extra_prefill:.1f} s of prefill; "
            f"B's {B['output_tokens'] - A['output_tokens']:,} extra output tokens add {extra_decode:.1f} s of decode.\n"
            f"Around {T:,.0f} tokens of context one output token costs {per_output_token * 1e3:.1f} ms and one more "
            f"prompt token {per_prompt_token * 1e3:.2f} ms: an output token is worth "
            f"{per_output_token / per_prompt_token:.0f} prompt tokens here. So {ab['slower']} is slower"
            + (" (both predictions extrapolate beyond the measured sizes)." if A["extrapolated"] or B["extrapolated"]
               else "."))


def plot_latency_fit(prefill_: Sweep, decode_: Sweep, latency: LatencyModel, held_out: HeldOut | None = None):
    """The fitted TTFT and ITL curves over the measured points, drawn dashed where they extrapolate
    out to the checkpoint's sizes."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    a_prompt = max(p for p, _ in CHECKPOINT_REQUESTS.values())
    b_context = max(p + n for p, n in CHECKPOINT_REQUESTS.values())
    for ax, sweep, fn, top, limit, label in (
            (left, prefill_, latency.ttft, a_prompt, latency.max_prompt, "TTFT (s) vs prompt tokens T"),
            (right, decode_, latency.itl, b_context, latency.max_context, "ITL (ms) vs context tokens C")):
        scale = 1.0 if ax is left else 1e3
        inside = np.linspace(1, limit, 200)
        beyond = np.linspace(limit, top, 200)
        ax.plot(sweep.lengths, [s * scale for s in sweep.seconds], "o", color="k", label="measured (sweep)")
        ax.plot(inside, [fn(x) * scale for x in inside], "-", color="tab:green", label="fit")
        ax.plot(beyond, [fn(x) * scale for x in beyond], "--", color="tab:green", label="fit, extrapolated")
        ax.set(xlabel=label.split(" vs ")[1], ylabel=label.split(" vs ")[0], title=label)
        ax.set_ylim(bottom=0)  # from zero, so a small slope looks as small as it is
        ax.grid(True, alpha=0.3)
    for name, (p, n) in CHECKPOINT_REQUESTS.items():
        left.axvline(p, color="gray", ls=":", lw=1)
        left.text(p, left.get_ylim()[1] * 0.9, f" {name}", fontsize=8)
    if held_out is not None:
        left.plot([held_out.prompt_len], [held_out.measured_ttft_s], "r*", ms=10, label="held-out run")
        right.plot([held_out.prompt_len + held_out.n_out / 2], [held_out.measured_itl_s * 1e3], "r*", ms=10,
                   label="held-out run")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# The seed's interview answers, in this machine's numbers
# ---------------------------------------------------------------------------------------------

def interview_answers(v: dict) -> str:
    """The seed's two interview answers, phrased with the values the notebook record()ed (keys as there)."""
    decode_ms = v["decode_ms_per_token"]
    prompt_per_output = decode_ms[0] / 1e3 * v["prefill_tokens_per_s_max"]
    first = (
        "Q: Why is the first token slow, then streaming fast?\n"
        f"A: The first token waits for prefill: all {v['call_prompt_tokens']} prompt tokens went through the "
        f"model in one parallel pass, {v['call_ttft_ms']:.0f} ms here, and that pass also filled the KV cache. "
        f"Every later token is one small decode step that reuses the cache: {v['call_itl_ms']:.0f} ms apiece. "
        f"Per token, prefill is the efficient phase - up to {v['prefill_tokens_per_s_max']:,.0f} tokens/s against "
        f"{v['decode_tokens_per_s'][0]:,.0f} tokens/s for decode, so one output token costs about as much time as "
        f"{prompt_per_output:,.0f} prompt tokens. The first token is slow only because it pays for the whole "
        f"prompt at once; a longer prompt lengthens the wait (TTFT), more output lengthens the stream.")
    second = (
        "Q: Why is decode memory-bandwidth-bound?\n"
        f"A: One decode step reads every weight ({v['weight_mb']:.0f} MB here in {v.get('dtype', 'this dtype')}) "
        f"plus the K and V of every cached token ({v['kv_mb_at_max_context']:.1f} MB at "
        f"{v['decode_contexts'][-1]:,} tokens) to do only {v['decode_gflop']:.2f} GFLOP: "
        f"{v['decode_intensity']:.2f} FLOPs per byte, below this machine's ridge of "
        f"{v['ridge_flop_per_byte']:.1f} FLOPs per byte. The arithmetic would take "
        f"{v['decode_gflop'] / v['matmul_gflop_s'] * 1e3:.1f} ms at {v['matmul_gflop_s']:.0f} GFLOP/s, moving the bytes "
        f"{v['decode_floor_ms']:.1f} ms at {v['bandwidth_gb_s']:.1f} GB/s, so memory is the wall the step hits first, "
        + (f"and the cache raises it as the context grows ({decode_ms[0]:.1f} → {decode_ms[-1]:.1f} ms per token "
           f"from {v['decode_contexts'][0]:,} to {v['decode_contexts'][-1]:,} tokens). "
           if decode_ms[-1] > decode_ms[0] else
           f"and the cache raises it as the context grows - though here the cache at {v['decode_contexts'][-1]:,} "
           f"tokens is small next to the weights, and timing noise hid its cost ({decode_ms[0]:.1f} → "
           f"{decode_ms[-1]:.1f} ms per token). ")
        + f"Prefill reads the same "
        f"weights once for all T tokens, so its FLOPs per byte grow with T and it is compute-bound instead.")
    if "breakdown_step_ms" in v:
        second += (
            f"\n   Honest footnote: the measured step ({v['breakdown_step_ms']:.1f} ms) is "
            f"{v['breakdown_step_ms'] / v['breakdown_floor_ms']:.1f}× the bandwidth floor. The "
            f"{v['breakdown_n_matmuls']} matrix-vector products alone moved weights at "
            f"{v['breakdown_gemv_gb_s']:.1f} GB/s (the probe: {v['bandwidth_gb_s']:.1f} GB/s), and the other "
            f"{v['breakdown_n_ops'] - v['breakdown_n_matmuls']:,} small operations cost "
            f"{v['breakdown_other_us_per_op']:.1f} µs each. Serving stacks fuse those into few kernels, which is "
            f"how they get close to the floor.")
    return first + "\n\n" + second
