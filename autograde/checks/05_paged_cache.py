"""Checks for exercise 05 (a paged KV cache: block pool, block tables, fork, the model on top): one list per test cell.

Every run drives the learner's BlockPool / PagedKVCache / fork on fixed, seeded inputs (the model through this module's
own copy of the given SequenceView) and returns only what does not depend on a free-list policy the instructions
leave open (which block id comes out first): counts, reference counts looked up through the learner's own tables,
gathered tensors, pools with their blocks put in table order, tokens, and whether the right exception was raised.
Where the notebook's rules are about block ids (distinct, in range, shared by a fork), the ids come back raw and a
compare function here checks those rules only.
The comparison with the solution's values happens outside the sandbox.
"""
import torch

from course.engine.config import ModelConfig
from course.engine.generate import generate
from course.engine.model import tiny_model
from course.grade.verdicts import Check, close, exact, raises, whole

TINY = ModelConfig.from_name("tiny")  # 2 layers, H_kv = 2, D_h = 16
MQA = TINY.with_(n_kv_heads=1)
WIDE_HEADS = TINY.with_(head_dim=24)  # D_h = 24, not dim // n_heads = 16
SMOLLM = ModelConfig.from_name("smollm2-135m")  # the course model: 30 layers, H_kv = 3, D_h = 64


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def kv(pair):
    """Copies of the (K, V) an update returned, before later updates can write into them."""
    return [pair[0].clone(), pair[1].clone()]


# ----------------------------------------------------------------------------- the pool

def pool_cycle(ns):
    """Counts after allocate, share and release, and the ids handed out: [a, b] first, then [c, d] after a was
    freed. Which ids come out is the learner's policy; `pool_ids` judges only what the notebook asks of them."""
    pool = ns["BlockPool"](3)
    out = [pool.num_free]
    a, b = pool.allocate(), pool.allocate()
    out += [pool.ref_count[a], pool.ref_count[b], pool.num_free]
    pool.share(a)
    out.append(pool.ref_count[a])
    pool.release(a)
    out += [pool.ref_count[a], pool.num_free]
    pool.release(a)
    out += [pool.ref_count[a], pool.num_free]
    c, d = pool.allocate(), pool.allocate()
    return [out, [a, b, c, d]]


def pool_ids(got, ref) -> bool:
    """The counts as the reference's; a != b, both in 0..2; then c, d are exactly the two blocks b is not."""
    if not (isinstance(got, list) and len(got) == 2 and exact(got[0], ref[0])):
        return False
    ids = [whole(i) for i in got[1]] if isinstance(got[1], list) else []
    if len(ids) != 4 or None in ids:
        return False
    a, b, c, d = ids
    return a != b and {a, b} <= {0, 1, 2} and c != d and {c, d} == {0, 1, 2} - {b}


def pool_empty(ns):
    pool = ns["BlockPool"](2)
    for _ in range(2):
        pool.allocate()
    return pool.allocate()


def says_what_to_do(ns):
    pool = ns["BlockPool"](1)
    pool.allocate()
    try:
        pool.allocate()
    except MemoryError as err:
        return str(err)
    return None


def says_enough(got, ref) -> bool:
    """The MemoryError's message, judged outside: a sentence (more than 20 characters), as the reference's is."""
    return type(got) is str and len(got) > 20 and type(ref) is str and len(ref) > 20


def free_block(method):
    """release() or share() on a block that was allocated and released again (free now): the notebook says
    ValueError."""
    def run(ns):
        pool = ns["BlockPool"](2)
        block = pool.allocate()
        pool.release(block)
        return getattr(pool, method)(block)
    return run


# ----------------------------------------------------------------------------- the cache

def block_counts(ns):
    cache = ns["PagedKVCache"](TINY, num_blocks=8, block_size=4)
    k, v = randn(1, 1, 2, 4, 16), randn(2, 1, 2, 4, 16)
    cache.update(0, 0, 0, k, v)
    out = [len(cache.tables[0]), cache.pool.num_free]
    cache.update(0, 1, 0, k, v)
    out.append(len(cache.tables[0]))
    cache.update(0, 0, 4, k[:, :, :1], v[:, :, :1])
    out += [len(cache.tables[0]), cache.pool.num_free, cache.lengths[0]]
    return out


