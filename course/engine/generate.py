"""One LLM call, in the phases the course teaches: prefill, then decode one token at a time.

    prefill            all T prompt tokens in one parallel pass; fills the KV cache; gives token 1
    decode_one_token   one new token attends over the cache; gives the next token
    generate           prefill + decode until EOS or the token limit, streaming and timing each token

Each phase is its own function so each can be timed on its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from course.engine.device import synchronize
from course.engine.kv_cache import KVCache
from course.engine.sampling import check_params, sample


@torch.inference_mode()
def prefill(model, prompt_ids: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """Run the prompt [B, T] at positions 0..T-1, filling the cache; return next-token logits [B, V]."""
    return model(prompt_ids, start_pos=0, cache=cache, last_only=True)


@torch.inference_mode()
def decode_one_token(model, token: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
    """Run one token per sequence ([B, 1]) at position `pos` against the cache; return logits [B, V]."""
    return model(token, start_pos=pos, cache=cache, last_only=True)


@torch.inference_mode()
def forward_uncached(model, ids: torch.Tensor) -> torch.Tensor:
    """No cache: recompute every position's K and V to get the next-token logits [B, V]."""
    return model(ids, start_pos=0, cache=None, last_only=True)


@dataclass
class Generation:
    """What one call produced, and when. Times are seconds."""
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, EOS included if it was produced
    token_times: list[float] = field(default_factory=list)  # seconds since the call started, per token
    stop_reason: str = ""  # "eos" or "length"

    @property
    def time_to_first_token(self) -> float:
        return self.token_times[0]

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def mean_inter_token_latency(self) -> float:
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else float("nan")

    @property
    def total_time(self) -> float:
        return self.token_times[-1] if self.token_times else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.mean_inter_token_latency if self.inter_token_latencies else float("nan")


def decode_n_tokens(model, first_token: torch.Tensor, start_pos: int, cache: KVCache, n: int,
                    pick: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Decode n tokens after `first_token` ([B, 1]) without streaming or stopping; returns [B, n]."""
    out, token = [], first_token
    for i in range(n):
        token = pick(decode_one_token(model, token, start_pos + i, cache)).view(-1, 1)
        out.append(token)
    return torch.cat(out, dim=1) if out else first_token[:, :0]


def generate(model, prompt_ids, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_id: int | None = None,
             use_cache: bool = True, on_token: Callable[[int], None] | None = None,
             cache: KVCache | None = None) -> Generation:
    """Generate up to max_new_tokens for one prompt (a list of ids or a [1, T] tensor).

    temperature 0 is greedy. `on_token(id)` is called as each token is produced (streaming).
    Without the cache every step re-runs the whole sequence: the O(T²) baseline.
    """
    check_params(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = model.device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)  # [1, T]
    T = ids.shape[1]
    if T == 0:
        raise ValueError("the prompt is empty: give at least one token")
    limit = model.config.max_seq_len
    if T + max_new_tokens > limit:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                         f"{limit} tokens; shorten the prompt or ask for fewer tokens")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    def pick(logits):
        return sample(logits, temperature, top_k, top_p, generator)

    result = Generation(prompt_ids=ids[0].tolist())
    if use_cache and cache is None:
        cache = KVCache(model.config, batch=1, max_seq_len=T + max_new_tokens, dtype=model.dtype, device=device)
    synchronize(device)
    t0 = time.perf_counter()
    seq = ids  # the whole sequence, needed only by the uncached path
    last = ids[:, -1:]  # [1, 1] the latest token, all the cached path feeds the model
    for step in range(max_new_tokens):
        if not use_cache:
            logits = forward_uncached(model, seq)
        elif step == 0:
            logits = prefill(model, ids, cache)
        else:
            logits = decode_one_token(model, last, T + step - 1, cache)
        token = int(pick(logits)[0])  # .item() waits for the device: the clock below is honest
        result.token_times.append(time.perf_counter() - t0)
        result.tokens.append(token)
        if on_token is not None:
            on_token(token)
        if eos_id is not None and token == eos_id:
            result.stop_reason = "eos"
            break
        last = torch.full((1, 1), token, dtype=torch.long, device=device)
        if not use_cache:
            seq = torch.cat([seq, last], dim=1)
    else:
        result.stop_reason = "length"
    return result
