"""A from-scratch Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied output head.

Read it top to bottom in one sitting. Shapes use the lesson's letters:
B batch, T tokens in this call, H query heads, H_kv key/value heads, D_h head dim, d hidden size.
The KV cache is an explicit argument (see course/kv_cache.py); with cache=None the model
recomputes attention over every token it is given, which is how we measure what the cache saves.

Batches of different lengths: pass `start_pos` as one position per sequence (a list, a [B] tensor or a
kv_cache.BatchPositions) instead of one int. RoPE then rotates each sequence by its own positions and
attention masks each sequence's keys past its own end — the marked lines in Attention.forward and
Transformer.forward are the whole difference. Sequences that bring different numbers of new tokens (a new
prompt next to running requests' decode tokens) go packed in one row [1, N] with a kv_cache.PackedPositions:
no padding, every matmul reads the weights once for all N rows, and a block-diagonal mask keeps each
sequence's attention to its own keys. Decode steps, bound by reading the weights, are where batching pays;
a prompt is already a matrix-matrix product, so packing it with others buys less.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from course.engine.config import ModelConfig
from course.engine.kv_cache import BatchPositions, KVCache, LayerKVCache, PackedPositions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even when the model runs in 16-bit: the mean of squares overflows in fp16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair: two [T_max, D_h] tables in float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D_h/2]
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # [T_max, D_h/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T_max, D_h]: the two halves share frequencies
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ([B, heads, T, D_h]) by its positions' angles (cos, sin: [T, D_h]).

    Half-split convention (as in Hugging Face): dimension i pairs with i + D_h/2.
    course/weights.py undoes llama.cpp's row permutation so GGUF weights fit this convention.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int | BatchPositions,
                cache: LayerKVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D_h]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D_h]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D_h]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if cache is not None:  # <-- the KV cache: keep this step's K/V, attend over every step's
            k, v = cache.update(start_pos, k, v)  # [B, H_kv, start_pos + T, D_h]

        T_k = k.shape[2]
        if isinstance(start_pos, (BatchPositions, PackedPositions)):  # <-- batched: own keys, own positions
            mask, causal = start_pos.mask, False  # [B, 1, T, T_k] (packed: [1, 1, N, B·kv_len])
        elif T == 1:
            mask, causal = None, False  # one new query may see every key so far
        elif T_k == T:
            mask, causal = None, True  # a fresh sequence: the plain causal triangle
        else:  # T new queries after start_pos cached keys: query i sees keys 0..start_pos+i
            mask, causal = torch.ones(T, T_k, dtype=torch.bool, device=x.device).tril(T_k - T), False
        # enable_gqa: each KV head serves n_heads // n_kv_heads query heads, without copying K and V.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=self.n_kv_heads != self.n_heads)  # [B, H, T, D_h]
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # [B, T, d]


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w_up = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w_down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, start_pos, cache):
        x = x + self.attention(self.attention_norm(x), cos, sin, start_pos, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.arch != "llama":
            raise ValueError(f"course.engine.model builds Llama-architecture models; {config.name} is {config.arch!r}")
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one [V, d] matrix reads tokens in and out
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def forward(self, tokens: torch.Tensor, start_pos=0, cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] at positions start_pos..start_pos+T-1 → logits [B, T, V] ([B, V] if last_only).

        With a cache, the model attends over the cached positions 0..start_pos-1 too; without one,
        start_pos must be 0 and the tokens are the whole sequence. start_pos may also be one position
        per sequence (list of ints, [B] tensor or BatchPositions): sequence b's tokens go at
        start_pos[b].. and attend over its own cached positions only (needs a cache that accepts
        BatchPositions: KVCache or a paged batch).
        """
        B, T = tokens.shape
        if not isinstance(start_pos, int):
            if isinstance(start_pos, PackedPositions):
                return self._forward_packed(tokens, start_pos, cache, last_only)
            if isinstance(start_pos, (BatchPositions, list, tuple)) or \
                    (isinstance(start_pos, torch.Tensor) and start_pos.dim() == 1):  # <-- batched: one per sequence
                return self._forward_batched(tokens, start_pos, cache, last_only)
            start_pos = operator.index(start_pos)  # a numpy or 0-dim tensor integer: the one-position path
        if cache is None and start_pos != 0:
            raise ValueError("start_pos > 0 needs a KV cache holding the earlier positions")
        if start_pos + T > self.config.max_seq_len:
            raise ValueError(
                f"{start_pos + T} tokens exceed the model's context of {self.config.max_seq_len}; "
                "shorten the prompt or ask for fewer new tokens"
            )
        cos = self.rope_cos[start_pos:start_pos + T].to(self.dtype)  # [T, D_h]
        sin = self.rope_sin[start_pos:start_pos + T].to(self.dtype)
        x = self.tok_embeddings(tokens)  # [B, T, d]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, start_pos, None if cache is None else cache[i])
        if last_only:
            x = x[:, -1]  # [B, d]: generation needs only the next-token logits
        return self.output(self.norm(x)).float()  # logits in float32 whatever the model dtype

    def _forward_batched(self, tokens: torch.Tensor, start_pos, cache, last_only: bool) -> torch.Tensor:
        """forward() with one start position per sequence: RoPE angles and the key mask per sequence."""
        B, T = tokens.shape
        if cache is None:
            raise ValueError("per-sequence positions need a KV cache holding each sequence's earlier tokens")
        at = BatchPositions.of(start_pos, T, self.device)
        if at.batch != B:
            raise ValueError(f"{at.batch} start positions for a batch of {B} sequences; give one per sequence")
        if at.kv_len > self.config.max_seq_len:
            raise ValueError(f"{at.kv_len} tokens exceed the model's context of {self.config.max_seq_len}; "
                             "shorten the prompt or ask for fewer new tokens")
        cos = self.rope_cos[at.positions].to(self.dtype)[:, None]  # [B, 1, T, D_h]: each sequence its own angles
        sin = self.rope_sin[at.positions].to(self.dtype)[:, None]
        x = self.tok_embeddings(tokens)  # [B, T, d]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, at, cache[i])
        if last_only:
            x = x[:, -1]  # [B, d]
        return self.output(self.norm(x)).float()

    def _forward_packed(self, tokens: torch.Tensor, at: PackedPositions, cache, last_only: bool) -> torch.Tensor:
        """tokens [1, N] of B packed sequences → logits [1, N, V], or [B, V] at each sequence's last token."""
        if cache is None:
            raise ValueError("packed sequences need a KV cache holding each sequence's earlier tokens")
        if tokens.shape != (1, at.n_tokens):
            raise ValueError(f"packed positions describe {at.n_tokens} tokens in one row; tokens are "
                             f"{list(tokens.shape)}")
        if at.kv_len > self.config.max_seq_len:
            raise ValueError(f"{at.kv_len} tokens exceed the model's context of {self.config.max_seq_len}; "
                             "shorten the prompt or ask for fewer new tokens")
        cos = self.rope_cos[at.positions].to(self.dtype)  # [N, D_h]: each token its own angle
        sin = self.rope_sin[at.positions].to(self.dtype)
        x = self.tok_embeddings(tokens)  # [1, N, d]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, at, cache[i])
        if last_only:
            x = x[0, at.last_index]  # [B, d]
        return self.output(self.norm(x)).float()


def tiny_model(seed: int = 0, config: ModelConfig | None = None) -> Transformer:
    """A randomly initialised model of the same architecture, for fast tests."""
    config = config or ModelConfig.from_name("tiny")
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02 * 4)
    return model.eval()
