"""The line that shows decode is bandwidth-bound: ms per decode step against bytes read per step.

    line = bytes_line()              # the course model, SmolLM2-360M and TinyLlama-1.1B, float32: ≤ 60 s on CPU
    print(line)                      # the table, the fit and its verdict
    line.plot()

Each point is a model of a real published shape (course.engine.config.PRESETS) built with random weights:
a decode step does the same arithmetic on the same number of bytes whatever the values are, so its time
does not depend on them. The weights are real numbers (normal, std 0.02, like a freshly initialised model)
and never uninitialised memory, which can hold denormals: numbers so small that x86 floating-point units
handle them up to ~100× slower, which would skew the time.

The fit is time = bytes ÷ bandwidth + fixed cost per step (least squares over the points). If decode is
bound by memory bandwidth, the points lie on a line (R² near 1) whose slope gives back the machine's
streaming-read bandwidth (probed between the models with the same number of threads); the intercept is what
a step costs beyond reading: Python, the framework's per-call work, kernel launches on a GPU. From the fit,
each model's step is split into its bytes part and its fixed part, and the larger one names what bounds it.

Every step runs the course's compiled decode block (course.engine.fast.decode_block), one block at a time,
compiled once with dynamic shapes so that every model shape shares one compilation. On the CPU its products
go through the course's row kernel (course.engine.row_product) where it builds: Inductor's streamed reduction,
compiled for symbolic sizes, read the bigger shapes' weights at under half the probe's bandwidth (AMD EPYC,
2 threads: TinyLlama-1.1B 16.8 GB/s against the kernel's 34.2, probe 39.3), which bent the line. Bigger shapes
(Llama-3.2-1B, SmolLM2-1.7B on a CPU; up to Llama-2-7B in bfloat16 on a GPU) with KVCOURSE_FULL=1.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from course.engine import row_product
from course.engine.arena import materialize_packed
from course.engine.config import ModelConfig
from course.engine.fast import decode_block, fused_block_weights, lm_head, row_linear, step_inputs, streamed_linear
from course.engine.model import Transformer, rope_tables
from course.measure.costs import decode_cost, dtype_bytes as _dtype_bytes
from course.measure.results import full_size
from course.measure.timing import ReadProbe, Stopwatch, steadiness

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
    """A course Transformer of this shape with random weights: normal(0, 0.02) numbers, norms at 1.

    Built on the meta device, given its memory once (on the CPU one huge-page buffer, as the compiled step
    wants it: course.engine.arena.materialize_packed) and filled from one random block (per-element random
    numbers would take a minute for 4 GB); every tensor holds ordinary numbers, so no denormal slows it.
    The RoPE tables cover only `context` + 1 positions (a real 128k table would be bigger than the
    cache this measures).
    """
    config = config.with_(max_seq_len=context + 1)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype)
    if torch.device(device).type != "cpu" or not materialize_packed(model):  # CPU: one huge-page buffer
        model = model.to_empty(device=device)  # allocated once, in the final dtype
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


class BlockwiseStep:
    """One decode step of `model` (batch 1, the last cache position) with the compiled decode block.

    The blocks run one after another from Python (L calls of one compiled graph), then the compiled norm +
    head. compile=False runs the same functions eagerly.
    """

    _compiled: dict = {}  # (kind) → compiled function, shared by every shape (the products' function is an argument)

    def __init__(self, model: Transformer, context: int = CONTEXT, compile: bool = True):
        c = model.config
        self.model, self.config = model, c
        S = context + 1
        shape = (1, c.n_kv_heads, S, c.head_dim)
        self.caches = [(torch.zeros(shape, dtype=model.dtype, device=model.device),
                        torch.zeros(shape, dtype=model.dtype, device=model.device)) for _ in range(c.n_layers)]
        # Plain tensors, not nn.Parameters: TorchDynamo keeps a parameter's shape static, and one compiled
        # block must serve every model shape.
        if model.device.type == "cpu":  # one huge-page buffer, as the lessons' compiled step has (course.engine.arena)
            from course.engine.arena import pack_parameters

            pack_parameters(model)
        self.weights = [fused_block_weights(layer) for layer in model.layers]  # q|k|v and gate|up as one weight each
        self.norm_weight, self.head_weight = model.norm.weight.detach(), model.output.weight.detach()
        self.positions = torch.tensor([context], device=model.device)  # every step rewrites the last slot
        self.rows = torch.zeros(1, dtype=torch.long, device=model.device)
        self.token = torch.zeros(1, dtype=torch.long, device=model.device)
        self.linear = row_linear if compile and row_product.computes(self.head_weight) else streamed_linear
        self.block, self.head = decode_block, lm_head
        if compile:
            if not BlockwiseStep._compiled:
                options = {"size_asserts": False}  # no per-call size/stride checks of every input
                BlockwiseStep._compiled = {"block": torch.compile(decode_block, dynamic=True, options=options),
                                           "head": torch.compile(lm_head, dynamic=True, options=options)}
            self.block, self.head = BlockwiseStep._compiled["block"], BlockwiseStep._compiled["head"]
        self.bytes_per_step = read_bytes(c, context, model.dtype)

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        m, c = self.model, self.config
        cos, sin, hidden = step_inputs(m, self.positions, self.caches[0][0].shape[2])
        x = m.tok_embeddings(self.token)  # [1, d]
        for w, (k, v) in zip(self.weights, self.caches):
            x = self.block(x, w, c.norm_eps, k, v, self.rows, self.positions, cos, sin, hidden,
                           c.n_heads, c.n_kv_heads, False, self.linear)
        return self.head(x, self.norm_weight, self.head_weight, c.norm_eps, self.linear)


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
    return f"{'−' if ms < 0 else '+'} {abs(ms):.{places}f} ms"


def fit_line(bytes_per_step: list[float], ms_per_step: list[float]) -> Fit:
    """Least-squares line through (bytes, ms); needs at least 2 different byte counts."""
    n = len(bytes_per_step)
    if n < 2 or n != len(ms_per_step) or len(set(bytes_per_step)) < 2:
        raise ValueError(f"a line needs at least 2 points of different sizes; got bytes {bytes_per_step}")
    mx, my = sum(bytes_per_step) / n, sum(ms_per_step) / n
    sxx = sum((x - mx) ** 2 for x in bytes_per_step)
    sxy = sum((x - mx) * (y - my) for x, y in zip(bytes_per_step, ms_per_step))
    slope = sxy / sxx  # ms per byte
    fixed = my - slope * mx
    ss_res = sum((y - (fixed + slope * x)) ** 2 for x, y in zip(bytes_per_step, ms_per_step))
    ss_tot = sum((y - my) ** 2 for y in ms_per_step)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    bandwidth = 1e3 / slope if slope > 0 else float("inf")  # bytes/s
    return Fit(bandwidth, fixed, r2)


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

    @classmethod
    def from_values(cls, v: dict) -> "BytesLine":
        """The line back from its values() (as a notebook records them), with the same fit, verdict and table."""
        points = [Point(p["name"], p["params"], p["bytes_per_step"], p["ms_per_step"], list(p.get("times_ms", [])))
                  for p in v["points"]]
        fit = Fit(v["fitted_bandwidth_bytes_per_s"], v["fixed_ms"], v["r2"])
        return cls(points, v["probe_bytes_per_s"], list(v["probes"]), fit, v["device"], v["dtype"], v["threads"],
                   v["compiled"], tuple(v["load_average"]), v["wall_s"])

    def verdict(self) -> str:
        """The sentence the lesson prints, generated from the fit."""
        f = self.fit
        fitted, probe = f.bandwidth_bytes_per_s / 1e9, self.probe_bytes_per_s / 1e9
        if not self.rising:
            return (f"Fit over {len(self.points)} models: the step time did not grow with the bytes read in this "
                    f"run (the fitted slope is not positive); the streaming-read probe gave {probe:.1f} GB/s. A busy "
                    f"machine (load average {self.load_average[0]:.1f} → {self.load_average[1]:.1f} on "
                    f"{os.cpu_count()} cores) made a bigger model's steps no slower than a smaller one's, so this run "
                    "cannot say what bounds a decode step: rerun when it is quiet.")
        head = (f"Fit over {len(self.points)} models: time = bytes ÷ {fitted:.1f} GB/s {signed_ms(f.fixed_ms)} "
                f"(R² = {f.r2:.3f}); the streaming-read probe gave {probe:.1f} GB/s, so the slope's bandwidth is "
                f"{self.bandwidth_ratio:.0%} of the probe's.")
        steady, moved = steadiness(self.probes)  # moved: how far the read probe went between rounds
        if self.bandwidth_bound:
            claim = ("Decode is bandwidth-bound here: step time grows in proportion to the bytes read, at the "
                     "speed this machine streams memory.")
        elif not self.on_the_line:
            claim = (f"The points are not on one line (R² {f.r2:.3f} < {R2_BOUND}), so this run cannot claim a "
                     "bandwidth-bound step; a busy machine (load average "
                     f"{self.load_average[0]:.1f} → {self.load_average[1]:.1f} on {os.cpu_count()} cores) "
                     "scatters the times: rerun when it is quiet.")
        elif not steady:
            claim = (f"The times lie on a line (time does grow with bytes), but {moved}: the memory system was "
                     "unsteady, so this run cannot say how close the slope comes to the machine's read bandwidth; "
                     "rerun when it is quiet.")
        else:
            side = "slower" if self.bandwidth_ratio < 1 else "faster"
            claim = (f"The times lie on a line (time does grow with bytes) but it streams {side} than the probe "
                     f"by more than {BANDWIDTH_TOLERANCE:.0%}: "
                     + ("the step's kernels read memory less efficiently than a plain sum does."
                        if side == "slower" else "part of the weights was served from a cache, not memory."))
        if not steady and (self.bandwidth_bound or not self.on_the_line):  # the verdict stands; the swing beside it
            claim += f" ({moved[0].upper()}{moved[1:]}: the memory system was unsteady.)"
        if f.fixed_ms < 0:  # no step costs less than nothing: the intercept is noise, and so is any split by it
            return (f"{head} {claim}\nFrom the fit: the fixed cost came out negative (−{-f.fixed_ms:.2f} ms). "
                    "A step cannot cost less than nothing, so the intercept is noise in the fit, and its split of "
                    "each step into bytes and fixed cost is not meaningful in this run.")
        parts = [f"{p.name}: {self.bytes_share(p):.0%} bytes, {1 - self.bytes_share(p):.0%} fixed cost "
                 f"→ bound by {self.dominated_by(p)}" for p in self.points]
        return f"{head} {claim}\nFrom the fit: " + "; ".join(parts) + "."

    def __str__(self) -> str:
        rows = [f"{'model':<16}{'params':>9}{'MB/step':>10}{'ms/step':>10}{'GB/s':>8}{'fit ms':>9}"]
        for p in self.points:
            rows.append(f"{p.name:<16}{p.params / 1e6:>8.0f}M{p.bytes_per_step / 1e6:>10.0f}{p.ms_per_step:>10.2f}"
                        f"{p.achieved_bytes_per_s / 1e9:>8.1f}{self.fit.predict_ms(p.bytes_per_step):>9.2f}")
        threads = f"{self.threads} thread" + ("" if self.threads == 1 else "s")  # measure/ may not import wording
        how = f"{self.dtype}, {self.device}, {threads}, " + ("compiled" if self.compiled else "eager")
        return "\n".join(rows) + f"\n({how}; {self.wall_s:.0f} s)\n" + self.verdict()

    def plot(self, ax=None):
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
        ax.plot([0, top], [0, top * 1e9 / self.probe_bytes_per_s * 1e3], "--",
                label=f"floor: bytes ÷ probe {self.probe_bytes_per_s / 1e9:.1f} GB/s")
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
               resident_bytes: float = 8e9) -> BytesLine:
    """Time one decode step for each shape and fit the line.

    When all the models fit in `resident_bytes` together, they are built first and then take turns, round
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
    together = sum(c.n_params for c in configs) * _dtype_bytes(dtype) <= resident_bytes
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(configs) * (2 if together else 1), desc="bytes line", unit="step")

    def prepare(config):
        """Build the model and its step, and run it once (the first call compiles, for every shape at once)."""
        model = random_model(config, dtype, device, context=context)
        step = BlockwiseStep(model, context, compile=state["compile"])
        try:
            with torch.fx.experimental._config.patch(use_duck_shape=False):  # sizes equal by chance stay apart
                step()
        except Exception as exc:  # no C++ compiler: the same functions, eagerly
            if not state["compile"]:
                raise
            if log:
                log(f"[bytes line] compiling failed ({type(exc).__name__}); timing the eager block instead")
            state["compile"] = False
            step = BlockwiseStep(model, context, compile=False)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=state["compile"]), Stopwatch(device) as sw:
            step()  # warm now: the guards need not be evaluated again on the timed calls (they cost per call)
        n = max(min_repeats, min(50, int(budget_s / max(sw.seconds, 1e-4))))
        if bar:
            bar.update()
        return step, n

    def timed(step, n) -> list[float]:
        out = []
        with torch.compiler.set_stance(skip_guard_eval_unsafe=state["compile"]):
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
