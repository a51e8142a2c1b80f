"""Preallocation vs paging: how much KV-cache memory a batch of real-looking requests reserves.

A server that preallocates gives every request a [H_kv, max_seq_len, D_h] slab per layer the moment it
arrives, however short the request turns out to be. A paged cache (the idea behind vLLM's
PagedAttention, Kwon et al. 2023; lesson 5 builds one) hands out fixed-size blocks of `block_size` tokens as a sequence grows,
so a request wastes at most one partly filled block.

    reserved, preallocated = N · max_seq_len · bytes_per_token
    reserved, paged        = Σ ceil(len_i / block_size) · block_size · bytes_per_token
    used                   = Σ len_i · bytes_per_token
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from course.measure.costs import _config, _positive_int, kv_bytes_per_token


def sample_request_lengths(n_requests: int = 64, max_seq_len: int = 4096, seed: int = 0,
                           prompt_median: int = 400, output_median: int = 250) -> np.ndarray:
    """Total tokens (prompt + output) of n_requests chat requests: two log-normals, capped at max_seq_len.

    Log-normal lengths (many short requests, a long tail) are what published serving traces show; the
    medians are adjustable. Returns an int array of lengths in [1, max_seq_len].
    """
    n = _positive_int("n_requests", n_requests)
    cap = _positive_int("max_seq_len", max_seq_len)
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(math.log(_positive_int("prompt_median", prompt_median)), 1.0, n)
    outputs = rng.lognormal(math.log(_positive_int("output_median", output_median)), 0.8, n)
    return np.clip(np.round(prompts + outputs), 1, cap).astype(int)


def blocks_needed(length: int, block_size: int = 16) -> int:
    """Blocks a sequence of `length` tokens occupies: ceil(length / block_size)."""
    return -(-_positive_int("length", length) // _positive_int("block_size", block_size))


class BlockAllocator:
    """A pool of fixed-size KV blocks and one block table per sequence (the bookkeeping of a paged cache)."""

    def __init__(self, num_blocks: int, block_size: int = 16):
        self.block_size = _positive_int("block_size", block_size)
        self.free_blocks = list(range(_positive_int("num_blocks", num_blocks) - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}  # sequence id → physical block ids, in token order
        self.lengths: dict[int, int] = {}

    def append(self, seq_id: int, n_tokens: int = 1) -> list[int]:
        """Grow a sequence by n_tokens, taking a new block only when its last one is full."""
        table = self.tables.setdefault(seq_id, [])
        length = self.lengths.get(seq_id, 0) + _positive_int("n_tokens", n_tokens)
        while len(table) * self.block_size < length:
            if not self.free_blocks:
                raise MemoryError(f"out of KV blocks while growing sequence {seq_id}; free a finished sequence")
            table.append(self.free_blocks.pop())
        self.lengths[seq_id] = length
        return table

    def free(self, seq_id: int):
        """Return a finished sequence's blocks to the pool."""
        self.free_blocks.extend(reversed(self.tables.pop(seq_id, [])))
        self.lengths.pop(seq_id, None)

    @property
    def blocks_in_use(self) -> int:
        return sum(len(t) for t in self.tables.values())


class ReservedBytes:
    """Bytes the tokens use against the bytes reserved two ways: a max-length slot per request (preallocated) or
    fixed-size blocks on demand (paged). Subclasses have used_bytes, preallocated_bytes and paged_bytes."""

    @property
    def preallocated_waste(self) -> float:
        """Share of the preallocated cache that never holds a token."""
        return 1 - self.used_bytes / self.preallocated_bytes

    @property
    def paged_waste(self) -> float:
        """Share of the paged blocks' bytes that hold nothing (the last block of each request, partly filled)."""
        return 1 - self.used_bytes / self.paged_bytes

    @property
    def saving(self) -> float:
        """preallocated / paged reserved bytes."""
        return self.preallocated_bytes / self.paged_bytes


