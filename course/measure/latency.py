"""The latency model: total ≈ TTFT(T_prompt) + (n_out − 1) · ITL(context), fitted to the sweeps and checked.

    fit_latency_model   the fit (non-negative least squares on relative error)
    held_out_check      a run the fit never saw, predicted vs measured
    checkpoint_ab       the lesson's two requests: a long prompt and a short answer, or the reverse
"""
from __future__ import annotations

import os

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from course.engine.generate import generate
from course.measure.costs import check_lengths
from course.measure.sweeps import Sweep, random_prompt
from course.measure.display import Printed
from course.measure.threads import free_cores

# The checkpoint of lesson 01: (A) a long prompt and a short answer, (B) a short prompt and a long answer.


CHECKPOINT_REQUESTS = {"A": (4000, 50), "B": (400, 2000)}


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


def itl_scatter(latency: LatencyModel, decode_: Sweep) -> float:
    """The measured decode points' RMS scatter around the fitted ITL line, in seconds: the noise a rise across the
    contexts must beat (twice over) before the fit can claim it."""
    return math.sqrt(sum((latency.itl(c) - s) ** 2 for c, s in zip(decode_.lengths, decode_.seconds))
                     / len(decode_.lengths))


def itl_slope_sentence(latency: LatencyModel, decode_: Sweep, config, machine, dtype) -> str:
    """The fitted ITL slope beside the one theory expects, 2·L·H_kv·D_h·bytes ÷ bandwidth per cached token, and
    whether the measured contexts can resolve it: the rise theory predicts across them, against the scatter of
    the measured points around the fit."""
    from course.measure.costs import dtype_bytes, kv_bytes_per_token

    size = dtype_bytes(dtype)
    per_token = kv_bytes_per_token(config, size)
    theory = per_token / machine.bytes_per_s  # seconds per cached token
    fitted = latency.itl_coef[1]
    lo, hi = min(decode_.lengths), max(decode_.lengths)
    rise = theory * (hi - lo)
    scatter = itl_scatter(latency, decode_)
    head = (f"ITL slope: fitted {fitted * 1e6:.3f} µs per cached token; theory 2·L·H_kv·D_h·bytes ÷ bandwidth = "
            f"2·{config.n_layers}·{config.n_kv_heads}·{config.head_dim}·{size:g} B ÷ "
            f"{machine.bytes_per_s / 1e9:.1f} GB/s = {theory * 1e6:.3f} µs per cached token.")
    if rise < 2 * scatter:
        return (head + f" From C = {lo:,} to {hi:,} theory adds only {rise * 1e3:.2f} ms per step, less than twice "
                f"the measured points' scatter around the fit ({scatter * 1e3:.2f} ms): the fit cannot resolve the "
                "slope at these contexts (KVCOURSE_FULL=1 sweeps longer ones).")
    ratio = fitted / theory
    return (head + f" From C = {lo:,} to {hi:,} theory adds {rise * 1e3:.2f} ms per step, beyond the points' "
            f"scatter ({scatter * 1e3:.2f} ms); the fitted slope is {ratio:.2f}× theory's.")


def fit_latency_model(prefill_: Sweep, decode_: Sweep) -> LatencyModel:
    """Fit TTFT to the prefill sweep and ITL to the decode sweep (non-negative, relative least squares)."""
    if len(prefill_.lengths) < 2 or len(decode_.lengths) < 2:
        raise ValueError("fitting needs at least 2 prefill lengths and 2 decode contexts; sweep more lengths")
    ttft = nonnegative_fit([[1.0, T, T * T] for T in prefill_.lengths], prefill_.seconds)
    itl = nonnegative_fit([[1.0, C] for C in decode_.lengths], decode_.seconds)
    return LatencyModel(tuple(ttft), tuple(itl), max(prefill_.lengths), max(decode_.lengths))


