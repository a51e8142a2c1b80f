"""The paged KV cache: block pool, tables, free list, reference counts, sharing, copy-on-write, equal logits."""
import pytest
import torch

from course.engine.generate import generate
from course.engine.kv_cache import KVCache
from course.engine.paged import BlockAllocator, PagedKVCache, PoolExhausted, block_bytes, gather_blocks


def ids_of(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def run_paged(model, cache, seq_id, prompt, n):
    """Prefill (after any shared blocks) then n - 1 decode steps through the paged cache; logits per step."""
    cached = cache.add_sequence(seq_id, prompt)
    batch = cache.append([seq_id], [prompt[cached:]])
    logits = [model(torch.tensor([prompt[cached:]]), batch.positions, batch, last_only=True)[0]]
    for _ in range(n - 1):
        tok = int(logits[-1].argmax())
        batch = cache.append([seq_id], [[tok]])
        logits.append(model(torch.tensor([[tok]]), batch.positions, batch, last_only=True)[0])
    return cached, torch.stack(logits)


@torch.inference_mode()
def run_contiguous(model, prompt, n):
    cache = KVCache(model.config, 1, len(prompt) + n)
    logits = [model(torch.tensor([prompt]), 0, cache, last_only=True)[0]]
    for i in range(n - 1):
        logits.append(model(torch.tensor([[int(logits[-1].argmax())]]), len(prompt) + i, cache, last_only=True)[0])
    return torch.stack(logits)


# ------------------------------------------------------------------------------------------- the allocator
def test_allocator_free_list_and_reference_counts():
    a = BlockAllocator(3, 4)
    blocks = [a.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and a.num_free == 0
    with pytest.raises(PoolExhausted, match="all 3 blocks .* in use"):
        a.allocate()
    a.share(blocks[0])
    assert a.ref_count[blocks[0]] == 2
    assert a.release(blocks[0]) is False  # still held once
    assert a.release(blocks[0]) is True and a.num_free == 1
    with pytest.raises(ValueError, match="released twice"):
        a.release(blocks[0])
    assert a.allocate() == blocks[0]  # the freed block is handed out again


def test_allocator_rejects_bad_sizes():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            BlockAllocator(bad, 4)
        with pytest.raises(ValueError, match="positive integer"):
            BlockAllocator(4, bad)


# ------------------------------------------------------------------------------------------- the cache
def test_paged_logits_equal_contiguous_across_block_boundaries(tiny, one_thread):
    cache = PagedKVCache(tiny.config, num_blocks=16, block_size=4)
    prompt = ids_of(6)  # 1.5 blocks; decoding crosses several boundaries
    _, paged = run_paged(tiny, cache, "a", prompt, 12)
    torch.testing.assert_close(paged, run_contiguous(tiny, prompt, 12), atol=1e-5, rtol=0)
    assert cache.length("a") == 6 + 11
    assert len(cache.block_table("a")) == -(-17 // 4)


def test_a_block_is_allocated_exactly_at_a_boundary(tiny):
    cache = PagedKVCache(tiny.config, num_blocks=8, block_size=4)
    cache.add_sequence("a")
    grew = []
    for step in range(9):
        before = len(cache.block_table("a"))
        cache.append(["a"], n_new=1)
        grew.append(len(cache.block_table("a")) > before)
    # position p needs a new block when p % 4 == 0
    assert grew == [p % 4 == 0 for p in range(9)]
    assert cache.allocator.num_free == 8 - 3


def test_gather_reads_blocks_in_table_order(tiny):
    """Blocks handed out out of order (a freed block reused) still gather as positions 0..T-1."""
    c = tiny.config
    cache = PagedKVCache(c, num_blocks=6, block_size=2)
    cache.add_sequence("x")
    cache.append(["x"], n_new=4)  # takes blocks 0, 1
    cache.add_sequence("a")
    cache.append(["a"], n_new=2)  # block 2
    cache.free_sequence("x")  # 1, 0 back on the free list (last block first), behind 3, 4, 5
    k_new = torch.arange(9 * c.n_kv_heads * c.head_dim, dtype=torch.float32).view(1, c.n_kv_heads, 9, c.head_dim)
    b1 = cache.append(["a"], n_new=9)  # positions 2..10 → blocks 3, 4, 5, 1, 0: out of order
    k_all, _ = b1[0].update(b1.positions, k_new, k_new)
    table = cache.block_table("a")
    assert table[0] == 2 and table[1:] == [3, 4, 5, 1, 0]
    gathered = gather_blocks(cache.k[0], torch.tensor([table]))  # [1, H_kv, 12, D_h]
    torch.testing.assert_close(gathered[:, :, 2:11], k_new)
    torch.testing.assert_close(k_all[:, :, 2:], k_new)


def test_free_returns_every_block(tiny):
    cache = PagedKVCache(tiny.config, num_blocks=10, block_size=4)
    for s, n in (("a", 9), ("b", 3)):
        cache.add_sequence(s)
        cache.append([s], n_new=n)
    assert cache.allocator.num_free == 10 - 3 - 1
    assert cache.free_sequence("a") == 3
    assert cache.free_sequence("b") == 1
    assert cache.allocator.num_free == 10 and cache.bytes_reserved == 0
    with pytest.raises(KeyError, match="no sequence"):
        cache.free_sequence("a")


def test_empty_pool_is_a_clear_error_and_changes_nothing(tiny):
    cache = PagedKVCache(tiny.config, num_blocks=3, block_size=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    cache.append(["a", "b"], n_new=4)  # two blocks
    with pytest.raises(PoolExhausted, match="needs 2 new blocks .* 1 of 3 are free"):
        cache.append(["a", "b"], n_new=1)
    assert cache.length("a") == cache.length("b") == 4 and cache.allocator.num_free == 1


def test_shared_prefix_points_at_the_same_full_blocks(tiny, one_thread):
    bs = 4
    cache = PagedKVCache(tiny.config, num_blocks=32, block_size=bs)
    system = ids_of(10, seed=5)  # 2 full blocks + 2 tokens
    p1, p2 = system + ids_of(3, seed=6), system + ids_of(5, seed=7)
    cached1, logits1 = run_paged(tiny, cache, "r1", p1, 6)
    cached2, logits2 = run_paged(tiny, cache, "r2", p2, 6)
    assert cached1 == 0 and cached2 == 2 * bs  # only full blocks are shared
    t1, t2 = cache.block_table("r1"), cache.block_table("r2")
    assert t1[:2] == t2[:2] and not set(t1[2:]) & set(t2[2:])
    assert all(cache.allocator.ref_count[b] == 2 for b in t1[:2])
    assert cache.bytes_logical - cache.bytes_used == 2 * bs * cache.bytes_per_token  # the shared positions
    torch.testing.assert_close(logits2, run_contiguous(tiny, p2, 6), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits1, run_contiguous(tiny, p1, 6), atol=1e-5, rtol=0)
    cache.free_sequence("r1")
    assert all(cache.allocator.ref_count[b] == 1 for b in t1[:2])  # r2 still holds them
    cache.free_sequence("r2")
    assert cache.allocator.num_free == 32
    # freed blocks keep their contents: a third request with the prefix still finds them
    cached3, logits3 = run_paged(tiny, cache, "r3", system + [1, 2], 3)
    assert cached3 == 2 * bs and cache.block_table("r3")[:2] == t1[:2]
    torch.testing.assert_close(logits3, run_contiguous(tiny, system + [1, 2], 3), atol=1e-5, rtol=0)


def test_sharing_leaves_the_last_prompt_token_to_compute(tiny):
    cache = PagedKVCache(tiny.config, num_blocks=16, block_size=4)
    prompt = ids_of(8)
    run_paged(tiny, cache, "a", prompt, 1)
    assert cache.add_sequence("b", prompt) == 4  # not 8: the model must still run the last token for its logits
    assert cache.add_sequence("c", prompt, share=False) == 0


def test_a_different_earlier_token_is_never_shared(tiny):
    """K/V of a block depend on every earlier token: the same block of tokens after another prefix is a miss."""
    cache = PagedKVCache(tiny.config, num_blocks=16, block_size=4)
    block = ids_of(4, seed=1)
    run_paged(tiny, cache, "a", ids_of(4, seed=2) + block + [9], 1)
    assert cache.add_sequence("b", ids_of(4, seed=3) + block + [9]) == 0


def test_fork_copies_the_partial_block_on_write(tiny, one_thread):
    """Beam search / parallel sampling: a fork shares every block; writing the shared partial block copies it."""
    cache = PagedKVCache(tiny.config, num_blocks=16, block_size=4)
    prompt = ids_of(6)
    _, logits = run_paged(tiny, cache, "parent", prompt, 1)
    cache.fork("parent", "child")
    assert cache.block_table("child") == cache.block_table("parent")
    layer0 = lambda seq: gather_blocks(cache.k[0], torch.tensor([cache.block_table(seq)]))[:, :, :6]  # noqa: E731
    before = layer0("parent").clone()
    with torch.inference_mode():
        for seq, tok in (("child", 3), ("parent", 5)):
            b = cache.append([seq], [[tok]])
            out = tiny(torch.tensor([[tok]]), b.positions, b, last_only=True)[0]
            ref = run_contiguous_after(tiny, prompt, tok)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    tp, tc = cache.block_table("parent"), cache.block_table("child")
    assert tp[0] == tc[0] and tp[1] != tc[1]  # full block shared, the partial one copied
    torch.testing.assert_close(layer0("parent"), before)


@torch.inference_mode()
def run_contiguous_after(model, prompt, tok):
    cache = KVCache(model.config, 1, len(prompt) + 1)
    model(torch.tensor([prompt]), 0, cache)
    return model(torch.tensor([[tok]]), len(prompt), cache, last_only=True)[0]


def test_paged_sequence_is_a_drop_in_for_generate(tiny, one_thread):
    cache = PagedKVCache(tiny.config, num_blocks=16, block_size=4)
    prompt = ids_of(7)
    assert generate(tiny, prompt, 15, cache=cache.sequence("g")).tokens == generate(tiny, prompt, 15).tokens
    assert cache.length("g") == 7 + 14
    cache.truncate("g", 5)  # a rewind (speculative decoding's rejected drafts) returns the blocks past it
    assert len(cache.block_table("g")) == 2


def test_bytes_reserved_used_and_budget(tiny):
    c = tiny.config
    cache = PagedKVCache.for_budget(c, budget_bytes=10 * block_bytes(c, 8) + 5, block_size=8)
    assert cache.allocator.num_blocks == 10
    assert cache.nbytes == 10 * cache.block_bytes
    assert cache.bytes_per_token == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    cache.add_sequence("a")
    cache.append(["a"], n_new=9)
    assert cache.bytes_reserved == 2 * cache.block_bytes and cache.bytes_used == 9 * cache.bytes_per_token
    picture = cache.pool_picture()
    assert [p["filled"] for p in picture if p["holders"]] == [8, 1]
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache.for_budget(c, budget_bytes=10, block_size=8)


@pytest.mark.slow
def test_real_model_paged_logits_equal_contiguous(real):
    model, tok = real
    prompt = tok.encode("The capital of France is Paris. The capital of Italy is")
    cache = PagedKVCache(model.config, num_blocks=8, block_size=16)
    _, paged = run_paged(model, cache, "a", prompt, 8)
    diff = (paged - run_contiguous(model, prompt, 8)).abs().max().item()
    assert diff <= 1e-5, f"paged vs contiguous logits differ by {diff:.2e}"


# ------------------------------------------------------------------------------------------- prefix store
def test_block_table_prefix_store_is_a_drop_in_for_generate(tiny, one_thread):
    import gc

    from course.engine.paged_prefix import PagedPrefixCache

    prefix = ids_of(50, seed=11)
    store = PagedPrefixCache(tiny, max_bytes=1 << 22, block_size=16)
    rows = []
    for seed in (12, 13, 14):
        prompt = prefix + ids_of(8, seed=seed)
        got = generate(tiny, prompt, 10, prefix_cache=store, prefix_len=len(prefix))
        assert got.tokens == generate(tiny, prompt, 10).tokens
        rows.append((got.reused_tokens, got.computed_tokens))
    assert rows == [(0, 58), (48, 10), (48, 10)]  # 3 full blocks of the 50-token prefix are shared
    gc.collect()  # the requests' caches are gone: only the pinned prefix holds blocks
    assert store.pool.blocks_held == 3 and len(store) == 1 and store.nbytes == 3 * store.pool.block_bytes
    s = store.stats
    assert (s.hits, s.misses, s.tokens_reused, s.tokens_computed) == (2, 1, 96, 58 + 2 * 10)
    assert store.entry_bytes(50) == 4 * store.pool.block_bytes
    assert len(store.match(prefix + [1]).tokens) == 50 and store.match(ids_of(60, seed=15)) is None


def test_prefix_store_unpins_the_oldest_when_the_pool_is_full(tiny, one_thread):
    from course.engine.paged_prefix import PagedPrefixCache

    store = PagedPrefixCache(tiny, max_bytes=6 * block_bytes(tiny.config, 4), block_size=4)
    a, b = ids_of(8, seed=20), ids_of(8, seed=21)
    store.add(a)
    store.add(b)  # 4 of 6 blocks pinned
    result = store.prefill(ids_of(9, seed=22))  # needs 3 blocks: a, the oldest, is unpinned
    assert a not in store and b in store and store.stats.evictions == 1
    store.release(result.cache)
    assert store.pool.blocks_held == 2
    with pytest.raises(ValueError, match="max_bytes"):
        store.add(ids_of(40, seed=23))
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            PagedPrefixCache(tiny, max_bytes=bad)
    with pytest.raises(ValueError, match="empty"):
        store.prefill([])
    with pytest.raises(ValueError, match="prefix_len"):
        store.prefill([1, 2, 3], prefix_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        store.prefill([1, 2, 3], max_seq_len=2)


@pytest.mark.slow
def test_system_prompt_reuse_on_the_real_model(real_model, tokenizer):
    from course.engine.paged_prefix import PagedPrefixCache

    system = ("You are the help desk of the Harbour Library. Answer in one short sentence. "
              "Opening hours: Monday to Friday 9:00-18:00, Saturday 10:00-14:00, closed on Sunday.")
    prefix = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                                            add_generation_prompt=False), add_bos=False)
    store = PagedPrefixCache(real_model, max_bytes=64 << 20)
    for question in ("When do you open on Saturday?", "Are you open on Sunday?"):
        prompt = tokenizer.chat_ids(question, system=system)
        assert prompt[:len(prefix)] == prefix  # the system turn is a token prefix of every request
        got = generate(real_model, prompt, 12, prefix_cache=store, prefix_len=len(prefix))
        assert got.tokens == generate(real_model, prompt, 12).tokens
    assert got.reused_tokens == len(prefix) // 16 * 16  # the prefix's whole blocks
    assert store.stats.hits == 1 and store.stats.misses == 1


@torch.inference_mode()
def test_packed_batch_of_different_lengths(tiny, one_thread):
    """A new prompt next to a decode step in one paged call: the packed batch writes and gathers each sequence."""
    cache = PagedKVCache(tiny.config, num_blocks=16, block_size=4)
    a, b = ids_of(6, seed=30), ids_of(10, seed=31)
    _, logits_a = run_paged(tiny, cache, "a", a, 1)
    cache.add_sequence("b", b)
    tok = int(logits_a[0].argmax())
    batch = cache.append(["a", "b"], [[tok], b])
    assert batch.packed and batch.write_slots.numel() == 11
    out = tiny(torch.tensor([[tok] + b]), batch.positions, batch, last_only=True)  # [2, V]
    torch.testing.assert_close(out[0], run_contiguous(tiny, a, 2)[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1], run_contiguous(tiny, b, 1)[0], atol=1e-5, rtol=0)
