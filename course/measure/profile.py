"""Where a decode step's time goes: operations counted, matrix-vector products timed alone, two dtypes side by side.

    count_ops           FLOPs of one decode step, counted by PyTorch
    decode_breakdown    matrix-vector products vs everything else
    dtype_side_by_side  one decode step in two dtypes
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from course.engine.device import cpu_flags
from course.measure.costs import decode_cost, dtype_bytes
from course.measure.roofline import Machine
from course.measure.sweeps import _measure_within, decode_step, prepare_context
from course.measure.timing import Timing
from course.measure.display import Printed


def count_ops(model, context: int = 16) -> tuple[int, int]:
    """(all tensor operations, matrix products) one decode step dispatches, counted at the ATen level."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total = self.matmuls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.total += 1
            self.matmuls += func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "matmul", "linear")
            return func(*args, **(kwargs or {}))

    cache, _ = prepare_context(model, context)
    token = torch.ones(1, 1, dtype=torch.long, device=model.device)
    counter = Counter()
    with torch.inference_mode(), counter:
        model(token, start_pos=context, cache=cache, last_only=True)
    return counter.total, counter.matmuls


def linear_weights(model) -> list[torch.Tensor]:
    """The weight of every nn.Linear, in forward order (a tied output head appears once)."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def linears_pass(model, budget_s: float = 1.0, max_repeats: int = 10) -> Timing:
    """Time only the matrix-vector products of a decode step: one row through every weight matrix, in
    order, so all the weights stream from memory just as they do in a real step."""
    weights = linear_weights(model)
    inputs = {w.shape[1]: torch.ones(1, w.shape[1], dtype=model.dtype, device=model.device) for w in weights}

    @torch.inference_mode()
    def run():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return _measure_within(run, model.device, budget_s, max_repeats, min_repeats=3)


@dataclass(frozen=True)
class DecodeBreakdown(Printed):
    """A decode step split by measurement into matrix-vector products and everything else."""
    context: int
    step_s: float  # one real decode step, median
    linears_s: float  # the same weights through F.linear alone, median
    linear_weight_bytes: float
    floor_s: float  # bytes read per step ÷ measured bandwidth
    n_ops: int  # tensor operations dispatched in one step
    n_matmuls: int

    @property
    def gemv_bytes_per_s(self) -> float:
        """Bandwidth the matrix-vector products achieved on their own."""
        return self.linear_weight_bytes / self.linears_s

    @property
    def other_s(self) -> float:
        return max(self.step_s - self.linears_s, 0.0)

    @property
    def other_us_per_op(self) -> float:
        return self.other_s / max(self.n_ops - self.n_matmuls, 1) * 1e6

    def values(self) -> dict:
        return dict(breakdown_context=self.context, breakdown_step_ms=self.step_s * 1e3,
                    breakdown_linears_ms=self.linears_s * 1e3, breakdown_floor_ms=self.floor_s * 1e3,
                    breakdown_gemv_gb_s=self.gemv_bytes_per_s / 1e9, breakdown_n_ops=self.n_ops,
                    breakdown_n_matmuls=self.n_matmuls, breakdown_other_ms=self.other_s * 1e3,
                    breakdown_other_us_per_op=self.other_us_per_op)

    def __str__(self) -> str:
        return (f"decode step at C={self.context}: {self.step_s * 1e3:.1f} ms measured vs "
                f"{self.floor_s * 1e3:.1f} ms bandwidth floor\n"
                f"  {self.n_matmuls} matrix-vector products alone: {self.linears_s * 1e3:.1f} ms "
                f"({self.gemv_bytes_per_s / 1e9:.1f} GB/s of weights)\n"
                f"  the other {self.n_ops - self.n_matmuls} ops (norms, RoPE, cache writes, attention, "
                f"adds, views): {self.other_s * 1e3:.1f} ms, {self.other_us_per_op:.1f} µs each")


def decode_breakdown(model, machine: Machine, context: int = 16, budget_s: float = 1.0) -> DecodeBreakdown:
    """Measure a decode step, the matrix-vector products on their own, and count the step's ops."""
    step = decode_step(model, context, budget_s)
    linears = linears_pass(model, budget_s)
    n_ops, n_mm = count_ops(model, context)
    b = dtype_bytes(model.dtype)
    weight_bytes = sum(w.numel() for w in linear_weights(model)) * b
    # the floor `kvcourse bench` reports too (course.measure.decode_floor.floor_ms): bytes ÷ the streaming read
    floor = decode_cost(model.config, context, b).bytes / (machine.read_bytes_per_s or machine.bytes_per_s)
    return DecodeBreakdown(context, step.median, linears.median, float(weight_bytes), floor, n_ops, n_mm)


