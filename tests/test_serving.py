"""The scheduler: continuous vs static batching, every output equal to its solo run, metrics, timeline, sharing."""
import pytest
import torch

from course.engine.paged import PagedKVCache, PoolExhausted
from course.engine.serving import Request, make_trace, memory_on_mix, percentile, serve, solo_outputs


@pytest.fixture(scope="module")
def trace():
    return make_trace(10, seed=3, prompt_len=(3, 14), new_tokens=(2, 20), mean_gap=1.0)


@pytest.fixture(scope="module")
def solo(trace):
    """Solo greedy runs of the trace on the `tiny` fixture's model (same seed), once per module."""
    from course.engine.model import tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return solo_outputs(tiny_model(seed=0), trace, progress=False)
    finally:
        torch.set_num_threads(threads)


def run(model, requests, policy, **kw):
    kw.setdefault("clock", "steps")
    kw.setdefault("block_size", 4)
    return serve(model, requests, policy, kw.pop("max_batch", 4), progress=False, **kw)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_every_output_equals_its_solo_run(tiny, trace, solo, policy, one_thread):
    result = run(tiny, trace, policy)
    assert result.outputs() == solo
    assert result.generated_tokens == sum(r.max_new_tokens for r in trace)


def test_continuous_refills_slots_that_static_leaves_idle(tiny, trace, one_thread):
    cont, static = run(tiny, trace, "continuous"), run(tiny, trace, "static")
    assert cont.slot_occupancy > static.slot_occupancy
    assert cont.throughput > static.throughput  # tokens per iteration on the steps clock
    assert cont.latency_p95 <= static.latency_p95
    # static admits only into an empty batch: a prefill never runs next to a decode
    for step in static.timeline:
        phases = {p for _, p in step.slots}
        assert not ({"prefill", "decode"} <= phases)
    # continuous does exactly that when a slot frees up while others still decode
    assert any({"prefill", "decode"} <= {p for _, p in s.slots} for s in cont.timeline)


def test_timeline_and_metrics_are_consistent(tiny, trace, one_thread):
    result = run(tiny, trace, "continuous")
    for c in result.completions:
        r = c.request
        cells = [(s.start, p) for s in result.timeline for rid, p in s.slots if rid == r.id]
        assert [p for _, p in cells].count("prefill") == 1  # no preemption with a pool sized for everyone
        assert [p for _, p in cells].count("decode") == r.max_new_tokens - 1
        assert r.arrival <= c.admitted < c.first_token <= c.finished
        assert c.time_to_first_token >= 1 and c.latency >= c.time_to_first_token
    assert all(len(s.slots) == result.max_batch for s in result.timeline)
    assert all(s.decoded <= result.max_batch for s in result.timeline)
    assert result.peak_bytes_used <= result.peak_bytes_reserved <= result.cache_bytes
    summary = result.summary()
    assert summary["throughput"] == result.generated_tokens / result.makespan
    assert summary["ttft_p50"] <= summary["ttft_p95"]


def test_wall_clock_times_are_measured(tiny, trace, one_thread):
    at_once = [Request(r.id, r.prompt_ids, r.max_new_tokens, 0.0) for r in trace[:4]]  # never idle
    result = serve(tiny, at_once, "continuous", 2, clock="wall", block_size=4, progress=False)
    assert all(s.seconds > 0 for s in result.timeline)
    total = sum(s.seconds for s in result.timeline)  # the clock is the iterations' measured time
    assert all(s.cpu_seconds > 0 for s in result.timeline)
    assert result.cpu_throughput == result.generated_tokens / sum(s.cpu_seconds for s in result.timeline)
    assert total - result.timeline[-1].seconds < result.makespan <= total


def test_a_small_pool_preempts_and_still_reproduces_solo(tiny, trace, solo, one_thread):
    result = run(tiny, trace, "continuous", max_batch=6, num_blocks=10)
    assert result.preemptions > 0
    assert result.outputs() == solo
    block = PagedKVCache(tiny.config, 1, 4).block_bytes
    assert result.cache_bytes == 10 * block and result.peak_bytes_reserved <= result.cache_bytes


def test_shared_system_prompt_is_computed_once(tiny, one_thread):
    system = list(range(40, 52))  # 3 full blocks of 4
    trace = make_trace(6, seed=1, prompt_len=(2, 6), new_tokens=(3, 6), mean_gap=2.0, shared_prefix=system)
    solo = solo_outputs(tiny, trace, progress=False)
    shared = run(tiny, trace, "continuous", share_prefix=True)
    alone = run(tiny, trace, "continuous", share_prefix=False)
    assert shared.outputs() == solo == alone.outputs()
    cached = [c.cached_tokens for c in shared.completions]
    assert cached[0] == 0 and all(n == 12 for n in cached[1:])
    assert all(c.cached_tokens == 0 for c in alone.completions)
    assert shared.peak_bytes_shared > 0 and alone.peak_bytes_shared == 0
    prefilled = lambda r: sum(s.prefill_tokens for s in r.timeline)  # noqa: E731
    assert prefilled(alone) - prefilled(shared) == 12 * 5
    # all at once: the first request's blocks are written and shared inside the same packed pass
    at_once = [Request(r.id, r.prompt_ids, r.max_new_tokens, 0.0) for r in trace]
    together = run(tiny, at_once, "continuous", max_batch=6)
    assert together.outputs() == solo
    assert [c.cached_tokens for c in together.completions] == cached


