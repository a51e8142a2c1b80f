"""Sample submissions for exercise 05 (the paged KV cache), imported by make_samples.py.

Each entry has the fields of make_samples.Sample: what it is (`about`), what it must score (`expect`: full,
zero or loses), and either `patches` (grade_id -> [(old, new)] replacements in the reference answer) or whole
`answers` (grade_id -> code). The planted bugs are the mistakes a paged cache invites: a block taken one token
late or early, a block never freed, blocks shared without a reference count, a gather in the wrong order, a
table that is not extended at a boundary.
"""
from __future__ import annotations

ASSIGNMENT = "05_paged_cache"

# SequenceView rewritten to keep a contiguous cache of its own (torch.cat), on the PagedKVCache object so that new
# views of a sequence find it: the model then never reads the paged cache.
CONTIGUOUS_VIEW = """class SequenceView:
    \"\"\"Keeps a contiguous K/V per layer of the sequence, grown with torch.cat.\"\"\"

    def __init__(self, paged, seq_id):
        self.paged, self.seq_id = paged, seq_id
        if not hasattr(paged, "_rows"):
            paged._rows = {}

    def __getitem__(self, layer):
        return _LayerView(self.paged._rows, (self.seq_id, layer))


class _LayerView:
    def __init__(self, rows, key):
        self.rows, self.key = rows, key

    def update(self, start_pos, k_new, v_new):
        k, v = self.rows.get(self.key, (k_new[:, :, :0], v_new[:, :, :0]))
        k = torch.cat([k[:, :, :start_pos], k_new], dim=2)
        v = torch.cat([v[:, :, :start_pos], v_new], dim=2)
        self.rows[self.key] = (k, v)
        return k, v"""
GIVEN_VIEW_START = "class SequenceView:"
GIVEN_VIEW_END = "        return self.paged.update(self.seq_id, self.layer, start_pos, k_new, v_new)"


def replace_view(nb):
    """The given cell's SequenceView and _LayerView replaced by CONTIGUOUS_VIEW."""
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and GIVEN_VIEW_START in c.source]
    start, end = cell.source.index(GIVEN_VIEW_START), cell.source.index(GIVEN_VIEW_END) + len(GIVEN_VIEW_END)
    cell.source = cell.source[:start] + CONTIGUOUS_VIEW + cell.source[end:]


