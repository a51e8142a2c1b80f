"""Where a forward pass's new tokens sit: one sequence, a batch at different positions, or packed prompts.

gpt-fast hands its model `input_pos` (the absolute position of every new token: RoPE's angles, the cache columns to
write, the rows of the causal mask); nano-vllm hands its attention a `Context` (slots, sequence lengths, block tables).
`Positions` is ours. It is built once per model call, at the edge, and every layer reads the same tensors:

    positions  [B, T] absolute position of each new token ([1, T] when every row shares them; packed: [1, N])
    start      per sequence: the position of its first new token         n_new: per sequence, how many new tokens
    rows       per sequence: its row in a contiguous cache (None: every row of the cache, at the same positions)
    mask       True where a query may see a key: [B, 1, T, kv_len] (packed: [1, 1, N, B·kv_len]); None: plain causal
    last       packed only: the index in N of each sequence's last token, whose logits generation keeps

    Positions.at(start, T)                   every row at start .. start+T-1: a prompt, a decode step, beams in step
    Positions.per_sequence(starts, T, rows)  sequence b at starts[b] ..: requests of different lengths decoded together
    Positions.pack(starts, n_new, rows)      sequence b brings n_new[b] tokens, all N in one row [1, N]: a new prompt
                                             beside running requests' decode tokens (Orca's selective batching)

Packed sequences attend over every sequence's keys laid side by side, [1, H_kv, B·kv_len, D_h], under a block-diagonal
causal mask; plain SDPA computes the masked scores too (cheap for a few sequences; FlashAttention's variable-length
kernels skip them).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Positions:
    start: list[int]
    n_new: list[int]
    rows: list[int] | None
    positions: torch.Tensor
    mask: torch.Tensor | None
    last: torch.Tensor | None = None

    # ------------------------------------------------------------------ the three cases
    @classmethod
    def at(cls, start: int, n_new: int, device="cpu") -> "Positions":
        start = _checked([start if isinstance(start, int) else operator.index(start)], [n_new])[0]  # an int stays
        # as it is: under torch.compile it is a symbolic size, which operator.index would pin to one value
        positions = torch.arange(start, start + n_new, device=device)[None]  # [1, T]
        mask = None  # None: one query sees every key so far; T queries from position 0: the causal triangle
        if start and n_new > 1:  # T new queries after `start` cached keys: query i sees keys 0 .. start+i
            mask = torch.ones(n_new, start + n_new, dtype=torch.bool, device=device).tril(start)  # [T, kv_len]
        return cls([start], [n_new], None, positions, mask)

    @classmethod
    def per_sequence(cls, starts, n_new: int, rows=None, device="cpu") -> "Positions":
        starts = _checked([int(p) for p in starts], [n_new] * len(starts))
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(n_new, device=device)  # [B, T]
        keys = torch.arange(max(starts) + n_new, device=device)  # [kv_len]
        mask = (keys <= positions[..., None])[:, None]  # [B, 1, T, kv_len]: own keys up to own position
        return cls(starts, [n_new] * len(starts), _rows(rows, len(starts)), positions, mask)

    @classmethod
    def pack(cls, starts, n_new, rows=None, device="cpu") -> "Positions":
        starts, n_new = [int(p) for p in starts], [int(n) for n in n_new]
        if len(starts) != len(n_new):
            raise ValueError(f"give one start and one n_new per sequence, got {starts} and {n_new}")
        _checked(starts, n_new)
        B, L, counts = len(starts), max(p + n for p, n in zip(starts, n_new)), torch.tensor(n_new, device=device)
        sequence = torch.repeat_interleave(torch.arange(B, device=device), counts)  # [N] which sequence
        first = torch.cumsum(counts, 0) - counts  # [B] where each sequence's tokens begin in N
        offset = torch.arange(sum(n_new), device=device) - first[sequence]  # [N] 0 .. n_new[b]-1
        positions = torch.tensor(starts, device=device)[sequence] + offset  # [N]
        key_seq = torch.arange(B, device=device).repeat_interleave(L)  # [B·L] the sequence of each key
        key_pos = torch.arange(L, device=device).repeat(B)  # [B·L] its position
        mask = (key_seq == sequence[:, None]) & (key_pos <= positions[:, None])  # [N, B·L] block-diagonal causal
        return cls(starts, n_new, _rows(rows, B), positions[None], mask[None, None], last=first + counts - 1)

    @classmethod
    def of(cls, start_pos, shape, device="cpu") -> "Positions":
        """The one conversion at the model's edge: an int start (every row), a list or [B] tensor (one per sequence),
        or a Positions, checked against the tokens' shape [B, T]."""
        B, T = shape
        if isinstance(start_pos, (list, tuple)) or (isinstance(start_pos, torch.Tensor) and start_pos.dim() == 1):
            start_pos = cls.per_sequence(torch.as_tensor(start_pos).tolist(), T, device=device)
        elif not isinstance(start_pos, Positions):
            start_pos = cls.at(start_pos, T, device)
        shape = list(start_pos.positions.shape)  # [1, T] for every row, [B, T] one row per sequence, [1, N] packed
        if shape[1] != T or (start_pos.rows is not None and shape[0] != B):
            raise ValueError(f"positions shaped {shape} for tokens shaped {[B, T]}; give one start position per "
                             "sequence (packed sequences: all their tokens in one row)")
        return start_pos

    # ------------------------------------------------------------------ what the model and the caches read
    batch = property(lambda self: len(self.start))  # sequences
    n_tokens = property(lambda self: sum(self.n_new))  # new tokens, all sequences
    kv_len = property(lambda self: max(p + n for p, n in zip(self.start, self.n_new)))  # keys read per sequence
    packed = property(lambda self: self.last is not None)

    @property
    def causal(self) -> bool:
        """SDPA's is_causal: no mask and more than one query (all from position 0)."""
        return self.mask is None and self.positions.shape[1] > 1

    @property
    def cache_pos(self):
        """What cache.update() receives: the start as an int when every row shares it (so a cache written for
        `update(start_pos: int, k, v)`, as in the lessons and exercises, runs under the model), else this object."""
        return self.start[0] if self.rows is None else self

    def token_rows(self, device) -> torch.Tensor:
        """The cache row of every new token, shaped like `positions`."""
        rows = torch.tensor(self.rows, device=device)
        if self.packed:
            return torch.repeat_interleave(rows, torch.tensor(self.n_new, device=device))[None]  # [1, N]
        return rows[:, None].expand(self.positions.shape)  # [B, T]

    def row_index(self, device):
        """Which cache rows to read: a slice (a view) when they are consecutive, else an index tensor (a copy)."""
        first = self.rows[0]
        if self.rows == list(range(first, first + self.batch)):
            return slice(first, first + self.batch)
        return torch.tensor(self.rows, device=device)

    def arrange(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values [B, H_kv, kv_len, D_h] as the mask reads them (packed: side by side, [1, H_kv, B·L, D_h])."""
        if not self.packed:
            return x
        B, H, L, D = x.shape
        return x.transpose(0, 1).reshape(1, H, B * L, D)

    def last_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] → [B, d]: each sequence's last new token, the one whose logits predict what comes next."""
        return x[:, -1] if self.last is None else x[0, self.last]


def _checked(starts: list[int], n_new: list[int]) -> list[int]:
    if not starts or min(starts) < 0 or min(n_new) <= 0:
        raise ValueError(f"positions must be >= 0 and each sequence needs n_new > 0 new tokens, got start={starts}, "
                         f"n_new={n_new}")
    return starts


def _rows(rows, B: int) -> list[int]:
    rows = list(range(B)) if rows is None else [int(r) for r in rows]
    if len(rows) != B:
        raise ValueError(f"{len(rows)} cache rows for {B} sequences; give one row each")
    return rows
