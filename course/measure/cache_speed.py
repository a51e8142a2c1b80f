"""Generation with and without the KV cache: equivalence, then time per step and cumulative time.

Without the cache, step t runs the whole sequence (prompt + t tokens) through the model again, so a
step's cost grows with t and the total grows about quadratically. With it, a step runs one token
against the cache: roughly constant per step, linear in total.

One generation of the longest length per mode gives every shorter length too: the first n tokens of
a 256-token greedy run are exactly the work of a 16-token run (same tokens, same passes), so the
cumulative clock at token n is the time an n-token generation takes.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from course.engine.generate import generate, prefill, teacher_forced_logits


ROUNDING_SLACK = 256  # roundings a reordered computation may drift: sums of hundreds of terms, layer on layer


def rounding_unit(dtype: torch.dtype, device="cpu") -> float:
    """Machine epsilon of the dtype the products round to: float32's, or TF32's 10 bits where CUDA allows it."""
    if dtype == torch.float32 and torch.device(device).type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return 2.0 ** -10
    return torch.finfo(dtype).eps


def rounding_verdict(diff: float, scale: float, dtype: torch.dtype, device="cpu") -> str:
    """Whether |Δ| between two orders of the same arithmetic is rounding, for values up to `scale`: a few words."""
    name = str(dtype).replace("torch.", "")
    unit = rounding_unit(dtype, device) * max(scale, 1e-30)  # one rounding at the largest values
    if diff == 0:
        return "bit for bit identical"
    n = round(diff / unit)
    roundings = f"{n:,} rounding{'s' * (n != 1)} at values up to {scale:.3g}"
    if diff <= ROUNDING_SLACK * unit:
        return f"{name} rounding ({roundings})"
    return f"MORE than {name} rounding: {roundings}"


@dataclass
class Equivalence:
    n_tokens: int
    max_abs_logit_diff: float  # cached step logits vs one uncached pass over the same tokens
    tokens_identical: bool  # greedy tokens of generate(use_cache=True) == generate(use_cache=False)
    cached_tokens: list[int] = field(default_factory=list)
    uncached_tokens: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    logit_scale: float = 0.0  # largest |logit| compared

    def __str__(self) -> str:
        verdict = rounding_verdict(self.max_abs_logit_diff, self.logit_scale, self.dtype, self.device)
        return (f"Largest logit difference over {self.n_tokens} steps: {self.max_abs_logit_diff:.1e}, {verdict}.\n"
                f"Greedy tokens with and without the cache: {'' if self.tokens_identical else 'NOT '}identical.")


@torch.inference_mode()
def check_equivalence(model, prompt_ids, n_tokens: int = 24) -> Equivalence:
    """Cached vs uncached: logits at every generated position, and the greedy tokens of both generate() paths."""
    with tqdm(total=2 * n_tokens, desc="greedy generation, with and without cache", unit="tok") as bar:
        cached = generate(model, prompt_ids, n_tokens, use_cache=True, on_token=lambda _: bar.update()).tokens
        uncached = generate(model, prompt_ids, n_tokens, use_cache=False, on_token=lambda _: bar.update()).tokens
    ids = torch.as_tensor(list(prompt_ids) + cached, dtype=torch.long, device=model.device).view(1, -1)
    T = len(prompt_ids)
    full = prefill(model, ids, cache=None, last_only=False)[0, T - 1:-1]  # [n_tokens, V]: one uncached pass
    steps = teacher_forced_logits(model, prompt_ids, cached)  # [n_tokens, V]: the cached loop, the same tokens
    diff = (steps - full).abs().max().item()
    return Equivalence(n_tokens, diff, cached == uncached, cached, uncached, full.dtype, str(full.device),
                       full.abs().max().item())


@dataclass
class SpeedComparison:
    """Per-token clocks (seconds since the call started) of one greedy generation per mode."""
    lengths: list[int]
    cached_times: list[float]
    uncached_times: list[float]
    prompt_tokens: int
    tokens_identical: bool

    def cumulative(self, n: int, cached: bool) -> float:
        """Seconds to generate the first n tokens."""
        return (self.cached_times if cached else self.uncached_times)[n - 1]

    @property
    def speedups(self) -> list[float]:
        """uncached time / cached time for an n-token generation, for each n in lengths."""
        return [self.cumulative(n, False) / self.cumulative(n, True) for n in self.lengths]

    @property
    def unit_costs(self) -> tuple[float, float]:
        """(P, C) in seconds: the prefill of the prompt (either run's first token) and the median cached decode step."""
        return min(self.cached_times[0], self.uncached_times[0]), statistics.median(self.cached_step_times[1:])

    @property
    def predicted_speedups(self) -> list[float]:
        """Uncached ÷ cached time for each length from the two unit costs alone: a pass over T tokens costs one decode
        step plus T − 1 tokens at the prefill's cost per token, and the uncached run makes one pass per new token."""
        (P, C), T0 = self.unit_costs, self.prompt_tokens
        per_token = max(P - C, 0.0) / max(T0 - 1, 1)
        return [sum(C + (T0 + t - 1) * per_token for t in range(n)) / (P + (n - 1) * C) for n in self.lengths]

    @staticmethod
    def _steps(times):
        return [times[0]] + [b - a for a, b in zip(times, times[1:])]

    @property
    def cached_step_times(self) -> list[float]:
        return self._steps(self.cached_times)

    @property
    def uncached_step_times(self) -> list[float]:
        return self._steps(self.uncached_times)


def measure_cache_speedup(model, prompt_ids, lengths=(16, 64, 128, 256)) -> SpeedComparison:
    """Greedy-generate max(lengths) tokens with and without the cache (EOS ignored), timing every token."""
    lengths = sorted(int(n) for n in lengths)
    if not lengths or lengths[0] <= 0:
        raise ValueError(f"lengths must be positive numbers of new tokens, got {lengths}")
    n = lengths[-1]
    generate(model, prompt_ids, 4, use_cache=True)  # warm-up: first calls pay for allocation and kernels
    generate(model, prompt_ids, 2, use_cache=False)
    runs = {}
    for use_cache in (True, False):
        label = "with cache" if use_cache else "without cache"
        with tqdm(total=n, desc=f"generating {n} tokens {label}", unit="tok") as bar:
            runs[use_cache] = generate(model, prompt_ids, n, use_cache=use_cache, on_token=lambda _: bar.update())
    return SpeedComparison(lengths, runs[True].token_times, runs[False].token_times, len(prompt_ids),
                           runs[True].tokens == runs[False].tokens)


def plot_cache_speed(result: SpeedComparison, quoted_speedup: float = 5.21):
    """Per-step time (flat vs growing), cumulative time (linear vs quadratic), and the speedup per length."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = range(1, len(result.cached_times) + 1)
    ax = axes[0]
    ax.plot(steps, [t * 1e3 for t in result.uncached_step_times], label="without cache", color="tab:red")
    ax.plot(steps, [t * 1e3 for t in result.cached_step_times], label="with cache", color="tab:blue")
    ax.set(xlabel="new token", ylabel="ms for this token", title="Time per step", yscale="log")
    ax.legend()
    ax = axes[1]
    ax.plot(steps, result.uncached_times, label="without cache", color="tab:red")
    ax.plot(steps, result.cached_times, label="with cache", color="tab:blue")
    ax.set(xlabel="tokens generated", ylabel="seconds since the call started", title="Cumulative time")
    ax.legend()
    ax = axes[2]
    ax.bar([str(n) for n in result.lengths], result.speedups, color="tab:green")
    ax.axhline(quoted_speedup, color="gray", ls="--", label=f"Hugging Face's KV-caching post: {quoted_speedup}× (GPT-2, T4 GPU)")
    for i, s in enumerate(result.speedups):
        ax.text(i, s, f"{s:.1f}×", ha="center", va="bottom")
    ax.set(xlabel="tokens generated", ylabel="uncached / cached time", title="Speedup from the cache",
           ylim=(0, 1.3 * max(result.speedups + [quoted_speedup])))  # room for the legend
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig
