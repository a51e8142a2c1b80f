"""The latency model: total ≈ TTFT(T_prompt) + (n_out − 1) · ITL(context), fitted to the sweeps and checked.

    fit_latency_model   the fit (non-negative least squares on relative error)
    held_out_check      a run the fit never saw, predicted vs measured
    checkpoint_ab       the lesson's two requests: a long prompt and a short answer, or the reverse
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from course.engine.generate import generate
from course.measure.costs import check_lengths
from course.measure.sweeps import Sweep, random_prompt

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


def fit_latency_model(prefill_: Sweep, decode_: Sweep) -> LatencyModel:
    """Fit TTFT to the prefill sweep and ITL to the decode sweep (non-negative, relative least squares)."""
    if len(prefill_.lengths) < 2 or len(decode_.lengths) < 2:
        raise ValueError("fitting needs at least 2 prefill lengths and 2 decode contexts; sweep more lengths")
    ttft = nonnegative_fit([[1.0, T, T * T] for T in prefill_.lengths], prefill_.seconds)
    itl = nonnegative_fit([[1.0, C] for C in decode_.lengths], decode_.seconds)
    return LatencyModel(tuple(ttft), tuple(itl), max(prefill_.lengths), max(decode_.lengths))


@dataclass(frozen=True)
class HeldOut:
    """A real generate() call at sizes the fit never saw (medians over the repeats), and the fit's prediction."""
    prompt_len: int
    n_out: int
    measured_s: float
    measured_ttft_s: float
    measured_itl_s: float
    predicted_s: float
    predicted_ttft_s: float
    predicted_itl_s: float

    def rows(self) -> list[tuple[str, float, float, str]]:
        """(what, predicted, measured, unit) for a course.measure.display.Report."""
        return [("time to first token", self.predicted_ttft_s * 1e3, self.measured_ttft_s * 1e3, "ms"),
                ("each later token", self.predicted_itl_s * 1e3, self.measured_itl_s * 1e3, "ms"),
                ("whole call", self.predicted_s, self.measured_s, "s")]

    def values(self) -> dict:
        return dict(heldout_prompt=self.prompt_len, heldout_new=self.n_out, heldout_measured_s=self.measured_s,
                    heldout_predicted_s=self.predicted_s, heldout_error=self.predicted_s / self.measured_s - 1,
                    heldout_ttft_ms=self.measured_ttft_s * 1e3, heldout_itl_ms=self.measured_itl_s * 1e3,
                    heldout_predicted_ttft_ms=self.predicted_ttft_s * 1e3,
                    heldout_predicted_itl_ms=self.predicted_itl_s * 1e3)


def held_out_check(model, latency: LatencyModel, prompt_len: int, n_out: int, repeats: int = 3,
                   seed: int = 1) -> HeldOut:
    """Run the whole loop (generate(), greedy, no early stop) `repeats` times and set its clock beside the fit's."""
    from statistics import median

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    check_lengths("prompt_len + n_out", [prompt_len + n_out], model.config.max_seq_len)
    ids = random_prompt(model, prompt_len, seed)[0].tolist()
    runs = [generate(model, ids, n_out) for _ in range(repeats)]
    return HeldOut(prompt_len, n_out, median(g.total_time for g in runs),
                   median(g.time_to_first_token for g in runs), median(g.mean_inter_token_latency for g in runs),
                   latency.total(prompt_len, n_out), latency.ttft(prompt_len),
                   latency.itl(prompt_len + (n_out - 2) / 2))


def checkpoint_ab(latency: LatencyModel, requests: dict | None = None) -> dict:
    """The checkpoint's two requests answered with the fit: seconds of prefill, decode and total per request."""
    out = {}
    for name, (prompt_len, n_out) in (requests or CHECKPOINT_REQUESTS).items():
        ttft = latency.ttft(prompt_len)
        out[name] = dict(prompt_tokens=prompt_len, output_tokens=n_out, ttft_s=ttft,
                         decode_s=latency.decode_time(prompt_len, n_out), total_s=latency.total(prompt_len, n_out),
                         extrapolated=latency.extrapolates(prompt_len, n_out))
    out["slower"] = max(out, key=lambda k: out[k]["total_s"])
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


def ab_values(ab: dict) -> dict:
    """checkpoint_ab's answer as flat values to record."""
    return {"ab_slower": ab["slower"], "output_token_in_prompt_tokens": ab["exchange"]["output_in_prompt_tokens"],
            "output_token_exchange_context": ab["exchange"]["context"],
            **{f"ab_{name}_{k}": ab[name][k] for name in CHECKPOINT_REQUESTS
               for k in ("total_s", "ttft_s", "decode_s", "extrapolated")}}


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
