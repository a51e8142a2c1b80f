"""Greedy is not deterministic: where the low bits of a logit come from, and when they change a token. A right-padded
batch row is mathematically the lone prompt (the causal mask hides the padding), but its matrix multiplies see another
shape, pick another blocking, and add the same products in another order."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from course.engine.generate import generate


def sum_orders(n: int = 100_000, seed: int = 0) -> tuple[dict[str, float], float]:
    """n random float32 values (about the size of a dot product's products) summed in four orders, and the exact sum
    (math.fsum in float64)."""
    if n < 2:
        raise ValueError(f"n must be >= 2 values to have an order, got {n}")
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return ({"left to right": float(np.cumsum(x)[-1]),  # cumsum adds one value after another
             "right to left": float(np.cumsum(x[::-1])[-1]), "pairwise (np.sum)": float(np.sum(x)),
             "smallest first": float(np.cumsum(x[np.argsort(np.abs(x))])[-1])}, math.fsum(x.astype(np.float64)))


@dataclass
class LogitDiff:
    """How two computations of the same next-token logits [V] differ."""
    label: str
    max_abs_diff: float
    n_differ: int  # logits whose float32 bits differ
    n_total: int
    median_ulps: float  # median |Δ| of the differing logits, in units of the float32 spacing at each logit
    same_argmax: bool

    def summary(self) -> str:
        return (f"{self.label}: {self.n_differ:,} of {self.n_total:,} logits differ, max |Δ| {self.max_abs_diff:.1e} "
                f"(median {self.median_ulps:.0f} ULP); same argmax: {'yes' if self.same_argmax else 'NO'}.")


def compare_logits(a: torch.Tensor, b: torch.Tensor, label: str = "") -> LogitDiff:
    """Compare two [V] logit vectors bit for bit."""
    if a.shape != b.shape or a.dim() != 1:
        raise ValueError(f"a and b must be [V] logit vectors of one shape, got {tuple(a.shape)}, {tuple(b.shape)}")
    a, b = a.float(), b.float()
    diff, differ = (a - b).abs(), a != b
    ulp = torch.nextafter(a.abs(), torch.tensor(float("inf"))) - a.abs()  # float32 spacing at each logit
    return LogitDiff(label, float(diff.max()), int(differ.sum()), a.numel(),
                     float((diff / ulp)[differ].median()) if bool(differ.any()) else 0.0,
                     int(a.argmax()) == int(b.argmax()))


# Two longer chat requests to share the batch with: the prompt under test gets right-padded to their length.
BATCH_MATES = ("Write a long poem about the sea, the wind and the ships that sail across it at night.",
               "Explain in two sentences why the sky is blue during the day.")


@torch.inference_mode()
def alone_vs_batched(model, prompt_ids: list[int], other_ids: list[list[int]], pad_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits [V] for `prompt_ids` run alone, and as the last row of a batch right-padded with `pad_id`,
    read at this prompt's own last position, which the padding cannot reach."""
    if not prompt_ids or not other_ids:
        raise ValueError("prompt_ids must be non-empty and other_ids must hold at least one prompt")
    alone = model(torch.tensor([prompt_ids], device=model.device), last_only=True)[0]  # [V]
    rows = list(other_ids) + [prompt_ids]
    batch = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long, device=model.device)  # [B, T_max]
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r, device=model.device)  # right padding
    batched = model(batch)[-1, len(prompt_ids) - 1]  # [V] this prompt's last real position
    return alone.float().cpu(), batched.float().cpu()


def greedy_gaps(model, prompt_ids: list[int], n_new: int = 24) -> list[float]:
    """Top-1 minus top-2 logit at each of n_new greedy steps: how far each argmax was from flipping."""
    gen = generate(model, prompt_ids, n_new, temperature=0.0, keep_logits=True)  # no EOS: always n_new steps
    return [float(top2[0] - top2[1]) for top2 in (torch.topk(logits.float(), 2).values for logits in gen.logits)]


