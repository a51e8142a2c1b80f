"""A paged KV cache: K and V in fixed-size blocks from one pool per layer, a block table per sequence.

A preallocated cache (course.engine.kv_cache.KVCache) reserves max_seq_len positions for every sequence
before it has produced a token. Paging reserves memory the way an operating system does: in blocks of
`block_size` tokens, one block at a time, when a sequence crosses a block boundary. Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention" (SOSP 2023, vLLM).

    pool (per layer)   k, v: [num_blocks, block_size, H_kv, D_h]   every layer uses the same block ids
    block table        sequence → [block id of positions 0..bs-1, of bs..2bs-1, ...]
    free list          block ids nobody holds; allocate pops one, a finished request pushes its blocks back
    reference counts   a full block may sit in several tables (a shared system prompt, beam search's
                       common history); it returns to the free list when its count reaches 0
    position p of a sequence lives at slot  table[p // bs] · bs + p % bs  of the flattened pool

Sharing follows "only full blocks are shared": a block is looked up by the exact tokens of the whole prefix
up to its end (K/V at position t depends on tokens 0..t), and only once every one of its positions is
written. A write into a block that is still shared (a fork, or rewriting a shared position) first copies
it (copy-on-write). Freed blocks keep their contents and their prefix key until the pool hands them out
again, so a later request with the same system prompt can find them (vLLM's automatic prefix caching;
nano-vllm's block_manager has the same shape).

Use with the model:

    cache = PagedKVCache(config, num_blocks=64, block_size=16)
    cached = cache.add_sequence("a", prompt_ids)           # tokens already in shared blocks (0 the first time)
    batch = cache.append(["a"], [prompt_ids[cached:]])     # reserve slots (new blocks on boundaries)
    logits = model(ids, start_pos=batch.positions, cache=batch, last_only=True)
    batch = cache.append(["a", "b"], [[tok_a], [tok_b]])   # one decode step for two sequences
    cache.free_sequence("a")                               # its blocks back to the free list

`cache.sequence(seq_id)` is a one-sequence adapter with the interface of KVCache (`cache[i].update(start_pos,
k, v)`), so generate() runs on a paged cache unchanged.
"""
from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from course.engine.config import ModelConfig, whole
from course.engine.positions import Positions


class PoolExhausted(RuntimeError):
    """The block pool has no free block left for a write."""


class BlockAllocator:
    """Block ids 0..num_blocks-1: a free list, a reference count per block, and a table of full shareable blocks.

    It holds no tensors: the same allocator serves every layer's pool.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = whole("num_blocks", num_blocks), whole("block_size", block_size)
        self.free: deque[int] = deque(range(num_blocks))  # allocate from the left, return to the right
        self.ref_count = [0] * num_blocks
        self.key_of: list[tuple | None] = [None] * num_blocks  # the prefix tokens a full block holds
        self.block_of: dict[tuple, int] = {}  # prefix tokens → the full block ending there

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        """A fresh block with reference count 1; PoolExhausted if none is free."""
        if not self.free:
            raise PoolExhausted(
                f"the KV block pool is full: all {self.num_blocks} blocks of {self.block_size} tokens are in use; "
                "finish or free a request first, or create the cache with more blocks")
        block = self.free.popleft()
        self._forget(block)  # its old contents are about to be overwritten
        self.ref_count[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more holder of `block` (a cached block on the free list comes back into use)."""
        if self.ref_count[block] == 0:
            self.free.remove(block)
        self.ref_count[block] += 1
        return block

    def release(self, block: int) -> bool:
        """One holder fewer; True when the block went back to the free list."""
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} is already free: released twice")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.append(block)  # keeps its contents and key until allocate() hands it out again
        return self.ref_count[block] == 0

    def register(self, block: int, key: tuple) -> None:
        """Mark `block` as full, holding the prefix `key`, so later sequences with that prefix can share it."""
        if key not in self.block_of:  # the same prefix already has a block: keep the first
            self._forget(block)
            self.key_of[block], self.block_of[key] = key, block

    def _forget(self, block: int) -> None:
        key, self.key_of[block] = self.key_of[block], None
        if key is not None and self.block_of.get(key) == block:
            del self.block_of[key]


