"""The KV cache: preallocated K and V buffers, one pair per layer, written in place.

Shape of every buffer: [B, H_kv, T_max, D_h]. Nothing is hidden in global state: the cache is
created by the caller and passed to the model explicitly, so a learner can print it, measure
its bytes and throw it away.

Two ways to write:
    update(start_pos: int, k, v)            every row of the batch at the same positions (one prompt, or
                                            B prompts of equal length): the path every lesson uses
    update(BatchPositions, k, v)            each sequence at its own position, in the cache rows it names:
                                            B requests of different lengths decoded in one step
In the second, row b of the returned keys holds sequence b's positions 0..kv_len-1 (kv_len = the longest
sequence's end); positions a shorter sequence has not reached are stale and `BatchPositions.mask` hides them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from course.engine.config import ModelConfig


@dataclass
class BatchPositions:
    """Where each sequence of a batch writes its T new tokens: sequence b at start[b] .. start[b] + T - 1.

    start: one position per sequence (Python ints: finding the longest needs no device sync).
    rows: the cache rows holding the sequences (None: rows 0..B-1), so a scheduler can decode any subset
    of its slots. The tensors below are built once per model call and shared by every layer.
    """
    start: list[int]
    n_new: int
    device: torch.device | str = "cpu"
    rows: list[int] | None = None
    positions: torch.Tensor = field(init=False, repr=False)  # [B, T] absolute position of every new token
    mask: torch.Tensor = field(init=False, repr=False)  # [B, 1, T, kv_len] True where a query may see a key

    def __post_init__(self):
        self.start = [int(p) for p in self.start]
        if not self.start:
            raise ValueError("BatchPositions needs at least one sequence")
        if min(self.start) < 0 or self.n_new <= 0:
            raise ValueError(f"positions must be >= 0 and n_new > 0, got start={self.start}, n_new={self.n_new}")
        if self.rows is not None:
            self.rows = [int(r) for r in self.rows]
            if len(self.rows) != len(self.start):
                raise ValueError(f"{len(self.rows)} cache rows for {len(self.start)} sequences; give one row each")
        start = torch.tensor(self.start, dtype=torch.long, device=self.device)  # [B]
        self.positions = start[:, None] + torch.arange(self.n_new, device=self.device)  # [B, T]
        keys = torch.arange(self.kv_len, device=self.device)  # [kv_len]
        self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]  # [B, 1, T, kv_len]

    @classmethod
    def of(cls, start, n_new: int, device="cpu") -> "BatchPositions":
        """A BatchPositions from an existing one (returned as is), a list of ints or a [B] tensor."""
        if isinstance(start, BatchPositions):
            if start.n_new != n_new:
                raise ValueError(f"BatchPositions was built for {start.n_new} new tokens per sequence, "
                                 f"the call has {n_new}")
            return start
        if isinstance(start, torch.Tensor):
            start = start.flatten().tolist()
        return cls(list(start), n_new, device)

    @property
    def batch(self) -> int:
        return len(self.start)

    @property
    def end(self) -> list[int]:
        """One past each sequence's last new position: its length after this call."""
        return [p + self.n_new for p in self.start]

    @property
    def kv_len(self) -> int:
        """Keys attention reads per sequence: the longest sequence's end."""
        return max(self.start) + self.n_new


