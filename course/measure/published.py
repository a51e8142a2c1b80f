"""Published hardware figures, each with its source, and the worked datacenter example built from them.

Nothing here is measured on the learner's machine: these are the numbers a lesson compares its own
measurements with. Each figure names where it comes from, so a sentence that quotes it can cite it.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

from course.measure.costs import weights_bytes


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_per_s: float  # off-chip memory bandwidth
    bf16_flops_per_s: float  # dense BF16 tensor-core peak (no sparsity)
    source: str
    sram_bytes_per_s: float | None = None  # on-chip SRAM bandwidth, where a source states one
    sram_source: str = ""
    sram_beside_hbm: float | None = None  # the HBM bandwidth that source gives beside its SRAM figure
    sram_beside_name: str = ""  # the card that source describes (it may be another model of this GPU)

    @property
    def sram_over_hbm(self) -> float:
        """SRAM ÷ HBM as the source states them, side by side (one card's figures, not a mix of two)."""
        return (self.sram_bytes_per_s or 0) / (self.sram_beside_hbm or self.hbm_bytes_per_s)

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the compute roof meets the HBM roof."""
        return self.bf16_flops_per_s / self.hbm_bytes_per_s


A100 = Accelerator("NVIDIA A100 80GB SXM", 2.039e12, 312e12, "NVIDIA A100 Tensor Core GPU datasheet",
                   19e12, "Dao et al., FlashAttention (NeurIPS 2022), Figure 1", 1.5e12, "A100 40GB")
H100 = Accelerator("NVIDIA H100 SXM", 3.35e12, 989e12, "NVIDIA H100 Tensor Core GPU datasheet")
ACCELERATORS = {"a100": A100, "h100": H100}


@dataclass(frozen=True)
class DatacenterExample:
    """Batch-1 decode of a model in FP16 on one accelerator: the bandwidth floor, and how far decode's
    arithmetic intensity sits below the ridge."""
    model: str
    gpu: Accelerator
    weight_bytes: int

    @property
    def floor_s(self) -> float:
        """Each decode step streams every weight once: bytes ÷ HBM bandwidth (the cache adds more)."""
        return self.weight_bytes / self.gpu.hbm_bytes_per_s

    @property
    def decode_intensity(self) -> float:
        """2 FLOPs per parameter over 2 bytes per parameter: 1 FLOP/byte in FP16 at batch 1."""
        return 2 / 2

    def values(self) -> dict:
        return {"dc_model": self.model, "dc_gpu": self.gpu.name, "dc_weight_gb": self.weight_bytes / 1e9,
                "dc_floor_ms": self.floor_s * 1e3, "dc_ridge": self.gpu.ridge,
                "dc_sram_over_hbm": self.gpu.sram_over_hbm}

    def __str__(self) -> str:
        g = self.gpu
        lines = [
            f"{self.model} in FP16: {self.weight_bytes / 1e9:.1f} GB of weights. On an {g.name} "
            f"({g.hbm_bytes_per_s / 1e12:.2f} TB/s HBM, {g.bf16_flops_per_s / 1e12:.0f} TFLOP/s BF16; {g.source}):",
            f"  decode floor = {self.weight_bytes / 1e9:.1f} GB ÷ {g.hbm_bytes_per_s / 1e12:.2f} TB/s = "
            f"{self.floor_s * 1e3:.1f} ms per token at batch 1 ({1 / self.floor_s:.0f} tokens/s at most)",
            f"  ridge = {g.bf16_flops_per_s / 1e12:.0f} TFLOP/s ÷ {g.hbm_bytes_per_s / 1e12:.2f} TB/s = "
            f"{g.ridge:.0f} FLOP/byte; batch-1 decode does {self.decode_intensity:.0f} FLOP/byte, "
            f"{g.ridge / self.decode_intensity:.0f}× below it: the tensor cores mostly wait for memory"]
        if g.sram_bytes_per_s:
            lines.append(
                f"  on-chip SRAM: {g.sram_bytes_per_s / 1e12:.0f} TB/s, {g.sram_over_hbm:.0f}× the HBM beside it "
                f"({(g.sram_beside_hbm or g.hbm_bytes_per_s) / 1e12:.1f} TB/s"
                + (f" on the {g.sram_beside_name}" if g.sram_beside_name else "") + f"; {g.sram_source}). "
                "FlashAttention computes attention in SRAM-sized tiles so the T×T scores never travel to HBM "
                "and back.")
        return "\n".join(textwrap.fill(line, 108, subsequent_indent="    ", break_on_hyphens=False) for line in lines)


def datacenter_example(model: str = "llama-2-7b", gpu: str = "a100") -> DatacenterExample:
    if gpu not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {gpu!r}; choose one of {sorted(ACCELERATORS)}")
    return DatacenterExample(model, ACCELERATORS[gpu], weights_bytes(model, "fp16"))
