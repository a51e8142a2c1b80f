"""KV-cache and weight memory, exactly: KV_bytes = 2 · L · B · T · H_kv · D_h · dtype_bytes.

The leading 2 counts K and V. Every function validates its inputs and names the wrong one.
Sizes are in bytes; GiB = 2**30 bytes, GB = 10**9 bytes (the lesson says which it means).
"""
from __future__ import annotations

from numbers import Integral

from .config import PRESETS, ModelConfig

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}
GiB, MiB, KiB = 2 ** 30, 2 ** 20, 2 ** 10
GB, MB = 10 ** 9, 10 ** 6


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def dtype_bytes(dtype) -> float:
    """Bytes per element for a dtype name ('fp16', 'int8', ...) or a number of bytes (e.g. 0.5 for int4)."""
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)} or a number of bytes")
        return DTYPE_BYTES[dtype.lower()]
    if isinstance(dtype, bool) or not isinstance(dtype, (int, float)) or dtype <= 0:
        raise ValueError(f"dtype_bytes must be a positive number of bytes per element, got {dtype!r}")
    return dtype


def kv_cache_bytes(n_layers: int, batch: int, seq_len: int, n_kv_heads: int, head_dim: int, dtype_bytes_=2,
                   n_heads: int | None = None) -> int:
    """2 · L · B · T · H_kv · D_h · dtype_bytes. Give n_heads to also check that H_kv divides it."""
    L = _positive_int("n_layers", n_layers)
    B = _positive_int("batch", batch)
    T = _positive_int("seq_len", seq_len)
    H_kv = _positive_int("n_kv_heads", n_kv_heads)
    D_h = _positive_int("head_dim", head_dim)
    if n_heads is not None and _positive_int("n_heads", n_heads) % H_kv:
        raise ValueError(f"n_kv_heads ({H_kv}) must divide n_heads ({n_heads})")
    total = 2 * L * B * T * H_kv * D_h * dtype_bytes(dtype_bytes_)
    return int(total) if float(total).is_integer() else total


def kv_bytes_per_token(config: ModelConfig | str, dtype="fp16") -> int:
    """Cache bytes one token adds (B = 1, T = 1)."""
    c = _config(config)
    return kv_cache_bytes(c.n_layers, 1, 1, c.n_kv_heads, c.head_dim, dtype, n_heads=c.n_heads)


def kv_cache_bytes_for(config: ModelConfig | str, seq_len: int, batch: int = 1, dtype="fp16",
                       beam_width: int = 1) -> int:
    """Cache bytes for a model preset; beam search keeps one cache per beam (× beam_width)."""
    c = _config(config)
    beams = _positive_int("beam_width", beam_width)
    return kv_cache_bytes(c.n_layers, batch * beams, seq_len, c.n_kv_heads, c.head_dim, dtype, n_heads=c.n_heads)


def weights_bytes(config: ModelConfig | str, dtype="fp16") -> int:
    """Bytes of the parameters at a dtype (tied embeddings counted once)."""
    c = _config(config)
    return int(c.n_params * dtype_bytes(dtype))


def max_context(config: ModelConfig | str, memory_bytes: int, batch: int = 1, dtype="fp16",
                weights_dtype=None) -> int:
    """Longest T whose cache fits in memory_bytes after the weights (0 if the weights alone don't fit)."""
    free = _positive_int("memory_bytes", memory_bytes) - weights_bytes(config, weights_dtype or dtype)
    per_token = kv_bytes_per_token(config, dtype) * _positive_int("batch", batch)
    return max(0, int(free // per_token))


def max_batch(config: ModelConfig | str, memory_bytes: int, seq_len: int, dtype="fp16", weights_dtype=None) -> int:
    """Most sequences of length seq_len whose caches fit in memory_bytes after the weights."""
    free = _positive_int("memory_bytes", memory_bytes) - weights_bytes(config, weights_dtype or dtype)
    per_sequence = kv_bytes_per_token(config, dtype) * _positive_int("seq_len", seq_len)
    return max(0, int(free // per_sequence))


def crossover_context(config: ModelConfig | str, batch: int = 1, dtype="fp16") -> int:
    """The context length at which the KV cache outweighs the weights."""
    per_token = kv_bytes_per_token(config, dtype) * _positive_int("batch", batch)
    return -(-weights_bytes(config, dtype) // per_token)


def human_bytes(n: float, binary: bool = True) -> str:
    """1536 → '1.50 KiB' (binary) or '1.54 kB' (decimal)."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000, ["B", "kB", "MB", "GB", "TB"])
    n = float(n)
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= base
    return f"{n:.2f} {units[-1]}"


def _config(config: ModelConfig | str) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, str):
        return ModelConfig.from_name(config)
    raise ValueError(f"config must be a ModelConfig or a preset name ({sorted(PRESETS)}), got {config!r}")
