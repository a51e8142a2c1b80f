"""Lesson 05 (serving many requests): the batch sweep, the cache as the limit, and the paper numbers.

    batch_sweep          ms per decode step and total tokens/s for B = 1, 2, 4, … at each context, measured
                         on the real model, next to the prediction max((W + B·KV(C)) / bandwidth, B·F / FLOP/s)
    critical_batch       B*, where the FLOPs catch up with the bytes on paper; doubling_batch: where the
                         predicted step costs twice B = 1's (at most 2·B* when one sequence is memory-bound)
    find_knee            the knee: the first B whose step costs at least twice the one-sequence baseline (the
                         faster of B = 1 and B = 2), the same rule for the measured and the predicted steps
    plot_batch_sweep     step time and tokens/s against B; plot_batch_roofline: the decode points move right
    published_gpu_table  Llama-2-7B decode on an A100 / H100 on paper, from the vendors' published specs
    requests_that_fit    how many requests fit a memory budget, from the formula (Llama-2-7B, Llama-3.1-8B/70B
                         on 80 GB; none past a model's context window)
    cache_vs_weights     where B·T tokens of cache overtake the weights

The paged cache, the scheduler and their pictures are in course.lessons.serving_runs.
Letters as everywhere: B batch, C tokens already cached, L layers, H_kv KV heads, D_h head dim, W weight bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from course.engine.config import ModelConfig
from course.engine.kv_cache import KVCache
from course.engine.positions import Positions
from course.measure.costs import GB, Cost, GiB, decode_cost, kv_bytes_per_token, weights_bytes, weights_read_bytes
from course.measure.roofline import Machine
from course.measure.timing import Stopwatch, Timing
from course.lessons.wording import duration
from course.measure.display import Printed

# ---------------------------------------------------------------------------------------------
# Published accelerator specs (dense, no sparsity), for the paper version of the sweep
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accelerator:
    name: str
    bytes_per_s: float  # HBM bandwidth
    flops_per_s: float  # dense BF16/FP16 tensor-core FLOP/s
    memory_bytes: int
    source: str

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the two roofs meet."""
        return self.flops_per_s / self.bytes_per_s

    def machine(self) -> Machine:
        return Machine(self.name, "bf16", self.bytes_per_s, self.flops_per_s)


GPUS = {
    "A100": Accelerator("A100 SXM4 80GB", 2.039e12, 312e12, 80 * GB,
                        "NVIDIA A100 Tensor Core GPU datasheet: 2,039 GB/s HBM2e, 312 TFLOPS BF16 (dense)"),
    "H100": Accelerator("H100 SXM5 80GB", 3.35e12, 989e12, 80 * GB,
                        "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, 989 TFLOPS BF16 (dense; 1,979 "
                        "with sparsity)"),
}


# ---------------------------------------------------------------------------------------------
# The cost of one batched decode step, on paper
# ---------------------------------------------------------------------------------------------

def _decode_cost(config: ModelConfig, context: int, dtype_bytes: float, batch: int = 1) -> Cost:
    """decode_cost, also for paper contexts past the model's trained length (C = 4,096 on a 4k model)."""
    return decode_cost(config, context, dtype_bytes, batch=batch, within_context=False)


def batch_cost(config: ModelConfig, batch: int, context: int, dtype_bytes: float = 4) -> Cost:
    """One step for B sequences: the weights are read once, each sequence reads its own cache and does its own FLOPs."""
    return _decode_cost(config, context, dtype_bytes, batch)


def predicted_step(machine: Machine, cost: Cost) -> float:
    """max((W + B·KV) / bandwidth, B·F / FLOP/s), seconds."""
    return max(cost.bytes / machine.bytes_per_s, cost.flops / machine.flops_per_s)


def critical_batch(machine: Machine, one: Cost) -> float:
    """B* from one sequence's step cost: the B at which B·F / FLOP/s catches up with (W + B·KV) / bandwidth.

    Solve B·F/P = (W + B·K)/BW: B* = (W/BW) / (F/P − K/BW). When one sequence's cache takes longer to read
    than its FLOPs take to do (K/BW ≥ F/P), adding sequences adds bytes as fast as FLOPs: never compute-bound (inf).
    """
    per_seq = one.flops / machine.flops_per_s - one.kv_bytes / machine.bytes_per_s
    return math.inf if per_seq <= 0 else (one.weight_bytes / machine.bytes_per_s) / per_seq