@dataclass(frozen=True)
class HeldOut(Printed):
    """A real generate() call at sizes the fit never saw, against the fit's prediction."""
    prompt_len: int
    n_out: int
    measured_s: float  # median total over the repeats
    measured_ttft_s: float
    measured_itl_s: float
    predicted_s: float
    predicted_ttft_s: float
    predicted_itl_s: float
    load_average: float | None = None  # 1-minute load average over the check (None where unknown)
    cores: int | None = None
    others_cores: float | None = None  # other programs' CPU use during the runs, in cores (None where unknown)
    threads: int = 1  # this process's CPU threads during the runs
    tolerance: float = 0.2  # the fit "holds" when it is within this share of the measured time

    @property
    def error(self) -> float:
        """predicted ÷ measured − 1 (0.1 = the fit said 10 % too long)."""
        return self.predicted_s / self.measured_s - 1

    @property
    def holds(self) -> bool:
        return abs(self.error) <= self.tolerance

    @property
    def verdict(self) -> str:
        """What the check says about the fit, from its error and the machine's load."""
        if self.holds:
            return (f"the fit holds: within {abs(self.error):.0%} of a run it never saw "
                    f"(tolerance {self.tolerance:.0%}), so its predictions can be used as they are")
        if self.others_cores is not None:  # measured: other programs took a core this process's threads needed
            busy = bool(self.cores) and free_cores(self.others_cores, self.cores) < self.threads
            how = f"other programs used {self.others_cores:.1f} of its {self.cores} cores"
        else:  # the load average counts this process too
            busy = self.load_average is not None and bool(self.cores) and self.load_average > self.cores
            how = f"load average {self.load_average:.1f} on {self.cores} cores"
        why = (f"the machine was busy ({how}), so the sweeps and this run did not see the same machine" if busy
               else "the sweeps and this run saw different conditions (CPU clock, caches, other programs' "
               "memory traffic)")
        return (f"the fit does NOT hold: it is off by {self.error:+.0%} on a run it never saw. Most likely "
                f"{why}. Treat every prediction below as uncertain by at least ±{abs(self.error):.0%}, or "
                "re-run sections 2 and 7 on a quieter machine")

    def values(self) -> dict:
        return dict(heldout_prompt=self.prompt_len, heldout_new=self.n_out, heldout_measured_s=self.measured_s,
                    heldout_predicted_s=self.predicted_s, heldout_error=self.error,
                    heldout_ttft_ms=self.measured_ttft_s * 1e3, heldout_itl_ms=self.measured_itl_s * 1e3,
                    heldout_holds=self.holds, heldout_load_average=self.load_average,
                    heldout_others_cores=self.others_cores)

    def __str__(self) -> str:
        return (f"held-out run: {self.prompt_len}-token prompt, {self.n_out} tokens out\n"
                f"             predicted   measured\n"
                f"  TTFT      {self.predicted_ttft_s * 1e3:9.0f} ms {self.measured_ttft_s * 1e3:7.0f} ms\n"
                f"  ITL       {self.predicted_itl_s * 1e3:9.1f} ms {self.measured_itl_s * 1e3:7.1f} ms\n"
                f"  total     {self.predicted_s:9.2f} s  {self.measured_s:7.2f} s   "
                f"(fit off by {self.error:+.0%})\n" + self.verdict)