def exact_block_counts(block_size, lengths):
    def run(ns):
        out = []
        for n in lengths:
            cache = ns["PagedKVCache"](TINY, num_blocks=8, block_size=block_size)
            x = randn(n, 1, 2, n, 16)
            cache.update(0, 0, 0, x, x)
            out.append((len(cache.tables[0]), cache.pool.num_free))
        return out
    return run


def decode_counts(ns):
    """A 3-token prompt, then decode one token at a time past two boundaries: blocks held after each token."""
    cache = ns["PagedKVCache"](TINY, num_blocks=4, block_size=3)
    x = randn(3, 1, 2, 9, 16)
    cache.update(0, 0, 0, x[:, :, :3], x[:, :, :3])
    out = [len(cache.tables[0])]
    for pos in range(3, 9):
        cache.update(0, 0, pos, x[:, :, pos:pos + 1], x[:, :, pos:pos + 1])
        out.append(len(cache.tables[0]))
    return out


def chunk_after_prompt(ns):
    """A 3-token prompt, then chunks of 4 and 5 tokens (block size 2): each chunk takes two new blocks in one
    update, as a chunked prefill or a speculative verify step does."""
    cache = ns["PagedKVCache"](TINY, num_blocks=6, block_size=2)
    k, v = randn(14, 1, 2, 12, 16), randn(15, 1, 2, 12, 16)
    cache.update(0, 0, 0, k[:, :, :3], v[:, :, :3])
    out = kv(cache.update(0, 0, 3, k[:, :, 3:7], v[:, :, 3:7])) + [len(cache.tables[0]), cache.pool.num_free]
    out += kv(cache.update(0, 0, 7, k[:, :, 7:12], v[:, :, 7:12]))
    return out + [len(cache.tables[0]), cache.pool.num_free, cache.lengths[0]]


def pool_dtype(ns):
    """float16 pools: both pools of every layer as allocated (zeros of [num_blocks, H_kv, block_size, D_h]), then
    what an update in layer 1 gathers (after layer 0's, as the model calls them), and layer 1's and layer 0's pools
    with their blocks put in table order (unused blocks after, lowest id first), so that the values do not depend
    on which block ids the free list hands out, a policy the notebook leaves open."""
    cache = ns["PagedKVCache"](TINY, num_blocks=3, block_size=2, dtype=torch.float16)
    fresh = [cache.k[0].clone(), cache.v[0].clone(), cache.k[-1].clone(), cache.v[-1].clone()]
    x = randn(16, 1, 2, 3, 16).half()
    cache.update(0, 0, 0, x + 1, x * 3)
    out = fresh + kv(cache.update(0, 1, 0, x, x * 2))
    return out + in_table_order(cache, 0, [cache.k[1], cache.v[1], cache.k[0], cache.v[0]], num_blocks=3)


def in_table_order(cache, seq_id, pools, num_blocks):
    """Each pool with the sequence's blocks first, in table order, then every other block by id."""
    table = list(cache.tables[seq_id])
    order = table + sorted(set(range(num_blocks)) - set(table))
    return [pool[order].clone() for pool in pools]


def course_shape(ns):
    """The course model's own shape (SmolLM2-135M: 30 layers, H_kv = 3, D_h = 64), a small pool: the pools are
    sized from the config given, and an update in the last layer (after layer 0's, as the model calls them) stores
    and gathers [1, 3, T, 64]."""
    cache = ns["PagedKVCache"](SMOLLM, num_blocks=3, block_size=4)
    fresh = [len(cache.k), len(cache.v), [(tuple(k.shape), tuple(v.shape)) for k, v in zip(cache.k, cache.v)]]
    x = randn(19, 1, 3, 6, 64)
    cache.update("s", 0, 0, x[:, :, :5], x[:, :, :5])
    out = fresh + kv(cache.update("s", 29, 0, x[:, :, :5], -x[:, :, :5]))
    cache.update("s", 0, 5, x[:, :, 5:], x[:, :, 5:])
    return out + kv(cache.update("s", 29, 5, x[:, :, 5:], -x[:, :, 5:])) + [len(cache.tables["s"]), cache.pool.num_free]