def flip_rate_estimate(gaps: list[float], noise: float, window: float = 0.1) -> float:
    """Rough chance per greedy token that noise of size `noise` flips the argmax: near zero the gaps' density is about
    flat, so P(gap < noise) ≈ noise × (share of gaps below `window`) / window. An order of magnitude only."""
    if noise < 0 or window <= 0 or not gaps:
        raise ValueError(f"need noise >= 0, window > 0 and some gaps; got {noise}, {window}, {len(gaps)} gaps")
    below = max(sum(g < window for g in gaps) / len(gaps), 1 / len(gaps))  # at least one gap's worth: never 0
    return min(1.0, below / window * noise)


def gaps_text(gaps: list[float], noise: float) -> str:
    closest = min(gaps)
    return "\n".join([f"greedy steps                    {len(gaps)}",
                      f"closest top-two gap             {closest:.4f}"
                      + (f" ({closest / noise:,.0f}× the noise)" if noise else ""),
                      f"steps with a gap within noise   {sum(g <= noise for g in gaps)}",
                      f"rough flip chance per token     {flip_rate_estimate(gaps, noise):.0e}"])


def gaps_figure(gaps: list[float], noise: float):
    """Histogram of top-1 minus top-2 logit gaps (log scale), with the measured noise marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    positive = [x for x in (*gaps, noise) if x > 0]
    lo = min(positive) / 2 if positive else 1e-8
    ax.hist([max(g, lo) for g in gaps], bins=np.logspace(np.log10(lo), np.log10(max(max(gaps), lo) * 1.5), 40))
    ax.set(xscale="log", xlabel="logit gap between the top two tokens at a greedy step", ylabel="steps")
    if noise > 0:  # a noise of 0 (bit-identical runs) has no place on a log axis
        ax.axvline(noise, color="#d62728", ls="--", label=f"alone-vs-batched noise {noise:.1e}")
        ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


@dataclass
class NearTie:
    """The top token a and a runner-up b, with b's logit raised by `nudge` in both runs so they almost tie."""
    text_a: str
    text_b: str
    nudge: float
    margin_alone: float  # logit(a) - logit(b) after the nudge, alone: > 0 means a wins
    margin_batched: float
    continuation_alone: str  # the pick and greedy text after it
    continuation_batched: str

    @property
    def flipped(self) -> bool:
        return (self.margin_alone > 0) != (self.margin_batched > 0)

    def __str__(self) -> str:
        return "\n".join([f"{self.text_b!r} raised by {self.nudge:.4f} in both runs. Margin of {self.text_a!r} over "
                          f"it: alone {self.margin_alone:+.1e}, batched {self.margin_batched:+.1e}.",
                          f"alone  : …{self.continuation_alone}", f"batched: …{self.continuation_batched}"])


def near_tie(model, tokenizer, prompt_ids: list[int], alone: torch.Tensor, batched: torch.Tensor,
             n_continue: int = 12, candidates: int = 10) -> NearTie:
    """Pair the top token a with the likeliest runner-up b (of the top `candidates`) whose gap to a changed between
    the runs, raise b by the mean of the two gaps so one run picks a by a hair and the other b, and let greedy
    decoding continue from each pick. A prompt where the model is truly torn is this without the nudge."""
    a64, b64 = alone.double(), batched.double()
    top = torch.topk(alone, candidates).indices.tolist()
    a = top[0]
    b = next((t for t in top[1:] if (a64[a] - a64[t]) != (b64[a] - b64[t])), top[1])
    gap_alone, gap_batched = float(a64[a] - a64[b]), float(b64[a] - b64[b])
    nudge = (gap_alone + gap_batched) / 2  # runs that agree bit for bit tie exactly: both pick the lower id

    def continue_after(margin: float) -> str:
        token = a if margin > 0 else b if margin < 0 else min(a, b)  # an exact tie goes to the lower id, as argmax
        gen = generate(model, prompt_ids + [token], n_continue, temperature=0.0, eos_id=tokenizer.eos_id)
        return tokenizer.decode([token] + gen.tokens, skip_special=True)

    return NearTie(tokenizer.token_text(a), tokenizer.token_text(b), nudge, gap_alone - nudge, gap_batched - nudge,
                   continue_after(gap_alone - nudge), continue_after(gap_batched - nudge))
