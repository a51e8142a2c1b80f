"""What every bench item shares: the sizes, the Context (device, models, probes), side-by-side timing, targets.

An item is a function `run(ctx) -> dict` wrapped in an `Item` (its title, its Markdown table, its targets) and
named in bench/__init__.py's ITEMS. The dict has "status" ("ok", "skipped", "not available", "error") and, when
not ok, a "reason"; an ok one usually has "rows". A row whose compiled engine fell back to eager is refused: it
carries "refused" (the reason) and no figures, so no table, summary or target can read a number from it.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable

STATUSES = ("ok", "skipped", "not available", "error")

# Sizes: a full run, and --quick (seconds: the smoke test). decode_* and batching time context 64, as lesson 05 does.
FULL = dict(decode_contexts=[64, 1024], prefill_tokens=[32, 128, 512, 1024], rounds=5, steps_per_round=4,
            batch_rounds=8, batches=[1, 2, 4, 8, 16, 32, 64], bandwidth_bytes=1 << 30, matmul_n=1024,
            hf_new_tokens=64, hf_rounds=3, cache_prompt=128, cache_new=256, cache_rounds=2, load_rounds=3,
            widget_moves=40, sweep_rounds=3, trace_requests=32, trace_prompt=(8, 24), trace_new=(2, 8),
            trace_long_new=(48, 96), serve_batch=8, serve_rounds=3, mix_requests=200, mix_prompt=(16, 512),
            mix_new=(16, 512), mix_max_seq_len=2048)
QUICK = dict(decode_contexts=[16], prefill_tokens=[8, 32], rounds=2, steps_per_round=2,
             batch_rounds=2, batches=[1, 2, 4], bandwidth_bytes=64 << 20, matmul_n=256, hf_new_tokens=8,
             hf_rounds=1, cache_prompt=8, cache_new=8, cache_rounds=1, load_rounds=1, widget_moves=6,
             sweep_rounds=1, trace_requests=6, trace_prompt=(3, 8), trace_new=(2, 4), trace_long_new=(8, 12),
             serve_batch=3, serve_rounds=1, mix_requests=40, mix_prompt=(4, 64), mix_new=(4, 64), mix_max_seq_len=128)
CONTEXT = 64  # the cached tokens of decode_floor's and decode_batch's steps


@dataclass
class Target:
    """A bound one item's figure should meet: `measure(item_result)` gives (value or None, note)."""
    name: str
    what: str
    op: str  # "<=" or ">="
    bound: float
    measure: Callable[[dict], tuple]


@dataclass
class Item:
    run: Callable  # (ctx) -> dict
    title: str
    slow: bool = False  # --quick leaves it out
    columns: dict | None = None  # Markdown table: header → format string over a row, or a function of the row
    text: Callable[[dict], str] | None = None  # a paragraph under the table, from the item's dict
    targets: list[Target] = field(default_factory=list)


def cell(spec, row: dict) -> str:
    """One Markdown table cell: a format string over the row's keys, or a function of the row."""
    return str(spec(row)) if callable(spec) else spec.format(**row)


def fmt(value, spec) -> str:
    """A number for a table, or — when it was not measured."""
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