ALT_HEAP = {
    "block_pool": """
        import heapq


        class BlockPool:
            \"\"\"Lowest free id first (a heap), reference counts in a list.\"\"\"

            def __init__(self, num_blocks):
                self.heap = list(range(num_blocks))
                self.ref_count = [0 for _ in range(num_blocks)]

            def allocate(self):
                if len(self.heap) == 0:
                    raise MemoryError("no free KV block left: free a finished request or build a bigger pool")
                block = heapq.heappop(self.heap)
                self.ref_count[block] = 1
                return block

            def share(self, block):
                if self.ref_count[block] <= 0:
                    raise ValueError(f"block {block} is free: allocate it before sharing it")
                self.ref_count[block] = self.ref_count[block] + 1

            def release(self, block):
                if self.ref_count[block] == 0:
                    raise ValueError(f"block {block} is not allocated")
                self.ref_count[block] = self.ref_count[block] - 1
                if self.ref_count[block] == 0:
                    heapq.heappush(self.heap, block)

            @property
            def num_free(self):
                return len(self.heap)
        """,
    "paged_cache": """
        class PagedKVCache:
            \"\"\"Slots computed with divmod, writes and reads through index tensors.\"\"\"

            def __init__(self, config, num_blocks, block_size, dtype=torch.float32):
                self.block_size, self.pool = block_size, BlockPool(num_blocks)
                self.k = [torch.zeros(num_blocks, config.n_kv_heads, block_size, config.head_dim, dtype=dtype)
                          for _ in range(config.n_layers)]
                self.v = [torch.zeros_like(t) for t in self.k]
                self.tables, self.lengths = {}, {}

            def update(self, seq_id, layer, start_pos, k_new, v_new):
                n = k_new.shape[2]
                end = start_pos + n
                table = self.tables.setdefault(seq_id, [])
                needed = (end + self.block_size - 1) // self.block_size
                while len(table) < needed:
                    table.append(self.pool.allocate())
                self.lengths[seq_id] = max(end, self.lengths.get(seq_id, 0))
                where = [divmod(p, self.block_size) for p in range(start_pos, end)]
                blocks = torch.tensor([table[i] for i, _ in where])
                offsets = torch.tensor([o for _, o in where])
                self.k[layer][blocks, :, offsets] = k_new[0].transpose(0, 1)  # [n, H_kv, D_h]
                self.v[layer][blocks, :, offsets] = v_new[0].transpose(0, 1)
                pos = torch.arange(end)
                rows = torch.tensor(table)[pos // self.block_size]
                k = self.k[layer][rows, :, pos % self.block_size]  # [end, H_kv, D_h]
                v = self.v[layer][rows, :, pos % self.block_size]
                return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

            def free(self, seq_id):
                table = self.tables.pop(seq_id)
                self.lengths.pop(seq_id)
                while table:
                    self.pool.release(table.pop())
        """,
    "fork": """
        def fork(cache, parent, child):
            n = cache.lengths[parent]
            full, part = divmod(n, cache.block_size)
            table = []
            for i, block in enumerate(cache.tables[parent]):
                if i < full:
                    cache.pool.share(block)
                    table.append(block)
                elif i == full and part:
                    copy = cache.pool.allocate()
                    for k, v in zip(cache.k, cache.v):
                        k[copy].copy_(k[block])
                        v[copy].copy_(v[block])
                    table.append(copy)
            cache.tables[child] = table
            cache.lengths[child] = n
        """,
}

ALT_DEQUE = {
    "block_pool": """
        from collections import deque


        class BlockPool:
            \"\"\"First in, first out: a freed block goes to the back of the queue.\"\"\"

            def __init__(self, num_blocks):
                self.queue = deque(range(num_blocks))
                self.ref_count = [0] * num_blocks

            def allocate(self):
                try:
                    block = self.queue.popleft()
                except IndexError:
                    raise MemoryError(f"the pool of {len(self.ref_count)} blocks is exhausted; wait for a request "
                                      "to finish or allocate more blocks") from None
                self.ref_count[block] += 1
                return block

            def share(self, block):
                if not self.ref_count[block]:
                    raise ValueError("share of free block %d" % block)
                self.ref_count[block] += 1

            def release(self, block):
                if not self.ref_count[block]:
                    raise ValueError("double free of block %d" % block)
                self.ref_count[block] -= 1
                if not self.ref_count[block]:
                    self.queue.append(block)

            @property
            def num_free(self):
                return len(self.queue)
        """,
    "paged_cache": """
        class PagedKVCache:
            \"\"\"Token-by-token writes; the gather concatenates the blocks' slices.\"\"\"

            def __init__(self, config, num_blocks, block_size, dtype=torch.float32):
                self.block_size = block_size
                self.pool = BlockPool(num_blocks)
                self.k, self.v = [], []
                for _ in range(config.n_layers):
                    self.k.append(torch.zeros(num_blocks, config.n_kv_heads, block_size, config.head_dim, dtype=dtype))
                    self.v.append(torch.zeros(num_blocks, config.n_kv_heads, block_size, config.head_dim, dtype=dtype))
                self.tables = {}
                self.lengths = {}

            def update(self, seq_id, layer, start_pos, k_new, v_new):
                if seq_id not in self.tables:
                    self.tables[seq_id], self.lengths[seq_id] = [], 0
                table = self.tables[seq_id]
                for t in range(k_new.shape[2]):
                    pos = start_pos + t
                    if pos // self.block_size == len(table):  # the first token of a new block
                        table.append(self.pool.allocate())
                    self.k[layer][table[pos // self.block_size], :, pos % self.block_size] = k_new[0, :, t]
                    self.v[layer][table[pos // self.block_size], :, pos % self.block_size] = v_new[0, :, t]
                end = start_pos + k_new.shape[2]
                self.lengths[seq_id] = max(self.lengths[seq_id], end)
                ks, vs = [], []
                for i, block in enumerate(table):
                    take = min(self.block_size, end - i * self.block_size)
                    if take <= 0:
                        break
                    ks.append(self.k[layer][block, :, :take])
                    vs.append(self.v[layer][block, :, :take])
                return torch.cat(ks, dim=1)[None], torch.cat(vs, dim=1)[None]

            def free(self, seq_id):
                for block in self.tables[seq_id]:
                    self.pool.release(block)
                del self.tables[seq_id], self.lengths[seq_id]
        """,
}

