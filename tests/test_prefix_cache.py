"""Prefix caching: reuse gives the same logits and K/V as a full prefill; the LRU store keeps its byte bound."""
from __future__ import annotations

import pytest
import torch

from course.engine.generate import generate
from course.engine.kv_cache import KVCache
from course.measure.costs import kv_cache_bytes
from course.engine.prefix_cache import PrefixCache


@pytest.fixture(autouse=True)
def _steady(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def full_prefill(model, ids):
    cache = KVCache(model.config, batch=1, max_seq_len=len(ids), dtype=model.dtype)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), start_pos=0, cache=cache, last_only=True)
    return logits, cache


def _ids(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_reuse_gives_identical_logits_and_kv(tiny):
    prefix = _ids(60, 0)
    store = PrefixCache(tiny, max_bytes=1 << 24)
    for seed in (1, 2, 3):
        prompt = prefix + _ids(12, seed)
        want_logits, want_cache = full_prefill(tiny, prompt)
        got = store.prefill(prompt, prefix_len=len(prefix))
        assert torch.allclose(got.logits, want_logits, atol=1e-5, rtol=1e-5)
        for a, b in zip(got.cache.layers, want_cache.layers):
            assert torch.allclose(a.k, b.k, atol=1e-5) and torch.allclose(a.v, b.v, atol=1e-5)
        if seed == 1:  # the first request stores the prefix and pays for all of it
            assert (got.reused_tokens, got.computed_tokens) == (0, len(prompt))
        else:
            assert (got.reused_tokens, got.computed_tokens) == (60, 12)
    s = store.stats
    assert (s.misses, s.hits, len(store)) == (1, 2, 1)
    assert s.tokens_reused == 120 and s.tokens_computed == 72 + 24
    assert s.prefill_saved == pytest.approx(120 / 216)


def test_generation_through_the_store_matches_plain_generate(tiny):
    prefix = _ids(50, 4)
    store = PrefixCache(tiny, max_bytes=1 << 24)
    for seed in (5, 6):
        prompt = prefix + _ids(8, seed)
        want = generate(tiny, prompt, 12, temperature=0).tokens
        plain = generate(tiny, prompt, 12)
        reused = generate(tiny, prompt, 12, prefix_cache=store, prefix_len=len(prefix))
        assert plain.tokens == want and reused.tokens == want
        assert plain.reused_tokens == 0 and plain.computed_tokens == len(prompt)
    assert reused.reused_tokens == len(prefix) and reused.computed_tokens == 8


def test_prompt_equal_to_prefix_needs_no_model_call(tiny):
    prefix = _ids(30, 7)
    store = PrefixCache(tiny, max_bytes=1 << 24)
    store.add(prefix)
    calls = []
    hook = tiny.register_forward_hook(lambda *a: calls.append(1))
    try:
        got = store.prefill(prefix)
    finally:
        hook.remove()
    assert calls == []
    assert torch.allclose(got.logits, full_prefill(tiny, prefix)[0], atol=1e-5)


def test_longest_stored_prefix_wins(tiny):
    ids = _ids(40, 8)
    store = PrefixCache(tiny, max_bytes=1 << 24)
    store.add(ids[:10])
    store.add(ids[:25])
    store.add(_ids(5, 9))  # an unrelated prefix
    assert store.match(ids).n_tokens == 25
    assert store.match(ids[:20]).n_tokens == 10
    assert store.match(_ids(20, 10)) is None
    got = store.prefill(ids)
    assert got.reused_tokens == 25 and got.computed_tokens == 15


def test_entry_bytes_follow_the_kv_formula(tiny):
    c = tiny.config
    store = PrefixCache(tiny, max_bytes=1 << 24)
    entry = store.add(_ids(33, 11))
    kv = kv_cache_bytes(c.n_layers, 1, 33, c.n_kv_heads, c.head_dim, 4)
    assert entry.nbytes == kv + c.vocab_size * 4 == store.entry_bytes(33)
    assert store.nbytes == entry.nbytes


def test_lru_eviction_respects_the_byte_bound(tiny):
    P = 20
    store = PrefixCache(tiny, max_bytes=int(2.5 * PrefixCache(tiny, 1).entry_bytes(P)))
    a, b, c, d = (_ids(P, s) for s in (20, 21, 22, 23))
    store.add(a)
    store.add(b)
    assert len(store) == 2
    store.prefill(a + [5, 6])  # a hit: a becomes the most recently used
    store.add(c)  # no room for three: b, the least recently used, goes
    assert a in store and c in store and b not in store
    assert store.stats.evictions == 1 and store.nbytes <= store.max_bytes
    store.add(d)
    assert a not in store and c in store and d in store
    for n in (5, 10, 30, 40):  # many sizes: the bound always holds
        store.add(_ids(n, 100 + n))
        assert store.nbytes <= store.max_bytes and store.stats.bytes == store.nbytes
    with pytest.raises(ValueError, match="max_bytes"):
        store.add(_ids(200, 12)[:100])  # bigger than the whole budget


def test_bad_arguments(tiny):
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            PrefixCache(tiny, max_bytes=bad)
    store = PrefixCache(tiny, max_bytes=1 << 20)
    with pytest.raises(ValueError, match="empty"):
        store.prefill([])
    with pytest.raises(ValueError, match="prefix_len"):
        store.prefill([1, 2, 3], prefix_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        store.prefill([1, 2, 3], max_seq_len=2)


@pytest.mark.slow
def test_system_prompt_reuse_on_the_real_model(real_model, tokenizer):
    system = ("You are the help desk of the Harbour Library. Answer in one short sentence. "
              "Opening hours: Monday to Friday 9:00-18:00, Saturday 10:00-14:00, closed on Sunday.")
    prefix = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                                            add_generation_prompt=False), add_bos=False)
    store = PrefixCache(real_model, max_bytes=64 << 20)
    for question in ("When do you open on Saturday?", "Are you open on Sunday?"):
        prompt = tokenizer.chat_ids(question, system=system)
        assert prompt[:len(prefix)] == prefix  # the system turn is a token prefix of every request
        want = generate(real_model, prompt, 12, temperature=0).tokens
        got = generate(real_model, prompt, 12, prefix_cache=store, prefix_len=len(prefix))
        assert got.tokens == want
    assert got.reused_tokens == len(prefix)
    assert store.stats.hits == 1 and store.stats.misses == 1