class Context:
    """What the items share: the device, sizes, the loaded models and the bandwidth / FLOP/s probes."""

    def __init__(self, device, sizes, compile, log, model_name="course", options: dict | None = None):
        self.device, self.sizes, self.compile, self.log = device, sizes, compile, log
        self.real = model_name == "course"  # False: a random tiny model (tests of the suite itself)
        self.options = dict(options or {})  # command-line settings for particular items (e.g. grade_samples)
        self._models, self._fast, self.tokenizer = {}, {}, None
        self.bandwidth_samples: list[float] = []  # bytes/s, one per probe
        self.flops_samples: dict[str, list[float]] = {}

    @property
    def quick(self) -> bool:
        return self.sizes is QUICK

    @staticmethod
    def progress(iterable, desc):
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, leave=False, file=sys.stderr)

    def model(self, dtype: str = "float32"):
        if dtype not in self._models:
            from course.engine.device import pick_dtype

            if self.real:
                from course.engine.tokenizer import load_tokenizer
                from course.engine.weights import load_model

                self._models[dtype] = load_model(device=self.device, dtype=dtype)
                self.tokenizer = self.tokenizer or load_tokenizer()
            else:
                from course.engine.model import tiny_model

                self._models[dtype] = tiny_model(seed=0).to(device=self.device, dtype=pick_dtype(dtype))
        return self._models[dtype]

    def fast(self, dtype: str = "float32", any_shape: bool = False):
        """The compiled engine over the eager model's own weights: FastModel(model), or the serving lesson's
        FastModel(model, any_shape=True) (one graph for every batch, context and paged batch)."""
        if (dtype, any_shape) not in self._fast:
            from course.engine.fast import FastModel

            self._fast[(dtype, any_shape)] = FastModel(self.model(dtype), any_shape=any_shape)
        return self._fast[(dtype, any_shape)]

    def engines(self, dtype: str, any_shape: bool = False) -> dict:
        """The eager model and, unless --quick or --no-compile, the compiled engine beside it."""
        engines = {"eager": self.model(dtype)}
        if self.compile and not self.quick:
            engines["compiled, any shape" if any_shape else "compiled"] = self.fast(dtype, any_shape)
        return engines

    def probe_bandwidth(self) -> float:
        from course.measure.timing import memory_bandwidth

        probe = memory_bandwidth(self.device, nbytes=self.sizes["bandwidth_bytes"], repeats=3)
        self.bandwidth_samples.append(probe.bytes_per_s)
        return probe.bytes_per_s

    def probe_flops(self, dtype: str) -> float:
        from course.engine.device import pick_dtype
        from course.measure.timing import matmul_flops

        f = matmul_flops(self.device, n=self.sizes["matmul_n"], dtype=pick_dtype(dtype), repeats=3)
        self.flops_samples.setdefault(dtype, []).append(f)
        return f

    @property
    def bandwidth(self) -> float:
        if not self.bandwidth_samples:
            self.probe_bandwidth()
        return statistics.median(self.bandwidth_samples)

    def hardware(self) -> dict:
        out = {}
        if self.bandwidth_samples:
            out["memory_bandwidth_bytes_per_s"] = summary(self.bandwidth_samples)
            out["memory_bandwidth_probe_bytes"] = self.sizes["bandwidth_bytes"]
        if self.flops_samples:
            out["matmul_flops_per_s"] = {d: summary(v) for d, v in self.flops_samples.items()}
            out["matmul_n"] = self.sizes["matmul_n"]
        return out


def side_by_side(steps: dict, device, rounds: int, per_round: int, before_round=None) -> dict:
    """Time every step `per_round` times a round, the steps taking turns, round after round: a burst of load from
    another program hits them all alike. Returns {name: [[seconds] per round]}. before_round(r) runs first in
    each round (a bandwidth probe, a thread count), and then one untimed step: the first step after a probe
    streamed its buffer through memory measured slower than the next ones."""
    from course.measure.timing import Stopwatch

    times = {name: [] for name in steps}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
            next(iter(steps.values()))()
        for name, step in steps.items():
            ts = []
            for _ in range(per_round):
                with Stopwatch(device) as sw:
                    step()
                ts.append(sw.seconds)
            times[name].append(ts)
    return times


def median_of(rounds: list[list[float]]) -> float:
    return statistics.median(t for ts in rounds for t in ts)


def paired_ratio(rounds: list[list[float]], base: list[list[float]]) -> float:
    """Time ÷ base time, side by side: the median over rounds of (this round's median ÷ the base's median in the
    same round). A shared host's speed drifts between rounds; within a round both saw the same machine."""
    if len(rounds) != len(base) or not rounds:
        raise ValueError(f"paired_ratio needs the same rounds on both sides; got {len(rounds)} and {len(base)}")
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(rounds, base))


def fell_back(engine) -> str | None:
    """Why a compiled engine is not what its label says (it fell back to eager), or None. Eager engines: None."""
    compiled = getattr(engine, "compiled", None)
    if compiled is None:
        return None
    step = getattr(engine, "step", engine)
    return None if compiled else (getattr(step, "fallback", None) or "it runs eagerly")


def refused(label: str, engine, **keys) -> dict | None:
    """The row for a compiled engine that fell back to eager: its label and why, no figures (None if it did not)."""
    why = fell_back(engine)
    return None if why is None else dict(engine=label, refused=f"{label} fell back to eager: {why}", **keys)


def best(item: dict, keep, key: str, pick) -> tuple:
    """(the best row's `key`, its engine) over the rows `keep` accepts, for a target; (None, "") when none."""
    rows = [r for r in item.get("rows", []) if "refused" not in r and keep(r)]
    if not rows:
        return None, "not measured"
    row = pick(rows, key=lambda r: r[key])
    return row[key], row.get("engine", "")