ALT_RANDOM = {  # from the grader review (2026-12-03): a correct cache scored 19/22 when checks read raw pools
    "block_pool": """
        import random


        class BlockPool:
            \"\"\"Free blocks kept in a set; allocate() hands out a RANDOM free block (the policy is left open).\"\"\"

            def __init__(self, num_blocks):
                if num_blocks < 1:
                    raise ValueError("need at least one block")
                self._free = set(range(num_blocks))
                self.ref_count = [0] * num_blocks

            def allocate(self):
                if not self._free:
                    raise MemoryError("no free KV block left: free a finished request or build a bigger pool")
                block = random.choice(sorted(self._free))
                self._free.discard(block)
                self.ref_count[block] = 1
                return block

            def share(self, block):
                if self.ref_count[block] == 0:
                    raise ValueError("cannot share a free block")
                self.ref_count[block] += 1

            def release(self, block):
                if self.ref_count[block] == 0:
                    raise ValueError(f"block {block} is already free")
                self.ref_count[block] -= 1
                if self.ref_count[block] == 0:
                    self._free.add(block)

            @property
            def num_free(self):
                return sum(1 for r in self.ref_count if r == 0)
        """,
    "paged_cache": """
        class PagedKVCache:
            def __init__(self, config, num_blocks, block_size, dtype=torch.float32):
                self.block_size = block_size
                self.pool = BlockPool(num_blocks)
                self.k, self.v = [], []
                for _layer in range(config.n_layers):
                    self.k.append(torch.zeros(num_blocks, config.n_kv_heads, block_size, config.head_dim, dtype=dtype))
                    self.v.append(torch.zeros(num_blocks, config.n_kv_heads, block_size, config.head_dim, dtype=dtype))
                self.tables, self.lengths = {}, {}

            def _blocks_for(self, n_tokens):
                return (n_tokens + self.block_size - 1) // self.block_size

            def update(self, seq_id, layer, start_pos, k_new, v_new):
                n_new = k_new.shape[2]
                end = start_pos + n_new
                table = self.tables.get(seq_id)
                if table is None:
                    table = self.tables[seq_id] = []
                for _ in range(self._blocks_for(end) - len(table)):
                    table.append(self.pool.allocate())
                self.lengths[seq_id] = max(end, self.lengths.get(seq_id, 0))
                pos = start_pos
                while pos < end:  # write a run of tokens into one block at a time
                    b, off = divmod(pos, self.block_size)
                    n = min(self.block_size - off, end - pos)
                    self.k[layer][table[b], :, off:off + n] = k_new[0, :, pos - start_pos:pos - start_pos + n]
                    self.v[layer][table[b], :, off:off + n] = v_new[0, :, pos - start_pos:pos - start_pos + n]
                    pos += n
                ks = [self.k[layer][blk] for blk in table[:self._blocks_for(end)]]
                vs = [self.v[layer][blk] for blk in table[:self._blocks_for(end)]]
                return torch.cat(ks, dim=1)[None, :, :end], torch.cat(vs, dim=1)[None, :, :end]

            def free(self, seq_id):
                for blk in self.tables.pop(seq_id, []):
                    self.pool.release(blk)
                self.lengths.pop(seq_id, None)
        """,
}

