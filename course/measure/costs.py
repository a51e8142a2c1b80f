"""KV-cache and weight memory, exactly: KV_bytes = 2 · L · B · T · H_kv · D_h · dtype_bytes.

The leading 2 counts K and V. Every function validates its inputs and names the wrong one.
Sizes are in bytes; GiB = 2**30 bytes, GB = 10**9 bytes (the lesson says which it means).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Sequence

from course.engine.config import PRESETS, ModelConfig

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
    """Bytes per element for a dtype name ('fp16', 'int8', ...), a torch.dtype, or a number of bytes (e.g. 0.5
    for int4). The one place in the course that knows how big an element is."""
    if type(dtype).__name__ == "dtype" and hasattr(dtype, "itemsize"):  # a torch.dtype (torch not imported here)
        return dtype.itemsize
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


# Long-context models the lessons quote where Llama-2's 4,096-token context falls short. Same cache shape as a
# Llama-2 neighbour (Llama-3.1-70B: L = 80, H_kv = 8, D_h = 128, as Llama-2-70B), so the same bytes per token.
LONG_CONTEXT: dict[str, ModelConfig] = {
    "llama-3.1-8b": PRESETS["llama-3-8b"].with_(name="llama-3.1-8b", max_seq_len=131_072,
                                                  source="meta-llama/Llama-3.1-8B config.json"),
    "llama-3.1-70b": ModelConfig("llama-3.1-70b", n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, dim=8192,
                                 ffn_dim=28672, vocab_size=128256, max_seq_len=131_072, rope_theta=500_000.0,
                                 source="meta-llama/Llama-3.1-70B config.json"),
}


def _config(config: ModelConfig | str) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, str):
        if config.lower() in LONG_CONTEXT:
            return LONG_CONTEXT[config.lower()]
        return ModelConfig.from_name(config)
    raise ValueError(f"config must be a ModelConfig or a preset name ({sorted(PRESETS)}), got {config!r}")


# ---------------------------------------------------------------------------------------------------
# Lesson 02 helpers: the formula spelled out, the commonly quoted table, head-count variants, measured bytes.

def kv_formula(config: ModelConfig | str, seq_len: int, batch: int = 1, dtype="fp16", beam_width: int = 1) -> str:
    """The formula with the numbers plugged in, e.g. '2 · L=32 · B=1 · T=4,096 · H_kv=32 · D_h=128 · 2 B = ...'."""
    c = _config(config)
    total = kv_cache_bytes_for(c, seq_len, batch, dtype, beam_width)
    rows = f"B={batch}" if beam_width == 1 else f"B={batch}×beams={beam_width}"
    return (f"2 · L={c.n_layers} · {rows} · T={seq_len:,} · H_kv={c.n_kv_heads} · D_h={c.head_dim} · "
            f"{dtype_bytes(dtype):g} B = {total:,} B ({human_bytes(total)}, {human_bytes(total, binary=False)})")


# KV-cache sizes as commonly quoted (FP16): model, context T, batch B, the figure quoted, and the model it is quoted
# for where that model's window is shorter than T (Llama-2-70B: 4,096 tokens; shown for Llama-3.1-70B, same cache
# shape). "128k" is ambiguous: 128,000 tokens give the quoted "~39 GB" (in GiB), 131,072 give 40 GiB / 42.9 GB.
QUOTED_KV_TABLE = (
    ("llama-2-7b", 4096, 1, "2 GB", None),
    ("llama-2-7b", 4096, 8, "16 GB", None),
    ("gpt2-124m", 1024, 1, "~36 MB", None),
    ("llama-3.1-70b", 128_000, 1, "~39 GB", "llama-2-70b"),
    ("llama-3.1-70b", 131_072, 1, "~39 GB", "llama-2-70b"),
    ("llama-3.1-70b", 32_000, 4, "≈ 40 GB", "llama-2-70b"),
)


def quoted_kv_table(dtype="fp16") -> list[dict]:
    """The quoted table recomputed from the presets (bytes per token, total bytes) and measured on a real KVCache of
    each shape (on the meta device: shapes without memory)."""
    rows = []
    for name, seq_len, batch, quoted, quoted_for in QUOTED_KV_TABLE:
        total = kv_cache_bytes_for(name, seq_len, batch, dtype)
        rows.append(dict(model=name, seq_len=seq_len, batch=batch, bytes_per_token=kv_bytes_per_token(name, dtype),
                         total_bytes=total, GiB=total / GiB, GB=total / GB, MiB=total / MiB, quoted=quoted,
                         measured_bytes=measure_kv_cache_bytes(name, seq_len, batch, dtype),
                         **({"quoted_for": quoted_for} if quoted_for else {})))
    return rows


def crossover_table(models=("smollm2-135m", "llama-2-7b", "llama-3.1-8b", "llama-3.1-70b"), batches=(1, 8),
                    dtype="fp16") -> list[dict]:
    """Per model: weights, cache per token, context window, and the context at which the cache outweighs the weights
    for each batch size."""
    return [dict(model=name, weights_bytes=weights_bytes(name, dtype), window=_config(name).max_seq_len,
                 kv_bytes_per_token=kv_bytes_per_token(name, dtype),
                 crossover={b: crossover_context(name, b, dtype) for b in batches}) for name in models]


def kv_head_variants(config: ModelConfig | str, seq_len: int, batch: int = 1, dtype="fp16") -> list[dict]:
    """The same model with every valid KV-head count (each divisor of H): MHA (H_kv = H), GQA, MQA (H_kv = 1).

    Only H_kv changes; layers, head dim and query heads stay, so the cache scales exactly with H_kv.
    """
    c = _config(config)
    rows = []
    for h_kv in (h for h in range(c.n_heads, 0, -1) if c.n_heads % h == 0):
        kind = "MHA" if h_kv == c.n_heads else "MQA" if h_kv == 1 else "GQA"
        variant = c.with_(n_kv_heads=h_kv)
        rows.append(dict(kind=kind, n_kv_heads=h_kv, group_size=c.n_heads // h_kv,
                         bytes_per_token=kv_bytes_per_token(variant, dtype),
                         total_bytes=kv_cache_bytes_for(variant, seq_len, batch, dtype),
                         is_original=h_kv == c.n_kv_heads))
    return rows


def tensor_bytes(obj) -> int:
    """Measured bytes of every tensor reachable in obj, each storage counted once.

    Works on our KVCache (its .layers), transformers' DynamicCache, tensors, and lists/tuples/dicts of them.
    Views of one buffer count once (by storage), so a cache's `update` return values add nothing.
    """
    import torch

    seen, total = set(), 0

    def visit(x, depth=0):
        nonlocal total
        if depth > 6 or x is None:
            return
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":  # no storage to point at: key by the tensor a view was taken from
                base = x if x._base is None else x._base
                key, size = ("meta", id(base)), base.numel() * base.element_size()
            else:
                storage = x.untyped_storage()
                key, size = (x.device.type, storage.data_ptr()), storage.nbytes()
            if key not in seen:
                seen.add(key)
                total += size
        elif isinstance(x, (dict, list, tuple)) or hasattr(x, "__dict__") and not isinstance(x, type):
            items = x if isinstance(x, (list, tuple)) else x.values() if isinstance(x, dict) else vars(x).values()
            for item in items:
                visit(item, depth + 1)

    visit(obj)
    return total


def measure_kv_cache_bytes(config: ModelConfig | str, seq_len: int, batch: int = 1, dtype="fp16",
                           device: str = "meta") -> int:
    """Allocate a real course.engine.kv_cache.KVCache of this shape and return its measured bytes.

    device='meta' builds the tensors' shapes and dtypes without memory, so a 40 GB Llama-2-70B cache can be
    "allocated" on a laptop; device='cpu' allocates for real (keep it small).
    """
    import torch

    from course.engine.kv_cache import KVCache

    torch_dtypes = {1: torch.int8, 2: torch.float16, 4: torch.float32}
    size = dtype_bytes(dtype)
    if size not in torch_dtypes:
        raise ValueError(f"dtype must be 1, 2 or 4 bytes per element to allocate a cache, got {dtype!r}")
    c = _config(config)
    cache = KVCache(c, batch=_positive_int("batch", batch), max_seq_len=_positive_int("seq_len", seq_len),
                    dtype=torch_dtypes[size], device=device)
    return cache.nbytes


# ---------------------------------------------------------------------- FLOPs and bytes of one pass
def check_lengths(name: str, lengths: Sequence[int], limit: int) -> list[int]:
    """Token counts for a sweep or a cost: a non-empty list of whole numbers in 1..limit (the model's context)."""
    lengths = list(lengths)
    if not lengths:
        raise ValueError(f"{name} is empty: give at least one length, e.g. [16, 256]")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
            raise ValueError(f"{name} must hold whole numbers in 1..{limit} (the model's context), got {n!r}")
    return lengths


def layer_matmul_params(config: ModelConfig) -> int:
    """Weights every token multiplies through in the L blocks: wq wk wv wo + w_gate w_up w_down."""
    d, D_h = config.dim, config.head_dim
    attention = d * config.n_heads * D_h + 2 * d * config.n_kv_heads * D_h + config.n_heads * D_h * d
    return config.n_layers * (attention + 3 * d * config.ffn_dim)


def weights_read_bytes(config: ModelConfig, dtype_bytes: float) -> float:
    """Bytes of weights one forward pass reads: all of them (a tied embedding is the output head too).

    An untied input embedding is only looked up (one row per token), so it is not counted.
    """
    params = config.n_params - (0 if config.tie_embeddings else config.vocab_size * config.dim)
    return params * dtype_bytes


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of one call of a phase, from the config alone (activations ignored)."""
    phase: str
    length: int  # T for prefill, C for decode
    flops: float
    weight_bytes: float  # read once per step, whatever the batch
    kv_bytes: float
    batch: int = 1  # B sequences in the step: FLOPs and cache bytes are B × one sequence's

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved."""
        return self.flops / self.bytes

    def __str__(self) -> str:
        letter = "T" if self.phase == "prefill" else "C"
        return (f"{self.phase:7} {letter}={self.length:<5} {self.flops / 1e9:8.2f} GFLOP, reads "
                f"{self.bytes / 1e6:7.1f} MB (weights {self.weight_bytes / 1e6:.1f} + KV {self.kv_bytes / 1e6:.2f})"
                f" → {self.intensity:7.2f} FLOP/byte")


def prefill_flops(config: ModelConfig, T: int) -> int:
    """Multiply-add FLOPs of a prefill of T tokens (next-token logits at the last position only): 2 per weight
    per token in the blocks, the output head once, causal attention QKᵀ and PV: 2·D_h·T(T+1) per head per layer."""
    c = config
    return (2 * layer_matmul_params(c) * T + 2 * c.vocab_size * c.dim
            + 2 * c.head_dim * T * (T + 1) * c.n_heads * c.n_layers)


def prefill_cost(config: ModelConfig, prompt_len: int, dtype_bytes: float = 4) -> Cost:
    """Prefill of T tokens: 2 FLOPs per weight per token in the blocks, the output head once (last
    position only), causal attention 2·D_h·T(T+1) per head per layer; reads the weights once and
    writes T tokens of K and V."""
    T = check_lengths("prompt_len", [prompt_len], config.max_seq_len)[0]
    c = config
    flops = prefill_flops(c, T)
    kv = kv_cache_bytes(c.n_layers, 1, T, c.n_kv_heads, c.head_dim, dtype_bytes)
    return Cost("prefill", T, float(flops), float(weights_read_bytes(c, dtype_bytes)), float(kv))


def decode_cost(config: ModelConfig, context: int, dtype_bytes: float = 4, batch: int = 1,
                within_context: bool = True) -> Cost:
    """One decode step for B sequences with C tokens cached each: 2 FLOPs per weight, attention 4·D_h·(C+1) per
    head per layer, per sequence; reads every weight once and each sequence's K and V of all C + 1 positions.

    within_context=False allows a C past the model's trained length (paper arithmetic, e.g. C = 4,096 on a 4k model)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a whole number >= 1, got {batch!r}")
    limit = config.max_seq_len - 1 if within_context else max(config.max_seq_len, context + 1)
    C = check_lengths("context", [context], limit)[0]
    c = config
    flops = 2 * layer_matmul_params(c) + 2 * c.vocab_size * c.dim + 4 * c.head_dim * (C + 1) * c.n_heads * c.n_layers
    kv = kv_cache_bytes(c.n_layers, batch, C + 1, c.n_kv_heads, c.head_dim, dtype_bytes)
    return Cost("decode", C, float(batch * flops), float(weights_read_bytes(c, dtype_bytes)), float(kv), batch)