def doubling_batch(machine: Machine, one: Cost, factor: float = 2.0) -> float:
    """The (fractional) B at which the predicted step reaches `factor` × B = 1's: the knee on paper.

    The step is max((W + B·K)/BW, B·F/P); each term reaches factor × step(1) at its own B, the smaller wins.
    Past B* the step grows in proportion to B, so when B = 1 is memory-bound this lies at or below 2·B*."""
    target = factor * predicted_step(machine, one)
    by_flops = target * machine.flops_per_s / one.flops
    by_bytes = (target * machine.bytes_per_s - one.weight_bytes) / one.kv_bytes if one.kv_bytes else math.inf
    return min(by_flops, by_bytes)


def predicted_critical_batch(machine: Machine, config: ModelConfig, context: int, dtype_bytes: float = 4) -> float:
    """critical_batch for a model at context C; inf when compute never catches up."""
    return critical_batch(machine, _decode_cost(config, context, dtype_bytes))


def predicted_doubling_batch(machine: Machine, config: ModelConfig, context: int, dtype_bytes: float = 4) -> float:
    """doubling_batch for a model at context C."""
    return doubling_batch(machine, _decode_cost(config, context, dtype_bytes))


def critical_batch_sentence(machine: Machine, config: ModelConfig, context: int, dtype_bytes: float = 4) -> str:
    """One context on paper: W, KV(C) and F at this C, the critical batch B* and the knee (the step doubles)."""
    one = _decode_cost(config, context, dtype_bytes)
    b_star, doubles = critical_batch(machine, one), doubling_batch(machine, one)
    when = (f"critical batch B* ≈ {b_star:.1f} (compute catches up with memory)" if math.isfinite(b_star) else
            "no critical batch (one sequence's cache takes longer to read than its FLOPs take)")
    return (f"C = {context:,}: W = {one.weight_bytes / 1e6:,.0f} MB, KV(C) = {one.kv_bytes / 1e6:,.1f} MB and "
            f"F = {one.flops / 1e9:.3f} GFLOP per sequence -> {when}; the step costs twice B = 1's (the knee) "
            f"at B ≈ {doubles:.1f}.")


@dataclass(frozen=True)
class Knee:
    """Where a sweep's step first cost find_knee's factor × the one-sequence baseline (batch None: no step did)."""
    batch: int | None
    ratio: float  # the knee's step ÷ baseline; with no knee, the largest B's
    baseline_s: float  # the faster of B = 1 and B = 2: a step for two sequences cannot truly cost less than one
    last_batch: int  # the largest B measured
    below: tuple[int, float] | None = None  # the B just before the knee and its ratio: how close it came

    @property
    def found(self) -> bool:
        return self.batch is not None


def find_knee(batches: Sequence[int], seconds: Sequence[float], factor: float = 2.0) -> Knee:
    """The knee of a sweep: the first B > 1 whose step takes at least `factor` × the baseline.

    The baseline is the faster of B = 1 and B = 2: two sequences do at least one sequence's work, so when B = 2
    ran faster, B = 1 caught noise, and against it the 2× line would sit too high (the knee too late, or hidden)."""
    pairs = sorted(zip(batches, seconds))
    if not pairs or pairs[0][0] != 1:
        raise ValueError(f"a sweep for a knee must start at B = 1, got batches {sorted(batches)}")
    baseline = min(s for b, s in pairs if b <= 2)
    ratios = [(b, s / baseline) for b, s in pairs]
    for i, (b, r) in enumerate(ratios):
        if b > 1 and r >= factor:
            return Knee(b, r, baseline, pairs[-1][0], ratios[i - 1])
    return Knee(None, ratios[-1][1], baseline, pairs[-1][0])


def ratio_text(ratio: float) -> str:
    """A ratio to 2 decimals, truncated so it never rounds across the 2× line (1.997 prints 1.99×, not 2.00×)."""
    return f"{math.floor(ratio * 100 + 1e-9) / 100:.2f}×"


# ---------------------------------------------------------------------------------------------
# The measured sweep
# ---------------------------------------------------------------------------------------------

