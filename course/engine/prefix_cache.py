"""Prefix caching: compute the K/V of a shared prefix once, reuse it for every request that starts with it.

K and V at position t depend only on tokens 0..t (causal attention), so a system prompt's K/V rows are
the same in every request that opens with that system prompt. Store them once; for each new request,
copy the rows into a fresh KVCache and prefill only the tokens after the prefix:

    miss   prefill all T tokens                          (T tokens of compute; the prefix is stored)
    hit    copy P rows  +  prefill T - P tokens           (a memcpy of P · bytes_per_token instead)

The store is bounded: entries are kept in least-recently-used order and the oldest are evicted until
the total bytes fit `max_bytes`. (Serving engines share the rows instead of copying them, in
fixed-size blocks with reference counts: vLLM's automatic prefix caching, SGLang's RadixAttention.)
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from course.engine.device import synchronize
from course.engine.generate import prefill
from course.engine.kv_cache import KVCache


@dataclass
class PrefixEntry:
    """The stored state after a prefix: per-layer K and V rows, and the next-token logits."""
    tokens: tuple[int, ...]
    k: list[torch.Tensor]  # L tensors [1, H_kv, P, D_h]
    v: list[torch.Tensor]  # L tensors [1, H_kv, P, D_h]
    last_logits: torch.Tensor  # [V]: lets a request that IS the prefix skip the model entirely
    hits: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        tensors = [*self.k, *self.v, self.last_logits]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class PrefixCacheStats:
    hits: int = 0  # requests that found a stored prefix
    misses: int = 0  # requests that found none
    evictions: int = 0
    bytes: int = 0  # bytes held by the stored entries now (always <= max_bytes)
    tokens_reused: int = 0  # prompt tokens whose K/V came from the store
    tokens_computed: int = 0  # prompt tokens the model had to prefill
    seconds_copying: float = 0.0  # time spent copying stored rows into request caches

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else float("nan")

    @property
    def prefill_saved(self) -> float:
        """Share of prompt tokens not prefilled thanks to the store."""
        total = self.tokens_reused + self.tokens_computed
        return self.tokens_reused / total if total else float("nan")


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, V] next-token logits after the whole prompt
    cache: KVCache  # holds the prompt's K/V, ready for decoding
    reused_tokens: int  # prompt tokens copied from the store
    computed_tokens: int  # prompt tokens run through the model
    seconds: float = 0.0


class PrefixStore:
    """What every prefix store shares: a model, a byte budget, its entries (token tuple → entry with .tokens and
    .n_tokens, oldest first), its stats, and the lookups. Subclasses say how an entry is held (PrefixCache: copied
    rows; course.engine.paged_prefix.PagedPrefixCache: shared blocks) and give entry_bytes, add and prefill."""

    budget_of = "stored K/V"  # what max_bytes counts, for the error message

    def __init__(self, model: nn.Module, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer (bytes of {self.budget_of}), got {max_bytes!r}")
        self.model = model
        self.max_bytes = max_bytes
        self.entries: OrderedDict = OrderedDict()  # oldest first
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, prefix_ids) -> bool:
        return tuple(int(t) for t in prefix_ids) in self.entries

    def match(self, ids):
        """The longest stored prefix that ids start with (marked most recently used), or None."""
        ids = [int(t) for t in ids]
        best = None
        for tokens, entry in self.entries.items():
            if len(tokens) <= len(ids) and (best is None or len(tokens) > best.n_tokens) \
                    and ids[:len(tokens)] == list(tokens):
                best = entry
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best

    def _to_add(self, prefix_ids) -> tuple:
        """For add(): the prefix as a token tuple, checked (not empty, its entry fits max_bytes), and the entry
        already stored for it (marked most recently used) or None."""
        tokens = tuple(int(t) for t in torch.as_tensor(prefix_ids).flatten().tolist())
        if not tokens:
            raise ValueError("the prefix is empty: give at least one token")
        if tokens in self.entries:
            self.entries.move_to_end(tokens)
            return tokens, self.entries[tokens]
        need = self.entry_bytes(len(tokens))
        if need > self.max_bytes:
            raise ValueError(f"a {len(tokens)}-token prefix needs {need:,} bytes of {self.budget_of} but max_bytes "
                             f"is {self.max_bytes:,}; raise max_bytes or cache a shorter prefix")
        return tokens, None

    def _start(self, prompt_ids, max_seq_len: int | None, prefix_len: int | None) -> tuple:
        """prefill()'s opening: the checked prompt ids and cache size, the clock (started after a device sync),
        and the longest stored prefix of the prompt (or None)."""
        ids, max_seq_len = check_prompt(prompt_ids, max_seq_len, prefix_len)
        synchronize(self.model.device)
        return ids, max_seq_len, time.perf_counter(), self.match(ids)

    def _finish(self, logits, cache, reused: int, computed: int, t0: float) -> PrefillResult:
        """prefill()'s close: count the tokens reused and computed, sync, and time the whole prefill."""
        self.stats.tokens_reused += reused
        self.stats.tokens_computed += computed
        synchronize(self.model.device)
        return PrefillResult(logits=logits, cache=cache, reused_tokens=reused, computed_tokens=computed,
                             seconds=time.perf_counter() - t0)


