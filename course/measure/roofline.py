"""The roofline (Williams, Waterman and Patterson, 2009): a point's time is at least its bytes ÷ bandwidth and at
least its FLOPs ÷ FLOP/s, and the larger of the two is its roof.

    Machine.from_profile(prof)   the machine profile's two roofs (course.measure.machine)
    compare                      each swept point beside its roofline time
    plot_roofline                both phases on one roofline
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course.engine.config import ModelConfig
from course.measure import costs
from course.measure.costs import Cost, decode_cost, prefill_cost
from course.measure.sweeps import Sweep


@dataclass(frozen=True)
class Machine:
    """What this machine can do: bytes per second from memory, FLOPs per second in a big matmul."""
    device: str
    dtype: str
    bytes_per_s: float
    flops_per_s: float

    @classmethod
    def from_profile(cls, prof) -> "Machine":
        return cls(prof.device, prof.dtype, prof.bandwidth_gb_s * 1e9, prof.gflop_s * 1e9)

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the two roofs meet: below it, memory is the limit."""
        return self.flops_per_s / self.bytes_per_s

    def seconds(self, cost: Cost) -> float:
        """Roofline time: the slower of moving the bytes and doing the FLOPs."""
        return max(cost.bytes / self.bytes_per_s, cost.flops / self.flops_per_s)

    def bound(self, cost: Cost) -> str:
        return "memory" if cost.intensity < self.ridge else "compute"


@dataclass(frozen=True)
class Point:
    """One swept point: its phase, length (T or C), cost from the config, roofline time and measured time."""
    phase: str
    tokens: int
    cost: Cost
    bound: str  # "memory" or "compute"
    predicted_s: float
    measured_s: float

    @property
    def achieved_flops_per_s(self) -> float:
        return self.cost.flops / self.measured_s


def compare(config: ModelConfig, prefill_: Sweep, decode_: Sweep, machine: Machine) -> list[Point]:
    """Each measured point next to its roofline prediction, max(bytes ÷ bandwidth, FLOPs ÷ FLOP/s)."""
    b = costs.dtype_bytes(getattr(torch, prefill_.dtype))
    return [Point(sweep.phase, n, cost, machine.bound(cost), machine.seconds(cost), measured)
            for sweep, cost_of in ((prefill_, prefill_cost), (decode_, decode_cost))
            for n, measured in zip(sweep.lengths, sweep.seconds) for cost in [cost_of(config, n, b)]]


def plot_roofline(machine: Machine, points: list[Point]):
    """Log-log roofline: the memory slope and the matmul ceiling, with every measured point placed at its
    arithmetic intensity (x) and the FLOP/s it achieved (y)."""
    import matplotlib.pyplot as plt
    import numpy as np

    xs = [p.cost.intensity for p in points]
    lo, hi = min(min(xs), machine.ridge) / 4, max(max(xs), machine.ridge) * 4
    x = np.logspace(math.log10(lo), math.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.plot(x, np.minimum(machine.flops_per_s, machine.bytes_per_s * x) / 1e9, "k-", lw=2,
            label=f"roof: min({machine.bytes_per_s / 1e9:.1f} GB/s × intensity, {machine.flops_per_s / 1e9:.0f} GFLOP/s)")
    ax.axvline(machine.ridge, color="gray", ls=":", lw=1)
    ax.text(machine.ridge, machine.flops_per_s / 1e9 * 0.5, f" ridge: {machine.ridge:.1f} FLOP/byte", fontsize=8,
            color="gray")
    for phase, marker, color in (("prefill", "o", "tab:orange"), ("decode", "s", "tab:blue")):
        rows = [p for p in points if p.phase == phase]
        ax.scatter([p.cost.intensity for p in rows], [p.achieved_flops_per_s / 1e9 for p in rows],
                   marker=marker, color=color, zorder=3, label=f"{phase} (measured, eager)")
        for p in rows:
            ax.annotate(f"{'T' if phase == 'prefill' else 'C'}={p.tokens}", (p.cost.intensity, p.achieved_flops_per_s / 1e9),
                        fontsize=7, xytext=(4, -10 if phase == "decode" else 4), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte moved)",
           ylabel="achieved GFLOP/s", title=f"Roofline of this machine: {machine.device}, {machine.dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