def test_eos_ends_a_request_early(tiny, trace, solo, one_thread):
    rid, i = next((rid, i) for rid, toks in solo.items() for i in range(1, len(toks)) if toks[i] not in toks[:i])
    eos = solo[rid][i]  # a token this request first produces at step i
    result = run(tiny, trace, "continuous", eos_id=eos)
    stopped = result.completions[rid]
    assert stopped.stop_reason == "eos" and stopped.tokens == solo[rid][:i + 1]
    assert result.outputs() == solo_outputs(tiny, trace, eos_id=eos, progress=False)


def test_trace_is_seeded_and_ordered():
    a = make_trace(20, seed=7, mean_gap=0.5)
    assert a == make_trace(20, seed=7, mean_gap=0.5) and a != make_trace(20, seed=8, mean_gap=0.5)
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] > 0
    assert all(8 <= len(r.prompt_ids) <= 48 and 4 <= r.max_new_tokens <= 48 for r in a)
    assert {r.arrival for r in make_trace(5, mean_gap=0)} == {0.0}
    bimodal = make_trace(200, seed=1, new_tokens=(2, 6), long_share=0.25, long_new_tokens=(40, 60))
    long = [r for r in bimodal if r.max_new_tokens >= 40]
    assert all(r.max_new_tokens <= 6 for r in bimodal if r not in long) and 30 <= len(long) <= 70
    with pytest.raises(ValueError, match="long_new_tokens"):
        make_trace(3, long_share=0.5)


def test_memory_on_the_mix(tiny):
    mix = make_trace(30, seed=0, prompt_len=(10, 100), new_tokens=(10, 200))
    m = memory_on_mix(tiny.config, mix, block_size=8)
    assert m["used"] <= m["paged"]
    waste = m["paged"] - m["used"]
    per_token = 2 * tiny.config.n_layers * tiny.config.n_kv_heads * tiny.config.head_dim * 4
    assert 0 <= waste < len(mix) * 8 * per_token  # under one block per request
    assert m["preallocated"] == len(mix) * max(r.max_len for r in mix) * per_token
    assert m["preallocated_over_used"] > m["paged_over_used"]


@pytest.mark.timeout(20)
def test_malformed_requests_and_caches_are_refused_never_waited_on(tiny):
    """Every bad field, and every request the cache it is given can never hold, is a ValueError naming it."""
    good = [Request(0, [1, 2], 3)]
    bad_requests = {  # the Request itself refuses these
        "arrival": [(0, [1], 2, float("nan")), (0, [1], 2, float("inf")), (0, [1], 2, -1.0), (0, [1], 2, "0")],
        "max_new_tokens": [(0, [1], 0), (0, [1], 2.5), (0, [1], True), (0, [1], "3")],
        "prompt": [(0, [], 3), (0, [1.5], 3), (0, ["a"], 3), ([0], [1], 3)],
    }
    for words, cases in bad_requests.items():
        for args in cases:
            with pytest.raises(ValueError, match=words if words != "prompt" else "prompt|empty|hashable"):
                Request(*args)
    small = PagedKVCache(tiny.config, 2, 4)  # 8 positions in all
    held = PagedKVCache(tiny.config, 4, 4)
    held.add_sequence("other")
    held.append(["other"], n_new=9)  # 3 of its 4 blocks belong to a sequence outside this call
    other_model = PagedKVCache(tiny.config.with_(n_layers=3), 8, 4)
    refused = [  # (what serve() is given, words the error must contain)
        (dict(policy="fifo"), "policy"), (dict(clock="cpu"), "clock"), (dict(max_batch=0), "max_batch"),
        (dict(max_batch=2.0), "max_batch"), (dict(block_size=0), "block_size"), (dict(num_blocks=0), "num_blocks"),
        (dict(eos_id=-1), "eos_id"), (dict(cache="gpu"), "cache must be"), (dict(requests=[]), "no requests"),
        (dict(requests=[{"id": 0}]), "Request objects"), (dict(requests=good + good), "unique"),
        (dict(requests=[Request(0, [1] * 100, 100)]), "request 0 needs 200 positions"),
        (dict(requests=[Request("x", [1, 300], 2)]), "request 'x' holds token ids outside"),
        (dict(requests=[Request(7, [1] * 6, 5)], cache=small), "request 7 needs 3 blocks"),
        (dict(requests=[Request(7, [1] * 6, 5)], num_blocks=2, block_size=4), "request 7 needs 3 blocks"),
        (dict(cache=held), "request 0 needs 2 blocks of 4 tokens, more than the whole pool's 1 free"),
        (dict(cache=other_model), "made for"),
        (dict(requests=[Request("other", [1], 1)], cache=held), "already sequences"),
    ]
    for kwargs, words in refused:
        kwargs = {"requests": good, **kwargs}
        with pytest.raises(ValueError, match=words):
            serve(tiny, progress=False, **kwargs)
    mixed = [Request("a", [5, 6, 7], 3), Request(1, [8, 9], 4, arrival=0.5)]  # ids of two types: no ordering needed
    assert run(tiny, mixed, "continuous").outputs() == solo_outputs(tiny, mixed, progress=False)
    with pytest.raises(ValueError, match="range"):
        make_trace(3, prompt_len=(5, 2))


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 95) == 5
    assert percentile(list(range(101)), 95) == 95


@pytest.mark.slow
def test_real_model_serving_equals_solo(real):
    model, tok = real
    system = tok.encode("You are a helpful assistant. Answer in one short sentence.")
    trace = make_trace(4, seed=0, prompt_len=(3, 10), new_tokens=(2, 6), mean_gap=0.05, shared_prefix=system,
                       vocab_size=model.config.vocab_size, low_token=1000)
    solo = solo_outputs(model, trace, progress=False)
    for policy in ("continuous", "static"):
        result = serve(model, trace, policy, 3, block_size=8, progress=False)
        assert result.outputs() == solo, policy
    assert sum(c.cached_tokens for c in result.completions) > 0