def pools_in_place(ns):
    """The pools as __init__ allocated them, held before any update: after a 3-token prompt and a decode step in
    both layers, each with its blocks put in table order (unused after). A cache that writes into a new copy of a
    pool (clone, cat) leaves these zeros."""
    cache = ns["PagedKVCache"](TINY, num_blocks=3, block_size=2)
    held = list(cache.k) + list(cache.v)
    x = randn(25, 1, 2, 4, 16)
    for start, end in ((0, 3), (3, 4)):
        for layer in range(TINY.n_layers):
            cache.update(0, layer, start, x[:, :, start:end] + layer, -x[:, :, start:end])
    return in_table_order(cache, 0, held, num_blocks=3)


def wide_heads(ns):
    """A config whose D_h (24) is not dim // n_heads (16): the pools' shapes, then what layers 0 and 1 gather for a
    3-token prompt (block size 2)."""
    cache = ns["PagedKVCache"](WIDE_HEADS, num_blocks=3, block_size=2)
    shapes = [(tuple(k.shape), tuple(v.shape)) for k, v in zip(cache.k, cache.v)]
    x = randn(24, 1, 2, 3, 24)
    out = [cache.update(0, layer, 0, x + layer, -x)[0].clone() for layer in range(WIDE_HEADS.n_layers)]
    return [shapes] + out


def rewind(ns):
    """7 tokens, then an update at start_pos 3 of 2 tokens (a rejected speculative draft rewrites positions 3, 4):
    it returns positions 0 .. 4 only, with the new 3 and 4; decoding on from 5 sees those."""
    c = ns["PagedKVCache"](TINY, num_blocks=6, block_size=2)
    a, b = randn(17, 1, 2, 7, 16), randn(18, 1, 2, 3, 16)
    c.update(0, 0, 0, a, a * 2)
    return kv(c.update(0, 0, 3, b[:, :, :2], b[:, :, :2] * 2)) + kv(c.update(0, 0, 5, b[:, :, 2:], b[:, :, 2:] * 2))


def gather(ns):
    cache = ns["PagedKVCache"](TINY, num_blocks=8, block_size=4)
    k, v = randn(3, 1, 2, 10, 16), randn(4, 1, 2, 10, 16)
    out = kv(cache.update(0, 0, 0, k[:, :, :6], v[:, :, :6]))
    for pos in range(6, 10):
        last = cache.update(0, 0, pos, k[:, :, pos:pos + 1], v[:, :, pos:pos + 1])
    return out + kv(last)


def free_all(ns):
    cache = ns["PagedKVCache"](TINY, num_blocks=6, block_size=4)
    x = randn(5, 1, 2, 7, 16)
    cache.update(0, 0, 0, x, x)
    cache.update(1, 0, 0, x[:, :, :3], x[:, :, :3])
    out = [cache.pool.num_free]
    cache.free(0)
    out += [cache.pool.num_free, sorted(cache.tables)]  # the sequences still held: [1]
    cache.free(1)
    return out + [cache.pool.num_free]


