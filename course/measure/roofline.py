"""The roofline: this machine's measured bandwidth and FLOP/s, and each phase's predicted vs measured time.

    measure_machine  memory bandwidth and matmul FLOP/s (course.measure.timing probes)
    compare          predicted (roofline) vs measured seconds, point by point
    plot_roofline    both phases on one roofline
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course.engine.config import ModelConfig
from course.measure import costs
from course.measure.costs import Cost, decode_cost, prefill_cost
from course.measure.sweeps import Sweep
from course.measure.timing import matmul_flops, memory_bandwidth
from course.measure.display import Printed


@dataclass(frozen=True)
class Machine:
    """What this machine can do: bytes per second from memory, FLOPs per second in a big matmul.

    `bandwidth_source` / `flops_source` say where each roof came from: "probe" (course.measure.timing),
    or the lesson's own point that beat the probe (see `best_roofs`)."""
    device: str
    dtype: str
    bytes_per_s: float
    flops_per_s: float
    bandwidth_source: str = "probe"
    flops_source: str = "probe"
    probe_bytes_per_s: float | None = None
    probe_flops_per_s: float | None = None
    read_bytes_per_s: float | None = None  # the probe's streaming read alone: the decode floor's denominator

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the two roofs meet: below it, memory is the limit."""
        return self.flops_per_s / self.bytes_per_s

    def seconds(self, cost: Cost) -> float:
        """Roofline time: the slower of moving the bytes and doing the FLOPs."""
        return max(cost.bytes / self.bytes_per_s, cost.flops / self.flops_per_s)

    def bound(self, cost: Cost) -> str:
        return "memory" if cost.intensity < self.ridge else "compute"

    def values(self) -> dict:
        out = dict(bandwidth_gb_s=self.bytes_per_s / 1e9, matmul_gflop_s=self.flops_per_s / 1e9,
                   ridge_flop_per_byte=self.ridge)
        if self.probe_bytes_per_s:  # roofs from best_roofs: say where each came from
            out.update(probe_bandwidth_gb_s=self.probe_bytes_per_s / 1e9, probe_gflop_s=self.probe_flops_per_s / 1e9,
                       bandwidth_source=self.bandwidth_source, flops_source=self.flops_source)
        return out

    def __str__(self) -> str:
        line = (f"{self.device} ({self.dtype}): memory {self.bytes_per_s / 1e9:.1f} GB/s, "
                f"matmul {self.flops_per_s / 1e9:.1f} GFLOP/s, ridge {self.ridge:.1f} FLOP/byte")
        if self.probe_bytes_per_s is None:
            return line
        notes = []
        for what, source, best, probe, unit in (
                ("memory", self.bandwidth_source, self.bytes_per_s, self.probe_bytes_per_s, "GB/s"),
                ("matmul", self.flops_source, self.flops_per_s, self.probe_flops_per_s, "GFLOP/s")):
            notes.append(f"{what} roof: the probe's {probe / 1e9:.1f} {unit}" if source == "probe" else
                         f"{what} roof raised to {best / 1e9:.1f} {unit}, reached by {source} "
                         f"({best / probe:.2f}× the probe's {probe / 1e9:.1f}: the probe under-measured)")
        return line + "\nroofs = the best this machine showed, probe or lesson:\n  " + "\n  ".join(notes)


def measure_machine(device="cpu", dtype: torch.dtype = torch.float32, bandwidth_bytes: int = 256 << 20,
                    matmul_n: int | None = None) -> Machine:
    """Run the course.measure.timing probes: a 256 MiB streaming read/copy and an n×n matmul in `dtype`."""
    device = torch.device(device)
    n = matmul_n or (1024 if device.type == "cpu" else 4096)
    bw = memory_bandwidth(device, nbytes=bandwidth_bytes)
    flops = matmul_flops(device, n=n, dtype=dtype)
    return Machine(str(device), str(dtype).split(".")[-1], bw.bytes_per_s, flops,
                   read_bytes_per_s=bw.read_bytes_per_s)


@dataclass
class Comparison(Printed):
    """Predicted (roofline) vs measured seconds for every swept point."""
    rows: list[dict]

    def ratios(self, phase: str) -> list[float]:
        return [r["predicted_over_measured"] for r in self.rows if r["phase"] == phase]

    def values(self) -> dict:
        decode = [r for r in self.rows if r["phase"] == "decode"]
        first, last = decode[0], decode[-1]
        return dict(prefill_predicted_over_measured=self.ratios("prefill"),
                    decode_predicted_over_measured=self.ratios("decode"),
                    decode_floor_ms=first["predicted_s"] * 1e3, decode_gflop=first["flops"] / 1e9,
                    decode_intensity=first["intensity"], decode_bytes_mb=first["bytes"] / 1e6,
                    kv_mb_at_max_context=last["kv_bytes"] / 1e6, weight_mb=first["weight_bytes"] / 1e6,
                    decode_bound=first["bound"], prefill_bounds=[r["bound"] for r in self.rows if r["phase"] == "prefill"])

    def __str__(self) -> str:
        head = f"{'phase':8} {'tokens':>6} {'FLOP/B':>7} {'bound':>8} {'predicted ms':>13} {'measured ms':>12} " \
               f"{'pred/meas':>9}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['phase']:8} {r['tokens']:>6} {r['intensity']:>7.1f} {r['bound']:>8} "
                         f"{r['predicted_s'] * 1e3:>13.1f} {r['measured_s'] * 1e3:>12.1f} "
                         f"{r['predicted_over_measured']:>9.2f}")
        return "\n".join(lines) + "\n(FLOPs and bytes per point: the costs printed in section 3)"


def compare(config: ModelConfig, prefill_: Sweep, decode_: Sweep, machine: Machine,
            dtype_bytes: float | None = None) -> Comparison:
    """Each measured point next to its roofline prediction: max(bytes ÷ bandwidth, FLOPs ÷ FLOP/s)."""
    b = dtype_bytes or costs.dtype_bytes(getattr(torch, prefill_.dtype))
    rows = []
    for sweep, cost_of in ((prefill_, prefill_cost), (decode_, decode_cost)):
        for n, measured in zip(sweep.lengths, sweep.seconds):
            cost = cost_of(config, n, b)
            predicted = machine.seconds(cost)
            rows.append(dict(phase=sweep.phase, tokens=n, flops=cost.flops, bytes=cost.bytes,
                             weight_bytes=cost.weight_bytes, kv_bytes=cost.kv_bytes,
                             intensity=cost.intensity, bound=machine.bound(cost), predicted_s=predicted,
                             measured_s=measured, predicted_over_measured=predicted / measured,
                             achieved_flops_per_s=cost.flops / measured))
    return Comparison(rows)


def best_roofs(machine: Machine, comparison: Comparison) -> Machine:
    """Raise each roof to the best the machine showed: the probe, or a measured point that beat it.

    A roof is a limit, so no measured point may sit above it: if a prefill reached more FLOP/s than the
    probe's matmul, or a decode step streamed its bytes faster than the probe, the probe under-measured
    (a size its kernels handle worse, a busy moment) and that point is the better estimate of the limit."""
    probe_b = machine.probe_bytes_per_s or machine.bytes_per_s
    probe_f = machine.probe_flops_per_s or machine.flops_per_s
    best_b, src_b, best_f, src_f = probe_b, "probe", probe_f, "probe"
    for r in comparison.rows:
        label = f"{r['phase']} at {'T' if r['phase'] == 'prefill' else 'C'}={r['tokens']}"
        achieved_b = r["bytes"] / r["measured_s"]
        if achieved_b > best_b:
            best_b, src_b = achieved_b, label
        if r["achieved_flops_per_s"] > best_f:
            best_f, src_f = r["achieved_flops_per_s"], label
    return Machine(machine.device, machine.dtype, best_b, best_f, src_b, src_f, probe_b, probe_f,
                   machine.read_bytes_per_s)


def plot_roofline(machine: Machine, comparison: Comparison):
    """Log-log roofline: the memory slope and the matmul ceiling, with every measured point placed
    at its arithmetic intensity (x) and the FLOP/s it achieved (y)."""
    import matplotlib.pyplot as plt
    import numpy as np

    xs = [r["intensity"] for r in comparison.rows]
    lo, hi = min(min(xs), machine.ridge) / 4, max(max(xs), machine.ridge) * 4
    x = np.logspace(math.log10(lo), math.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.plot(x, np.minimum(machine.flops_per_s, machine.bytes_per_s * x) / 1e9, "k-", lw=2,
            label=f"roof: min({machine.bytes_per_s / 1e9:.0f} GB/s × intensity, {machine.flops_per_s / 1e9:.0f} GFLOP/s)")
    ax.axvline(machine.ridge, color="gray", ls=":", lw=1)
    ax.text(machine.ridge, machine.flops_per_s / 1e9 * 0.5, f" ridge: {machine.ridge:.1f} FLOP/byte", fontsize=8,
            color="gray")
    for phase, marker, color in (("prefill", "o", "tab:orange"), ("decode", "s", "tab:blue")):
        rows = [r for r in comparison.rows if r["phase"] == phase]
        ax.scatter([r["intensity"] for r in rows], [r["achieved_flops_per_s"] / 1e9 for r in rows],
                   marker=marker, color=color, zorder=3, label=f"{phase} (measured)")
        for r in rows:
            ax.annotate(f"{'T' if phase == 'prefill' else 'C'}={r['tokens']}",
                        (r["intensity"], r["achieved_flops_per_s"] / 1e9), fontsize=7,
                        xytext=(4, -10 if phase == "decode" else 4), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte moved)",
           ylabel="achieved GFLOP/s", title=f"Roofline of this machine: {machine.device}, {machine.dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
