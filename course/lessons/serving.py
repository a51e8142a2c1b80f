"""Lesson 05 (serving many requests): the batch sweep against its prediction, step(B) ≈ max((W + B·KV(C)) /
bandwidth, B·F / FLOP/s) from the machine profile, its knee (where the step first costs twice B = 1's) and its
physics gate; the same arithmetic for published models and GPUs. The serving runs are in serving_runs.
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
from course.measure import gates
from course.measure.costs import (GB, Cost, GiB, _config, decode_cost, kv_bytes_per_token, weights_bytes,
                                  weights_read_bytes)
from course.measure.display import Report, verdict
from course.measure.results import record_gated
from course.measure.roofline import Machine
from course.measure.timing import ReadProbe, Stopwatch, Timing

KNEE_TOLERANCE = 0.5  # the knee sits between two measured batch sizes a factor 2 apart: ±50 % is one step of the sweep


# The vendors' datasheets: HBM bandwidth and dense BF16 tensor-core FLOP/s, 80 GB each (lesson 05's paper table)
GPUS = {"A100": Machine("A100 SXM4 80GB", "bf16", 2.039e12, 312e12),
        "H100": Machine("H100 SXM5 80GB", "bf16", 3.35e12, 989e12)}


def roofs(prof) -> Machine:
    """The machine profile's bandwidth and FLOP/s (course.measure.machine) as a roofline Machine."""
    return Machine(prof.device, prof.dtype, prof.bandwidth_gb_s * 1e9, prof.gflop_s * 1e9)


def batch_cost(config: ModelConfig, batch: int, context: int, dtype_bytes: float = 4) -> Cost:
    """One step for B sequences: the weights read once, each sequence's own cache and FLOPs (C may pass the
    model's window: paper arithmetic)."""
    return decode_cost(config, context, dtype_bytes, batch=batch, within_context=False)


def predicted_step(machine: Machine, cost: Cost) -> float:
    """max((W + B·KV) / bandwidth, B·F / FLOP/s), seconds."""
    return max(cost.bytes / machine.bytes_per_s, cost.flops / machine.flops_per_s)


def critical_batch(machine: Machine, one: Cost) -> float:
    """B* from one sequence's cost: B·F/P = (W + B·K)/BW gives B* = (W/BW) / (F/P − K/BW); inf when one sequence's
    cache takes longer to read than its FLOPs take (adding sequences then adds bytes as fast as FLOPs)."""
    per_seq = one.flops / machine.flops_per_s - one.kv_bytes / machine.bytes_per_s
    return math.inf if per_seq <= 0 else (one.weight_bytes / machine.bytes_per_s) / per_seq


def doubling_batch(machine: Machine, one: Cost, factor: float = 2.0) -> float:
    """The (fractional) B at which the predicted step reaches factor × B = 1's: the knee on paper. Each term of the
    max reaches it at its own B; the smaller wins. When B = 1 is memory-bound this lies at or below 2·B*."""
    target = factor * predicted_step(machine, one)
    by_flops = target * machine.flops_per_s / one.flops
    by_bytes = (target * machine.bytes_per_s - one.weight_bytes) / one.kv_bytes if one.kv_bytes else math.inf
    return min(by_flops, by_bytes)


def knee(batches: Sequence[int], seconds: Sequence[float], factor: float = 2.0) -> float | None:
    """The measured knee: where the step first reaches factor × B = 1's, interpolated linearly in B between the two
    measured batches around it (past the flat part a step grows about linearly in B); None if no step reached it."""
    pairs = sorted(zip(batches, seconds))
    if not pairs or pairs[0][0] != 1:
        raise ValueError(f"a sweep for a knee must start at B = 1, got batches {sorted(batches)}")
    target = factor * pairs[0][1]
    for (b0, s0), (b1, s1) in zip(pairs, pairs[1:]):
        if s1 >= target:
            return b1 if s1 <= s0 else b0 + (b1 - b0) * (target - s0) / (s1 - s0)
    return None


