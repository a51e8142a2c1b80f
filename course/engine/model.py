"""A from-scratch Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied output head.

Read it top to bottom in one sitting. Shapes use the lesson's letters:
B batch, T tokens in this call, H query heads, H_kv key/value heads, D_h head dim, d hidden size.
The KV cache is an explicit argument (course/engine/kv_cache.py); with cache=None the model
recomputes attention over every token it is given, which is how we measure what the cache saves.

Where the new tokens sit is one object, course.engine.positions.Positions, built once per call from `start_pos`
(an int: every row at the same positions; one int per sequence: a batch of requests at different lengths; or a
Positions, e.g. prompts of different lengths packed in one row [1, N]). It carries each token's absolute position
(RoPE's angle), where its K/V go in the cache, and the attention mask, so one forward serves all three cases.
Decode steps, bound by reading the weights, are where batching pays; a prompt is already a matrix-matrix product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course.engine.config import ModelConfig
from course.engine.positions import Positions


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
    """Rotate x ([B, heads, T, D_h]) by its positions' angles (cos, sin: [T, D_h], or [B, 1, T, D_h] per sequence).

    Half-split convention (as in Hugging Face): dimension i pairs with i + D_h/2.
    course/engine/weights.py undoes llama.cpp's row permutation so GGUF weights fit this convention.
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at: Positions, cache) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D_h]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D_h]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D_h]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if cache is not None:  # <-- the KV cache: keep this step's K/V, attend over every step's
            k, v = cache.update(at.cache_pos, k, v)  # [B, H_kv, T_k, D_h], T_k = start_pos + T

        # The mask keeps each query to its own sequence's keys up to its own position (None: the plain causal
        # triangle, or one query that may see every key). enable_gqa: each KV head serves n_heads // n_kv_heads
        # query heads, without copying K and V.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=at.mask, is_causal=at.causal,
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

    def forward(self, x, cos, sin, at, cache):
        x = x + self.attention(self.attention_norm(x), cos, sin, at, cache)
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

    device = property(lambda self: self.tok_embeddings.weight.device)
    dtype = property(lambda self: self.tok_embeddings.weight.dtype)

    def forward(self, tokens: torch.Tensor, start_pos=0, cache=None, last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] → logits [B, T, V] in float32 ([B, V] with last_only: each sequence's next-token logits).

        start_pos: an int (every row at start_pos .. start_pos+T-1), one int per sequence (a list or [B] tensor:
        sequence b at start_pos[b] ..), or a course.engine.positions.Positions. With a cache the model attends over
        the cached positions too; without one the tokens are the whole sequence, from position 0.
        """
        at = Positions.of(start_pos, tokens.shape, self.device)  # the one conversion, shared by every layer
        if at.kv_len > self.config.max_seq_len:
            raise ValueError(f"{at.kv_len} tokens exceed the model's context of {self.config.max_seq_len}; "
                             "shorten the prompt or ask for fewer new tokens")
        if cache is None and at.cache_pos != 0:  # without a cache attention sees only these tokens
            raise ValueError("start_pos > 0 or per-sequence positions need a KV cache holding the earlier tokens; "
                             "pass cache=")
        cos = self.rope_cos[at.positions][:, None].to(self.dtype)  # [B or 1, 1, T, D_h]: each token its own angle
        sin = self.rope_sin[at.positions][:, None].to(self.dtype)
        x = self.tok_embeddings(tokens)  # [B, T, d]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, at, None if cache is None else cache[i])
        if last_only:
            x = at.last_tokens(x)  # [B, d]: generation needs only the next-token logits
        return self.output(self.norm(x)).float()  # logits in float32 whatever the model dtype


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