@dataclass
class SweepPoint:
    batch: int
    context: int
    timing: Timing
    predicted_s: float
    cost: Cost

    @property
    def seconds(self) -> float:
        return self.timing.median

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.seconds

    @property
    def achieved_flops_per_s(self) -> float:
        return self.cost.flops / self.seconds


@dataclass
class BatchSweep(Printed):
    machine: Machine
    points: list[SweepPoint] = field(default_factory=list)

    @property
    def contexts(self) -> list[int]:
        return sorted({p.context for p in self.points})

    def at(self, context: int) -> list[SweepPoint]:
        rows = sorted((p for p in self.points if p.context == context), key=lambda p: p.batch)
        if not rows:
            raise ValueError(f"no points at context {context}; the sweep has {self.contexts}")
        return rows

    def best(self, context: int) -> SweepPoint:
        return max(self.at(context), key=lambda p: p.tokens_per_s)

    def speedup(self, context: int) -> float:
        """Total decode tokens/s at the best batch ÷ at B = 1."""
        rows = self.at(context)
        return self.best(context).tokens_per_s / rows[0].tokens_per_s

    def knee_detail(self, context: int, predicted: bool = False) -> Knee:
        """find_knee on the measured steps at `context` (predicted=True: on the predicted steps, same rule)."""
        rows = self.at(context)
        return find_knee([p.batch for p in rows], [p.predicted_s if predicted else p.seconds for p in rows])

    def knee(self, context: int) -> int:
        """The first measured B whose step took at least twice the baseline (the faster of B = 1 and B = 2);
        the largest B measured when none did (see knee_found)."""
        k = self.knee_detail(context)
        return k.batch if k.found else k.last_batch

    def predicted_knee(self, context: int) -> int:
        k = self.knee_detail(context, predicted=True)
        return k.batch if k.found else k.last_batch

    def knee_found(self, context: int) -> bool:
        """Did some measured step cost twice the baseline? If not, knee() is only the largest B measured."""
        return self.knee_detail(context).found

    def predicted_knee_found(self, context: int) -> bool:
        return self.knee_detail(context, predicted=True).found

    def _knee_gap(self, context: int) -> str:
        """A clause joining the measured knee to the predicted one when both were found: at the earlier of the two
        B, the measured step ÷ its baseline against the predicted step ÷ its baseline is what put them apart."""
        k, pk = self.knee_detail(context), self.knee_detail(context, predicted=True)
        if not (k.found and pk.found):
            return ""
        if k.batch == pk.batch:
            return "; the measured knee came where predicted"
        at = min(k.batch, pk.batch)
        row = next(p for p in self.at(context) if p.batch == at)
        meas, pred = row.seconds / k.baseline_s, row.predicted_s / pk.baseline_s
        word, grew = ("later", "less") if k.batch > pk.batch else ("earlier", "more")
        return (f"; the measured knee came {word} because the measured step grew {grew} than the predicted one: at "
                f"B = {at} it cost {ratio_text(meas)} its baseline against {ratio_text(pred)} on paper "
                f"(pred/meas {row.predicted_s / row.seconds:.2f})")

    def knee_sentence(self, context: int) -> str:
        """The knee measured and predicted by the same rule, with the ratios that decided it, and how the
        predicted one relates to the critical batch B*."""
        k, pk = self.knee_detail(context), self.knee_detail(context, predicted=True)
        batches = [p.batch for p in self.at(context)]
        base = (f"C = {context:,}: baseline {duration(k.baseline_s)} (the faster of B = 1 and B = 2)" if 2 in batches
                else f"C = {context:,}: baseline {duration(k.baseline_s)} (B = 1)")
        if k.found:
            close = (f"; B = {k.below[0]} had reached {ratio_text(k.below[1])}" if k.below and k.below[0] > 1 else "")
            measured = (f"{base}; the knee, the first B at ≥ 2× it, came at B = {k.batch} ({ratio_text(k.ratio)})"
                        f"{close}.")
        else:
            measured = (f"{base}; no B up to {k.last_batch}, the largest measured, cost 2× it "
                        f"({ratio_text(k.ratio)} there): the knee lies beyond it.")
        one = self.at(context)[0].cost
        b_star, doubles = critical_batch(self.machine, one), doubling_batch(self.machine, one)
        why = (f"{doubles / b_star:.1f}× the critical batch B* ≈ {b_star:.1f} of section 1" if math.isfinite(b_star)
               else "from the cache alone: compute never catches up, there is no critical batch")
        if pk.found:
            earlier = [b for b in batches if b < pk.batch]
            first_past = pk.batch >= doubles and (not earlier or earlier[-1] < doubles)
            where = (f", the first measured B at or past B ≈ {doubles:.1f}, where its step doubles" if first_past
                     else f"; on paper its step doubles at B ≈ {doubles:.1f}")
            predicted = f"The prediction, by the same rule: B = {pk.batch}{where} ({why}){self._knee_gap(context)}."
        else:
            predicted = (f"The prediction, by the same rule, puts it beyond B = {pk.last_batch}"
                         f"{'' if k.found else ' too'}: its step doubles at B ≈ {doubles:.1f} ({why}).")
        return f"{measured} {predicted}"

    def values(self) -> dict:
        out = {}
        for c in self.contexts:
            rows = self.at(c)
            out[str(c)] = dict(batch=[p.batch for p in rows], ms=[p.seconds * 1e3 for p in rows],
                               predicted_ms=[p.predicted_s * 1e3 for p in rows],
                               round_ms=[[t * 1e3 for t in p.timing.times] for p in rows],
                               tokens_per_s=[p.tokens_per_s for p in rows],
                               intensity=[p.cost.intensity for p in rows],
                               knee=self.knee(c), predicted_knee=self.predicted_knee(c),
                               knee_found=self.knee_found(c), predicted_knee_found=self.predicted_knee_found(c),
                               knee_baseline_ms=self.knee_detail(c).baseline_s * 1e3,
                               knee_ratio=self.knee_detail(c).ratio,
                               best_batch=self.best(c).batch, speedup=self.speedup(c))
        return out

    def __str__(self) -> str:
        lines = [f"{'C':>5} {'B':>4} {'ms/step':>8} {'predicted':>9} {'pred/meas':>9} {'tokens/s':>9} {'FLOP/B':>7}"]
        for p in sorted(self.points, key=lambda p: (p.context, p.batch)):
            lines.append(f"{p.context:>5} {p.batch:>4} {p.seconds * 1e3:>8.1f} {p.predicted_s * 1e3:>9.1f} "
                         f"{p.predicted_s / p.seconds:>9.2f} {p.tokens_per_s:>9.1f} {p.cost.intensity:>7.2f}")
        return "\n".join(lines)