@dataclass(frozen=True)
class DtypeComparison(Printed):
    """The same decode step (and its matrix-vector products alone) in two dtypes on one machine."""
    context: int
    dtypes: tuple[str, str]
    step_s: tuple[float, float]
    linears_s: tuple[float, float]
    bytes_read: tuple[float, float]
    cpu_bf16: bool | None
    device: str
    features: tuple[str, ...] | None = None  # what the hardware check found (CPU flags, or the GPU's name)

    @property
    def slowdown(self) -> float:
        """Second dtype's step time ÷ the first's (> 1: the smaller dtype was slower)."""
        return self.step_s[1] / self.step_s[0]

    @property
    def bandwidth_prediction(self) -> float:
        """What a purely bandwidth-bound step would do: time scales with bytes read."""
        return self.bytes_read[1] / self.bytes_read[0]

    def values(self) -> dict:
        a, b = self.dtypes
        return {f"{a}_decode_ms": self.step_s[0] * 1e3, f"{b}_decode_ms": self.step_s[1] * 1e3,
                f"{a}_linears_ms": self.linears_s[0] * 1e3, f"{b}_linears_ms": self.linears_s[1] * 1e3,
                f"{b}_over_{a}_decode": self.slowdown, "cpu_has_bf16": self.cpu_bf16,
                "bf16_hardware": self.hardware}

    def __str__(self) -> str:
        a, b = self.dtypes
        where = self.hardware
        return (f"decode step at C={self.context} on {self.device} ({where})\n"
                f"{'':10}{a:>12}{b:>12}\n"
                f"{'MB read':10}{self.bytes_read[0] / 1e6:>12.1f}{self.bytes_read[1] / 1e6:>12.1f}\n"
                f"{'step ms':10}{self.step_s[0] * 1e3:>12.1f}{self.step_s[1] * 1e3:>12.1f}\n"
                f"{'GEMVs ms':10}{self.linears_s[0] * 1e3:>12.1f}{self.linears_s[1] * 1e3:>12.1f}\n"
                f"bytes predict {b} at {self.bandwidth_prediction:.2f}× the {a} time; measured "
                f"{self.slowdown:.2f}×: " + self.verdict)

    @property
    def hardware(self) -> str:
        """The hardware fact behind the verdict, as found on this machine."""
        if self.device != "cpu":
            return f"{', '.join(self.features or ()) or self.device}"
        if self.features is None:
            return "this CPU's flags could not be read (/proc/cpuinfo is missing)"
        if self.features:
            return f"this CPU advertises {', '.join(self.features)}"
        return "this CPU advertises no bfloat16 instructions (no avx512_bf16, amx_bf16 or Arm bf16 flag)"

    @property
    def verdict(self) -> str:
        a, b = self.dtypes
        if self.slowdown > 1.05:
            return (f"{b} was SLOWER although it reads {1 / self.bandwidth_prediction:.0f}× fewer bytes - "
                    f"its kernels here cost more than the bytes they save")
        if self.slowdown >= 0.95:  # within 5 % either way: neither faster nor slower
            return (f"{b} ran within 5 % of {a} ({self.slowdown:.2f}×) although it reads "
                    f"{1 / self.bandwidth_prediction:.0f}× fewer bytes - the bytes do not set this step's time here")
        if self.slowdown > self.bandwidth_prediction * 1.25:
            return f"{b} was faster, but by less than the bytes alone predict - the step is not purely bandwidth-bound"
        return f"{b} was faster by about what the bytes predict - the step behaves as bandwidth-bound"

    @property
    def advice(self) -> str:
        """Which dtype to use on this machine, from this measurement and the hardware found."""
        a, b = self.dtypes
        faster = b if self.slowdown < 0.95 else a if self.slowdown > 1.05 else None
        if faster is None:
            return (f"{a} and {b} ran within 5 % of each other here ({self.hardware}); {a} keeps results "
                    "exactly comparable, so the course stays with it.")
        return (f"on this machine {faster} decoded faster ({self.slowdown:.2f}× the {a} time for {b}; "
                f"{self.hardware}). The course still defaults to {a} so that later lessons can compare "
                f"results exactly; load with dtype=\"{b}\" to use it.") if faster == b else (
                f"on this machine {b} was slower ({self.slowdown:.2f}× the {a} time; {self.hardware}), so "
                f"{a} is both the faster and the exact choice here.")


def dtype_side_by_side(model_a, model_b, context: int = 16, budget_s: float = 1.0) -> DtypeComparison:
    """Time one decode step and the bare matrix-vector products of two copies of a model (e.g. fp32, bf16)."""
    steps, linears, reads, names = [], [], [], []
    for m in (model_a, model_b):
        steps.append(decode_step(m, context, budget_s, max_repeats=5).median)
        linears.append(linears_pass(m, budget_s, max_repeats=5).median)
        reads.append(decode_cost(m.config, context, dtype_bytes(m.dtype)).bytes)
        names.append(str(m.dtype).split(".")[-1])
    return DtypeComparison(context, tuple(names), tuple(steps), tuple(linears), tuple(reads), cpu_has_bf16(),
                           str(model_a.device), bf16_features(model_a.device))


def bf16_features(device="cpu") -> tuple[str, ...] | None:
    """The bfloat16 hardware found: CPU flags from /proc/cpuinfo (None if unreadable), or, on CUDA, the
    GPU's name and whether it has bf16 tensor cores (compute capability 8.0, Ampere, or newer)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        cores = "bf16 tensor cores" if major >= 8 else "no bf16 tensor cores"
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}: {cores})",)
    if device.type != "cpu":
        return (device.type,)
    flags = cpu_flags()
    if flags is None:
        return None
    return tuple(sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "bf16"}))


def cpu_has_bf16() -> bool | None:
    """Does this CPU advertise bfloat16 instructions (avx512_bf16 / amx_bf16 / Arm bf16)? None if unknown."""
    flags = cpu_flags()
    if flags is None:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