def paper_table(machine: Machine, config: ModelConfig, contexts: Sequence[int], dtype_bytes: float = 4) -> str:
    """Per context, on paper: the bytes and FLOPs of one sequence's step, the critical batch and the knee."""
    lines = [f"{'C':>6} {'W (MB)':>7} {'KV(C) (MB)':>10} {'F (GFLOP)':>9} {'B*':>6} {'knee on paper':>13}"]
    for c in contexts:
        one = batch_cost(config, 1, c, dtype_bytes)
        b_star = critical_batch(machine, one)
        lines.append(f"{c:>6,} {one.weight_bytes / 1e6:>7,.0f} {one.kv_bytes / 1e6:>10.1f} {one.flops / 1e9:>9.3f} "
                     f"{b_star if math.isfinite(b_star) else math.inf:>6.1f} {doubling_batch(machine, one):>13.1f}")
    return "\n".join(lines)


@dataclass
class SweepPoint:
    batch: int
    context: int
    timing: Timing
    predicted_s: float
    cost: Cost

    seconds = property(lambda self: self.timing.median)
    tokens_per_s = property(lambda self: self.batch / self.seconds)


@dataclass
class BatchSweep:
    machine: Machine
    points: list[SweepPoint] = field(default_factory=list)
    engine: str = "eager"  # "compiled" when every step ran through torch.compile (course.engine.fast.FastModel)

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
        return self.best(context).tokens_per_s / self.at(context)[0].tokens_per_s

    def knee(self, context: int) -> float | None:
        rows = self.at(context)
        return knee([p.batch for p in rows], [p.seconds for p in rows])

    def predicted_knee(self, context: int) -> float:
        return doubling_batch(self.machine, self.at(context)[0].cost)

    def rules(self, prof) -> list:
        """The physics gate: no step under its bandwidth floor (the profile's, when measured quiet), none cheaper than
        a smaller batch's, and no batch of B making more than B times B = 1's tokens per second (beyond 10 % noise)."""
        out = []
        for c in self.contexts:
            rows = self.at(c)
            out += [gates.not_below_floor(p.seconds * 1e3, prof.gate_floor_ms(p.cost.bytes),
                                          f"B = {p.batch} at C = {c}") for p in rows]
            out += [gates.not_cheaper(a.seconds * 1e3, b.seconds * 1e3, f"B = {a.batch}", f"B = {b.batch} at C = {c}")
                    for a, b in zip(rows, rows[1:])]
            out += [gates.batch_gain(p.batch, p.tokens_per_s / rows[0].tokens_per_s) for p in rows]
        return out

    def values(self) -> dict:
        return {str(c): dict(batch=[p.batch for p in self.at(c)], ms=[p.seconds * 1e3 for p in self.at(c)],
                             predicted_ms=[p.predicted_s * 1e3 for p in self.at(c)],
                             tokens_per_s=[p.tokens_per_s for p in self.at(c)],
                             intensity=[p.cost.intensity for p in self.at(c)], knee=self.knee(c),
                             predicted_knee=self.predicted_knee(c), best_batch=self.best(c).batch,
                             speedup=self.speedup(c)) for c in self.contexts}


