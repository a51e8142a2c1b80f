"""The compiled decode step (course/engine/fast.py): the eager model's logits and tokens, one graph per batch size.

Compiling takes about a minute on 2 busy cores, so the compiled step is built once per session (one batch
size for the tiny model, one batched); the step function's semantics (per-sequence positions, cache rows,
errors) are tested on the same function run eagerly.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from course.engine.fast import (DecodeStep, FastModel, block_weights, decode_step, fused_block_weights, stream_product,
                               streamed_linear)
from course.engine.generate import decode_one_token, generate, prefill
from course.engine.kv_cache import KVCache
from course.engine.model import tiny_model

S = 96  # cache length of every test: 64 decode steps after prompts of up to 20 tokens fit


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _solo_caches(model, prompts):
    """Each prompt prefilled alone (the eager model's own path): its next-token logits and its cache."""
    out = []
    for p in prompts:
        cache = KVCache(model.config, 1, S)
        out.append((prefill(model, torch.tensor([p]), cache), cache))
    return out


def _stack(model, caches) -> KVCache:
    """One batch cache whose row b holds solo cache b."""
    batch = KVCache(model.config, len(caches), S)
    for b, c in enumerate(caches):
        for layer, solo in zip(batch.layers, c.layers):
            layer.k[b], layer.v[b] = solo.k[0], solo.v[0]
    return batch


@pytest.fixture(scope="session")
def compiled_tiny():
    model = tiny_model(seed=3)
    return model, DecodeStep(model)


def test_streamed_products_are_matrix_products():
    w = torch.randn(40, 24)
    for B in (1, 3):
        x = torch.randn(B, 24)
        torch.testing.assert_close(stream_product(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(streamed_linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_step_function_matches_the_model_at_per_sequence_positions(one_thread):
    model = tiny_model(seed=1)
    prompts = [[5, 9, 2], list(range(7, 20)), [200] * 8]  # three different lengths in one batch
    solo = _solo_caches(model, prompts)
    batch = _stack(model, [c for _, c in solo])
    ks, vs = [l.k for l in batch.layers], [l.v for l in batch.layers]
    tokens = torch.tensor([[11], [12], [13]])
    positions = torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        got = decode_step(model, tokens, positions, ks, vs)  # [3, V]
    for b, (p, (_, cache)) in enumerate(zip(prompts, solo)):
        want = decode_one_token(model, tokens[b:b + 1], len(p), cache)  # the eager model, alone
        torch.testing.assert_close(got[b:b + 1], want, atol=1e-5, rtol=1e-5)
        for layer, solo_layer in zip(batch.layers, cache.layers):  # the step wrote the same K/V where they belong
            torch.testing.assert_close(layer.k[b, :, :len(p) + 1], solo_layer.k[0, :, :len(p) + 1])


def test_fused_weights_are_views_of_the_models_own_parameters_and_decode_the_same(one_thread):
    model = tiny_model(seed=1)
    prompt = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        before = model(prompt).clone()
    originals = [t.clone() for t in block_weights(model.layers[0])]
    fused = [fused_block_weights(layer, rehome=True) for layer in model.layers]  # re-homed as on a GPU
    att, ff = model.layers[0].attention, model.layers[0].feed_forward
    wqkv, wo, w13 = fused[0][:3]
    d, nq, nkv = model.config.dim, att.wq.weight.shape[0], att.wk.weight.shape[0]
    assert wqkv.shape == (nq + 2 * nkv, d) and w13.shape == (2 * ff.w_gate.weight.shape[0], d)
    # the parameters now live inside the fused tensors (no second copy), with their values unchanged
    assert att.wq.weight.data_ptr() == wqkv.data_ptr() and att.wv.weight.data_ptr() == wqkv[nq + nkv:].data_ptr()
    assert ff.w_up.weight.data_ptr() == w13[ff.w_gate.weight.shape[0]:].data_ptr() and wo is not None
    for now, then in zip(block_weights(model.layers[0]), originals):
        assert torch.equal(now, then)
    assert fused_block_weights(model.layers[0])[0].data_ptr() == wqkv.data_ptr()  # the second time: no copy
    assert len(fused_block_weights(tiny_model(seed=2).layers[0])) == 9  # on the CPU, never a plain copy
    with torch.no_grad():
        att.wk.weight.mul_(2)  # an in-place change of a parameter is seen through the fused view
    assert torch.equal(wqkv[nq:nq + nkv], att.wk.weight)
    with torch.no_grad():
        att.wk.weight.div_(2)
    with torch.inference_mode():
        torch.testing.assert_close(model(prompt), before, atol=0, rtol=0)  # the eager model is unchanged
    prompts = [[5, 9, 2], list(range(7, 20))]
    batch = _stack(model, [c for _, c in _solo_caches(model, prompts)])
    twin = _stack(model, [c for _, c in _solo_caches(model, prompts)])
    tokens, positions = torch.tensor([[11], [12]]), torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        got = decode_step(model, tokens, positions, [l.k for l in batch.layers], [l.v for l in batch.layers],
                          weights=fused)
        want = decode_step(model, tokens, positions, [l.k for l in twin.layers], [l.v for l in twin.layers])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(batch.layers, twin.layers):  # and wrote the same K and V
        torch.testing.assert_close(a.k, b.k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a.v, b.v, atol=1e-6, rtol=1e-6)


def test_step_function_decodes_a_subset_of_cache_rows(one_thread):
    model = tiny_model(seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    solo = _solo_caches(model, prompts)
    batch = _stack(model, [c for _, c in solo])
    before = [l.k[1].clone() for l in batch.layers]
    step = DecodeStep(model, compile=False)
    got = step(torch.tensor([[3], [4]]), torch.tensor([3, 2]), batch, rows=[0, 2])  # row 1 is left alone
    for i, b in enumerate((0, 2)):
        want = decode_one_token(model, torch.tensor([[3 + i]]), len(prompts[b]), solo[b][1])
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(l.k[1], k) for l, k in zip(batch.layers, before))


def test_fast_model_takes_the_serving_engines_batch_positions(one_thread):
    from course.engine.positions import Positions

    model = tiny_model(seed=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    solo = _solo_caches(model, prompts)
    fast = FastModel(model, compile=False)
    batch = _stack(model, [c for _, c in solo])
    reference = _stack(model, [c for _, c in solo])
    tokens = torch.tensor([[7], [8]])
    at = Positions.per_sequence([len(prompts[0]), len(prompts[2])], 1, rows=[0, 2])
    got = decode_one_token(fast, tokens, at, batch)  # the step, on cache rows 0 and 2
    want = decode_one_token(model, tokens, at, reference)  # the eager model's own batched path
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = decode_one_token(fast, torch.tensor([[1], [2], [3]]), [4, 6, 3], batch)  # a plain list of positions
    want = decode_one_token(model, torch.tensor([[1], [2], [3]]), [4, 6, 3], reference)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_step_rejects_bad_input_with_a_clear_message(one_thread):
    model = tiny_model()
    step = DecodeStep(model, compile=False)
    cache = KVCache(model.config, 2, 8)
    with pytest.raises(ValueError, match="tokens must be"):
        step(torch.zeros(1, 1, dtype=torch.long), 0, cache)
    with pytest.raises(ValueError, match="positions must be"):
        step(torch.zeros(2, 1, dtype=torch.long), torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ValueError, match="overflow.*larger max_seq_len"):
        step(torch.zeros(2, 1, dtype=torch.long), 8, cache)
    with pytest.raises(ValueError, match="overflow"):
        step(torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 8]), cache)
    with pytest.raises(ValueError, match="overflow"):
        step(torch.zeros(2, 1, dtype=torch.long), [0, 9], cache)
    with pytest.raises(ValueError, match="product must be"):
        DecodeStep(model, product="gemm")
    with pytest.raises(TypeError, match="must hold torch.float32"):
        step(torch.zeros(2, 1, dtype=torch.long), 0, KVCache(model.config, 2, 8, dtype=torch.bfloat16))
    odd = KVCache(model.config, 2, 8)  # same shapes, another layout: a warm graph would misread it
    odd.layers[1].v = torch.zeros(2, 8, *odd.layers[1].v.shape[1:2], odd.layers[1].v.shape[3]).transpose(1, 2)
    assert odd.layers[1].v.shape == cache.layers[1].v.shape
    with pytest.raises(TypeError, match="must be contiguous"):
        step(torch.zeros(2, 1, dtype=torch.long), 0, odd)


def test_fast_model_keeps_prefill_and_other_caches_eager(one_thread):
    model = tiny_model()
    fast = FastModel(model, compile=False)
    calls = []
    fast._decode = lambda *a, **k: calls.append(a[0].shape) or model(*a, **k)
    cache = KVCache(model.config, 1, 20)
    prefill(fast, torch.randint(0, 256, (1, 9)), cache)
    assert calls == []
    decode_one_token(fast, torch.tensor([[3]]), 9, cache)
    assert calls == [torch.Size([1, 1])]


def test_compiled_step_matches_eager_for_64_steps_without_recompiling(compiled_tiny, one_thread):
    model, step = compiled_tiny
    prompt = list(range(30, 42))
    (logits_e, cache_e), = _solo_caches(model, [prompt])
    (_, cache_c), = _solo_caches(model, [prompt])
    tok_e = tok_c = logits_e.argmax(-1, keepdim=True)  # [1, 1]
    tokens_e, tokens_c, worst = [], [], 0.0
    step(tok_c, len(prompt), cache_c)  # compile (or load from Inductor's disk cache) ...
    (_, cache_c), = _solo_caches(model, [prompt])  # ... and start again from a clean cache
    graphs = _graphs()
    with torch.compiler.set_stance("fail_on_recompile"), warnings.catch_warnings():
        # a recompile as the position grows, or an eager fallback, is an error
        warnings.filterwarnings("error", message="DecodeStep|torch.compile failed")
        for i in range(64):
            pos = len(prompt) + i
            a = decode_one_token(model, tok_e, pos, cache_e)
            b = step(tok_c, torch.tensor([pos]), cache_c)
            worst = max(worst, float((a - b).abs().max()))
            tok_e, tok_c = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
            tokens_e.append(int(tok_e)), tokens_c.append(int(tok_c))
    assert _graphs() == graphs  # no new graph in 64 positions
    assert step.compiled
    assert worst <= 1e-4, f"compiled vs eager logits differ by {worst:.2e}"
    assert tokens_c == tokens_e
    # on the CPU the warm graph is called without TorchDynamo (DecodeStep's direct path), and its cache writes
    # land in the cache itself: every layer's K and V equal the eager model's at every position written
    assert [key[0] for key in step._direct] == ([1] if step._graphs is not None else [])
    end = len(prompt) + 64
    for e, c in zip(cache_e.layers, cache_c.layers):
        torch.testing.assert_close(c.k[:, :, :end], e.k[:, :, :end], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c.v[:, :, :end], e.v[:, :, :end], atol=1e-4, rtol=1e-4)
    assert len(set(tokens_e)) > 1  # the test decoded something, not one token over and over


def test_fast_model_generates_the_eager_tokens(compiled_tiny, one_thread):
    model, step = compiled_tiny
    fast = FastModel(model)
    fast.step = step  # the session's compiled step: same shapes as above, no new compile
    prompt = list(range(30, 42))
    cache = KVCache(model.config, 1, S)
    got = generate(fast, prompt, 40, cache=cache).tokens
    assert got == generate(model, prompt, 40).tokens


def test_compiled_batch_matches_each_sequence_alone_and_serves_every_batch_size(compiled_tiny, one_thread):
    model, step = compiled_tiny
    prompts = [[5, 9, 2], list(range(7, 20)), [200] * 8, [1]]
    solo = _solo_caches(model, prompts)
    batch = _stack(model, [c for _, c in solo])
    tokens = torch.stack([lg.argmax(-1) for lg, _ in solo])  # [4, 1]
    positions = torch.tensor([len(p) for p in prompts])
    graphs = None
    for i in range(6):  # the batch decodes together; every sequence must follow its solo greedy run
        got = step(tokens, positions + i, batch)
        if i == 0:
            graphs = _graphs()  # the batch of 4 compiled once, at the first step
        for b in range(len(prompts)):
            want = decode_one_token(model, tokens[b:b + 1], len(prompts[b]) + i, solo[b][1])
            torch.testing.assert_close(got[b:b + 1], want, atol=1e-4, rtol=1e-4)
        tokens = got.argmax(-1, keepdim=True)
    assert _graphs() == graphs
    from course.engine import row_product

    assert step.row_kernel is row_product.available()  # the batch ran on the row kernel where it builds
    three = _stack(model, [c for _, c in _solo_caches(model, prompts[:3])])  # another batch size, same graph
    got = step(tokens[:3], positions[:3] + 6, three)
    assert _graphs() == graphs and got.shape == (3, model.config.vocab_size)
    if step._graphs is not None:  # both batch sizes call the one batch graph directly once warm
        batch_graphs = {id(g) for key, g in step._direct.items() if key[0] in (3, 4)}
        assert {key[0] for key in step._direct} >= {3, 4} and len(batch_graphs) == 1
        copy = KVCache(model.config, 3, S)
        for mine, theirs in zip(copy.layers, three.layers):
            mine.k.copy_(theirs.k), mine.v.copy_(theirs.v)
        nxt = got.argmax(-1, keepdim=True)
        again = step(nxt, positions[:3] + 7, three)  # the warm size of 3, now called directly
        want = DecodeStep(model, compile=False)(nxt, positions[:3] + 7, copy)  # the same step, eagerly
        torch.testing.assert_close(again, want, atol=1e-4, rtol=1e-4)
        for mine, theirs in zip(copy.layers, three.layers):  # and it wrote the same K and V
            torch.testing.assert_close(theirs.k, mine.k, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_real_model_matches_eager_for_64_greedy_tokens(real_model):
    torch.set_num_threads(2)
    fast = FastModel(real_model)
    prompt = list(range(1000, 1064))
    eager = generate(real_model, prompt, 64)
    compiled = generate(fast, prompt, 64)
    assert fast.compiled and compiled.tokens == eager.tokens
    c_e, c_c = KVCache(real_model.config, 1, 128), KVCache(real_model.config, 1, 128)  # generate's size: no new compile
    prefill(real_model, torch.tensor([prompt]), c_e), prefill(real_model, torch.tensor([prompt]), c_c)
    token = torch.tensor([[eager.tokens[0]]])
    a = decode_one_token(real_model, token, 64, c_e)
    b = decode_one_token(fast, token, 64, c_c)
    assert float((a - b).abs().max()) <= 1e-4


def test_any_shape_step_serves_every_batch_context_and_paged_batch_with_one_graph_each(one_thread):
    """A server's step (any_shape): every batch size, 1 included, every cache length and row count run on one
    compiled group of layers for consecutive rows, one for other rows and one for paged batches, and one compiled
    head; each step matches the eager model."""
    import dataclasses

    from course.engine.config import ModelConfig
    from course.engine.fast import layer_group
    from course.engine.paged import PagedKVCache

    torch._dynamo.reset()  # graphs compiled by earlier tests (a head of the same shapes) would be reused
    model = tiny_model(seed=5, config=dataclasses.replace(ModelConfig.from_name("tiny"), n_layers=6))
    step = DecodeStep(model, any_shape=True)  # two compiled calls per step, three layers each
    prompts = [[5, 9, 2], list(range(7, 20)), [200] * 8, [1, 4]]
    solo = _solo_caches(model, prompts)
    batch = _stack(model, [c for _, c in solo])
    nexts = [int(lg.argmax(-1)) for lg, _ in solo]
    lengths = [len(p) for p in prompts]
    start = _graphs()

    def check(rows, cache=batch):
        """Decode the given cache rows one step, compiled; each must equal its sequence decoded alone, eagerly."""
        tokens = torch.tensor([[nexts[r]] for r in rows])
        got = step(tokens, [lengths[r] for r in rows], cache, rows=rows)
        for i, r in enumerate(rows):
            want = decode_one_token(model, tokens[i:i + 1], lengths[r], solo[r][1])
            torch.testing.assert_close(got[i:i + 1], want, atol=1e-4, rtol=1e-4)
            nexts[r], lengths[r] = int(want.argmax(-1)), lengths[r] + 1

    for rows in ([0, 1, 2, 3], [1, 2], [3], [0, 1, 2]):  # consecutive rows: views of the cache
        check(rows)
    views = _graphs()
    assert views == start + 2 and step.compiled  # the group of layers and the head
    # once a kind is warm its group and head graphs are called without TorchDynamo (DecodeStep's direct path):
    # the checks after each kind's first step compare those direct calls with the eager model
    kinds = lambda: {key[0][0] for key in step._direct}  # noqa: E731
    assert kinds() == ({"views"} if step.direct else set())
    assert step._group == layer_group(6) == 3 and len(step._weights) == 2
    short = KVCache(model.config, 2, 40)  # another cache length and row count: the same graph
    got = step(torch.tensor([[3], [4]]), [0, 0], short, rows=[0, 1])
    assert got.shape == (2, model.config.vocab_size) and _graphs() == views
    for rows in ([0, 2], [3, 1, 0], [2, 0]):  # any other rows: gathered, a second group graph
        check(rows)
    gathered = _graphs()
    assert gathered == views + 1  # a second group graph, the same head
    assert kinds() == ({"views", "rows"} if step.direct else set())

    paged = PagedKVCache(model.config, num_blocks=24, block_size=4)
    logits, lens = {}, {}
    for sid, p in enumerate(prompts):
        paged.add_sequence(sid, p, share=False)
        pb = paged.append([sid], [p])
        logits[sid], lens[sid] = model(torch.tensor([p]), start_pos=pb.positions, cache=pb, last_only=True), len(p)
    solo_paged = {sid: _solo_caches(model, [p])[0][1] for sid, p in enumerate(prompts)}  # eager references
    for ids in ([0, 1, 2, 3], [2], [1, 3], [0, 1, 2, 3], [0]):  # blocks fill and new ones join the table
        tokens = torch.tensor([[int(logits[s].argmax(-1))] for s in ids])
        pb = paged.append(ids, tokens.tolist())
        got = step(tokens, pb.positions, pb)
        for i, s in enumerate(ids):
            want = decode_one_token(model, tokens[i:i + 1], lens[s], solo_paged[s])
            torch.testing.assert_close(got[i:i + 1], want, atol=1e-4, rtol=1e-4)
            logits[s], lens[s] = got[i:i + 1], lens[s] + 1
    assert _graphs() == gathered + 1  # every paged batch above on a third group graph
    assert kinds() == ({"views", "rows", "paged"} if step.direct else set())
    assert step.direct == (model.device.type == "cpu")
    with pytest.raises(ValueError, match="pass start_pos=batch.positions"):
        step(torch.tensor([[1]]), [0], paged.append([0], [[1]]))


def test_layer_group_divides_the_layers():
    from course.engine.fast import layer_group

    assert [layer_group(n) for n in (30, 2, 7, 32, 24, 1)] == [5, 2, 1, 4, 4, 1]