def _check_batches(batches: Sequence[int]) -> list[int]:
    batches = sorted(set(batches))
    if not batches or batches[0] != 1 or any(isinstance(b, bool) or not isinstance(b, int) for b in batches):
        raise ValueError(f"batches must be whole numbers starting at 1 (the baseline), e.g. [1, 2, 4, 8], got {batches}")
    return batches


@torch.inference_mode()
def batch_sweep(model, machine: Machine, contexts: Sequence[int] = (64, 512),
                batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), rounds: int = 3, progress: bool = True,
                max_cache_bytes: int = 4 * GiB) -> BatchSweep:
    """Time one decode step of B sequences, each with C tokens cached, for every (C, B).

    One cache of max(B) rows per context, filled with random keys and values (a step's time does not depend on
    what the cache holds, only on how much of it is read); batch B decodes its first B rows, each sequence at its
    own position (course.engine.positions.Positions), exactly as the serving loop does. Steps are timed in
    rounds, every B once per round, so a change in the machine's load hits every batch size alike.
    """
    from tqdm.auto import tqdm

    batches = _check_batches(batches)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    config, dev = model.config, model.device
    dtype_bytes = torch.empty((), dtype=model.dtype).element_size()
    biggest = batches[-1] * (max(contexts) + 1) * kv_bytes_per_token(config, dtype_bytes)
    if biggest > max_cache_bytes:
        raise ValueError(f"B = {batches[-1]} at C = {max(contexts)} needs a {biggest / GiB:.1f} GiB cache, over "
                         f"max_cache_bytes = {max_cache_bytes / GiB:.1f} GiB; use smaller batches or contexts")
    sweep = BatchSweep(machine)
    for C in contexts:
        cache = KVCache(config, batch=batches[-1], max_seq_len=C + 1, dtype=model.dtype, device=dev)
        for layer in cache.layers:
            layer.k.normal_()
            layer.v.normal_()
        steps = []
        for B in batches:
            at = Positions.per_sequence([C] * B, 1, rows=list(range(B)), device=dev)
            token = torch.ones(B, 1, dtype=torch.long, device=dev)
            steps.append(lambda at=at, token=token: model(token, start_pos=at, cache=cache, last_only=True))
        timings = [Timing() for _ in batches]
        for step in tqdm(steps, desc=f"warm-up at C={C} (a compiled engine compiles here, once)", unit="batch",
                         disable=not progress):
            step()
        for _ in tqdm(range(rounds), desc=f"batch sweep at C={C}", unit="round", disable=not progress):
            for step, timing in zip(steps, timings):
                with Stopwatch(dev) as sw:
                    step()
                timing.times.append(sw.seconds)
        for B, timing in zip(batches, timings):
            cost = batch_cost(config, B, C, dtype_bytes)
            sweep.points.append(SweepPoint(B, C, timing, predicted_step(machine, cost), cost))
        del cache
    return sweep


