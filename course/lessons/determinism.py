"""Greedy is not deterministic: where the low bits of a logit come from, and when they change a token.

    sum_orders()              one float sum, added up in different orders, gives different answers
    alone_vs_batched(...)     the real model's logits for one prompt, alone and as one row of a padded batch
    across_threads(...)       the same prompt with different torch thread counts
    compare_logits(a, b)      max |Δ|, how many logits differ, Δ in units in the last place (ULPs)
    greedy_gaps(...)          the gap between the top two logits at every step of greedy decoding
    near_tie(...)             a tie closer than the noise: the two runs pick different tokens, then diverge

Mathematically the batched row equals the lone prompt: right padding sits *after* the real tokens and the
causal mask stops every real position from attending to it. Numerically the matrix multiplies see a
different shape, pick a different blocking, and add the same products in a different order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from course.engine.device import torch_threads
from course.engine.generate import generate


# -- 1. float addition is not associative -------------------------------------------------------------------
@dataclass
class SumOrders:
    """The same float32 numbers summed four ways, against the exact sum (math.fsum in float64)."""
    n: int
    left_to_right: float
    right_to_left: float
    pairwise: float  # numpy's np.sum: blocked pairwise summation
    sorted_small_first: float
    exact: float

    @property
    def sums(self) -> dict[str, float]:
        return {"left to right": self.left_to_right, "right to left": self.right_to_left,
                "pairwise (np.sum)": self.pairwise, "smallest first": self.sorted_small_first}

    @property
    def spread(self) -> float:
        """Largest minus smallest of the four float32 sums."""
        return max(self.sums.values()) - min(self.sums.values())


def sum_orders(n: int = 100_000, seed: int = 0) -> SumOrders:
    """Sum n random float32 values (about the size of a dot product's products) in four orders."""
    if n < 2:
        raise ValueError(f"n must be >= 2 values to have an order, got {n}")
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return SumOrders(
        n=n,
        left_to_right=float(np.cumsum(x)[-1]),  # cumsum adds strictly one value after another
        right_to_left=float(np.cumsum(x[::-1])[-1]),
        pairwise=float(np.sum(x)),
        sorted_small_first=float(np.cumsum(x[np.argsort(np.abs(x))])[-1]),
        exact=math.fsum(x.astype(np.float64)),
    )


def three_term_examples() -> list[tuple[str, float, str, float]]:
    """Tiny cases to read by eye: (expression, value, the other grouping, its value)."""
    big, one = np.float32(1e8), np.float32(1.0)
    return [
        ("(0.1 + 0.2) + 0.3", (0.1 + 0.2) + 0.3, "0.1 + (0.2 + 0.3)", 0.1 + (0.2 + 0.3)),
        ("float32: (1e8 + 1) - 1e8", float((big + one) - big), "float32: (1e8 - 1e8) + 1", float((big - big) + one)),
    ]


# -- 2. the real model: alone vs in a batch, one thread vs two --------------------------------------------
@dataclass
class LogitDiff:
    """How two computations of the same next-token logits [V] differ."""
    label: str
    max_abs_diff: float
    n_differ: int  # logits whose float32 bits differ
    n_total: int
    median_ulps: float  # median |Δ| of the differing logits, in units of the float32 spacing at each logit
    same_argmax: bool
    top2_gap: float  # logit of the top token minus the runner-up (first computation)

    @property
    def frac_differ(self) -> float:
        return self.n_differ / self.n_total

    def summary(self) -> str:
        return (f"{self.label}: max |Δ| = {self.max_abs_diff:.2e} (median {self.median_ulps:.0f} ULP), "
                f"{self.n_differ:,} of {self.n_total:,} logits differ ({self.frac_differ:.0%}), "
                f"same argmax: {self.same_argmax}, top-2 gap {self.top2_gap:.3f}")


def compare_logits(a: torch.Tensor, b: torch.Tensor, label: str = "") -> LogitDiff:
    """Compare two [V] logit vectors bit for bit."""
    if a.shape != b.shape or a.dim() != 1:
        raise ValueError(f"a and b must be [V] logit vectors of the same shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    ulp = (torch.nextafter(a.abs(), torch.tensor(float("inf"))) - a.abs())  # float32 spacing at each logit
    differ = a != b
    top2 = torch.topk(a, 2).values
    return LogitDiff(label=label, max_abs_diff=float(diff.max()), n_differ=int(differ.sum()),
                     n_total=a.numel(),
                     median_ulps=float((diff / ulp)[differ].median()) if bool(differ.any()) else 0.0,
                     same_argmax=int(a.argmax()) == int(b.argmax()), top2_gap=float(top2[0] - top2[1]))


# Two longer chat requests to share the batch with: the prompt under test gets right-padded to their length.
BATCH_MATES = ("Write a long poem about the sea, the wind and the ships that sail across it at night.",
               "Explain in two sentences why the sky is blue during the day.")


@torch.inference_mode()
def alone_vs_batched(model, prompt_ids: list[int], other_ids: list[list[int]], pad_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits [V] for `prompt_ids` run alone, and as one row of a right-padded batch.

    The batch holds the other prompts and this one, every row padded on the right to the longest with
    `pad_id`. The logits are read at this prompt's own last position, which the padding cannot reach.
    """
    if not prompt_ids or not other_ids:
        raise ValueError("prompt_ids must be non-empty and other_ids must hold at least one prompt")
    device = model.device
    alone = model(torch.tensor([prompt_ids], device=device), last_only=True)[0]  # [V]
    rows = list(other_ids) + [prompt_ids]
    T_max = max(len(r) for r in rows)
    batch = torch.full((len(rows), T_max), pad_id, dtype=torch.long, device=device)  # [B, T_max]
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r, device=device)  # right padding
    logits = model(batch)  # [B, T_max, V]
    batched = logits[-1, len(prompt_ids) - 1]  # [V] this prompt's last real position
    return alone.float().cpu(), batched.float().cpu()


@torch.inference_mode()
def across_threads(model, prompt_ids: list[int], threads: tuple[int, int] = (1, 2)
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits [V] computed with two different torch thread counts (CPU)."""
    out = []
    for n in threads:
        with torch_threads(n):
            out.append(model(torch.tensor([prompt_ids], device=model.device), last_only=True)[0].float().cpu())
    return out[0], out[1]


def compare_threads(model, prompt_ids: list[int], threads: tuple[int, int] = (1, 2)) -> LogitDiff | None:
    """The logits at two CPU thread counts compared (across_threads), or None off the CPU: a GPU's kernels
    do not run on torch's CPU threads, so their count cannot change its logits."""
    if torch.device(model.device).type != "cpu":
        return None
    return compare_logits(*across_threads(model, prompt_ids, threads), f"{threads[0]} vs {threads[1]} CPU threads")


def threads_summary(result: LogitDiff | None, device) -> str:
    """compare_threads' result in words: its summary and whether the thread count mattered, or why it was skipped."""
    if result is None:
        return (f"CPU thread count: not compared on {device}, whose kernels do not run on torch's CPU threads "
                "(what changes a GPU's low bits is the batch's shape, above)")
    mattered = ("so the thread count changed the low bits here" if result.n_differ else
                "so on this CPU the thread count did not change a single bit (its kernels split the work "
                "without changing the order of the additions)")
    return f"{result.summary()}\n  {mattered}"


# -- 3. when do low bits change a token? -------------------------------------------------------------------
def greedy_gaps(model, prompt_ids: list[int], n_new: int = 24) -> list[float]:
    """Top-1 minus top-2 logit at each of n_new greedy steps: how far each argmax was from flipping."""
    gen = generate(model, prompt_ids, n_new, temperature=0.0, keep_logits=True)  # no EOS: always n_new steps
    gaps = []
    for logits in gen.logits:
        top2 = torch.topk(logits.float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return gaps


def gaps_over(model, prompts: list[list[int]], n_new: int = 20) -> list[float]:
    """greedy_gaps for several prompts, pooled."""
    from tqdm.auto import tqdm

    from course.measure.display import working

    with working(f"Decoding {n_new} greedy tokens for each of {len(prompts)} prompts, keeping every step's logits",
                 "several seconds on a 2-core CPU"):
        return [g for ids in tqdm(prompts, desc="prompts decoded", unit="prompt", leave=False)
                for g in greedy_gaps(model, ids, n_new)]


@dataclass
class NearTie:
    """Two tokens a and b, with b's logit raised by `nudge` in both runs so they almost tie."""
    token_a: int
    token_b: int
    text_a: str
    text_b: str
    nudge: float  # added to token b's logit in both computations
    margin_alone: float  # logit(a) - logit(b) after the nudge, alone: > 0 means a wins
    margin_batched: float  # the same in the batched run: < 0 means b wins
    pick_alone: int
    pick_batched: int
    continuation_alone: str  # greedy text after each pick
    continuation_batched: str

    @property
    def flipped(self) -> bool:
        return self.pick_alone != self.pick_batched

    def verdict(self) -> str:
        """What the constructed tie did in this run, from the picks."""
        if self.flipped:
            return ("Same prompt, same weights, temperature 0, two stories: the noise alone decided which token "
                    "won, and greedy decoding followed it.")
        return ("The two runs picked the same token even at the constructed tie (their logits agreed on this pair "
                "to the last bit), so greedy decoding told one story here.")


def near_tie(model, tokenizer, prompt_ids: list[int], alone: torch.Tensor, batched: torch.Tensor,
             n_continue: int = 12, candidates: int = 10) -> NearTie:
    """Build the near-tie the two runs disagree on, and let greedy decoding continue from each pick.

    Pair the top token a with the most likely runner-up b (among the top `candidates`) whose gap to a
    changed between the runs. Raising b's logit by the same constant in both runs puts it exactly halfway
    between the two gaps, so one run picks a by a hair and the other picks b. A real prompt where the
    model is torn between two tokens is this situation without the nudge.
    """
    a64, b64 = alone.double(), batched.double()
    top = torch.topk(alone, candidates).indices.tolist()
    a = top[0]
    deltas = {b: float((a64[a] - a64[b]) - (b64[a] - b64[b])) for b in top[1:]}
    b = next((t for t in top[1:] if deltas[t] != 0), top[1])
    gap_alone, gap_batched = float(a64[a] - a64[b]), float(b64[a] - b64[b])
    # If the runs agree bit for bit on every pair, b ties a exactly in both, both pick the lower id: no flip.
    nudge = (gap_alone + gap_batched) / 2
    margin_alone, margin_batched = gap_alone - nudge, gap_batched - nudge  # logit(a) - logit(b) after the nudge

    def pick(margin: float) -> int:  # argmax of the pair; an exact tie goes to the lower id, as torch.argmax
        return a if margin > 0 else b if margin < 0 else min(a, b)

    pick_alone, pick_batched = pick(margin_alone), pick(margin_batched)

    def continue_from(token: int) -> str:
        gen = generate(model, prompt_ids + [token], n_continue, temperature=0.0, eos_id=tokenizer.eos_id)
        return tokenizer.decode([token] + gen.tokens, skip_special=True)

    from course.measure.display import working

    with working(f"Decoding {n_continue} greedy tokens on from each run's pick at the near-tie",
                 "a few seconds on a 2-core CPU"):
        continuation_alone, continuation_batched = continue_from(pick_alone), continue_from(pick_batched)
    return NearTie(token_a=a, token_b=b, text_a=tokenizer.token_text(a), text_b=tokenizer.token_text(b),
                   nudge=nudge, margin_alone=margin_alone, margin_batched=margin_batched,
                   pick_alone=pick_alone, pick_batched=pick_batched,
                   continuation_alone=continuation_alone, continuation_batched=continuation_batched)


def flip_rate_estimate(gaps: list[float], noise: float, window: float = 0.1) -> float:
    """Rough chance per greedy token that noise of size `noise` flips the argmax.

    Near zero the gap's density is about flat, so P(gap < noise) ≈ noise × (share of gaps below `window`)
    / window. An order of magnitude, not a measurement: the sample of gaps is small.
    """
    if noise < 0 or window <= 0 or not gaps:
        raise ValueError(f"need noise >= 0, window > 0 and some gaps; got {noise}, {window}, {len(gaps)} gaps")
    below = sum(g < window for g in gaps) / len(gaps)
    density = max(below, 1 / len(gaps)) / window  # at least one gap's worth: an upper-side guess, never 0
    return min(1.0, density * noise)


def flip_sentence(gaps: list[float], noise: float, rate: float) -> str:
    """The gaps of real greedy steps against the measured noise, and the rough flip chance, in words."""
    if not gaps:
        raise ValueError("need at least one greedy gap")
    within = sum(g <= noise for g in gaps)
    closest = min(gaps)
    if noise == 0:
        head = (f"The two runs agreed bit for bit (noise 0), so none of the {len(gaps)} greedy steps could flip "
                "here; a different batch or machine can still move the low bits.")
    elif within:
        head = (f"{within} of {len(gaps)} greedy steps had a top-two gap within the noise ({noise:.1e}): at "
                f"{'that step' if within == 1 else 'those steps'} this noise could flip the token.")
    else:
        head = (f"None of the {len(gaps)} greedy steps came within the noise: the closest gap, {closest:.4f}, "
                f"is {closest / noise:,.0f}× the noise ({noise:.1e}).")
    odds = "unlikely" if rate < 1e-3 else "not rare" if rate < 0.1 else "likely"
    return f"{head} Rough chance per greedy token ≈ {rate:.0e}: a flip of any single token is {odds} at this noise."
