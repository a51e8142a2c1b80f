"""One LLM call, in the phases the course teaches: prefill, then decode one token at a time.

    prefill            the prompt's T tokens in one parallel pass; fills the KV cache; gives token 1's logits
    decode_one_token   one new token per sequence attends over the cache; gives the next logits
    decode_loop        THE token-by-token loop: prefill, then one step per new token (every variant below uses it)
    generate           decode_loop + a sampler, until EOS or the token limit, streaming and timing each token

Everything that decodes token by token goes through `decode_loop`, changing it only by parameters: the cache
object (KVCache, the INT8 cache, a cache filled from a stored prefix, a batch of beams), where the next tokens
come from (a sampler, known tokens for teacher forcing, a beam search's choice), no cache at all (the O(T²)
baseline), or the model itself (course.engine.fast.FastModel: the same call, decode steps compiled).
`sample_continuations` (course.engine.continuations), speculative decoding's draft and its target's verify
passes (course.engine.speculative) and beam search (course.engine.beam) build on it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Sequence

import numpy as np
import torch

from course.engine.config import whole
from course.engine.device import synchronize

# This module imports the caches (course.engine.kv_cache) and the sampler (course.engine.sampling) only where a call
# needs one of its own: a graded exercise's reference module may be absent from the grading sandbox.


# ---------------------------------------------------------------------- the phases
@torch.inference_mode()
def prefill(model, prompt_ids: torch.Tensor, cache, start_pos: int = 0, last_only: bool = True) -> torch.Tensor:
    """Run the prompt [B, T] at positions start_pos..start_pos+T-1, filling the cache (None: no cache, the whole
    sequence from position 0); return next-token logits [B, V] (last_only=False: every position's, [B, T, V])."""
    return model(prompt_ids, start_pos=start_pos, cache=cache, last_only=last_only)


@torch.inference_mode()
def decode_one_token(model, token: torch.Tensor, pos, cache) -> torch.Tensor:
    """Run one token per sequence ([B, 1]) at position `pos` (one int, or one per sequence) against the cache;
    return logits [B, V]."""
    return model(token, start_pos=pos, cache=cache, last_only=True)


def prompt_tensor(model, prompt_ids, max_new_tokens: int = 0) -> torch.Tensor:
    """A prompt (list of ids, [T] or [B, T] tensor, or B equal-length lists) as a [B, T] long tensor on the model's
    device, with room in the context for max_new_tokens after it."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=model.device)
    ids = ids.view(1, -1) if ids.dim() <= 1 else ids
    whole("max_new_tokens", max_new_tokens, minimum=0)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if ids.shape[1] + max_new_tokens > model.config.max_seq_len:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                         f"{model.config.max_seq_len} tokens; shorten the prompt or ask for fewer tokens")
    return ids


# ---------------------------------------------------------------------- the one decode loop
def decode_loop(model, ids: torch.Tensor, max_new_tokens: int, *, cache=None, use_cache: bool = True,
                start_pos: int = 0, first_logits: torch.Tensor | None = None) -> Generator[torch.Tensor, object, None]:
    """The token-by-token loop. A generator: it yields the next-token logits [B, V], up to max_new_tokens times,
    and you send back the tokens to append ([B] or [B, 1]) — sampled, known (teacher forcing), or chosen by a
    search. Send `(tokens, rows)` to first reorder the batch (row i continues old row rows[i]: beam search).
    Sending None, or the last of max_new_tokens, ends it without another pass.

        loop = decode_loop(model, ids, n, cache=cache)
        logits = next(loop)                      # the prefill (positions start_pos .. start_pos + T - 1)
        logits = loop.send(next_tokens)          # one decode step per call

    cache: filled from start_pos on (None with use_cache=True: a fresh KVCache sized for the call).
    first_logits: the prompt is already in the cache (e.g. copied from a prefix store): skip the prefill.
    use_cache=False re-runs the whole sequence every step. A compiled engine (course.engine.fast.FastModel) passes
    for the model: the loop calls only model(tokens, start_pos=..., cache=..., last_only=True).
    """
    B, T = ids.shape
    if not use_cache and start_pos:
        raise ValueError("start_pos needs a cache (use_cache=True): without one every step starts at position 0")
    if use_cache and cache is None:
        from course.engine.kv_cache import KVCache

        cache = KVCache(model.config, batch=B, max_seq_len=start_pos + T + max_new_tokens, dtype=model.dtype,
                        device=ids.device)
    seq, pos = ids, start_pos + T  # seq: the whole sequence (the uncached path); pos: where the next token goes
    logits = first_logits if first_logits is not None else prefill(model, ids, cache if use_cache else None, start_pos)
    for i in range(max_new_tokens):
        fed = yield logits
        if fed is None or i == max_new_tokens - 1:
            return
        fed, rows = fed if isinstance(fed, tuple) else (fed, None)
        tokens = torch.as_tensor(fed, dtype=torch.long, device=ids.device).view(B, 1)  # [B, 1]
        if not use_cache:  # <-- no cache: the whole sequence again, every step
            seq = torch.cat([seq if rows is None else seq[rows], tokens], dim=1)
            logits = prefill(model, seq, None)
        else:
            if rows is not None:  # row i of every cached tensor (K, V and any scales) becomes old row rows[i]
                for t in (t for layer in cache.layers for t in layer.tensors()):
                    t[:, :, :pos] = t[rows, :, :pos]  # advanced indexing copies, so overlapping rows are safe
            logits = decode_one_token(model, tokens, pos, cache)
        pos += 1


@torch.inference_mode()
def teacher_forced_logits(model, prompt_ids, tokens: Sequence[int], cache=None) -> torch.Tensor:
    """The logits [n, V] that predict each of n known tokens after the prompt, feeding the known tokens (not the
    model's own picks) through the decode loop: step i sees the prompt and tokens[:i]."""
    loop = decode_loop(model, prompt_tensor(model, prompt_ids, len(tokens)), len(tokens), cache=cache)
    return torch.cat([next(loop)] + [loop.send(torch.tensor([token])) for token in tokens[:-1]])  # [n, V]


# ---------------------------------------------------------------------- one call, timed
@dataclass
class Generation:
    """What one call produced, and when. Times are seconds."""
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, EOS included if it was produced
    token_times: list[float] = field(default_factory=list)  # seconds since the call started, per token
    stop_reason: str = ""  # "eos" or "length"
    reused_tokens: int = 0  # prompt tokens whose K/V came from a prefix store
    computed_tokens: int = 0  # prompt tokens this call prefilled (a stored prefix included on a miss)
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # [V] per token, with keep_logits=True
    text: str = ""  # the answer as text, when a tokenizer was at hand (stream_answer)

    time_to_first_token = property(lambda self: self.token_times[0])
    inter_token_latencies = property(lambda self: [b - a for a, b in zip(self.token_times, self.token_times[1:])])
    mean_inter_token_latency = property(lambda self: float(np.mean(self.inter_token_latencies))
                                        if self.inter_token_latencies else float("nan"))
    total_time = property(lambda self: self.token_times[-1] if self.token_times else 0.0)
    decode_tokens_per_s = property(lambda self: 1.0 / self.mean_inter_token_latency)  # nan without decode steps


def generate(model, prompt_ids, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_id: int | None = None,
             use_cache: bool = True, on_token: Callable[[int], None] | None = None, cache=None,
             sampler=None, prefix_cache=None, prefix_len: int | None = None,
             keep_logits: bool = False) -> Generation:
    """Generate up to max_new_tokens for one prompt (a list of ids or a [1, T] tensor).

    temperature 0 is greedy (or pass a ready `sampler`). `on_token(id)` is called as each token is produced
    (streaming). Without the cache every step re-runs the whole sequence: the O(T²) baseline. `cache`: the cache
    object to fill (e.g. course.engine.kv_quant.Int8KVCache). `prefix_cache` (a course.engine.paged_prefix
    .PagedPrefixCache): the prefill reuses its longest stored prefix (on a miss it pins prompt[:prefix_len]);
    the clock starts before it, so time_to_first_token compares directly with a plain call. keep_logits=True
    keeps each step's logits in Generation.logits.
    """
    if sampler is None:
        from course.engine.sampling import Sampler

        sampler = Sampler(temperature, top_k, top_p, seed=seed, device=model.device, dtype=model.dtype)
    ids = prompt_tensor(model, prompt_ids, max_new_tokens)  # [1, T]
    T = ids.shape[1]
    result = Generation(prompt_ids=ids[0].tolist(), computed_tokens=T)
    synchronize(model.device)
    t0 = time.perf_counter()
    first = None
    if prefix_cache is not None:
        pre = prefix_cache.prefill(result.prompt_ids, max_seq_len=T + max_new_tokens, prefix_len=prefix_len)
        first, cache = pre.logits, pre.cache
        result.reused_tokens, result.computed_tokens = pre.reused_tokens, pre.computed_tokens
    loop = decode_loop(model, ids, max_new_tokens, cache=cache, use_cache=use_cache, first_logits=first)
    result.stop_reason = "length"
    logits = next(loop, None) if max_new_tokens else None
    while logits is not None:
        token_ids, _ = sampler(logits)
        token = int(token_ids[0])  # waits for the device: the clock below is honest
        result.token_times.append(time.perf_counter() - t0)
        result.tokens.append(token)
        if keep_logits:
            result.logits.append(logits[0])
        if on_token is not None:
            on_token(token)
        if eos_id is not None and token == eos_id:
            result.stop_reason = "eos"
            loop.close()
            break
        logits = loop.send(token_ids) if len(result.tokens) < max_new_tokens else None
    return result