SAMPLES = {
    "reference": dict(about="the solutions' code", expect="full"),
    "blank": dict(about="the exercise as released", expect="zero", blank=True),
    "paged-bug-boundary-early": dict(
        about="off-by-one at the block boundary: takes a new block when the last one is exactly full",
        expect="loses", patches={"paged_cache": [
            ("while len(table) * self.block_size < end:", "while len(table) * self.block_size <= end:")]}),
    "paged-bug-boundary-late": dict(
        about="off-by-one at the block boundary: the new block comes one token late",
        expect="loses", patches={"paged_cache": [
            ("while len(table) * self.block_size < end:", "while len(table) * self.block_size < end - 1:")]}),
    "paged-bug-never-freed": dict(
        about="free() forgets the last, partly filled block: it never returns to the pool",
        expect="loses", patches={"paged_cache": [
            ("for block in self.tables.pop(seq_id, []):", "for block in self.tables.pop(seq_id, [])[:-1]:")]}),
    "paged-bug-no-refcount": dict(
        about="fork shares the parent's blocks without counting the new reference",
        expect="loses", patches={"fork": [("        cache.pool.share(block)\n", "        pass\n")]}),
    "paged-bug-gather-sorted": dict(
        about="gathers the blocks in block-id order instead of table order",
        expect="loses", patches={"paged_cache": [
            ("blocks = table[: -(-end // self.block_size)]", "blocks = sorted(table[: -(-end // self.block_size)])")]}),
    "paged-bug-not-extended": dict(
        about="the table is sized for the prompt once and never extended at a later boundary",
        expect="loses", patches={"paged_cache": [
            ("table = self.tables.setdefault(seq_id, [])\n        while len(table) * self.block_size < end:",
             "table = self.tables.setdefault(seq_id, [])\n        while not self.lengths.get(seq_id) and "
             "len(table) * self.block_size < end:")]}),
    "paged-bug-no-copy-on-fork": dict(
        about="fork shares the partly filled last block too, so parent and child overwrite each other's tokens",
        expect="loses", patches={"fork": [
            ("    full = length // cache.block_size  # blocks every position of which is written",
             "    full = len(table)  # every block, the partly filled one too"),
            ("    if length % cache.block_size:", "    if False:")]}),
    "paged-bug-share-free": dict(
        about="share() counts a reference on a free block instead of raising ValueError",
        expect="loses", patches={"block_pool": [
            ("        if self.ref_count[block] < 1:\n"
             "            raise ValueError(f\"block {block} is free: allocate it before sharing it\")\n",
             "")]}),
    "paged-bug-index-error": dict(
        about="an empty pool raises IndexError (popping an empty list) instead of MemoryError",
        expect="loses", patches={"block_pool": [("        if not self.free:\n", "        if False:\n")]}),
    "paged-bug-one-block-per-step": dict(
        about="after the prompt, takes at most one new block per update: a chunk that crosses two boundaries "
              "writes past the table (IndexError)",
        expect="loses", patches={"paged_cache": [
            ("        while len(table) * self.block_size < end:  # a token past the last block: take a new one\n"
             "            table.append(self.pool.allocate())",
             "        if start_pos == 0:\n"
             "            while len(table) * self.block_size < end:\n"
             "                table.append(self.pool.allocate())\n"
             "        elif len(table) * self.block_size < end:  # decode: one token past the last block\n"
             "            table.append(self.pool.allocate())")]}),
    "paged-bug-ignores-dtype": dict(
        about="PagedKVCache ignores its dtype argument: float32 pools always",
        expect="loses", patches={"paged_cache": [
            ("self.k = [torch.zeros(shape, dtype=dtype)", "self.k = [torch.zeros(shape)"),
            ("self.v = [torch.zeros(shape, dtype=dtype)", "self.v = [torch.zeros(shape)")]}),
    "paged-bug-own-view": dict(
        about="a block one token late (the cache fails at every boundary), and the given SequenceView rewritten to "
              "keep a contiguous torch.cat cache of its own, so that the model never reads the paged cache",
        expect="loses", patches={"paged_cache": [
            ("while len(table) * self.block_size < end:", "while len(table) * self.block_size < end - 1:")]},
        edits=[replace_view]),
    "paged-alt-pop-highest-first": dict(
        about="a plain stack as the free list: the highest block id comes out first (the policy is left open)",
        expect="full", patches={"block_pool": [
            ("self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...",
             "self.free = list(range(num_blocks))  # a plain stack: pop() hands out the highest id first")]}),
    "paged-alt-random-policy-runs": dict(
        about="a random free block on every allocate (unseeded), writes a run of tokens per block, gathers by "
              "concatenating blocks", expect="full", answers=ALT_RANDOM),
    "paged-bug-global-cfg": dict(
        about="PagedKVCache sizes its pools from the notebook's global cfg instead of its config argument",
        expect="loses", patches={"paged_cache": [
            ("shape = (num_blocks, config.n_kv_heads, block_size, config.head_dim)",
             "shape = (num_blocks, cfg.n_kv_heads, block_size, cfg.head_dim)")]}),
    "paged-bug-rewind-stale": dict(
        about="an update before the end (a rewrite) returns every token stored so far, not 0 .. start_pos + T_new - 1",
        expect="loses", patches={"paged_cache": [
            ("""        blocks = table[: -(-end // self.block_size)]
        H_kv, D_h = k_new.shape[1], k_new.shape[3]
        k = self.k[layer][blocks].transpose(0, 1).reshape(H_kv, -1, D_h)[:, :end]  # [H_kv, end, D_h]
        v = self.v[layer][blocks].transpose(0, 1).reshape(H_kv, -1, D_h)[:, :end]""",
             """        n = self.lengths[seq_id]
        blocks = table[: -(-n // self.block_size)]
        H_kv, D_h = k_new.shape[1], k_new.shape[3]
        k = self.k[layer][blocks].transpose(0, 1).reshape(H_kv, -1, D_h)[:, :n]
        v = self.v[layer][blocks].transpose(0, 1).reshape(H_kv, -1, D_h)[:, :n]""")]}),
    "paged-bug-free-keeps-length": dict(
        about="free() releases the blocks and drops the table but keeps lengths[seq_id]: a reused id starts with a "
              "stale length", expect="loses", patches={"paged_cache": [
            ("        self.lengths.pop(seq_id, None)", "        pass  # the length stays")]}),
    "paged-bug-fork-global-layers": dict(
        about="fork copies the partly filled block in the notebook's cfg.n_layers (2) layers, not in every layer of "
              "the cache it is given", expect="loses", patches={"fork": [
            ("for layer in range(len(cache.k)):", "for layer in range(cfg.n_layers):")]}),
    "paged-alt-transactional": dict(
        about="update() takes all the blocks it needs or none (a MemoryError gives back what it took and leaves no "
              "table), and free() of a sequence it does not hold raises KeyError", expect="full",
        patches={"paged_cache": [
            ("""        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < end:  # a token past the last block: take a new one
            table.append(self.pool.allocate())""",
             """        table, taken = list(self.tables.get(seq_id, [])), []
        try:
            while (len(table) + len(taken)) * self.block_size < end:
                taken.append(self.pool.allocate())
        except MemoryError:
            for block in taken:
                self.pool.release(block)
            raise
        table += taken
        self.tables[seq_id] = table"""),
            ("""        for block in self.tables.pop(seq_id, []):
            self.pool.release(block)
        self.lengths.pop(seq_id, None)""",
             """        for block in self.tables[seq_id]:
            self.pool.release(block)
        del self.tables[seq_id], self.lengths[seq_id]""")]}),
    "paged-alt-heap-index": dict(about="lowest-id-first heap, divmod slots, index-tensor writes and reads",
                                 expect="full", answers=ALT_HEAP),
    "paged-alt-fifo-loops": dict(about="first-in-first-out free list, token loops, gather by concatenating slices",
                                 expect="full", answers={**ALT_DEQUE, "fork": ALT_HEAP["fork"]}),
}

