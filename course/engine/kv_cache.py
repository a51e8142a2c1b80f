"""The KV cache: preallocated K and V buffers, one pair per layer, written in place.

Shape of every buffer: [B, H_kv, T_max, D_h]. Nothing is hidden in global state: the cache is
created by the caller and passed to the model explicitly, so a learner can print it, measure
its bytes and throw it away.

    update(start_pos: int, k, v)   every row at positions start_pos .. start_pos+T-1 (a prompt, a decode step)
    update(Positions, k, v)        each sequence at its own positions, in the cache row it names
                                   (course.engine.positions: requests of different lengths decoded together)

In the second, row b of the returned keys holds sequence b's positions 0 .. kv_len-1 (kv_len = the furthest end);
positions a shorter sequence has not reached are stale, and `Positions.mask` hides them.
"""
from __future__ import annotations

import torch

from course.engine.config import ModelConfig
from course.engine.positions import Positions


class LayerKVCache:
    """K and V for one layer: two preallocated [B, H_kv, T_max, D_h] tensors."""

    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (batch, n_kv_heads, max_seq_len, head_dim)  # [B, H_kv, T_max, D_h]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_seq_len(self):
        return self.k.shape[2]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer this layer holds (what its bytes are made of)."""
        return self.k, self.v

    def update(self, pos: int | Positions, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([B, H_kv, T_new, D_h]) at their positions; return every position so far, [B, H_kv, end, D_h].

        Writing at an earlier position overwrites what was there (how speculative decoding throws away
        rejected draft tokens).
        """
        end = self.check(pos, k.shape[2])
        self.write(self.k, pos, k)
        self.write(self.v, pos, v)
        return self.read(self.k, pos, end), self.read(self.v, pos, end)

    def check(self, pos: int | Positions, n_new: int) -> int:
        """The end of the write (one past the last position); ValueError if it leaves the buffers."""
        first, end, rows = (min(pos.start), pos.kv_len, pos.rows) if isinstance(pos, Positions) else \
            (pos, pos + n_new, None)
        if first < 0 or end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {first}..{end - 1} do not fit in a cache of "
                             f"{self.max_seq_len} tokens; create the cache with a larger max_seq_len")
        if rows is not None and not 0 <= min(rows) <= max(rows) < self.k.shape[0]:
            raise ValueError(f"cache rows {rows} do not exist in a cache of {self.k.shape[0]} rows")
        return end

    @staticmethod
    def write(buffer: torch.Tensor, pos: int | Positions, x: torch.Tensor) -> None:
        if isinstance(pos, Positions):  # each sequence in its own row: [B, T, H_kv, D_h] into (row, position) pairs
            buffer[pos.token_rows(buffer.device), :, pos.positions.to(buffer.device)] = x.transpose(1, 2)
        else:
            buffer[:, :, pos:pos + x.shape[2]] = x

    @staticmethod
    def read(buffer: torch.Tensor, pos: int | Positions, end: int) -> torch.Tensor:
        if isinstance(pos, Positions):
            return pos.arrange(buffer[pos.row_index(buffer.device), :, :end])  # [B, H_kv, kv_len, D_h]
        return buffer[:, :, :end]  # a view, no copy


class KVCache:
    """All layers' caches for one batch of sequences."""

    layer_class = LayerKVCache  # a variant cache (e.g. INT8) swaps in its own layer type

    def __init__(self, config: ModelConfig, batch: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        max_seq_len = max_seq_len or config.max_seq_len
        if batch <= 0 or max_seq_len <= 0:
            raise ValueError(f"batch and max_seq_len must be positive, got {batch} and {max_seq_len}")
        self.config = config
        self.layers = [self.layer_class(batch, config.n_kv_heads, max_seq_len, config.head_dim, dtype, device)
                       for _ in range(config.n_layers)]

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def max_seq_len(self):
        return self.layers[0].max_seq_len

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers: 2 · L · B · T_max · H_kv · D_h · dtype_bytes for the plain cache."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())
