"""Prefix caching through the block table: requests that share a prefix point at the same K/V blocks.

K and V at position t depend only on tokens 0..t (causal attention), so a system prompt's K/V are the same in every
request that opens with it. A serving engine computes them once and copies nothing: they sit in full blocks of a
paged pool (course.engine.paged), and a request whose prompt starts with the same tokens puts those block ids at the
head of its own block table, one more reference each (vLLM's automatic prefix caching; SGLang's RadixAttention shares
a tree of such blocks).

    miss   prefill all T tokens; the prompt's full blocks are registered under their prefix, and with
           prefix_len the prefix's blocks are pinned (one more reference, nothing computed or copied)
    hit    table ← the P' shared blocks (P' = the prefix rounded down to whole blocks)
           + prefill the T - P' tokens after them                      (no copy at all)

generate(model, ids, n, prefix_cache=store, prefix_len=P) runs on a store. A hit reuses the prefix rounded down to a
multiple of block_size, and the last prompt token is always computed (its logits are the first answer token's).

Memory: the pool holds max_bytes of blocks. `add()` pins a prefix (its blocks keep a reference); requests hold their
blocks while their cache object is alive and release them when it is garbage collected (or `release()`d). When a
request needs a block and none is free, the least recently used pinned prefix is unpinned; its blocks stay on the
free list, still findable, until the pool hands them out again.
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from course.engine.config import whole
from course.engine.device import synchronize
from course.engine.paged import PagedKVCache, PagedSequence


@dataclass
class PrefixCacheStats:
    hits: int = 0  # requests that found shared blocks of their prefix
    misses: int = 0  # requests that found none
    evictions: int = 0  # pinned prefixes unpinned to make room
    bytes: int = 0  # bytes of the blocks the pinned prefixes hold now (always <= max_bytes)
    tokens_reused: int = 0  # prompt tokens whose K/V came from shared blocks
    tokens_computed: int = 0  # prompt tokens the model had to prefill


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, V] next-token logits after the whole prompt
    cache: PagedSequence  # holds the prompt's K/V, ready for decoding
    reused_tokens: int  # prompt tokens whose K/V came from shared blocks
    computed_tokens: int  # prompt tokens run through the model
    seconds: float = 0.0


@dataclass
class PrefixEntry:
    """A pinned prefix: the sequence in the pool that holds its blocks."""
    tokens: tuple[int, ...]
    seq_id: tuple


class PagedPrefixCache:
    """A prefix store whose entries are shared blocks of one paged pool of `max_bytes`, least recently used first."""

    def __init__(self, model: nn.Module, max_bytes: int, block_size: int = 16):
        self.model, self.max_bytes, self.block_size = model, whole("max_bytes (of K/V blocks)", max_bytes), block_size
        self.pool = PagedKVCache.for_budget(model.config, max_bytes, block_size, model.dtype, model.device)
        self.pool.make_room = self._unpin_oldest
        self.entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()  # oldest first
        self.stats = PrefixCacheStats()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, prefix_ids) -> bool:
        return tuple(int(t) for t in prefix_ids) in self.entries

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the pinned prefixes hold (a block shared by two prefixes counted once)."""
        blocks = {b for e in self.entries.values() for b in self.pool.block_table(e.seq_id)}
        return len(blocks) * self.pool.block_bytes

    def entry_bytes(self, n_tokens: int) -> int:
        """Bytes of the blocks an n_tokens prefix occupies: ⌈P / block_size⌉ blocks of block_bytes."""
        return -(-n_tokens // self.block_size) * self.pool.block_bytes

    def match(self, ids) -> PrefixEntry | None:
        """The longest pinned prefix that ids start with (marked most recently used), or None."""
        ids = tuple(int(t) for t in ids)
        best = max((e for t, e in self.entries.items() if ids[:len(t)] == t), key=lambda e: len(e.tokens), default=None)
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best

    def add(self, prefix_ids) -> PrefixEntry:
        """Prefill the prefix into the pool (sharing what is cached already) and pin its blocks."""
        tokens = tuple(int(t) for t in torch.as_tensor(prefix_ids).flatten().tolist())
        if not tokens:
            raise ValueError("the prefix is empty: give at least one token")
        if tokens in self.entries:
            self.entries.move_to_end(tokens)
            return self.entries[tokens]
        if self.entry_bytes(len(tokens)) > self.max_bytes:
            raise ValueError(f"a {len(tokens)}-token prefix needs {self.entry_bytes(len(tokens)):,} bytes of K/V "
                             f"blocks but max_bytes is {self.max_bytes:,}; raise max_bytes or cache a shorter prefix")
        seq_id = ("prefix", next(self._ids))
        self._compute(seq_id, list(tokens))
        return self._register(tokens, seq_id)

    def prefill(self, prompt_ids, max_seq_len: int | None = None, prefix_len: int | None = None) -> PrefillResult:
        """Prefill a prompt on top of the shared blocks of its longest cached prefix (what generate(...,
        prefix_cache=store) calls). prefix_len: on a miss, pin prompt_ids[:prefix_len] (the shared part, e.g. the
        system prompt) so later requests hit. The returned cache is a PagedSequence of the pool (it grows block by
        block, so max_seq_len is only checked); its blocks are released when it is garbage collected."""
        ids = [int(t) for t in torch.as_tensor(prompt_ids).flatten().tolist()]
        T = len(ids)
        if T == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if prefix_len is not None and not 1 <= prefix_len <= T:
            raise ValueError(f"prefix_len must be in [1, {T}] (the prompt's length), got {prefix_len}")
        if max_seq_len is not None and max_seq_len < T:
            raise ValueError(f"max_seq_len ({max_seq_len}) must be at least the prompt length ({T})")
        synchronize(self.model.device)
        t0 = time.perf_counter()
        self.match(ids)  # a pinned prefix of this prompt becomes the most recently used
        seq_id = ("request", next(self._ids))
        cached, logits = self._compute(seq_id, ids)  # shares every cached full block of the prompt's prefix
        if cached:  # a pinned prefix, or blocks an earlier request left cached
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            if prefix_len is not None and ids[:prefix_len] not in self:  # pin its blocks: nothing computed or copied
                pinned = ("prefix", next(self._ids))
                self.pool.add_sequence(pinned, ids[:prefix_len], leave_last=False)
                self._register(tuple(ids[:prefix_len]), pinned)
        cache = self.pool.sequence(seq_id)
        weakref.finalize(cache, _release, self.pool, seq_id)
        self.stats.tokens_reused += cached
        self.stats.tokens_computed += T - cached
        synchronize(self.model.device)
        return PrefillResult(logits, cache, cached, T - cached, time.perf_counter() - t0)

    def release(self, cache: PagedSequence) -> None:
        """Give a request's blocks back now instead of when its cache is garbage collected."""
        _release(self.pool, cache.seq_id)

    @torch.inference_mode()
    def _compute(self, seq_id, ids: list[int]) -> tuple[int, torch.Tensor]:
        """Add seq_id for the prompt ids, share its cached full blocks, prefill the rest: (reused, logits [1, V])."""
        cached = self.pool.add_sequence(seq_id, ids)
        try:
            batch = self.pool.append([seq_id], [ids[cached:]])
        except Exception:
            self.pool.free_sequence(seq_id)
            raise
        suffix = torch.tensor([ids[cached:]], dtype=torch.long, device=self.model.device)  # [1, T - cached]
        return cached, self.model(suffix, start_pos=batch.positions, cache=batch, last_only=True)  # [1, V]

    def _register(self, tokens: tuple, seq_id) -> PrefixEntry:
        self.entries[tokens] = entry = PrefixEntry(tokens, seq_id)
        self.stats.bytes = self.nbytes
        return entry

    def _unpin_oldest(self, missing: int) -> bool:
        if not self.entries:
            return False
        _, old = self.entries.popitem(last=False)
        self.pool.free_sequence(old.seq_id)  # its blocks stay cached on the free list until reused
        self.stats.evictions += 1
        self.stats.bytes = self.nbytes
        return True


def _release(pool: PagedKVCache, seq_id) -> None:
    if seq_id in pool.sequences:
        pool.free_sequence(seq_id)