@dataclass
class PackedPositions:
    """B sequences with DIFFERENT numbers of new tokens in one call, packed in one row: tokens [1, N].

    Sequence b contributes n_new[b] tokens at positions start[b]..start[b] + n_new[b] - 1; N = Σ n_new. This is
    how a continuous-batching step runs a new request's prompt and the running requests' next tokens through
    the weights together (Orca's selective batching): every matmul sees N rows; only attention must keep the
    sequences apart. Attention reads all B sequences' keys laid side by side, [1, H_kv, B · kv_len, D_h], under a
    block-diagonal causal mask — plain SDPA computes the masked scores too (cheap for a few sequences; fused
    variable-length kernels such as FlashAttention's skip them).
    """
    start: list[int]
    n_new: list[int]
    device: torch.device | str = "cpu"
    rows: list[int] | None = None
    positions: torch.Tensor = field(init=False, repr=False)  # [N] absolute position of every new token
    sequence: torch.Tensor = field(init=False, repr=False)  # [N] which sequence (0..B-1) each token belongs to
    last_index: torch.Tensor = field(init=False, repr=False)  # [B] index in N of each sequence's last token
    mask: torch.Tensor = field(init=False, repr=False)  # [1, 1, N, B · kv_len]

    def __post_init__(self):
        self.start, self.n_new = [int(p) for p in self.start], [int(n) for n in self.n_new]
        if not self.start or len(self.start) != len(self.n_new):
            raise ValueError(f"give one start and one n_new per sequence, got {self.start} and {self.n_new}")
        if min(self.start) < 0 or min(self.n_new) <= 0:
            raise ValueError(f"positions must be >= 0 and n_new > 0, got start={self.start}, n_new={self.n_new}")
        if self.rows is not None:
            self.rows = [int(r) for r in self.rows]
            if len(self.rows) != len(self.start):
                raise ValueError(f"{len(self.rows)} cache rows for {len(self.start)} sequences; give one row each")
        dev, B, L = self.device, len(self.start), self.kv_len
        counts = torch.tensor(self.n_new, device=dev)
        self.sequence = torch.repeat_interleave(torch.arange(B, device=dev), counts)  # [N]
        first = torch.cumsum(counts, 0) - counts  # [B] where each sequence's tokens begin
        offset = torch.arange(int(sum(self.n_new)), device=dev) - first[self.sequence]  # [N] 0..n_new[b]-1
        self.positions = torch.tensor(self.start, device=dev)[self.sequence] + offset  # [N]
        self.last_index = first + counts - 1
        key_seq = torch.arange(B, device=dev).repeat_interleave(L)  # [B·L] the sequence of each key slot
        key_pos = torch.arange(L, device=dev).repeat(B)  # [B·L] its position
        self.mask = ((key_seq[None, :] == self.sequence[:, None])
                     & (key_pos[None, :] <= self.positions[:, None]))[None, None]  # [1, 1, N, B·L]

    @property
    def batch(self) -> int:
        return len(self.start)

    @property
    def n_tokens(self) -> int:
        return sum(self.n_new)

    @property
    def end(self) -> list[int]:
        return [p + n for p, n in zip(self.start, self.n_new)]

    @property
    def kv_len(self) -> int:
        """Key positions read per sequence: the longest sequence's end."""
        return max(self.end)


def side_by_side(keys: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, L, D_h] → [1, H_kv, B·L, D_h]: every sequence's keys in one row, for a PackedPositions call."""
    B, H, L, D = keys.shape
    return keys.transpose(0, 1).reshape(1, H, B * L, D)