@dataclass
class PagingReport(ReservedBytes):
    lengths: np.ndarray  # tokens per request
    max_seq_len: int
    block_size: int
    bytes_per_token: int
    used_bytes: int
    preallocated_bytes: int
    paged_bytes: int
    blocks_per_request: list[int] = field(default_factory=list)

    def values(self) -> dict:
        return {"paging_preallocated_waste": self.preallocated_waste, "paging_paged_waste": self.paged_waste,
                "paging_block_size": self.block_size, "paging_lengths": [int(n) for n in self.lengths],
                "paging_blocks": list(self.blocks_per_request), "paging_saving": self.saving}

    def __str__(self) -> str:
        from course.measure.costs import human_bytes

        return (f"{len(self.lengths)} requests, {int(self.lengths.sum()):,} tokens: used {human_bytes(self.used_bytes)}; "
                f"preallocated {human_bytes(self.preallocated_bytes)} ({self.preallocated_waste:.0%} empty); "
                f"paged {human_bytes(self.paged_bytes)} ({self.paged_waste:.1%} empty), "
                + (f"{self.saving:.1f}× less reserved" if self.saving >= 1 else
                   f"{1 / self.saving:.1f}× MORE reserved than preallocation"))


def simulate_paging(config="smollm2-135m", n_requests: int = 64, max_seq_len: int = 4096, block_size: int = 16,
                    dtype="fp16", seed: int = 0, lengths=None) -> PagingReport:
    """Reserve cache for a batch of requests both ways; the paged side grows each request in a real BlockAllocator."""
    c = _config(config)
    max_seq_len = _positive_int("max_seq_len", max_seq_len)
    block_size = _positive_int("block_size", block_size)
    if lengths is None:
        lengths = sample_request_lengths(n_requests, max_seq_len, seed)
    lengths = np.asarray(lengths, dtype=int)
    if lengths.size == 0 or lengths.min() < 1 or lengths.max() > max_seq_len:
        raise ValueError(f"lengths must be between 1 and max_seq_len={max_seq_len} tokens")
    per_token = kv_bytes_per_token(c, dtype)
    allocator = BlockAllocator(int(sum(blocks_needed(int(n), block_size) for n in lengths)), block_size)
    for seq_id, n in enumerate(lengths):
        allocator.append(seq_id, int(n))
    blocks = [len(allocator.tables[i]) for i in range(len(lengths))]
    return PagingReport(lengths, max_seq_len, block_size, per_token, int(lengths.sum()) * per_token,
                        len(lengths) * max_seq_len * per_token, allocator.blocks_in_use * block_size * per_token,
                        blocks)


def plot_paging(report: PagingReport):
    """Left: per request, reserved-but-empty token slots under each scheme. Right: total bytes, with the waste."""
    import matplotlib.pyplot as plt

    from course.measure.costs import human_bytes

    order = np.argsort(report.lengths)
    lengths = report.lengths[order]
    x = np.arange(len(order))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [2.2, 1]})
    paged_waste = np.array(report.blocks_per_request)[order] * report.block_size - lengths
    a.bar(x - 0.2, report.max_seq_len - lengths, width=0.4, color="#e06666",
          label=f"preallocated to max_seq_len = {report.max_seq_len:,}")
    a.bar(x + 0.2, np.maximum(paged_waste, 0.5), width=0.4, color="tab:blue",
          label=f"paged, {report.block_size}-token blocks (0 drawn as 0.5)")
    a.set(xlabel="request (sorted by length)", ylabel="empty token slots (log)", yscale="log",
          title="Waste per request: reserved minus used")
    a.set_ylim(0.3, report.max_seq_len * 40)  # headroom for the legend above the bars
    a.legend(loc="upper center", fontsize=8, ncol=2)
    names = ["used", "paged", "preallocated"]
    values = [report.used_bytes, report.paged_bytes, report.preallocated_bytes]
    b.bar(names, [v / 2 ** 20 for v in values], color=["gray", "tab:blue", "#e06666"])
    for i, v in enumerate(values):
        b.text(i, v / 2 ** 20, human_bytes(v), ha="center", va="bottom", fontsize=8)
    b.set(ylabel="MiB of KV cache", title=f"Waste: {report.preallocated_waste:.0%} preallocated, "
          f"{report.paged_waste:.1%} paged")
    b.title.set_fontsize(9)
    fig.tight_layout()
    return fig