def free_then_reuse(ns):
    """free() forgets the sequence (the notebook: release its blocks "and forget the sequence"; lengths[seq_id] is
    the tokens it holds): the sequences still known after a free (in tables and in lengths), then the freed id
    reused by a shorter request (3 tokens after 7): what it gathers, its length and its blocks, then the same after
    it decodes a 4th token. A stale length would, for one, make a fork of the reused id copy tokens that are not
    there."""
    c = ns["PagedKVCache"](TINY, num_blocks=8, block_size=4)
    x, y = randn(30, 1, 2, 7, 16), randn(31, 1, 2, 4, 16)
    for layer in range(TINY.n_layers):
        c.update("a", layer, 0, x, x * 2)
    c.update("b", 0, 0, x[:, :, :2], x[:, :, :2])
    c.free("a")
    out = [sorted(c.lengths), sorted(c.tables), c.pool.num_free]
    for layer in range(TINY.n_layers):
        last = c.update("a", layer, 0, y[:, :, :3], y[:, :, :3] * 2)
    out += kv(last) + [c.lengths["a"], len(c.tables["a"])]
    out += kv(c.update("a", 1, 3, y[:, :, 3:], y[:, :, 3:] * 2)) + [c.lengths["a"], len(c.tables["a"])]
    for seq in ("a", "b"):
        c.free(seq)
    return out + [sorted(c.lengths), c.pool.num_free]


def out_of_order(ns):
    """a and b interleave, b is freed, a grows into its block: a's table is not in block-id order."""
    c = ns["PagedKVCache"](TINY, num_blocks=4, block_size=2)
    xa, xb = randn(6, 1, 2, 8, 16), randn(7, 1, 2, 8, 16)
    c.update("a", 0, 0, xa[:, :, :2], xa[:, :, :2] * 2)
    c.update("b", 0, 0, xb[:, :, :2], xb[:, :, :2])
    c.update("a", 0, 2, xa[:, :, 2:4], xa[:, :, 2:4] * 2)
    c.free("b")
    for pos in range(4, 8):
        last = c.update("a", 0, pos, xa[:, :, pos:pos + 1], xa[:, :, pos:pos + 1] * 2)
    return kv(last) + [c.pool.num_free, len(c.tables["a"])]


def full_pool(ns):
    c = ns["PagedKVCache"](TINY, num_blocks=2, block_size=2)
    x = randn(8, 1, 2, 4, 16)
    c.update("a", 0, 0, x, x)
    return c.update("b", 0, 0, x[:, :, :1], x[:, :, :1])


def everything_returns(ns):
    c = ns["PagedKVCache"](TINY, num_blocks=5, block_size=2)
    for seq, n in (("a", 3), ("b", 4), ("c", 2)):
        x = randn(len(seq) + n, 1, 2, n, 16)
        c.update(seq, 0, 0, x, x)
    for seq in ("b", "a", "c"):
        c.free(seq)
    return [c.pool.num_free, list(c.pool.ref_count)]


def layers_share_a_table(ns):
    c = ns["PagedKVCache"](TINY.with_(n_layers=3), num_blocks=3, block_size=3)
    z = randn(9, 3, 1, 2, 7, 16)
    for layer in range(3):
        c.update(5, layer, 0, z[layer, :, :, :4], z[layer, :, :, :4])
    outs = []
    for pos in range(4, 7):
        for layer in range(3):
            outs.append(c.update(5, layer, pos, z[layer, :, :, pos:pos + 1], z[layer, :, :, pos:pos + 1])[0].clone())
    return outs + [len(c.tables[5]), c.pool.num_free]


# ----------------------------------------------------------------------------- fork

def fork_basic(ns):
    """The two tables (their ids are the learner's policy: `fork_tables` judges how they relate), then counts,
    and what child and parent gather after each decodes its own 7th token."""
    cache = ns["PagedKVCache"](TINY, num_blocks=8, block_size=4)
    x = randn(10, 1, 2, 6, 16)
    for layer in range(TINY.n_layers):
        cache.update("p", layer, 0, x, x)
    ns["fork"](cache, "p", "c")
    p, c = list(cache.tables["p"]), list(cache.tables["c"])
    out = [[p, c], cache.pool.ref_count[p[0]], cache.pool.num_free, cache.lengths["c"]]
    y = randn(11, 1, 2, 1, 16)
    out.append(cache.update("c", 0, 6, y, y)[0].clone())
    return out + [cache.update("p", 0, 6, -y, -y)[0].clone()]


