"""An INT8 KV cache: store keys and values as 8-bit integers plus a scale, dequantize when attention reads.

Symmetric absmax quantization with one scale per (sequence, KV head, token): the D_h values of one
head's key (or value) vector share a scale s = max|x| / 127 and are stored as round(x / s) in int8.

    bytes per token per head = D_h · 1 (int8) + 2 (one fp16 scale)     vs  D_h · 2 in fp16

so with D_h = 64 an INT8 cache holds 66 / 128 = 0.516 of the fp16 bytes (and 0.258 of fp32).
Per-token scales suit a cache that grows one token at a time: writing a token never changes the
scales of tokens already stored.

`Int8KVCache` has the interface of course.engine.kv_cache.KVCache (`cache[i].update(start_pos, k, v)`,
`nbytes`, `max_seq_len`), so course.engine.model and course.engine.generate use it unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from course.engine.config import ModelConfig, whole
from course.engine.kv_cache import KVCache, LayerKVCache

QMAX = 127  # symmetric int8 range [-127, 127]; -128 is left unused so that 0 is exactly representable
SCALE_DTYPE = torch.float16


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D_h] → (int8 values [..., D_h], fp16 scales [..., 1]), one scale per vector of D_h values."""
    absmax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    # Floor at fp16's smallest normal number: never a zero scale, and an all-tiny vector still
    # rounds to within 3e-5 of itself.
    scale = (absmax / QMAX).clamp(min=torch.finfo(SCALE_DTYPE).smallest_normal).to(SCALE_DTYPE)
    q = torch.round(x.float() / scale.float()).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 values [..., D_h] and scales [..., 1] → floats [..., D_h] in `dtype`."""
    return (q.float() * scale.float()).to(dtype)


class Int8LayerKVCache(LayerKVCache):
    """One layer's K and V as int8 [B, H_kv, T_max, D_h] buffers plus fp16 scales [B, H_kv, T_max, 1]."""

    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(batch, n_kv_heads, max_seq_len, head_dim, torch.int8, device)
        self.k_scale = torch.zeros(self.k.shape[:3] + (1,), dtype=SCALE_DTYPE, device=device)  # [B, H_kv, T_max, 1]
        self.v_scale = torch.zeros_like(self.k_scale)
        self.dtype = dtype  # what attention reads back

    def update(self, pos, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store k, v ([B, H_kv, T_new, D_h]); return every position so far, dequantized on read: the
        bytes stay int8 in memory, attention sees floats."""
        end = self.check(pos, k.shape[2])
        out = []
        for values, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_int8(x)
            self.write(values, pos, q)
            self.write(scales, pos, scale)
            out.append(dequantize_int8(self.read(values, pos, end), self.read(scales, pos, end), self.dtype))
        return out[0], out[1]  # [B, H_kv, end, D_h]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_scale, self.v_scale


class Int8KVCache(KVCache):
    """All layers' INT8 caches for one batch; its `nbytes` counts the int8 K and V and their fp16 scales."""

    layer_class = Int8LayerKVCache


def int8_bytes_per_token(config: ModelConfig) -> int:
    """Formula for the INT8 cache: 2 · L · H_kv · (D_h · 1 + 2) bytes per token (values + one fp16 scale)."""
    return 2 * config.n_layers * config.n_kv_heads * (config.head_dim + torch.finfo(SCALE_DTYPE).bits // 8)


@dataclass
class QuantComparison:
    """INT8 cache against the full-precision cache on the same prompt and the same tokens."""
    n_tokens: int
    max_abs_logit_diff: float  # largest |Δ logit| over every step and vocabulary entry
    mean_abs_logit_diff: float
    max_abs_logit: float  # for scale: the largest |logit| seen
    greedy_agreement: float  # share of steps whose argmax agrees, both fed the same tokens (teacher forcing)
    free_run_same_prefix: int  # tokens the INT8 greedy generation matches before its first difference
    reference_tokens: list[int] = field(default_factory=list)
    per_step_max_diff: list[float] = field(default_factory=list)


@torch.inference_mode()
def compare_int8_cache(model, prompt_ids, n_tokens: int = 64) -> QuantComparison:
    """Greedy-generate n_tokens with the model's own cache, replay them with an INT8 cache, and compare.

    Replaying the same tokens (teacher forcing) isolates the cache's error at each step; the free-running
    INT8 generation then shows whether that error ever flips a greedy choice.
    """
    from course.engine.generate import generate, teacher_forced_logits

    whole("n_tokens", n_tokens)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=model.device).view(1, -1)  # [1, T]
    size = ids.shape[1] + n_tokens
    with tqdm(total=2 * n_tokens, desc="float and INT8 caches, same tokens", unit="tok") as bar:
        ref = generate(model, ids, n_tokens, keep_logits=True, on_token=lambda _: bar.update())  # greedy
        tokens = ref.tokens
        q_cache = Int8KVCache(model.config, 1, size, dtype=model.dtype, device=model.device)
        q = teacher_forced_logits(model, ids, tokens, cache=q_cache)  # [n_tokens, V]: the INT8 cache, same tokens
        bar.update(n_tokens)
    ref = torch.stack(ref.logits)  # [n_tokens, V]
    diff = (ref - q).abs()
    agree = (ref.argmax(-1) == q.argmax(-1)).float().mean().item()
    free = generate(model, ids, n_tokens, use_cache=True,
                    cache=Int8KVCache(model.config, 1, size, dtype=model.dtype, device=model.device)).tokens
    same = next((i for i, (a, b) in enumerate(zip(tokens, free)) if a != b), min(len(tokens), len(free)))
    return QuantComparison(n_tokens=n_tokens, max_abs_logit_diff=diff.max().item(),
                           mean_abs_logit_diff=diff.mean().item(), max_abs_logit=ref.abs().max().item(),
                           greedy_agreement=agree, free_run_same_prefix=same, reference_tokens=tokens,
                           per_step_max_diff=diff.amax(-1).tolist())


def cache_bytes_by_dtype(config: ModelConfig, batch: int, max_seq_len: int) -> dict[str, int]:
    """Measured bytes of an fp32, an fp16 and an INT8 cache of the same shape (fp16/fp32 on the meta device)."""
    return {
        "fp32": KVCache(config, batch, max_seq_len, dtype=torch.float32, device="meta").nbytes,
        "fp16": KVCache(config, batch, max_seq_len, dtype=torch.float16, device="meta").nbytes,
        "int8": Int8KVCache(config, batch, max_seq_len).nbytes,
    }