def sweep_sentences(sweep: BatchSweep) -> list[str]:
    """What the sweep showed, from its numbers: per context its best batch, its knee and the prediction's error;
    then the two contexts compared."""
    out = []
    for c in sweep.contexts:
        rows, best = sweep.at(c), sweep.best(c)
        one = rows[0]
        verdict = ("still rising at the largest batch measured" if best.batch == rows[-1].batch
                   else f"falling again beyond B = {best.batch}")
        out.append(f"C = {c:,}: one step for B = 1 took {duration(one.seconds)} ({one.tokens_per_s:.1f} tokens/s); "
                   f"the best batch, B = {best.batch}, took {duration(best.seconds)} per step for "
                   f"{best.tokens_per_s:.0f} tokens/s in total, {sweep.speedup(c):.1f}× B = 1, {verdict}.")
        out.append(sweep.knee_sentence(c))
        ratios = [(p.predicted_s / p.seconds, p.batch) for p in rows]  # the table's pred/meas column
        (lo, b_lo), (hi, b_hi) = min(ratios), max(ratios)
        out.append(f"C = {c:,}: predicted ÷ measured (pred/meas above) ran from {lo:.2f} (B = {b_lo}) to {hi:.2f} "
                   f"(B = {b_hi}); "
                   + ("the bytes-and-FLOPs prediction is a floor here, the rest is per-operation overhead."
                      if hi <= 1 else "at some batches the step beat the prediction (the probes undershoot "
                                      "what the model's own kernels reach)."))
    if len(sweep.contexts) > 1:
        out.append(context_sentence(sweep))
    return out


def _speedup_range(rows: list[SweepPoint], best: SweepPoint) -> tuple[float, float]:
    """Lowest and highest speedup (best batch ÷ B = 1, in tokens/s) any pair of the timed rounds gives."""
    one = rows[0].timing.times
    return (best.batch * min(one) / max(best.timing.times), best.batch * max(one) / min(best.timing.times))


