"""The KV cache: preallocated K and V buffers, one pair per layer, written in place.

Shape of every buffer: [B, H_kv, T_max, D_h]. Nothing is hidden in global state: the cache is
created by the caller and passed to the model explicitly, so a learner can print it, measure
its bytes and throw it away.
"""
from __future__ import annotations

import torch

from course.engine.config import ModelConfig


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
        end = self.check_fits(start_pos, k.shape[2])
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


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