class PrefixCache(PrefixStore):
    """A bounded store of prefix K/V for one model. `max_bytes` caps the stored tensors' total size."""

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def entry_bytes(self, n_tokens: int) -> int:
        """Bytes an entry of n_tokens will take: its K and V rows (measured on a shape-only cache of that length,
        so the count is the cache's own) plus V float32 logits."""
        c = self.model.config
        rows = KVCache(c, batch=1, max_seq_len=n_tokens, dtype=self.model.dtype, device="meta").nbytes
        return rows + c.vocab_size * torch.finfo(torch.float32).bits // 8

    @torch.inference_mode()
    def add(self, prefix_ids) -> PrefixEntry:
        """Prefill the prefix once and store its K/V (most recently used). Returns the entry."""
        tokens, stored = self._to_add(prefix_ids)
        if stored is not None:
            return stored
        model, P = self.model, len(tokens)
        cache = KVCache(model.config, batch=1, max_seq_len=P, dtype=model.dtype, device=model.device)
        ids = torch.tensor([tokens], dtype=torch.long, device=model.device)
        logits = prefill(model, ids, cache)[0]  # [V]
        entry = PrefixEntry(tokens=tokens, k=[layer.k.clone() for layer in cache.layers],
                            v=[layer.v.clone() for layer in cache.layers], last_logits=logits.clone())
        self._evict(room_for=entry.nbytes)
        self.entries[tokens] = entry
        self.stats.bytes += entry.nbytes
        return entry

    def _evict(self, room_for: int) -> None:
        while self.entries and self.nbytes + room_for > self.max_bytes:
            _, old = self.entries.popitem(last=False)  # least recently used first
            self.stats.evictions += 1
            self.stats.bytes -= old.nbytes

    @torch.inference_mode()
    def prefill(self, prompt_ids, max_seq_len: int | None = None, prefix_len: int | None = None) -> PrefillResult:
        """Prefill a prompt, reusing the longest stored prefix; a drop-in for generate.prefill (and what
        generate(..., prefix_cache=store) calls).

        prefix_len: on a miss, first store prompt_ids[:prefix_len] (the shared part, e.g. the system
        prompt) so later requests hit. max_seq_len: size of the returned cache (default: the prompt).
        """
        model = self.model
        ids, max_seq_len, t0, entry = self._start(prompt_ids, max_seq_len, prefix_len)
        T = len(ids)
        hit = entry is not None
        computed = 0
        if hit:
            self.stats.hits += 1
            entry.hits += 1
        else:
            self.stats.misses += 1
            if prefix_len is not None:  # store the shared part now, so later requests hit; this one pays for it
                entry = self.add(ids[:prefix_len])
                computed += entry.n_tokens
        cache = KVCache(model.config, batch=1, max_seq_len=max_seq_len, dtype=model.dtype, device=model.device)
        P = 0
        if entry is not None:
            P = entry.n_tokens
            t_copy = time.perf_counter()
            for layer, k, v in zip(cache.layers, entry.k, entry.v):
                layer.k[:, :, :P] = k  # the copy that replaces P tokens of prefill
                layer.v[:, :, :P] = v
            self.stats.seconds_copying += time.perf_counter() - t_copy
        if P < T:
            suffix = torch.tensor([ids[P:]], dtype=torch.long, device=model.device)  # [1, T - P]
            logits = prefill(model, suffix, cache, start_pos=P)  # [1, V]: only the tokens after the prefix
        else:
            logits = entry.last_logits.clone().view(1, -1)
        computed += T - P
        return self._finish(logits, cache, reused=P if hit else 0, computed=computed, t0=t0)


def check_prompt(prompt_ids, max_seq_len: int | None, prefix_len: int | None) -> tuple[list[int], int]:
    """A prefix store's prefill arguments, checked: the prompt as ids, and the size of the cache to return."""
    ids = [int(t) for t in torch.as_tensor(prompt_ids).flatten().tolist()]
    T = len(ids)
    if T == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prefix_len is not None and not 1 <= prefix_len <= T:
        raise ValueError(f"prefix_len must be in [1, {T}] (the prompt's length), got {prefix_len}")
    max_seq_len = max_seq_len or T
    if max_seq_len < T:
        raise ValueError(f"max_seq_len ({max_seq_len}) must be at least the prompt length ({T})")
    return ids, max_seq_len