def context_sentence(sweep: BatchSweep) -> str:
    """Did the longer context gain less from batching, and is that the cache's doing? Only said when the data
    supports it: B = 1 no faster at the longer context (a longer cache cannot make a step cheaper), and the two
    speedups apart even at the extremes of the timed rounds. Otherwise the B = 1 times are too noisy to compare."""
    short, long_ = sweep.contexts[0], sweep.contexts[-1]
    a, b = sweep.speedup(short), sweep.speedup(long_)
    one_s, one_l = sweep.at(short)[0], sweep.at(long_)[0]
    lo_a, hi_a = _speedup_range(sweep.at(short), sweep.best(short))
    lo_b, hi_b = _speedup_range(sweep.at(long_), sweep.best(long_))
    def ms(s: float) -> str:  # one decimal: two close B = 1 times must not print the same
        return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"

    ones = f"B = 1 took {ms(one_l.seconds)} at C = {long_:,} against {ms(one_s.seconds)} at C = {short:,}"
    if one_l.seconds < one_s.seconds:
        return (f"Batching gained {b:.1f}× at C = {long_:,} against {a:.1f}× at C = {short:,}, but {ones}: a longer "
                "cache cannot make a step cheaper, so the B = 1 times are too noisy to compare and the two ratios "
                "say nothing about the cache here.")
    apart = hi_b < lo_a if b < a else hi_a < lo_b
    if not apart:
        return (f"Batching gained {b:.1f}× at C = {long_:,} against {a:.1f}× at C = {short:,} ({ones}), but across "
                f"the timed rounds the ratios ran {lo_b:.1f}–{hi_b:.1f}× and {lo_a:.1f}–{hi_a:.1f}×: the B = 1 "
                "times are too noisy to tell the two apart.")
    if b < a:
        return (f"The longer context paid less for batching: {b:.1f}× at C = {long_:,} against {a:.1f}× at "
                f"C = {short:,} ({ones}; the ratios ran {lo_b:.1f}–{hi_b:.1f}× and {lo_a:.1f}–{hi_a:.1f}× across "
                "the timed rounds) — each sequence's own cache is read at every step, so a bigger batch adds bytes.")
    return (f"The longer context gained more from batching here: {b:.1f}× at C = {long_:,} against {a:.1f}× at "
            f"C = {short:,} ({ones}).")


    return out