def fork_tables(got, ref) -> bool:
    """Two-block tables of ints: the full first block shared (same id), the partly filled one copied (other ids);
    everything after the tables as the reference's."""
    if not (isinstance(got, list) and len(got) == len(ref) and exact(got[1:], ref[1:])):
        return False
    tables = [[whole(i) for i in t] if isinstance(t, list) else [] for t in got[0]] if isinstance(got[0], list) else []
    if not (len(tables) == 2 and all(len(t) == 2 and None not in t for t in tables)):
        return False
    p, c = tables
    return c[0] == p[0] and c[1] != p[1] and len({p[0], p[1], c[1]}) == 3


def fork_then_free_parent(ns):
    c = ns["PagedKVCache"](TINY, num_blocks=6, block_size=2)
    x = randn(12, 1, 2, 5, 16)
    for layer in range(TINY.n_layers):
        c.update("p", layer, 0, x[:, :, :4], x[:, :, :4] + 1)
    ns["fork"](c, "p", "c")
    out = [c.pool.num_free]
    c.free("p")
    out.append(c.pool.num_free)
    junk = torch.full((1, 2, 6, 16), 9.0)
    c.update("other", 0, 0, junk, junk)
    out += kv(c.update("c", 0, 4, x[:, :, 4:5], x[:, :, 4:5] + 1)) + [c.pool.num_free]
    c.free("c")
    c.free("other")
    return out + [c.pool.num_free, list(c.pool.ref_count)]


def fork_twice(ns):
    c = ns["PagedKVCache"](TINY, num_blocks=5, block_size=3)
    x = randn(13, 1, 2, 4, 16)
    for layer in range(TINY.n_layers):
        c.update(0, layer, 0, x, x * 3)
    for child in (1, 2):
        ns["fork"](c, 0, child)
    out = [c.pool.ref_count[c.tables[0][0]], c.pool.num_free]
    for seq in (0, 1, 2):
        out.append(c.update(seq, 1, 4, x[:, :, :1], x[:, :, :1])[1].clone())
    for seq in (2, 0, 1):
        c.free(seq)
    return out + [c.pool.num_free]


def fork_three_layers(ns):
    """fork on a 3-layer cache (every other fork check uses the notebook's 2 layers): the partly filled block is
    copied in every layer of this cache, not in a fixed count of layers. Each layer holds other K and V; after the
    fork, child and parent each write their own 7th token in every layer, and every layer's gather comes back."""
    config = TINY.with_(n_layers=3)
    c = ns["PagedKVCache"](config, num_blocks=6, block_size=4)
    x, y = randn(14, 1, 2, 6, 16), randn(15, 1, 2, 1, 16)
    for layer in range(3):
        c.update("p", layer, 0, x + layer, x * 2 - layer)
    ns["fork"](c, "p", "c")
    out = [c.pool.num_free, c.lengths["c"]]
    for layer in range(3):
        out += kv(c.update("c", layer, 6, y + layer, y - layer))
        out += kv(c.update("p", layer, 6, -y, y * 3))
    return out


# ----------------------------------------------------------------------------- the model

# The given cell's SequenceView and _LayerView, copied: the model checks drive the learner's PagedKVCache through
# these, not through the notebook's copy (an editable cell that could keep a cache of its own).
class SequenceView:
    """What the course model sees for one sequence (batch 1): cache[layer].update(start_pos, k, v).

    The model calls it in every layer with k, v of shape [1, H_kv, T_new, D_h] and attends over what comes back.
    """

    def __init__(self, paged, seq_id):
        self.paged, self.seq_id = paged, seq_id

    def __getitem__(self, layer):
        return _LayerView(self.paged, self.seq_id, layer)


class _LayerView:
    def __init__(self, paged, seq_id, layer):
        self.paged, self.seq_id, self.layer = paged, seq_id, layer

    def update(self, start_pos, k_new, v_new):
        return self.paged.update(self.seq_id, self.layer, start_pos, k_new, v_new)