class LayerKVCache:
    """K and V for one layer: two preallocated [B, H_kv, T_max, D_h] tensors."""

    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (batch, n_kv_heads, max_seq_len, head_dim)  # [B, H_kv, T_max, D_h]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def check_fits(self, start_pos: int, n_new: int) -> int:
        """The end position of a write of n_new tokens at start_pos; ValueError if it overflows."""
        if isinstance(start_pos, (BatchPositions, PackedPositions)):
            raise TypeError(f"{type(self).__name__} writes every row at one start_pos; use course.engine.kv_cache."
                            "KVCache (or course.engine.paged.PagedKVCache) for per-sequence positions")
        end = start_pos + n_new
        if start_pos < 0 or end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: positions {start_pos}..{end - 1} do not fit in a cache of "
                f"{self.max_seq_len} tokens; create the cache with a larger max_seq_len"
            )
        return end

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer this layer holds (what its bytes are made of)."""
        return self.k, self.v

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([B, H_kv, T_new, D_h]) at positions start_pos..start_pos+T_new-1.

        Returns the keys and values of every position so far: [B, H_kv, start_pos+T_new, D_h].
        Writing at an earlier start_pos overwrites what was there (how speculative decoding
        throws away rejected draft tokens).
        """
        if isinstance(start_pos, (BatchPositions, PackedPositions)):
            return self.update_rows(start_pos, k, v)
        end = self.check_fits(start_pos, k.shape[2])
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def update_rows(self, at: BatchPositions, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write sequence b's k, v ([B, H_kv, T_new, D_h]) in cache row at.rows[b] at positions at.start[b]...

        Returns [B, H_kv, kv_len, D_h]: the rows of this batch, every position up to the longest end
        (a view when the rows are consecutive, a gathered copy otherwise).
        """
        if isinstance(at, PackedPositions):
            return self._update_packed(at, k, v)
        B, T = k.shape[0], k.shape[2]
        rows = list(range(B)) if at.rows is None else at.rows
        if at.batch != B or at.n_new != T:
            raise ValueError(f"positions for {at.batch} sequences × {at.n_new} tokens, but k is {list(k.shape)}")
        self._check_rows(rows, at.kv_len)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.k.device)[:, None].expand(B, T)  # [B, T]
        pos = at.positions.to(self.k.device)  # [B, T]
        self.k[row_index, :, pos] = k.transpose(1, 2)  # [B, T, H_kv, D_h] into (row, position) pairs
        self.v[row_index, :, pos] = v.transpose(1, 2)
        first = rows[0]
        if rows == list(range(first, first + B)):  # consecutive rows: a view, no copy
            return self.k[first:first + B, :, :at.kv_len], self.v[first:first + B, :, :at.kv_len]
        index = row_index[:, 0]
        return self.k[index, :, :at.kv_len], self.v[index, :, :at.kv_len]  # [B, H_kv, kv_len, D_h]

    def _check_rows(self, rows: list[int], kv_len: int) -> None:
        if max(rows) >= self.k.shape[0] or min(rows) < 0:
            raise ValueError(f"cache rows {rows} do not exist in a cache of {self.k.shape[0]} rows")
        if kv_len > self.max_seq_len:
            raise ValueError(f"KV cache overflow: a sequence reaches position {kv_len - 1} in a cache of "
                             f"{self.max_seq_len} tokens; create the cache with a larger max_seq_len")

    def _update_packed(self, at: PackedPositions, k: torch.Tensor, v: torch.Tensor):
        """k, v: [1, H_kv, N, D_h] of packed sequences → their keys side by side, [1, H_kv, B·kv_len, D_h]."""
        rows = list(range(at.batch)) if at.rows is None else at.rows
        if k.shape[0] != 1 or k.shape[2] != at.n_tokens:
            raise ValueError(f"packed positions for {at.n_tokens} tokens in one row, but k is {list(k.shape)}")
        self._check_rows(rows, at.kv_len)
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.k.device)  # [B]
        token_row = rows_t[at.sequence.to(self.k.device)]  # [N]
        pos = at.positions.to(self.k.device)  # [N]
        self.k[token_row, :, pos] = k[0].transpose(0, 1)  # [N, H_kv, D_h]
        self.v[token_row, :, pos] = v[0].transpose(0, 1)
        return side_by_side(self.k[rows_t, :, :at.kv_len]), side_by_side(self.v[rows_t, :, :at.kv_len])


class KVCache:
    """All layers' caches for one batch of sequences."""

    layer_class = LayerKVCache  # a variant cache (e.g. INT8) swaps in its own layer type

    def __init__(self, config: ModelConfig, batch: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        max_seq_len = max_seq_len or config.max_seq_len
        if batch <= 0 or max_seq_len <= 0:
            raise ValueError(f"batch and max_seq_len must be positive, got {batch} and {max_seq_len}")
        self.config = config
        self.layers = [
            self.layer_class(batch, config.n_kv_heads, max_seq_len, config.head_dim, dtype, device)
            for _ in range(config.n_layers)
        ]

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def max_seq_len(self) -> int:
        return self.layers[0].max_seq_len

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers: 2 · L · B · T_max · H_kv · D_h · dtype_bytes for the plain cache."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())
