"""Prefix caching through the block table: requests that share a prefix point at the same K/V blocks.

course.engine.prefix_cache.PrefixCache stores a prefix's K/V rows and copies them into every request's
cache. Serving engines copy nothing: the prefix's K/V sit in full blocks of a paged pool
(course.engine.paged), and a request whose prompt starts with the same tokens puts those block ids at the
head of its own block table, one more reference each (vLLM's automatic prefix caching; SGLang's RadixAttention
shares a tree of such blocks).

    miss   prefill all T tokens; the prompt's full blocks are registered under their prefix, and with
           prefix_len the prefix's blocks are pinned (one more reference, nothing computed or copied)
    hit    table ← the P' shared blocks (P' = the prefix rounded down to whole blocks)
           + prefill the T - P' tokens after them                      (no copy at all)

`PagedPrefixCache` has PrefixCache's methods (prefill, add, match, entry_bytes, nbytes, stats, `in`, len), so
generate(model, ids, n, prefix_cache=store, prefix_len=P) runs on it unchanged. Differences, both from
sharing whole blocks: a hit reuses the prefix rounded down to a multiple of block_size, and the last prompt
token is always computed (its logits are the first answer token's).

Memory: the pool holds max_bytes of blocks. `add()` pins a prefix (its blocks keep a reference); requests
hold their blocks while their cache object is alive and release them when it is garbage collected (or
`release()`d). When a request needs a block and none is free, the least recently used pinned prefix is
unpinned; its blocks stay on the free list, still findable, until the pool hands them out again.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from course.engine.paged import PagedKVCache, PagedSequence
from course.engine.prefix_cache import PrefillResult, PrefixStore


@dataclass
class PagedPrefixEntry:
    """A pinned prefix: the sequence in the pool that holds its blocks, and its next-token logits."""
    tokens: tuple[int, ...]
    seq_id: tuple
    last_logits: torch.Tensor | None  # [V] when computed by add(); None when pinned from a request's blocks
    hits: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class PagedPrefixCache(PrefixStore):
    """A prefix store whose entries are shared blocks of one paged pool of `max_bytes`."""

    budget_of = "K/V blocks"

    def __init__(self, model: nn.Module, max_bytes: int, block_size: int = 16):
        super().__init__(model, max_bytes)  # checks max_bytes; entries (oldest first) and stats
        self.block_size = block_size
        self.pool = PagedKVCache.for_budget(model.config, max_bytes, block_size, model.dtype, model.device)
        self.pool.make_room = self._unpin_oldest
        self._ids = itertools.count()

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the pinned prefixes hold (a block shared by two prefixes counted once)."""
        blocks = {b for e in self.entries.values() for b in self.pool.block_table(e.seq_id)}
        return len(blocks) * self.pool.block_bytes

    def entry_bytes(self, n_tokens: int) -> int:
        """Bytes of the blocks an n_tokens prefix occupies: ⌈P / block_size⌉ · block_size · 2 · L · H_kv · D_h · bytes."""
        return -(-n_tokens // self.block_size) * self.pool.block_bytes

    def _unpin_oldest(self, missing: int) -> bool:
        if not self.entries:
            return False
        _, old = self.entries.popitem(last=False)
        self.pool.free_sequence(old.seq_id)  # its blocks stay cached on the free list until reused
        self.stats.evictions += 1
        self.stats.bytes = self.nbytes
        return True

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
        logits = self.model(suffix, start_pos=batch.positions, cache=batch, last_only=True)  # [1, V]
        return cached, logits

    def add(self, prefix_ids) -> PagedPrefixEntry:
        """Prefill the prefix into the pool (sharing what is cached already) and pin its blocks."""
        tokens, stored = self._to_add(prefix_ids)
        if stored is not None:
            return stored
        seq_id = ("prefix", next(self._ids))
        _, logits = self._compute(seq_id, list(tokens))
        return self._register(tokens, seq_id, logits[0].clone())

    def _pin(self, tokens, logits) -> PagedPrefixEntry:
        """Pin the full blocks a just-computed request holds for `tokens` (no model call, no copy)."""
        tokens = tuple(tokens)
        seq_id = ("prefix", next(self._ids))
        self.pool.add_sequence(seq_id, list(tokens), leave_last=False)
        return self._register(tokens, seq_id, None if logits is None else logits[0].clone())

    def _register(self, tokens, seq_id, logits) -> PagedPrefixEntry:
        entry = PagedPrefixEntry(tokens, seq_id, logits)
        self.entries[tokens] = entry
        self.stats.bytes = self.nbytes
        return entry

    def prefill(self, prompt_ids, max_seq_len: int | None = None, prefix_len: int | None = None) -> PrefillResult:
        """Prefill a prompt on top of the shared blocks of its longest cached prefix; a drop-in for
        PrefixCache.prefill. The returned cache is a PagedSequence of the pool (it grows block by block, so
        max_seq_len is only checked); its blocks are released when it is garbage collected."""
        ids, max_seq_len, t0, entry = self._start(prompt_ids, max_seq_len, prefix_len)
        T = len(ids)
        seq_id = ("request", next(self._ids))
        cached, logits = self._compute(seq_id, ids)  # shares every cached full block of the prompt's prefix
        hit = cached > 0  # a pinned prefix, or blocks an earlier request left cached
        if hit:
            self.stats.hits += 1
            if entry is not None:
                entry.hits += 1
        else:
            self.stats.misses += 1
            if prefix_len is not None and ids[:prefix_len] not in self:
                self._pin(ids[:prefix_len], logits if prefix_len == T else None)  # later requests hit
        cache = self.pool.sequence(seq_id)
        weakref.finalize(cache, _release, self.pool, seq_id)
        return self._finish(logits, cache, reused=cached, computed=T - cached, t0=t0)

    def release(self, cache: PagedSequence) -> None:
        """Give a request's blocks back now instead of when its cache is garbage collected."""
        _release(self.pool, cache.seq_id)


def _release(pool: PagedKVCache, seq_id) -> None:
    if seq_id in pool.sequences:
        pool.free_sequence(seq_id)