@dataclass
class SequenceState:
    table: list[int]  # block ids, in position order
    length: int  # positions written
    tokens: list[int] | None  # the token ids at those positions (None: unknown, never shared)


class PagedKVCache:
    """Every layer's K/V pool plus the block tables of the sequences using it."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.config = config
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)  # [N_blocks, bs, H_kv, D_h]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.sequences: dict[Hashable, SequenceState] = {}
        # called with the number of blocks missing when the pool runs short; returns True if it freed some
        # (a prefix store unpins its least recently used prefix), False to give up and raise PoolExhausted
        self.make_room: Callable[[int], bool] | None = None

    @classmethod
    def for_budget(cls, config: ModelConfig, budget_bytes: int, block_size: int = 16,
                   dtype: torch.dtype = torch.float32, device="cpu") -> "PagedKVCache":
        """As many blocks as fit in budget_bytes of K/V memory."""
        per_block = block_bytes(config, block_size, dtype)
        if budget_bytes < per_block:
            raise ValueError(f"a budget of {budget_bytes:,} bytes holds no block of {per_block:,} bytes; raise it")
        return cls(config, budget_bytes // per_block, block_size, dtype, device)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_token(self) -> int:
        """2 · L · H_kv · D_h · dtype_bytes: one position of K and V in every layer."""
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * self.k[0].element_size()

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def nbytes(self) -> int:
        """The whole pool, allocated up front (like vLLM's gpu_memory_utilization share)."""
        return self.allocator.num_blocks * self.block_bytes

    @property
    def blocks_held(self) -> int:
        return self.allocator.num_blocks - self.allocator.num_free

    @property
    def bytes_reserved(self) -> int:
        """Bytes of the blocks some sequence holds now."""
        return self.blocks_held * self.block_bytes

    @property
    def bytes_used(self) -> int:
        """Bytes of the positions written and held (a shared block counted once)."""
        return sum(self._filled()[0].values()) * self.bytes_per_token

    @property
    def bytes_logical(self) -> int:
        """Bytes the sequences would hold with no sharing: Σ lengths · bytes_per_token."""
        return sum(s.length for s in self.sequences.values()) * self.bytes_per_token

    def _filled(self) -> tuple[dict[int, int], dict[int, list]]:
        """Positions written in each held block (a shared block: its fullest holder), and each block's holders."""
        filled: dict[int, int] = {}
        holders: dict[int, list] = {}
        for seq_id, s in self.sequences.items():
            for i, block in enumerate(s.table):
                filled[block] = max(filled.get(block, 0), min(self.block_size, s.length - i * self.block_size))
                holders.setdefault(block, []).append(seq_id)
        return filled, holders

    def blocks_needed(self, seq_id, n_new: int) -> int:
        """New blocks an append of n_new tokens to seq_id would take (0 for a sequence not added yet)."""
        s = self.sequences.get(seq_id)
        length, have = (0, 0) if s is None else (s.length, len(s.table))
        return max(0, -(-(length + n_new) // self.block_size) - have)

    def pool_picture(self) -> list[dict]:
        """Each block's state, for drawing the pool: holders (sequence ids), ref count, tokens filled."""
        filled, holders = self._filled()
        return [{"block": b, "ref_count": self.allocator.ref_count[b], "holders": holders.get(b, []),
                 "filled": filled.get(b, 0), "cached": self.allocator.key_of[b] is not None}
                for b in range(self.allocator.num_blocks)]

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int] | None = None, share: bool = True,
                     leave_last: bool = True) -> int:
        """Start a sequence; with its prompt ids, point its table at cached full blocks of the same prefix.

        Returns how many prompt tokens are already cached (a multiple of block_size, and with leave_last
        less than the prompt, so that at least its last token is computed and gives next-token logits). The
        caller appends and prefills prompt_ids[cached:]. leave_last=False shares a final full block too
        (pinning a prefix that is already computed).
        """
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id!r} is already in the cache; free it first or use another id")
        tokens = None if prompt_ids is None else [int(t) for t in prompt_ids]
        state = SequenceState(table=[], length=0, tokens=None if tokens is None else [])
        if tokens and share:
            bs = self.block_size
            for end in range(bs, len(tokens) + (0 if leave_last else 1), bs):  # full blocks (before the last token)
                block = self.allocator.block_of.get(tuple(tokens[:end]))
                if block is None:
                    break
                state.table.append(self.allocator.share(block))
                state.length = end
            state.tokens = tokens[:state.length]
        self.sequences[seq_id] = state
        return state.length

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """child starts as a copy of parent (beam search, parallel sampling): full blocks are shared, the
        partly filled last block is copied on the child's first write to it."""
        if child in self.sequences:
            raise ValueError(f"sequence {child!r} is already in the cache")
        p = self._get(parent)
        for block in p.table:
            self.allocator.share(block)
        self.sequences[child] = SequenceState(list(p.table), p.length, None if p.tokens is None else list(p.tokens))

    def free_sequence(self, seq_id: Hashable) -> int:
        """Drop a finished sequence; its blocks lose one holder. Returns how many went back to the free list."""
        if seq_id not in self.sequences:
            raise KeyError(f"no sequence {seq_id!r} in the cache")
        return sum(self.allocator.release(b) for b in reversed(self.sequences.pop(seq_id).table))

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Forget positions from `length` on (blocks past it return to the pool)."""
        s = self._get(seq_id)
        if not 0 <= length <= s.length:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of length {s.length} to {length}")
        keep = -(-length // self.block_size)
        for block in s.table[keep:]:
            self.allocator.release(block)
        del s.table[keep:]
        s.length = length
        if s.tokens is not None:
            del s.tokens[length:]

    def length(self, seq_id: Hashable) -> int:
        return self._get(seq_id).length

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).table)

    def slots(self, seq_id: Hashable, positions: Sequence[int]) -> list[int]:
        """Flat pool slots of a sequence's positions: table[p // bs] · bs + p % bs."""
        s, bs = self._get(seq_id), self.block_size
        return [s.table[p // bs] * bs + p % bs for p in positions]

    def _get(self, seq_id) -> SequenceState:
        if seq_id not in self.sequences:
            raise KeyError(f"no sequence {seq_id!r} in the cache; add_sequence() it first")
        return self.sequences[seq_id]

    def sequence(self, seq_id: Hashable = 0) -> "PagedSequence":
        """A one-sequence view with KVCache's interface (adds the sequence if it is new)."""
        if seq_id not in self.sequences:
            self.add_sequence(seq_id)
        return PagedSequence(self, seq_id)

    # ------------------------------------------------------------------ writing
    def append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]] | None = None,
               n_new: int | None = None) -> "PagedBatch":
        """Reserve the next positions of each sequence (token_ids[b] gives them, or n_new each) and return the batch
        to pass to the model: `model(tokens, start_pos=batch.positions, cache=batch)`."""
        seq_ids, start, n_new = self.reserve(seq_ids, token_ids, n_new)
        return PagedBatch(self, seq_ids, start, n_new)

    def reserve(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]] | None = None,
                n_new: int | None = None) -> tuple[list, list[int], int | list[int]]:
        """append()'s block bookkeeping alone: (sequence ids, start positions, n_new: one int, or one per sequence
        when they differ). Allocates a block where a sequence crosses a block boundary and copies a still-shared
        block before it is written (copy-on-write). All or nothing: PoolExhausted before any change."""
        seq_ids = list(seq_ids)
        if token_ids is not None:
            token_ids = [[int(t) for t in ids] for ids in token_ids]
            if len(token_ids) != len(seq_ids):
                raise ValueError(f"give one list of token ids per sequence: {len(token_ids)} lists for "
                                 f"{len(seq_ids)} sequences")
        counts = [len(ids) for ids in token_ids] if token_ids is not None else [n_new] * len(seq_ids)
        if not counts or any(not n or n <= 0 for n in counts):
            raise ValueError(f"append needs n_new > 0 new positions per sequence, got {counts}")
        states = [self._get(s) for s in seq_ids]
        start = [s.length for s in states]
        self._make_private(states, start, counts)
        bs = self.block_size
        for i, s in enumerate(states):
            s.length += counts[i]
            if s.tokens is None or token_ids is None:
                s.tokens = None  # positions of unknown tokens: this sequence can no longer share its blocks
                continue
            s.tokens.extend(token_ids[i])
            for b in range(start[i] // bs, s.length // bs):  # blocks that became full with this write
                self.allocator.register(s.table[b], tuple(s.tokens[:(b + 1) * bs]))
        return seq_ids, start, counts[0] if len(set(counts)) == 1 else counts

    def _make_private(self, states: list[SequenceState], start: list[int], counts: list[int]) -> None:
        """Make sure positions start[b] .. start[b]+counts[b]-1 have blocks of their own (all or nothing)."""
        bs, plan, need = self.block_size, [], 0
        for s, p0, n in zip(states, start, counts):
            first, last = p0 // bs, (p0 + n - 1) // bs
            cow = [i for i in range(first, min(last + 1, len(s.table))) if self.allocator.ref_count[s.table[i]] > 1]
            grow = max(0, last + 1 - len(s.table))
            plan.append((s, cow, grow))
            need += len(cow) + grow
        while need > self.allocator.num_free and self.make_room is not None \
                and self.make_room(need - self.allocator.num_free):
            pass
        if need > self.allocator.num_free:
            raise PoolExhausted(
                f"the KV block pool is full: this step needs {need} new blocks of {bs} tokens and "
                f"{self.allocator.num_free} of {self.allocator.num_blocks} are free; finish or free a request "
                "first, or create the cache with more blocks")
        for s, cow, grow in plan:
            for i in cow:  # copy-on-write: this sequence gets its own copy before writing into the block
                old, new = s.table[i], self.allocator.allocate()
                for pool in (*self.k, *self.v):
                    pool[new] = pool[old]
                self.allocator.release(old)
                s.table[i] = new
            s.table.extend(self.allocator.allocate() for _ in range(grow))

    def __repr__(self) -> str:
        a = self.allocator
        return (f"PagedKVCache({a.num_blocks} blocks × {self.block_size} tokens, {a.num_free} free, "
                f"{len(self.sequences)} sequences)")


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one block in every layer: 2 · L · block_size · H_kv · D_h · dtype_bytes."""
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * config.n_layers * block_size * config.n_kv_heads * config.head_dim * elt


def write_slots(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write values [N, H_kv, D_h] into a layer's pool [N_blocks, block_size, H_kv, D_h] at the flat slots [N]
    (block · block_size + offset)."""
    pool.view(-1, pool.shape[2], pool.shape[3])[slots] = values.to(pool.dtype)


def gather_blocks(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each sequence's blocks in table order: pool [N_blocks, bs, H_kv, D_h], table [B, n_blocks] →
    [B, H_kv, n_blocks · bs, D_h] (a copy; the positions past a sequence's length hold whatever the blocks do)."""
    return pool[table].flatten(1, 2).transpose(1, 2)


class _Layer:
    """cache[i] of a paged view: what one layer's attention calls."""

    def __init__(self, view, layer: int):
        self.view, self.layer = view, layer

    def update(self, pos, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view.update(self.layer, pos, k, v)


class _View:
    """A paged view as the model sees a cache: cache[i].update(pos, k, v)."""

    def __getitem__(self, layer: int) -> _Layer:
        return _Layer(self, layer)


class PagedBatch(_View):
    """One model call's view of the paged cache: B sequences, each writing n_new positions from its length.

    Built by PagedKVCache.append; pass it as the model's cache with start_pos=batch.positions. The slots to write
    and the padded block table to gather are computed once and shared by every layer. When the sequences write
    different numbers of tokens (a prompt next to decode steps), the positions are packed: tokens in one row [1, N].
    """

    def __init__(self, cache: PagedKVCache, seq_ids: list, start: list[int], n_new: int | list[int]):
        self.cache, self.seq_ids, self.n_new = cache, list(seq_ids), n_new
        device = cache.k[0].device
        self.packed = isinstance(n_new, list)
        self.positions = (Positions.pack(start, n_new, device=device) if self.packed
                          else Positions.per_sequence(start, n_new, device=device))
        write = [slot for s, p, n in zip(seq_ids, start, self.positions.n_new)
                 for slot in cache.slots(s, range(p, p + n))]
        self.write_slots = torch.tensor(write, dtype=torch.long, device=device)  # [B·T] or [N]
        self.kv_len = self.positions.kv_len
        n_blocks = -(-self.kv_len // cache.block_size)
        tables = [cache.sequences[s].table[:n_blocks] for s in seq_ids]
        padded = [t + [t[0]] * (n_blocks - len(t)) for t in tables]  # padding reads any block; the mask hides it
        self.block_table = torch.tensor(padded, dtype=torch.long, device=device)  # [B, n_blocks]

    def check_call(self, pos, n_tokens: int) -> None:
        """The model must write exactly the positions this batch reserved (pos: its Positions, one int for all, or
        one per sequence)."""
        given = pos.start if isinstance(pos, Positions) else torch.as_tensor(pos).flatten().tolist()
        expected = self.positions.start
        if len(given) == 1:
            given = given * len(expected)
        if given != expected or n_tokens != (self.positions.n_tokens if self.packed else self.n_new):
            raise ValueError(f"this paged batch reserved positions {expected} × {self.n_new} tokens, the model wrote "
                             f"{given} × {n_tokens}; pass start_pos=batch.positions")

    def update(self, layer: int, pos, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H_kv, T, D_h] (packed: [1, H_kv, N, D_h]) → every position of each sequence so far."""
        self.check_call(pos, k.shape[2])
        B, H_kv, T, D_h = k.shape
        out = []
        for pool, x in ((self.cache.k[layer], k), (self.cache.v[layer], v)):  # pool: [N_blocks, bs, H_kv, D_h]
            write_slots(pool, self.write_slots, x.transpose(1, 2).reshape(B * T, H_kv, D_h))
            out.append(self.positions.arrange(gather_blocks(pool, self.block_table)[:, :, :self.kv_len]))
        return out[0], out[1]  # [B, H_kv, kv_len, D_h] (packed: side by side, [1, H_kv, B·kv_len, D_h])


class PagedSequence(_View):
    """One sequence of a PagedKVCache behind KVCache's interface: cache[i].update(start_pos, k, v).

    Layer 0's update reserves the positions (allocating blocks, truncating if start_pos rewinds, as
    speculative decoding does); the other layers write into the same slots.
    """

    def __init__(self, cache: PagedKVCache, seq_id: Hashable):
        self.cache, self.seq_id = cache, seq_id
        self._batch: PagedBatch | None = None

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        if k.shape[0] != 1:
            raise ValueError(f"a PagedSequence holds one sequence; got a batch of {k.shape[0]}")
        if layer == 0:
            start_pos, length = operator.index(start_pos), self.cache.length(self.seq_id)
            if start_pos > length:
                raise ValueError(f"sequence {self.seq_id!r} holds {length} positions; cannot write at {start_pos}")
            self.cache.truncate(self.seq_id, start_pos)
            self._batch = self.cache.append([self.seq_id], n_new=k.shape[2])
        return self._batch.update(layer, start_pos, k, v)