def model_logits(seed, config, prompt_len, total, num_blocks, block_size):
    def run(ns):
        model = tiny_model(seed=seed, config=config)
        ids = torch.randint(0, config.vocab_size, (1, total), generator=torch.Generator().manual_seed(seed + 100))
        cache = ns["PagedKVCache"](model.config, num_blocks=num_blocks, block_size=block_size)
        view = SequenceView(cache, 0)
        with torch.no_grad():
            steps = [model(ids[:, :prompt_len], start_pos=0, cache=view)]
            steps += [model(ids[:, t:t + 1], start_pos=t, cache=view) for t in range(prompt_len, total)]
        return torch.cat(steps, dim=1)
    return run


def greedy(seed, config, prompt, n, num_blocks, block_size):
    def run(ns):
        model = tiny_model(seed=seed, config=config)
        cache = ns["PagedKVCache"](model.config, num_blocks=num_blocks, block_size=block_size)
        with torch.no_grad():
            tokens = generate(model, prompt, n, cache=SequenceView(cache, 0)).tokens
        cache.free(0)
        return [tokens, cache.pool.num_free]
    return run


def next_token(model, cache, seq_id, tokens, at):
    """The greedy token after `tokens`, written at positions at .. of sequence seq_id of the learner's cache."""
    return int(model(torch.tensor([tokens]), start_pos=at, cache=SequenceView(cache, seq_id), last_only=True).argmax())


def interleaved(ns):
    mqa = tiny_model(seed=7, config=MQA)
    prompts = {"x": [1, 2, 3, 4, 5], "y": [9, 8, 7]}
    c = ns["PagedKVCache"](mqa.config, num_blocks=20, block_size=3)
    out = {s: [] for s in prompts}
    with torch.no_grad():
        for s, p in prompts.items():
            out[s].append(next_token(mqa, c, s, p, 0))
        for _ in range(19):
            for s, p in prompts.items():  # the last token out goes in at position len(p) + (tokens out so far) - 1
                out[s].append(next_token(mqa, c, s, out[s][-1:], len(p) + len(out[s]) - 1))
    return out


def forked_continuations(ns):
    mqa = tiny_model(seed=7, config=MQA)
    c = ns["PagedKVCache"](mqa.config, num_blocks=8, block_size=4)
    p = [3, 1, 4, 1, 5, 9]
    outs = []
    with torch.no_grad():
        mqa(torch.tensor([p[:-1]]), start_pos=0, cache=SequenceView(c, "prompt"))
        ns["fork"](c, "prompt", "a")
        ns["fork"](c, "prompt", "b")
        for s in ("a", "b"):
            tokens = [p[-1]]
            for at in range(len(p) - 1, len(p) + 7):
                tokens.append(next_token(mqa, c, s, tokens[-1:], at))
            outs.append(tokens[1:])
    return outs


BOUNDARY = "hint: take a block exactly when a token falls past the last one: ceil(tokens / block_size) blocks"
ORDER = "hint: token t lives in block table[t // block_size] at offset t % block_size; gather in table order"
FREE = "hint: free() releases every block of the table, the partly filled last one too"
REFS = "hint: a shared block goes back to the free list only when its last user releases it (reference counts)"

# The course's own paged caches: left out of the sandbox (course.grade.sandbox.course_tree).
ABSENT = ["course.engine.paged", "course.engine.paged_prefix"]