def held_out_check(model, latency: LatencyModel, prompt_len: int, n_out: int, repeats: int = 3,
                   seed: int = 1, progress: bool = True) -> HeldOut:
    """Run the whole loop (generate(), greedy, no early stop) and compare its clock with the fit."""
    from statistics import median

    from tqdm.auto import tqdm

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    check_lengths("prompt_len + n_out", [prompt_len + n_out], model.config.max_seq_len)
    import torch

    from course.measure.threads import cpu_clock, others_busy

    ids = random_prompt(model, prompt_len, seed)[0].tolist()
    clock = cpu_clock()
    runs = [generate(model, ids, n_out) for _ in tqdm(range(repeats), desc="held-out runs", disable=not progress)]
    others = others_busy(clock, cpu_clock())
    run = sorted(runs, key=lambda g: g.total_time)[len(runs) // 2]
    mid_context = prompt_len + (n_out - 2) / 2
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not every platform has a load average
        load = None
    return HeldOut(prompt_len, n_out, median(g.total_time for g in runs), run.time_to_first_token,
                   run.mean_inter_token_latency, latency.total(prompt_len, n_out), latency.ttft(prompt_len),
                   latency.itl(mid_context), load, os.cpu_count(), others,
                   torch.get_num_threads() if model.device.type == "cpu" else 1)


def checkpoint_ab(latency: LatencyModel, requests: dict | None = None) -> dict:
    """The seed's checkpoint answered with the fit: seconds of prefill, decode and total per request."""
    out = {}
    for name, (prompt_len, n_out) in (requests or CHECKPOINT_REQUESTS).items():
        ttft = latency.ttft(prompt_len)
        out[name] = dict(prompt_tokens=prompt_len, output_tokens=n_out, ttft_s=ttft,
                         decode_s=latency.decode_time(prompt_len, n_out), total_s=latency.total(prompt_len, n_out),
                         extrapolated=latency.extrapolates(prompt_len, n_out))
    out["slower"] = max((k for k in out), key=lambda k: out[k]["total_s"])
    out["exchange"] = token_exchange(latency, out["A"]["prompt_tokens"], out["B"]["prompt_tokens"])
    return out


def token_exchange(latency: LatencyModel, prompt_a: int, prompt_b: int) -> dict:
    """The lesson's one definition of what an output token is worth in prompt tokens: at the mean of the two
    prompt lengths T, one decode step at context T (ITL(T)) ÷ the time one more prompt token adds to prefill
    (the fitted TTFT's slope between the two prompts). None when the fitted TTFT does not grow between them
    (a sweep too noisy to fit, on a busy machine): then a prompt token has no price to compare with."""
    T = (prompt_a + prompt_b) / 2
    per_prompt_token = (latency.ttft(prompt_a) - latency.ttft(prompt_b)) / (prompt_a - prompt_b)
    per_output_token = latency.itl(T)
    return dict(context=T, per_output_token_s=per_output_token, per_prompt_token_s=per_prompt_token,
                output_in_prompt_tokens=per_output_token / per_prompt_token if per_prompt_token > 0 else None)


def format_ab(ab: dict) -> str:
    lines = [f"{'request':8} {'prompt':>7} {'output':>7} {'TTFT s':>8} {'decode s':>9} {'total s':>8}"]
    for name, r in ab.items():
        if name in ("slower", "exchange"):
            continue
        lines.append(f"{name:8} {r['prompt_tokens']:>7} {r['output_tokens']:>7} {r['ttft_s']:>8.2f} "
                     f"{r['decode_s']:>9.2f} {r['total_s']:>8.2f}" + ("  (extrapolated)" if r["extrapolated"] else ""))
    return "\n".join(lines) + f"\n→ {ab['slower']} is slower end to end"


def ab_values(ab: dict) -> dict:
    out = {"ab_slower": ab["slower"]}
    if "exchange" in ab:
        out["output_token_in_prompt_tokens"] = ab["exchange"]["output_in_prompt_tokens"]
        out["output_token_exchange_context"] = ab["exchange"]["context"]
    for name in CHECKPOINT_REQUESTS:
        out[f"ab_{name}_total_s"] = ab[name]["total_s"]
        out[f"ab_{name}_ttft_s"] = ab[name]["ttft_s"]
        out[f"ab_{name}_decode_s"] = ab[name]["decode_s"]
        out[f"ab_{name}_extrapolated"] = ab[name]["extrapolated"]
    return out


def explain_ab(ab: dict, latency: LatencyModel, held_out: HeldOut | None = None) -> str:
    """Why the slower request is slower, in seconds of prefill and decode the fit predicts; with a failed
    held-out check, whether the answer survives the fit's measured error."""
    A, B = ab["A"], ab["B"]
    extra_prefill = A["ttft_s"] - B["ttft_s"]
    extra_decode = B["decode_s"] - A["decode_s"]
    x = ab.get("exchange") or token_exchange(latency, A["prompt_tokens"], B["prompt_tokens"])
    price = (f"and one more prompt token {x['per_prompt_token_s'] * 1e3:.2f} ms: one output token costs as much time "
             f"as {x['output_in_prompt_tokens']:.0f} prompt tokens here" if x["output_in_prompt_tokens"] is not None
             else "but the fitted time to first token does not grow with the prompt in this run (the prefill sweep "
                  "was too noisy to fit: rerun when the machine is quiet), so a prompt token has no price to compare")
    return (f"A's {A['prompt_tokens'] - B['prompt_tokens']:,} extra prompt tokens add {extra_prefill:.1f} s of prefill; "
            f"B's {B['output_tokens'] - A['output_tokens']:,} extra output tokens add {extra_decode:.1f} s of decode.\n"
            f"Around {x['context']:,.0f} tokens of context one output token costs {x['per_output_token_s'] * 1e3:.1f} ms "
            f"{price}. So {ab['slower']} is slower"
            + (" (both predictions extrapolate beyond the measured sizes)." if A["extrapolated"] or B["extrapolated"]
               else ".") + _robustness(ab, held_out))


def _robustness(ab: dict, held_out: HeldOut | None) -> str:
    if held_out is None or held_out.holds:
        return ""
    e = min(abs(held_out.error), 0.95)
    slow, fast = ab[ab["slower"]]["total_s"], min(ab[k]["total_s"] for k in ("A", "B"))
    if slow * (1 - e) > fast * (1 + e):
        return (f"\nThe fit missed its held-out run by {held_out.error:+.0%}, yet {ab['slower']} stays slower even if "
                f"each prediction is off by that much the wrong way ({slow / fast:.1f}× apart).")
    return (f"\nThe fit missed its held-out run by {held_out.error:+.0%}: within that error the two requests are too "
            "close to call on this machine.")


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
        ax.grid(True, alpha=0.3)
    if held_out is not None:  # drawn before the y-limits are fixed, so the axes take it in
        left.plot([held_out.prompt_len], [held_out.measured_ttft_s], "r*", ms=10, label="held-out run")
        right.plot([held_out.prompt_len + held_out.n_out / 2], [held_out.measured_itl_s * 1e3], "r*", ms=10,
                   label="held-out run")
    for ax in (left, right):
        ax.relim()
        ax.autoscale_view()
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)  # from zero, so a small slope looks as small as it is
    for name, (p, n) in CHECKPOINT_REQUESTS.items():
        left.axvline(p, color="gray", ls=":", lw=1)
        left.text(p, left.get_ylim()[1] * 0.9, f" {name}", fontsize=8)
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig
