"""The line that shows decode is bandwidth-bound: ms per decode step against bytes read per step.

    line = bytes_line()              # the course model, SmolLM2-360M and TinyLlama-1.1B, float32: ≤ 60 s on CPU
    print(line)                      # the table, its verdict and the details
    line.plot()

Each point is a model of a real published shape (course.engine.config.PRESETS) built with random weights:
a decode step does the same arithmetic on the same number of bytes whatever the values are, so its time
does not depend on them (random_model says why they are never uninitialised memory).

The fit is time = bytes ÷ bandwidth + fixed cost per step (least squares over the points). If decode is
bound by memory bandwidth, the points lie on a line (R² near 1) whose slope gives back the machine's
streaming-read bandwidth; the intercept is what a step costs beyond reading (Python, the framework's per-call
work, kernel launches on a GPU).

Every step is the engine's compiled decode step with one compiled block shared by every model shape
(course.engine.fast.DecodeStep, any_shape), so the shapes compile once. KVCOURSE_FULL=1 adds bigger shapes.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from course.engine.config import ModelConfig
from course.engine.fast import DecodeStep
from course.engine.kv_cache import KVCache
from course.engine.model import Transformer, rope_tables
from course.measure.costs import decode_cost, dtype_bytes as _dtype_bytes
from course.measure.results import full_size
from course.measure.timing import ReadProbe, Stopwatch

CPU_SHAPES = ("smollm2-135m", "smollm2-360m", "tinyllama-1.1b")  # 0.5, 1.4, 4.4 GB in float32
CPU_FULL_SHAPES = CPU_SHAPES + ("llama-3.2-1b", "smollm2-1.7b")  # + 4.9, 6.8 GB
GPU_SHAPES = ("smollm2-135m", "smollm2-360m", "tinyllama-1.1b", "smollm2-1.7b", "llama-2-7b")  # bfloat16
CONTEXT = 64  # cached tokens of every step (their K and V are read too, and counted)
WEIGHT_STD = 0.02
R2_BOUND, BANDWIDTH_TOLERANCE = 0.98, 0.25  # what "on the line" and "the probe's bandwidth" mean here


def default_shapes(device: torch.device | str = "cpu", full: bool | None = None) -> tuple[str, ...]:
    """The presets the line is drawn through: KVCOURSE_FULL=1 (or full=True) adds the bigger ones."""
    if full is None:
        full = full_size()
    if torch.device(device).type == "cuda":
        return GPU_SHAPES if full else GPU_SHAPES[:3]
    return CPU_FULL_SHAPES if full else CPU_SHAPES


def random_model(config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
                 context: int = CONTEXT) -> Transformer:
    """A course Transformer of this shape with random weights: normal(0, 0.02) numbers (like a freshly initialised
    model), norms at 1. Built on the meta device, given its memory once, in its final dtype, and filled from one
    random block (per-element random numbers would take a minute for 4 GB). Never uninitialised memory: it can hold
    denormals, numbers so small that x86 floating-point units handle them up to ~100× slower. The RoPE tables
    cover only `context` + 1 positions (a real 128k table would be bigger than the cache this measures)."""
    config = config.with_(max_seq_len=context + 1)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_embeddings:  # to_empty gives each module its own tensor: tie the head to the embedding again
        model.output.weight = model.tok_embeddings.weight
    gen = torch.Generator().manual_seed(seed)
    block = (torch.randn(1 << 20, generator=gen) * WEIGHT_STD).to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # attention_norm, ffn_norm, the final norm
                p.fill_(1.0)
                continue
            flat, n = p.view(-1), p.numel()
            for start in range(0, n, block.numel()):  # tile the block over the tensor
                stop = min(n, start + block.numel())
                flat[start:stop].copy_(block[:stop - start])
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval()


class Step:
    """One decode step of `model`: batch 1, `context` tokens cached, the last cache position rewritten every call
    (compiled as the module docstring says; compile=False: eager)."""

    def __init__(self, model: Transformer, context: int = CONTEXT, compile: bool = True):
        self.cache = KVCache(model.config, max_seq_len=context + 1, dtype=model.dtype, device=model.device)
        self.step = DecodeStep(model, compile=compile, any_shape=True)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
        self.context, self.bytes_per_step = context, read_bytes(model.config, context, model.dtype)

    @property
    def compiled(self) -> bool:
        return self.step.compiled  # False after a failed compilation: the step then runs eagerly

    def __call__(self) -> torch.Tensor:
        return self.step(self.token, self.context, self.cache)


def read_bytes(config: ModelConfig, context: int, dtype: torch.dtype) -> float:
    """Bytes one decode step reads: every weight (an untied embedding only looks up a row) + the K and V of
    the context + 1 positions (course.measure.costs.decode_cost)."""
    return decode_cost(config, context, _dtype_bytes(dtype), within_context=False).bytes


@dataclass
class Point:
    name: str
    params: int
    bytes_per_step: float
    ms_per_step: float  # median
    times_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes_per_step / (self.ms_per_step / 1e3)


@dataclass
class Fit:
    """time = bytes ÷ bandwidth + fixed (least squares)."""
    bandwidth_bytes_per_s: float
    fixed_ms: float
    r2: float

    def predict_ms(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_bytes_per_s * 1e3 + self.fixed_ms


def signed_ms(ms: float, places: int = 2) -> str:
    """A fixed cost as the term of a sum, with a true minus sign: '+ 4.15 ms', '− 4.15 ms' (never '+ -4.15')."""
    return f"{'−' if round(ms, places) < 0 else '+'} {abs(ms):.{places}f} ms"


def fit_line(bytes_per_step: list[float], ms_per_step: list[float]) -> Fit:
    """Least-squares line through (bytes, ms); needs at least 2 different byte counts."""
    if len(bytes_per_step) != len(ms_per_step) or len(set(bytes_per_step)) < 2:
        raise ValueError(f"a line needs at least 2 points of different sizes; got bytes {bytes_per_step}")
    slope, fixed = statistics.linear_regression(bytes_per_step, ms_per_step)  # ms per byte, ms
    # R² of a least-squares line is the squared correlation; points all at one time lie on a flat line
    r2 = statistics.correlation(bytes_per_step, ms_per_step) ** 2 if len(set(ms_per_step)) > 1 else 1.0
    return Fit(1e3 / slope if slope > 0 else float("inf"), fixed, r2)  # bandwidth in bytes/s


@dataclass
class BytesLine:
    points: list[Point]
    probe_bytes_per_s: float  # streaming read, median of the probes between the models
    probes: list[float]
    fit: Fit
    device: str
    dtype: str
    threads: int
    compiled: bool
    load_average: tuple[float, float]  # before, after (1-minute)
    wall_s: float

    @property
    def bandwidth_ratio(self) -> float:
        """Fitted ÷ probed bandwidth (1 = the slope is exactly the probe's bandwidth)."""
        return self.fit.bandwidth_bytes_per_s / self.probe_bytes_per_s

    @property
    def rising(self) -> bool:
        """The fitted time grows with the bytes (a positive slope, a finite bandwidth). A busy machine can make a
        bigger model's steps no slower than a smaller one's: then the slope says nothing about bandwidth."""
        return 0 < self.fit.bandwidth_bytes_per_s < float("inf")

    @property
    def on_the_line(self) -> bool:
        return self.rising and self.fit.r2 >= R2_BOUND

    @property
    def at_probe_bandwidth(self) -> bool:
        return abs(self.bandwidth_ratio - 1) <= BANDWIDTH_TOLERANCE

    @property
    def bandwidth_bound(self) -> bool:
        return self.on_the_line and self.at_probe_bandwidth

    def bytes_share(self, point: Point) -> float:
        """Fraction of a point's fitted step time spent reading bytes (the rest is the fixed cost)."""
        stream = point.bytes_per_step / self.fit.bandwidth_bytes_per_s * 1e3
        return stream / (stream + max(self.fit.fixed_ms, 0.0))

    def dominated_by(self, point: Point) -> str:
        return "bytes" if self.bytes_share(point) >= 0.5 else "fixed cost"

    def values(self) -> dict:
        return dict(points=[dict(name=p.name, params=p.params, bytes_per_step=p.bytes_per_step,
                                 ms_per_step=p.ms_per_step, achieved_bytes_per_s=p.achieved_bytes_per_s,
                                 bytes_share=self.bytes_share(p), dominated_by=self.dominated_by(p),
                                 times_ms=list(p.times_ms))
                            for p in self.points],
                    fitted_bandwidth_bytes_per_s=self.fit.bandwidth_bytes_per_s, fixed_ms=self.fit.fixed_ms,
                    r2=self.fit.r2, probe_bytes_per_s=self.probe_bytes_per_s, probes=list(self.probes),
                    bandwidth_ratio=self.bandwidth_ratio,
                    bandwidth_bound=self.bandwidth_bound, device=self.device, dtype=self.dtype,
                    threads=self.threads, compiled=self.compiled, load_average=list(self.load_average),
                    wall_s=self.wall_s)

    def verdict(self, reference_bytes_per_s: float | None = None, reference: str = "the read probe") -> str:
        """One headline (at most 30 words): does a step take its bytes ÷ a bandwidth? The slope is held against
        `reference_bytes_per_s` (default: the line's own read probe; lesson 01 passes the machine profile's)."""
        ref = reference_bytes_per_s or self.probe_bytes_per_s
        if not self.rising:
            return "Step time did not grow with the bytes read: other programs hid the line. Run it again when quiet."
        fitted, r2 = self.fit.bandwidth_bytes_per_s / 1e9, self.fit.r2
        if not self.on_the_line:
            return f"The points are off one line (R² {r2:.3f} < {R2_BOUND}): this run cannot call decode bandwidth-bound."
        ratio = fitted * 1e9 / ref
        if abs(ratio - 1) <= BANDWIDTH_TOLERANCE:
            return (f"Bandwidth-bound: step time grows with bytes read at {fitted:.1f} GB/s, within "
                    f"±{BANDWIDTH_TOLERANCE:.0%} of {reference}'s {ref / 1e9:.1f} GB/s (R² {r2:.3f}).")
        return (f"On a line (R² {r2:.3f}), but at {fitted:.1f} GB/s: {ratio:.0%} of {reference}'s {ref / 1e9:.1f} "
                f"GB/s, outside ±{BANDWIDTH_TOLERANCE:.0%}.")

    def details(self) -> list[str]:
        """The fit, its split of each step, the line's own read probes and how it ran: one short sentence each."""
        f, probes = self.fit, sorted(self.probes)
        out = []
        if self.rising:
            out.append(f"Fit: time = bytes ÷ {f.bandwidth_bytes_per_s / 1e9:.1f} GB/s {signed_ms(f.fixed_ms)} per step "
                       f"(R² = {f.r2:.3f}).")
            out.append("The fixed cost came out negative: noise in the fit, so it splits no step into parts."
                       if round(f.fixed_ms, 2) < 0 else "Share of each step spent reading bytes, by the fit: "
                       + ", ".join(f"{p.name} {self.bytes_share(p):.0%}" for p in self.points) + ".")
        out.append(f"The line's own read probe: {statistics.median(probes) / 1e9:.1f} GB/s (median of {len(probes)}, "
                   f"{probes[0] / 1e9:.1f} to {probes[-1] / 1e9:.1f}).")
        threads = f"{self.threads} thread" + ("" if self.threads == 1 else "s")
        out.append(f"Timed {'compiled' if self.compiled else 'eager'}, {self.dtype} on {self.device}, {threads}, "
                   f"context {CONTEXT}; {self.wall_s:.0f} s in all.")
        return out

    def __str__(self) -> str:
        rows = [f"{'model':<16}{'params':>9}{'MB/step':>10}{'ms/step':>10}{'GB/s':>8}"]
        for p in self.points:
            rows.append(f"{p.name:<16}{p.params / 1e6:>8.0f}M{p.bytes_per_step / 1e6:>10.0f}{p.ms_per_step:>10.2f}"
                        f"{p.achieved_bytes_per_s / 1e9:>8.1f}")
        return "\n".join(rows + [self.verdict()] + self.details())

    def plot(self, ax=None, reference_bytes_per_s: float | None = None, reference: str = "read probe"):
        """The points, the fit, and the floor: bytes ÷ `reference_bytes_per_s` (default: the line's read probe)."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(6.5, 4))
        xs = [p.bytes_per_step / 1e9 for p in self.points]
        ax.plot(xs, [p.ms_per_step for p in self.points], "o", label="measured (median)")
        top = max(xs) * 1.05
        if self.rising:
            ax.plot([0, top], [self.fit.fixed_ms, self.fit.predict_ms(top * 1e9)], "-",
                    label=f"fit: bytes ÷ {self.fit.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
                          f"{signed_ms(self.fit.fixed_ms, 1)}")
        ref = reference_bytes_per_s or self.probe_bytes_per_s
        ax.plot([0, top], [0, top * 1e9 / ref * 1e3], "--", label=f"floor: bytes ÷ {reference} {ref / 1e9:.1f} GB/s")
        for p, x in zip(self.points, xs):
            ax.annotate(p.name, (x, p.ms_per_step), textcoords="offset points", xytext=(5, -12), fontsize=8)
        ax.set_xlabel("bytes read per decode step (GB)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"Decode time vs bytes read ({self.dtype}, {self.device})")
        ax.set_xlim(0, top)
        ax.set_ylim(0, None)
        ax.legend(fontsize=8)
        return ax


def bytes_line(shapes: tuple[str, ...] | None = None, device="cpu", dtype: torch.dtype | str | None = None,
               context: int = CONTEXT, compile: bool = True, budget_s: float = 3.0, min_repeats: int = 3,
               probe_bytes: int = 1 << 30, progress: bool = True, log=None, rounds: int = 4,
               resident_bytes: float | None = None) -> BytesLine:
    """Time one decode step for each shape and fit the line.

    When all the models fit in `resident_bytes` together (default: 8 GB, or half the memory free now if that is
    less, so a laptop is not pushed into swap), they are built first and then take turns, round
    after round (a probe of the streaming-read bandwidth before each round), so a burst of load from another
    program hits every point alike; otherwise each is built, timed and freed in turn. budget_s: about how long
    each shape's timed steps take in all (at least min_repeats steps). Every model is freed at the end.
    """
    from course.engine.device import pick_dtype

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = pick_dtype(dtype) if isinstance(dtype, str) else dtype
    shapes = tuple(shapes or default_shapes(device))
    configs = [s if isinstance(s, ModelConfig) else ModelConfig.from_name(s) for s in shapes]
    if len(configs) < 2:
        raise ValueError(f"a line needs at least 2 shapes, got {list(shapes)}")
    t_start, load_before = time.perf_counter(), os.getloadavg()[0]
    state = {"compile": compile}
    if resident_bytes is None:
        import psutil

        resident_bytes = min(8e9, psutil.virtual_memory().available / 2)
    together = sum(c.n_params for c in configs) * _dtype_bytes(dtype) <= resident_bytes
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(configs) * (2 if together else 1), desc="bytes line", unit="step")

    def prepare(config):
        """Build the model and its step, and run it twice (the first call compiles, once for every shape)."""
        step = Step(random_model(config, dtype, device, context=context), context, compile=state["compile"])
        step()
        if state["compile"] and not step.compiled:  # no C++ compiler, say: the engine warned, and the line is timed eagerly
            state["compile"] = False
            if log:
                log(f"[bytes line] compiling failed ({step.step.fallback}); timing the eager step instead")
        with Stopwatch(device) as sw:
            step()
        n = max(min_repeats, min(50, int(budget_s / max(sw.seconds, 1e-4))))
        if bar:
            bar.update()
        return step, n

    def timed(step, n) -> list[float]:
        out = []
        for _ in range(n):
            with Stopwatch(device) as sw:
                step()
            out.append(sw.seconds * 1e3)
        return out

    def probe_once() -> float:
        """A read probe whose buffer is freed at once: beside models built one at a time, so the largest never
        shares memory with the probe's buffer."""
        reader = ReadProbe(device, nbytes=probe_bytes, repeats=3)
        try:
            return reader()
        finally:
            reader.close()

    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    probes, steps_bytes = [], {}
    if together:
        probe = ReadProbe(device, nbytes=probe_bytes, repeats=3)  # one buffer, read again before every round
        try:
            prepared = [prepare(c) for c in configs]
            for i, (step, _) in enumerate(prepared):
                steps_bytes[i] = step.bytes_per_step
            for _ in range(rounds):
                probes.append(probe())
                for i, (step, n) in enumerate(prepared):
                    times[i] += timed(step, max(1, -(-n // rounds)))
        finally:
            probe.close()
        if bar:
            bar.update(len(configs))
        del prepared, step
    else:
        for i, config in enumerate(configs):
            probes.append(probe_once())
            step, n = prepare(config)
            steps_bytes[i] = step.bytes_per_step
            times[i] = timed(step, n)
            del step  # free this model's weights before the next is built
            gc.collect()
        probes.append(probe_once())
    if bar:
        bar.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    points = [Point(c.name, c.n_params, steps_bytes[i], statistics.median(times[i]), times[i])
              for i, c in enumerate(configs)]
    fit = fit_line([p.bytes_per_step for p in points], [p.ms_per_step for p in points])
    return BytesLine(points, statistics.median(probes), probes, fit, device.type, str(dtype).replace("torch.", ""),
                     torch.get_num_threads(), state["compile"], (load_before, os.getloadavg()[0]),
                     time.perf_counter() - t_start)
