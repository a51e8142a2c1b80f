"""Prefill and decode timed over several lengths: the sweeps behind lesson 01's plots and the latency fit.

    default_sizes    what the lesson measures (quick, or full with KVCOURSE_FULL=1)
    prefill_sweep    seconds to prefill T prompt tokens, for several T
    decode_sweep     seconds per decode step with C tokens already cached, for several C (eager)
    prepare_context  a cache already holding C tokens
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from course.engine.generate import decode_one_token, prefill
from course.engine.kv_cache import KVCache
from course.measure.costs import check_lengths
from course.measure.results import full_size
from course.measure.timing import Stopwatch, Timing, measure


@dataclass(frozen=True)
class Sizes:
    """What the lesson measures. The default fits in a few minutes on 2 CPU cores."""
    prefill: tuple[int, ...]  # prompt lengths T, tokens
    decode: tuple[int, ...]  # context lengths C, tokens already in the cache
    held_out_prompt: int  # prompt tokens of the run the latency fit never saw
    held_out_new: int  # tokens it generates
    held_out_repeats: int
    full: bool

    def __str__(self) -> str:
        return (f"{'full' if self.full else 'quick'} sweeps: prefill at T = {', '.join(f'{t:,}' for t in self.prefill)}; "
                f"decode at C = {', '.join(f'{c:,}' for c in self.decode)}")


def default_sizes(full: bool | None = None) -> Sizes:
    """Quick sweeps by default; the full sweep to 2048 tokens when KVCOURSE_FULL=1 (or full=True)."""
    full = full_size() if full is None else full
    if full:
        return Sizes(prefill=(16, 32, 64, 128, 256, 512, 1024, 2048), decode=(16, 64, 256, 512, 1024, 2048),
                     held_out_prompt=768, held_out_new=64, held_out_repeats=3, full=True)
    return Sizes(prefill=(16, 64, 256, 1024), decode=(16, 256, 1024),
                 held_out_prompt=512, held_out_new=32, held_out_repeats=3, full=False)


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

    lengths = check_lengths("lengths", lengths, model.config.max_seq_len)
    timings = []
    for T in tqdm(lengths, desc="prefill sweep", unit="length", disable=not progress):
        ids = random_prompt(model, T, seed)
        cache = KVCache(model.config, batch=1, max_seq_len=T, dtype=model.dtype, device=model.device)
        timings.append(_measure_within(lambda: prefill(model, ids, cache), model.device, budget_s, max_repeats))
    return Sweep("prefill", lengths, timings, str(model.device), str(model.dtype).split(".")[-1])


def prepare_context(model, context: int, seed: int = 0) -> tuple[KVCache, torch.Tensor]:
    """Prefill `context` random tokens into a cache with room for one more; returns (cache, ids [1, C])."""
    check_lengths("context", [context], model.config.max_seq_len - 1)
    ids = random_prompt(model, context, seed)
    cache = KVCache(model.config, batch=1, max_seq_len=context + 1, dtype=model.dtype, device=model.device)
    prefill(model, ids, cache)
    return cache, ids


def decode_sweep(model, contexts: Sequence[int], budget_s: float = 1.0, max_repeats: int = 20,
                 min_repeats: int = 3, progress: bool = True, seed: int = 0) -> Sweep:
    """Median seconds per decode step at each context length C.

    First prefill C random tokens into one cache per context (untimed), then time steps in rounds,
    one step per context per round, so a change in the machine's load hits every context alike.
    `budget_s` is the timing budget per context.
    """
    from tqdm.auto import tqdm

    contexts = check_lengths("contexts", contexts, model.config.max_seq_len - 1)
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