def plot_batch_sweep(sweep: BatchSweep):
    """Left: ms per step against B, measured and predicted. Right: total tokens/s against B."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for c, color in zip(sweep.contexts, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        rows = sweep.at(c)
        bs = [p.batch for p in rows]
        left.plot(bs, [p.seconds * 1e3 for p in rows], "o-", color=color, label=f"C = {c:,}: measured")
        left.plot(bs, [p.predicted_s * 1e3 for p in rows], "--", color=color, alpha=0.7, label=f"C = {c:,}: predicted")
        if sweep.knee_found(c):  # no line where no step doubled: the largest B is not a knee
            left.axvline(sweep.knee(c), color=color, ls=":", lw=1)
        right.plot(bs, [p.tokens_per_s for p in rows], "o-", color=color, label=f"C = {c:,}")
        right.plot(bs, [p.batch / p.predicted_s for p in rows], "--", color=color, alpha=0.7)
    left.set(xscale="log", yscale="log", xlabel="batch B (sequences per step)", ylabel="ms per decode step",
             title="one step (dotted: the knee, where it first costs 2× the B = 1 baseline)")
    right.set(xscale="log", yscale="log", xlabel="batch B", ylabel="total decode tokens/s",
              title="throughput (dashed: predicted)")
    for ax in (left, right):
        ax.set_xticks([p.batch for p in sweep.at(sweep.contexts[0])])
        ax.set_xticklabels([p.batch for p in sweep.at(sweep.contexts[0])])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_batch_roofline(sweep: BatchSweep):
    """The roofline of lesson 01 with every (C, B) point at its intensity: batching moves decode to the right."""
    import matplotlib.pyplot as plt
    import numpy as np

    m = sweep.machine
    xs = [p.cost.intensity for p in sweep.points]
    x = np.logspace(math.log10(min(min(xs), m.ridge) / 3), math.log10(max(max(xs), m.ridge) * 3), 200)
    fig, ax = plt.subplots(figsize=(8, 4.4))
    ax.plot(x, np.minimum(m.flops_per_s, m.bytes_per_s * x) / 1e9, "k-", lw=2,
            label=f"roof: min({m.bytes_per_s / 1e9:.0f} GB/s × intensity, {m.flops_per_s / 1e9:.0f} GFLOP/s)")
    ax.axvline(m.ridge, color="gray", ls=":", lw=1)
    ax.text(m.ridge, m.flops_per_s / 1e9 * 0.5, f" ridge {m.ridge:.1f} FLOP/byte", fontsize=8, color="gray")
    for c, color in zip(sweep.contexts, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        rows = sweep.at(c)
        ax.plot([p.cost.intensity for p in rows], [p.achieved_flops_per_s / 1e9 for p in rows], "s-", color=color,
                label=f"decode, C = {c:,} (measured)")
        for p in rows:
            ax.annotate(f"B={p.batch}", (p.cost.intensity, p.achieved_flops_per_s / 1e9), fontsize=7,
                        xytext=(3, -10), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte moved)", ylabel="achieved GFLOP/s",
           title=f"Batching moves decode right on the roofline ({m.device}, {m.dtype})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Paper: Llama-2-7B on an A100 / H100
# ---------------------------------------------------------------------------------------------

def published_gpu_table(model: str = "llama-2-7b", contexts: Sequence[int] = (512, 4096),
                        batches: Sequence[int] = (1, 8, 32, 64, 128, 256), gpus: Sequence[str] = ("A100", "H100"),
                        dtype_bytes: float = 2) -> list[dict]:
    """Predicted decode step, tokens/s and whether the batch fits in memory, for a model on published GPUs."""
    config = ModelConfig.from_name(model)
    rows = []
    for g in gpus:
        gpu = GPUS[g]
        m = gpu.machine()
        for c in contexts:
            for b in batches:
                cost = batch_cost(config, b, c, dtype_bytes)
                s = predicted_step(m, cost)
                rows.append(dict(gpu=g, context=c, batch=b, ms=s * 1e3, tokens_per_s=b / s,
                                 intensity=cost.intensity, bound="compute" if cost.intensity >= gpu.ridge else "memory",
                                 memory_gb=(weights_bytes(config, "fp16") + cost.kv_bytes) / GB,
                                 fits=weights_bytes(config, "fp16") + cost.kv_bytes <= gpu.memory_bytes))
    return rows


def paper_summary(model: str = "llama-2-7b", context: int = 4096, dtype_bytes: float = 2) -> list[str]:
    """Ridge, weights-only critical batch and the critical batch at `context`, per GPU, as sentences."""
    config = ModelConfig.from_name(model)
    one = decode_cost(config, 1, dtype_bytes)
    flop_per_weight_byte = one.flops / one.weight_bytes  # a batch of B sequences: B × this, weights only
    out = []
    for gpu in GPUS.values():
        m = gpu.machine()
        b_star = predicted_critical_batch(m, config, context, dtype_bytes)
        at_ctx = ("never: each sequence's cache takes longer to read than its FLOPs take to do" if math.isinf(b_star)
                  else f"B ≈ {b_star:.0f}")
        out.append(f"{gpu.name}: ridge {gpu.ridge:.0f} FLOP/byte, so with the weights alone ({flop_per_weight_byte:.2f} "
                   f"FLOP per weight byte per sequence) decode turns compute-bound near B ≈ "
                   f"{gpu.ridge / flop_per_weight_byte:.0f}; at C = {context:,} with {config.name}'s cache: {at_ctx}.")
    return out


# ---------------------------------------------------------------------------------------------
# The cache as the limit
# ---------------------------------------------------------------------------------------------

def requests_that_fit(models: Sequence[str] = ("llama-2-7b", "llama-3.1-8b", "llama-3.1-70b"),
                      contexts: Sequence[int] = (4096, 32768), memory_bytes: int = 80 * GB, dtype: str = "fp16",
                      weights_dtype: str | None = None) -> list[dict]:
    """How many sequences of each context fit in one GPU's memory after the weights (0 if the weights don't fit).

    dtype is the cache's; weights_dtype the weights' (default: the same). A context past the model's own window
    is marked within_context=False and counts no request: the model cannot serve it."""
    from course.measure.costs import _config

    rows = []
    for name in models:
        w = weights_bytes(name, weights_dtype or dtype)
        per_token = kv_bytes_per_token(name, dtype)
        free, window = memory_bytes - w, _config(name).max_seq_len
        for c in contexts:
            within = c <= window
            rows.append(dict(model=name, context=c, weights_gb=w / GB, kv_gb_per_request=per_token * c / GB,
                             requests=int(free // (per_token * c)) if free > 0 and within else 0,
                             weights_fit=free > 0, within_context=within, max_context=window,
                             weights_dtype=weights_dtype or dtype, memory_gb=memory_bytes / GB))
    return rows


def fit_sentences(rows: list[dict]) -> list[str]:
    """One sentence per (model, context); one per model when its weights alone do not fit."""
    out, said = [], set()
    for r in rows:
        w = f"{r['weights_gb']:.1f} GB of {r['weights_dtype'].upper()} weights"
        if not r["weights_fit"]:
            if r["model"] not in said:
                out.append(f"{r['model']}: its {w} alone exceed {r['memory_gb']:.0f} GB — no request fits on one "
                           f"GPU (split it over several, or quantise the weights).")
                said.add(r["model"])
        elif not r.get("within_context", True):
            out.append(f"{r['model']} at C = {r['context']:,}: beyond its {r['max_context']:,}-token context "
                       "window: it cannot serve a request that long.")
        else:
            n = r["requests"]
            fit = "no request fits" if n == 0 else "1 request fits" if n == 1 else f"{n} requests fit"
            out.append(f"{r['model']} at C = {r['context']:,}: {r['kv_gb_per_request']:.2f} GB of cache per request, "
                       f"so {fit} beside {w}.")
    return out


def cache_vs_weights(config: ModelConfig, dtype_bytes: float = 4) -> dict:
    """Tokens of cache (B·T, summed over the batch) whose bytes equal the weights' bytes."""
    w = weights_read_bytes(config, dtype_bytes)
    per_token = kv_bytes_per_token(config, dtype_bytes)
    return dict(weight_bytes=w, kv_bytes_per_token=per_token, crossover_tokens=math.ceil(w / per_token))