@torch.inference_mode()
def batch_sweep(model, machine: Machine, contexts: Sequence[int] = (64, 512),
                batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), rounds: int = 3, progress: bool = True,
                max_cache_bytes: int = 4 * GiB) -> BatchSweep:
    """Time one decode step of B sequences, each with C tokens cached, for every (C, B), each a median of `rounds`.

    One cache of max(B) rows per context, filled with random keys and values (a step's time depends on how much is
    read, not on what); batch B decodes its first B rows, each sequence at its own position (Positions.per_sequence),
    as a server does. Every B is timed once per round, so a change in the machine's load hits all of them alike."""
    from tqdm.auto import tqdm

    batches = sorted(set(batches))
    if not batches or batches[0] != 1 or any(isinstance(b, bool) or not isinstance(b, int) for b in batches):
        raise ValueError(f"batches must be whole numbers starting at 1 (the baseline), e.g. [1, 2, 4, 8], got "
                         f"{batches}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    config, dev = model.config, model.device
    dtype_bytes = torch.empty((), dtype=model.dtype).element_size()
    biggest = batches[-1] * (max(contexts) + 1) * kv_bytes_per_token(config, dtype_bytes)
    if biggest > max_cache_bytes:
        raise ValueError(f"B = {batches[-1]} at C = {max(contexts)} needs a {biggest / GiB:.1f} GiB cache, over "
                         f"max_cache_bytes = {max_cache_bytes / GiB:.1f} GiB; use smaller batches or contexts")
    sweep = BatchSweep(machine)
    ReadProbe(dev)()  # a read beside the sweep: its floor gate holds steps to the fastest read seen (gate_floor_ms)
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
        for step in steps:  # warm-up: a compiled engine compiles here, once
            step()
        timings = [Timing() for _ in batches]
        for _ in tqdm(range(rounds), desc=f"batch sweep at C={C}", unit="round", disable=not progress, leave=False):
            for step, timing in zip(steps, timings):
                with Stopwatch(dev) as sw:
                    step()
                timing.times.append(sw.seconds)
        for B, timing in zip(batches, timings):
            cost = batch_cost(config, B, C, dtype_bytes)
            sweep.points.append(SweepPoint(B, C, timing, predicted_step(machine, cost), cost))
        del cache
    sweep.engine = "compiled" if getattr(model, "compiled", False) else "eager"  # a failed compile falls back
    return sweep


def sweep_report(run: gates.Measured, prof) -> Report:
    """The sweep at its first context as predicted against measured, recorded only when it passed its gate. Its
    compiled one-sequence step goes into the machine profile then too, unless lesson 1 already put its own there
    (the whole step as one graph, often faster): the course keeps one compiled figure, and this says how they differ."""
    from course.measure.machine import remember

    sweep: BatchSweep = run.value
    c = sweep.contexts[0]
    rows, k, pk = sweep.at(c), sweep.knee(c), sweep.predicted_knee(c)
    one, best = rows[0], sweep.best(c)
    record_gated("batch_sweep", run, sweep.values())
    step_key = "batch_step_ms_1" if sweep.engine == "compiled" else "eager_batch_step_ms_1"
    for key, value in (("batch_speedup", sweep.speedup(c)), ("batch_best", best.batch), (step_key, one.seconds * 1e3),
                       ("batch_knee", None if k is None else round(k))):
        if value is not None or not run.ok:  # no knee within the sweep: nothing to quote
            record_gated(key, run, value)
    whole = prof.decode_ms.get("compiled")
    if run.ok and sweep.engine == "compiled" and whole is None:
        remember(prof, "compiled", one.seconds * 1e3)
    if run.ok and k is not None:
        headline = (f"At C = {c}, the step first cost 2× one sequence's at B ≈ {k:.0f}, predicted {pk:.0f}: "
                    f"{verdict(pk, k, KNEE_TOLERANCE)[1]}. B = {best.batch} made {sweep.speedup(c):.1f}× the "
                    "tokens/s.")
    elif run.ok:
        headline = (f"At C = {c}, no step up to B = {rows[-1].batch} cost 2× one sequence's (predicted knee "
                    f"{pk:.0f}). B = {best.batch} made {sweep.speedup(c):.1f}× the tokens/s.")
    else:
        headline = run.headline("")
    return Report([(f"step, B = {p.batch} ({sweep.engine})", p.predicted_s * 1e3, run.shown(p.seconds * 1e3), "ms")
                   for p in rows]
                  + [("knee: first 2× B = 1's step", pk, run.shown(f"> {rows[-1].batch}" if k is None else k), "")],
                  headline, key="batch_sweep", details=[run.notice,
        f"Predicted: max(bytes ÷ {prof.bandwidth_gb_s:.1f} GB/s, FLOPs ÷ {prof.gflop_s:.0f} GFLOP/s), this machine's "
        "profile.",
        "The real step also pays a fixed cost per operation, which the batch shares too: that moves the knee later.",
        f"The knee is interpolated between the two measured batches around 2× the B = 1 step ({one.seconds * 1e3:.1f} "
        "ms).",
        "Each step is the median of its rounds; every batch size is timed once per round.",
        f"The profile's compiled step, lesson 1's one graph for the whole step, is {whole:.1f} ms; this engine runs "
        "groups of layers, so that one graph serves every batch size." if whole and run.ok else ""])


def score_knee(prediction, run: gates.Measured, context: int) -> None:
    """Score the learner's knee (course.teach.predict) against the measured one; a flagged sweep is not scored, and
    neither is a sweep whose steps never doubled (the knee lies past it)."""
    k = run.value.knee(context)
    if run.ok and k is None:
        print(f"No step up to B = {run.value.at(context)[-1].batch} cost twice B = 1's: the knee lies past the sweep, "
              "so the prediction is not scored.")
    else:
        prediction.check(k if run.ok else None)


def plot_batch_sweep(sweep: BatchSweep):
    """Left: ms per step against B, measured and predicted. Right: total tokens/s against B."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for c, color in zip(sweep.contexts, ("tab:blue", "tab:orange", "tab:green")):
        rows = sweep.at(c)
        bs = [p.batch for p in rows]
        left.plot(bs, [p.seconds * 1e3 for p in rows], "o-", color=color, label=f"C = {c:,}: measured")
        left.plot(bs, [p.predicted_s * 1e3 for p in rows], "--", color=color, alpha=0.7, label=f"C = {c:,}: predicted")
        if sweep.knee(c) is not None:
            left.axvline(sweep.knee(c), color=color, ls=":", lw=1)
        right.plot(bs, [p.tokens_per_s for p in rows], "o-", color=color, label=f"C = {c:,}")
        right.plot(bs, [p.batch / p.predicted_s for p in rows], "--", color=color, alpha=0.7)
    left.set(ylabel="ms per decode step", title="one step (dotted: the knee, 2× the B = 1 step)")
    right.set(ylabel="total decode tokens/s", title="throughput (dashed: predicted)")
    for ax in (left, right):
        ax.set(xscale="log", yscale="log", xlabel="batch B (sequences per step)")
        ax.set_xticks([p.batch for p in sweep.at(sweep.contexts[0])], [p.batch for p in sweep.at(sweep.contexts[0])])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def requests_that_fit(models: Sequence[str] = ("llama-2-7b", "llama-3.1-8b", "llama-3.1-70b"),
                      contexts: Sequence[int] = (4096, 32768), memory_bytes: int = 80 * GB, dtype: str = "fp16",
                      weights_dtype: str | None = None) -> list[dict]:
    """How many requests of each context fit in one GPU's memory beside the weights. dtype is the cache's,
    weights_dtype the weights' (default: the same). A context past the model's window counts no request."""
    rows = []
    for name in models:
        w, per_token = weights_bytes(name, weights_dtype or dtype), kv_bytes_per_token(name, dtype)
        free, window = memory_bytes - w, _config(name).max_seq_len
        for c in contexts:
            rows.append(dict(model=name, context=c, weights_gb=w / GB, kv_gb_per_request=per_token * c / GB,
                             requests=int(free // (per_token * c)) if free > 0 and c <= window else 0,
                             weights_fit=free > 0, within_context=c <= window, max_context=window,
                             weights_dtype=weights_dtype or dtype))
    return rows


def fit_table(rows: list[dict]) -> str:
    lines = [f"{'model':14} {'weights':>12} {'C':>7} {'cache/request':>13} {'requests':>9}"]
    for r in rows:
        n = (r["requests"] if r["weights_fit"] and r["within_context"] else
             "past window" if r["weights_fit"] else "weights > GPU")
        lines.append(f"{r['model']:14} {r['weights_gb']:>6.1f} GB {r['weights_dtype']:>4} {r['context']:>7,} "
                     f"{r['kv_gb_per_request']:>10.2f} GB {n:>9}")
    return "\n".join(lines)


def cache_vs_weights(config: ModelConfig, dtype_bytes: float = 4) -> dict:
    """Tokens of cache (B·T, summed over the batch) whose bytes equal the weights' bytes."""
    w, per_token = weights_read_bytes(config, dtype_bytes), kv_bytes_per_token(config, dtype_bytes)
    return dict(weight_bytes=w, kv_bytes_per_token=per_token, crossover_tokens=math.ceil(w / per_token))