CHECKS = {
    "test_pool_allocate": [
        Check("allocate, share, release", pool_cycle, pool_ids,
              "hint: allocate() takes a free block at count 1; release() frees it when the count reaches 0"),
    ],
    "test_pool_refuses": [
        Check("an empty pool", pool_empty, raises, "hint: when no block is free, raise MemoryError"),
        Check("the message", says_what_to_do, says_enough, "hint: say in the MemoryError what to do"),
    ],
    "test_cache_blocks": [
        Check("a full block, then the next token", block_counts, exact, BOUNDARY),
    ],
    "test_cache_gather": [
        Check("prefill 6, decode 4 across a boundary", gather, exact, ORDER),
    ],
    "test_cache_free": [
        Check("two requests end", free_all, exact, FREE),
    ],
    "test_cache_hidden": [
        Check("a table out of block-id order", out_of_order, exact, ORDER),
        Check("the pool runs out", full_pool, raises, "hint: an empty pool must raise MemoryError"),
        Check("every block comes back", everything_returns, exact, FREE),
        Check("exact block counts, block size 2", exact_block_counts(2, (1, 2, 3, 4, 5)), exact, BOUNDARY),
        Check("decoding past two boundaries", decode_counts, exact,
              "hint: decoding must extend the table at every block boundary, not only the prompt's blocks"),
        Check("a chunk of several blocks after the prompt", chunk_after_prompt, exact,
              "hint: after the prompt too, take as many blocks as start_pos + T_new tokens need: a chunk can cross "
              "more than one boundary"),
        Check("float16 pools", pool_dtype, exact,
              "hint: allocate the K and V pools once, as zeros of [num_blocks, H_kv, block_size, D_h] and the dtype "
              "you are given"),
        Check("the course model's shape", course_shape, exact,
              "hint: size the pools from the config you are given (config.n_layers, config.n_kv_heads, "
              "config.head_dim), not from the notebook's own cfg"),
        Check("the pools allocated in __init__ hold the tokens", pools_in_place, exact,
              "hint: allocate the pools once in __init__ and write into those tensors in place, not into a new copy"),
        Check("D_h is not dim / n_heads", wide_heads, exact,
              "hint: size the pools with config.head_dim: D_h is not always config.dim // config.n_heads"),
        Check("rewind: an update before the end", rewind, exact,
              "hint: update() returns positions 0 .. start_pos + T_new - 1, also when start_pos is below the "
              "tokens already stored (a rewrite)"),
        Check("three layers, one table", layers_share_a_table, exact,
              "hint: each layer has its own K/V pool, and all layers share one block table"),
        Check("releasing a free block", free_block("release"), raises,
              "hint: releasing a block that is already free must raise ValueError"),
        Check("sharing a free block", free_block("share"), raises,
              "hint: sharing a block that is free (never allocated, or released) must raise ValueError"),
        Check("a freed id reused", free_then_reuse, exact,
              "hint: free() forgets the sequence: its table and its length (lengths[seq_id]) go, so that the id "
              "can start again from 0 tokens"),
    ],
    "test_fork": [
        Check("fork a 6-token sequence (block size 4)", fork_basic, fork_tables,
              "hint: share() every full block of the parent; copy the partly filled last one into a new block"),
    ],
    "test_fork_hidden": [
        Check("free the parent first", fork_then_free_parent, exact, REFS),
        Check("two forks of one prompt", fork_twice, exact,
              "hint: copy the partly filled block in every layer; free each user once"),
        Check("fork on a 3-layer cache", fork_three_layers, exact,
              "hint: copy the partly filled block in every layer of this cache (len(cache.k)), not in the "
              "notebook's cfg.n_layers"),
    ],
    "test_model_logits": [
        Check("prefill 6, decode 6", model_logits(0, TINY, 6, 12, 6, 4), close(1e-5),
              "hint: if the cache passes but this fails, check that update() returns every position so far, in order"),
    ],
    "test_greedy_32": [
        Check("32 greedy tokens", greedy(0, TINY, [169, 163, 192, 95], 32, 4, 16), exact,
              "hint: a token written to the wrong block changes every token after it"),
    ],
    "test_model_hidden": [
        Check("MQA, block size 3, 20 greedy tokens after a 5-token prompt", greedy(7, MQA, [1, 2, 3, 4, 5], 20, 9, 3),
              exact,
              "hint: check the block boundaries with another block size"),
        Check("two requests interleaved", interleaved, exact,
              "hint: interleaved requests must each decode their solo tokens"),
        Check("forked continuations", forked_continuations, exact,
              "hint: a forked sequence must decode like the original"),
    ],
}