def crossover_sentence(crossing: dict, request_tokens: int = 512) -> str:
    """cache_vs_weights in words, with the number of `request_tokens`-token requests that reaches the crossover
    (rounded up: fewer would stay below it)."""
    n = crossing["crossover_tokens"]
    return (f"{crossing['kv_bytes_per_token'] / 1024:.0f} KiB of cache per token against "
            f"{crossing['weight_bytes'] / 2**20:.0f} MiB of weights: past B·T = {n:,} resident tokens (e.g. "
            f"{math.ceil(n / request_tokens)} requests of {request_tokens} tokens) the cache is the bigger of the two.")


def plot_cache_vs_weights(config: ModelConfig, contexts: Sequence[int] = (512, 2048, 8192),
                          batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), dtype_bytes: float = 4):
    """Bytes of cache against B for a few contexts, with the weights as a flat line: where they cross."""
    import matplotlib.pyplot as plt

    info = cache_vs_weights(config, dtype_bytes)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for c in contexts:
        ax.plot(batches, [b * c * info["kv_bytes_per_token"] / GiB for b in batches], "o-", label=f"cache, T = {c:,}")
    ax.axhline(info["weight_bytes"] / GiB, color="k", lw=2, label=f"weights ({info['weight_bytes'] / GiB:.2f} GiB)")
    ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="GiB",
           title=f"{config.name}: the cache overtakes the weights at B·T ≈ {info['crossover_tokens']:,} tokens")
    ax.set_xticks(list(batches))
    ax.set_xticklabels(list(batches))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_batch_mask(lengths: Sequence[int] = (5, 9, 3, 7)):
    """One decode step for sequences of different lengths, drawn from the real Positions.per_sequence mask: row b is
    sequence b's one new query, columns are cache positions; it sees its own keys (blue) and its new token
    (red), while the positions past its own end (grey: left from longer rows, or never written) are masked."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    at = Positions.per_sequence(list(lengths), 1)
    mask = at.mask[:, 0, 0]  # [B, kv_len]: True where the query may attend
    fig, ax = plt.subplots(figsize=(0.42 * at.kv_len + 2.2, 0.42 * at.batch + 1.2))
    for b, n in enumerate(lengths):
        for t in range(at.kv_len):
            color = "tab:red" if t == n else ("#9ecae1" if bool(mask[b, t]) else "#e0e0e0")
            ax.add_patch(Rectangle((t, -b), 0.9, 0.9, facecolor=color, edgecolor="black", lw=0.4))
        ax.text(-0.3, -b + 0.45, f"seq {b}: {n} cached", ha="right", va="center", fontsize=8)
    ax.set(xlim=(-3.2, at.kv_len), ylim=(-at.batch + 0.8, 1.4), aspect="equal")
    ax.set_title("one batched decode step: each row's new token (red) attends to its own cached keys (blue);\n"
                 "positions past its own end (grey) are masked", fontsize=9)
    ax.text(0, 1.05, "cache position →", fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    return fig
