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
k, v)`), so generate() and the exercises run on a paged cache unchanged.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from course.engine.config import ModelConfig
from course.engine.kv_cache import BatchPositions, PackedPositions, side_by_side


class PoolExhausted(RuntimeError):
    """The block pool has no free block left for a write."""


class BlockAllocator:
    """Block ids 0..num_blocks-1: a free list, a reference count per block, and a table of full shareable blocks.

    It holds no tensors: the same allocator serves every layer's pool (and the exercise's own pool).
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))  # allocate from the left, return to the right
        self.ref_count = [0] * num_blocks
        self.key_of: list[tuple | None] = [None] * num_blocks  # the prefix tokens a full block holds
        self.block_of: dict[tuple, int] = {}  # prefix tokens → the full block ending there

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

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
            return True
        return False

    def lookup(self, key: tuple) -> int | None:
        """The full block holding exactly the prefix `key` (all tokens up to the block's end), or None."""
        return self.block_of.get(key)

    def register(self, block: int, key: tuple) -> None:
        """Mark `block` as full, holding the prefix `key`, so later sequences with that prefix can share it."""
        if key in self.block_of and self.block_of[key] != block:
            return  # the same prefix already has a block; keep the first
        self._forget(block)
        self.key_of[block], self.block_of[key] = key, block

    def _forget(self, block: int) -> None:
        key = self.key_of[block]
        if key is not None:
            self.key_of[block] = None
            if self.block_of.get(key) == block:
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
        self.peak_blocks = 0  # most blocks held at once since creation (or reset_peak)
        # called with the number of blocks missing when the pool runs short; returns True if it freed some
        # (a prefix store unpins its least recently used prefix), False to give up and raise PoolExhausted
        self.make_room: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ sizes
    @classmethod
    def for_budget(cls, config: ModelConfig, budget_bytes: int, block_size: int = 16,
                   dtype: torch.dtype = torch.float32, device="cpu") -> "PagedKVCache":
        """As many blocks as fit in budget_bytes of K/V memory."""
        per_block = block_bytes(config, block_size, dtype)
        if budget_bytes < per_block:
            raise ValueError(f"a budget of {budget_bytes:,} bytes holds no block of {per_block:,} bytes; raise it")
        return cls(config, budget_bytes // per_block, block_size, dtype, device)

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
        """Bytes of the whole pool (allocated up front, like vLLM's gpu_memory_utilization share)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def bytes_reserved(self) -> int:
        """Bytes of the blocks held by some sequence now."""
        return self.blocks_held * self.block_bytes

    @property
    def blocks_held(self) -> int:
        return self.allocator.num_used

    def _filled(self) -> tuple[dict[int, int], dict[int, list]]:
        """Positions written in each held block (a shared block: its fullest holder), and each block's holders."""
        filled: dict[int, int] = {}
        holders: dict[int, list] = {}
        for seq_id, s in self.sequences.items():
            for i, block in enumerate(s.table):
                filled[block] = max(filled.get(block, 0), min(self.block_size, s.length - i * self.block_size))
                holders.setdefault(block, []).append(seq_id)
        return filled, holders

    @property
    def bytes_used(self) -> int:
        """Bytes of positions actually written and held (a shared block counted once)."""
        return sum(self._filled()[0].values()) * self.bytes_per_token

    @property
    def bytes_logical(self) -> int:
        """Bytes the sequences would hold with no sharing: Σ lengths · bytes_per_token."""
        return sum(s.length for s in self.sequences.values()) * self.bytes_per_token

    @property
    def bytes_shared(self) -> int:
        """Bytes saved by sharing: positions that sit in one block but belong to several sequences."""
        return self.bytes_logical - self.bytes_used

    def reset_peak(self) -> None:
        self.peak_blocks = self.blocks_held

    def _note_peak(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.blocks_held)

    def blocks_needed(self, seq_id, n_new: int) -> int:
        """New blocks an append of n_new tokens to seq_id would take (0 for a sequence not added yet)."""
        s = self.sequences.get(seq_id)
        length, have = (0, 0) if s is None else (s.length, len(s.table))
        return max(0, -(-(length + n_new) // self.block_size) - have)

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
        state = SequenceState(table=[], length=0, tokens=[] if tokens is not None else None)
        if tokens and share:
            bs = self.block_size
            for end in range(bs, len(tokens) + (0 if leave_last else 1), bs):  # full blocks (before the last token)
                block = self.allocator.lookup(tuple(tokens[:end]))
                if block is None:
                    break
                state.table.append(self.allocator.share(block))
                state.length = end
            state.tokens = tokens[:state.length]
        self.sequences[seq_id] = state
        self._note_peak()
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
        state = self.sequences.pop(seq_id, None)
        if state is None:
            raise KeyError(f"no sequence {seq_id!r} in the cache")
        return sum(self.allocator.release(b) for b in reversed(state.table))

    def length(self, seq_id: Hashable) -> int:
        return self._get(seq_id).length

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).table)

    def _get(self, seq_id) -> SequenceState:
        if seq_id not in self.sequences:
            raise KeyError(f"no sequence {seq_id!r} in the cache; add_sequence() it first")
        return self.sequences[seq_id]

    # ------------------------------------------------------------------ writing
    def append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]] | None = None,
               n_new: int | None = None) -> "PagedBatch":
        """Reserve the next n_new positions of each sequence (token_ids[b] gives them, and their number).

        Allocates a block where a sequence crosses a block boundary and copies a still-shared block before
        it is written (copy-on-write). All or nothing: PoolExhausted before any change if the pool is short.
        Returns the batch to pass to the model as `cache=` with `start_pos=batch.positions`.
        """
        seq_ids, start, n_new = self.reserve(seq_ids, token_ids, n_new)
        return PagedBatch(self, seq_ids, start, n_new)

    def reserve(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]] | None = None,
                n_new: int | None = None) -> tuple[list, list[int], int | list[int]]:
        """append() without building the model's view: the block bookkeeping alone (sequence ids, the start
        positions reserved, n_new: one int, or one per sequence when they differ). For sizing too."""
        seq_ids = list(seq_ids)
        if token_ids is not None:
            token_ids = [[int(t) for t in ids] for ids in token_ids]
            if len(token_ids) != len(seq_ids):
                raise ValueError(f"give one list of token ids per sequence: {len(token_ids)} lists for "
                                 f"{len(seq_ids)} sequences")
            counts = [len(ids) for ids in token_ids]
        else:
            counts = [n_new] * len(seq_ids)
        if not counts or any(not n or n <= 0 for n in counts):
            raise ValueError(f"append needs n_new > 0 new positions per sequence, got {counts}")
        states = [self._get(s) for s in seq_ids]
        start = [s.length for s in states]
        self._reserve(seq_ids, start, counts)
        for i, s in enumerate(states):
            s.length += counts[i]
            if s.tokens is not None and token_ids is not None:
                s.tokens.extend(token_ids[i])
                self._register_full_blocks(s, start[i])
            else:
                s.tokens = None  # positions of unknown tokens: this sequence can no longer share its blocks
        self._note_peak()
        return seq_ids, start, counts[0] if len(set(counts)) == 1 else counts

    def _reserve(self, seq_ids, start: list[int], counts: list[int]) -> None:
        """Make sure positions start[b]..start[b]+counts[b]-1 have private blocks (all or nothing)."""
        bs, plan, need = self.block_size, [], 0
        for seq_id, p0, n_new in zip(seq_ids, start, counts):
            s = self.sequences[seq_id]
            first, last = p0 // bs, (p0 + n_new - 1) // bs
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

    def _register_full_blocks(self, s: SequenceState, old_length: int) -> None:
        bs = self.block_size
        for i in range(old_length // bs, s.length // bs):  # blocks that became full with this write
            self.allocator.register(s.table[i], tuple(s.tokens[:(i + 1) * bs]))

    def sequence(self, seq_id: Hashable = 0) -> "PagedSequence":
        """A one-sequence view with KVCache's interface (adds the sequence if it is new)."""
        if seq_id not in self.sequences:
            self.add_sequence(seq_id)
        return PagedSequence(self, seq_id)

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

    # ------------------------------------------------------------------ reading
    def slots(self, seq_id: Hashable, positions: Sequence[int]) -> list[int]:
        """Flat pool slots of a sequence's positions: table[p // bs] · bs + p % bs."""
        s, bs = self._get(seq_id), self.block_size
        return [s.table[p // bs] * bs + p % bs for p in positions]

    def gather(self, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V in position order: two [1, H_kv, length, D_h] tensors."""
        s = self._get(seq_id)
        table = torch.tensor(s.table, dtype=torch.long, device=self.k[layer].device)
        k = self.k[layer][table].flatten(0, 1)[:s.length]  # [n_blocks·bs, H_kv, D_h] → [length, H_kv, D_h]
        v = self.v[layer][table].flatten(0, 1)[:s.length]
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def pool_picture(self) -> list[dict]:
        """Each block's state, for drawing the pool: holders (sequence ids), ref count, tokens filled."""
        filled, holders = self._filled()
        return [{"block": b, "ref_count": self.allocator.ref_count[b], "holders": holders.get(b, []),
                 "filled": filled.get(b, 0), "cached": self.allocator.key_of[b] is not None}
                for b in range(self.allocator.num_blocks)]

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


class PagedBatch:
    """One model call's view of the paged cache: B sequences, each writing n_new positions from its length.

    Built by PagedKVCache.append; pass it as the model's cache with start_pos=batch.positions. The slot
    indices (where to write) and the padded block table (what to gather) are computed once and shared by
    every layer. When the sequences write different numbers of tokens (a prompt next to decode steps),
    positions is a PackedPositions and the tokens go in one row [1, N].
    """

    def __init__(self, cache: PagedKVCache, seq_ids: list, start: list[int], n_new: int | list[int]):
        self.cache, self.seq_ids, self.n_new = cache, seq_ids, n_new
        device = cache.k[0].device
        counts = n_new if isinstance(n_new, list) else [n_new] * len(seq_ids)
        self.packed = isinstance(n_new, list)
        self.positions = (PackedPositions(start, n_new, device) if self.packed
                          else BatchPositions(start, n_new, device))
        bs = cache.block_size
        write = [slot for s, p, n in zip(seq_ids, start, counts) for slot in cache.slots(s, range(p, p + n))]
        self.write_slots = torch.tensor(write, dtype=torch.long, device=device)  # [B·T] or [N]
        kv_len = self.positions.kv_len
        n_blocks = -(-kv_len // bs)
        tables = [cache.sequences[s].table[:n_blocks] for s in seq_ids]
        padded = [t + [t[0]] * (n_blocks - len(t)) for t in tables]  # padding reads any block; the mask hides it
        self.block_table = torch.tensor(padded, dtype=torch.long, device=device)  # [B, n_blocks]
        self.kv_len = kv_len

    def check_call(self, start_pos, n_tokens: int) -> None:
        """The model must write exactly the positions this batch reserved (start_pos: its positions, one per
        sequence, or one int for all)."""
        expected = self.positions.start
        if isinstance(start_pos, (BatchPositions, PackedPositions)):
            given = start_pos.start
        elif isinstance(start_pos, torch.Tensor) and start_pos.dim() > 0:
            given = start_pos.flatten().tolist()
        elif isinstance(start_pos, (list, tuple)):
            given = [int(p) for p in start_pos]
        else:
            given = [int(start_pos)] * len(expected)
        n_expected = self.positions.n_tokens if self.packed else self.n_new
        if given != expected or n_tokens != n_expected:
            raise ValueError(f"this paged batch reserved positions {expected} × {self.n_new} tokens, the model wrote "
                             f"{given} × {n_tokens}; pass start_pos=batch.positions")

    def __getitem__(self, layer: int) -> "PagedLayerView":
        return PagedLayerView(self, layer)

    def __len__(self) -> int:
        return len(self.cache.k)


class PagedLayerView:
    """What one layer's attention sees: update() writes into the pool's slots and gathers the batch's blocks."""

    def __init__(self, batch: PagedBatch, layer: int):
        self.batch, self.layer = batch, layer

    def update(self, start_pos, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H_kv, T, D_h] → every position of each sequence so far, [B, H_kv, kv_len, D_h]."""
        b = self.batch
        b.check_call(start_pos, k.shape[2])  # packed: the N tokens of one row
        B, H_kv, T, D_h = k.shape
        k_pool, v_pool = b.cache.k[self.layer], b.cache.v[self.layer]  # [N_blocks, bs, H_kv, D_h]
        write_slots(k_pool, b.write_slots, k.transpose(1, 2).reshape(B * T, H_kv, D_h))
        write_slots(v_pool, b.write_slots, v.transpose(1, 2).reshape(B * T, H_kv, D_h))
        # each sequence's blocks in table order, then its first kv_len positions: [B, H_kv, kv_len, D_h]
        k_all = gather_blocks(k_pool, b.block_table)[:, :, :b.kv_len]
        v_all = gather_blocks(v_pool, b.block_table)[:, :, :b.kv_len]
        if b.packed:  # every sequence's keys in one row, for the packed queries' block-diagonal mask
            return side_by_side(k_all), side_by_side(v_all)
        return k_all, v_all


class PagedSequence:
    """One sequence of a PagedKVCache behind KVCache's interface: cache[i].update(start_pos, k, v).

    Layer 0's update reserves the positions (allocating blocks, truncating if start_pos rewinds, as
    speculative decoding does); the other layers write into the same slots.
    """

    def __init__(self, cache: PagedKVCache, seq_id: Hashable):
        self.cache, self.seq_id = cache, seq_id
        self._batch: PagedBatch | None = None

    def __getitem__(self, layer: int) -> "_SequenceLayer":
        return _SequenceLayer(self, layer)

    def __len__(self) -> int:
        return len(self.cache.k)

    @property
    def max_seq_len(self) -> int:
        return self.cache.config.max_seq_len

    @property
    def nbytes(self) -> int:
        return len(self.cache.block_table(self.seq_id)) * self.cache.block_bytes

    def _reserve(self, start_pos: int, n_new: int) -> PagedBatch:
        length = self.cache.length(self.seq_id)
        if start_pos > length:
            raise ValueError(f"sequence {self.seq_id!r} holds {length} positions; cannot write at {start_pos}")
        if start_pos < length:
            self.cache.truncate(self.seq_id, start_pos)
        self._batch = self.cache.append([self.seq_id], n_new=n_new)
        return self._batch


class _SequenceLayer:
    def __init__(self, seq: PagedSequence, layer: int):
        self.seq, self.layer = seq, layer

    def update(self, start_pos, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k.shape[0] != 1:
            raise ValueError(f"a PagedSequence holds one sequence; got a batch of {k.shape[0]}")
        if isinstance(start_pos, BatchPositions):
            start_pos = start_pos.start[0]
        batch = self.seq._reserve(int(start_pos), k.shape[2]) if self.layer == 0 else self.seq._batch
        return batch[self.layer].update(start_pos, k, v)
