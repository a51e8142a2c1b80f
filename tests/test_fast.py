"""The compiled decode step (course/engine/fast.py): the eager model's logits and tokens, few graphs, and a fallback
that says so. Compiling takes tens of seconds on 2 busy cores, so the tiny model's whole-step graphs are compiled
once per session (one for B = 1, one for every B >= 2) and the step's checks run on the same function eagerly."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

from course.engine.fast import DecodeStep, FastModel
from course.engine.generate import decode_one_token, generate, prefill
from course.engine.kv_cache import KVCache
from course.engine.model import tiny_model
from course.engine.positions import Positions

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


def test_step_function_decodes_per_sequence_positions_and_a_subset_of_rows(one_thread):
    model = tiny_model(seed=1)
    prompts = [[5, 9, 2], list(range(7, 20)), [200] * 8]  # three different lengths in one batch
    solo = _solo_caches(model, prompts)
    batch = _stack(model, [c for _, c in solo])
    step = DecodeStep(model, compile=False)
    tokens = torch.tensor([[11], [12], [13]])
    got = step(tokens, [len(p) for p in prompts], batch)  # [3, V]
    for b, (p, (_, cache)) in enumerate(zip(prompts, solo)):
        want = decode_one_token(model, tokens[b:b + 1], len(p), cache)  # the eager model, alone
        torch.testing.assert_close(got[b:b + 1], want, atol=1e-5, rtol=1e-5)
        for layer, solo_layer in zip(batch.layers, cache.layers):  # the step wrote the same K/V where they belong
            torch.testing.assert_close(layer.k[b, :, :len(p) + 1], solo_layer.k[0, :, :len(p) + 1])
    before = [layer.k[1].clone() for layer in batch.layers]
    got = step(torch.tensor([[3], [4]]), torch.tensor([4, 9]), batch, rows=[0, 2])  # row 1 is left alone
    for i, b in enumerate((0, 2)):
        want = decode_one_token(model, torch.tensor([[3 + i]]), len(prompts[b]) + 1, solo[b][1])
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(layer.k[1], k) for layer, k in zip(batch.layers, before))


def test_fast_model_takes_the_serving_engines_positions_and_keeps_prefill_eager(one_thread):
    model = tiny_model(seed=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    solo = _solo_caches(model, prompts)
    fast = FastModel(model, compile=False)
    calls = []
    step = fast.step
    fast.step = lambda *a, **k: calls.append(a[0].shape) or step(*a, **k)
    batch, reference = (_stack(model, [c for _, c in solo]) for _ in range(2))
    tokens = torch.tensor([[7], [8]])
    at = Positions.per_sequence([len(prompts[0]), len(prompts[2])], 1, rows=[0, 2])
    torch.testing.assert_close(decode_one_token(fast, tokens, at, batch), decode_one_token(model, tokens, at, reference),
                               atol=1e-5, rtol=1e-5)  # the step, on cache rows 0 and 2
    three = torch.tensor([[1], [2], [3]])
    torch.testing.assert_close(decode_one_token(fast, three, [4, 6, 3], batch),  # a plain list of positions
                               decode_one_token(model, three, [4, 6, 3], reference), atol=1e-5, rtol=1e-5)
    assert calls == [torch.Size([2, 1]), torch.Size([3, 1])]
    prefill(fast, torch.randint(0, 256, (1, 9)), KVCache(model.config, 1, 20))  # prefill ([1, 9]) stays eager
    fast(torch.tensor([[1]]), 0, cache=None)  # no cache: eager
    assert len(calls) == 2 and fast.config is model.config and fast.dtype == model.dtype


def test_step_rejects_bad_input_with_a_clear_message(one_thread):
    model = tiny_model()
    step = DecodeStep(model, compile=False)
    cache = KVCache(model.config, 2, 8)
    two = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="tokens must be"):
        step(torch.zeros(2, 3, dtype=torch.long), 0, cache)
    with pytest.raises(ValueError, match="give one per sequence"):
        step(two, torch.tensor([1, 2, 3]), cache)
    for positions in (8, torch.tensor([0, 8]), [0, 9], -1):
        with pytest.raises(ValueError, match="overflow.*larger max_seq_len"):
            step(two, positions, cache)
    with pytest.raises(ValueError, match="cache rows .* in a cache of 2 rows"):
        step(two, 0, cache, rows=[0, 5])
    with pytest.raises(TypeError, match="must hold 2 layers of torch.float32"):
        step(two, 0, KVCache(model.config, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="contiguous KVCache or a PagedBatch"):
        step(two, 0, [cache])


def test_compiled_step_matches_eager_for_64_steps_without_recompiling(compiled_tiny, one_thread):
    model, step = compiled_tiny
    prompt = list(range(30, 42))
    (logits_e, cache_e), = _solo_caches(model, [prompt])
    (_, cache_c), = _solo_caches(model, [prompt])
    tok_e = tok_c = logits_e.argmax(-1, keepdim=True)  # [1, 1]
    tokens_e, tokens_c, worst = [], [], 0.0
    step(tok_c, len(prompt), KVCache(model.config, 1, S))  # compile (or load from Inductor's disk cache)
    graphs = _graphs()
    with torch.compiler.set_stance("fail_on_recompile"), warnings.catch_warnings():
        warnings.filterwarnings("error", message="the compiled decode step fell back")  # a fallback is an error
        for i in range(64):
            pos = len(prompt) + i
            a = decode_one_token(model, tok_e, pos, cache_e)
            b = step(tok_c, torch.tensor([pos]), cache_c)
            worst = max(worst, float((a - b).abs().max()))
            tok_e, tok_c = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
            tokens_e.append(int(tok_e)), tokens_c.append(int(tok_c))
    assert _graphs() == graphs and step.compiled and step.fallback is None  # no new graph in 64 positions
    from course.engine import arena

    assert arena.is_packed(model) == arena.huge_pages_offered()  # the weights on huge pages where Linux offers them
    assert worst <= 1e-4, f"compiled vs eager logits differ by {worst:.2e}"
    assert tokens_c == tokens_e and len(set(tokens_e)) > 1  # it decoded something, not one token over and over
    end = len(prompt) + 64
    for e, c in zip(cache_e.layers, cache_c.layers):  # the graph's cache writes landed in the cache itself
        torch.testing.assert_close(c.k[:, :, :end], e.k[:, :, :end], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c.v[:, :, :end], e.v[:, :, :end], atol=1e-4, rtol=1e-4)
    fast = FastModel(model)
    fast.step = step  # the session's compiled step: the same shapes, no new compile
    assert generate(fast, prompt, 40, cache=KVCache(model.config, 1, S)).tokens == generate(model, prompt, 40).tokens


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
        graphs = graphs or _graphs()  # the batch of 4 compiled once, at the first step
        for b in range(len(prompts)):
            want = decode_one_token(model, tokens[b:b + 1], len(prompts[b]) + i, solo[b][1])
            torch.testing.assert_close(got[b:b + 1], want, atol=1e-4, rtol=1e-4)
        tokens = got.argmax(-1, keepdim=True)
    three = _stack(model, [c for _, c in _solo_caches(model, prompts[:3])])  # another batch size, the same graph
    assert step(tokens[:3], positions[:3] + 6, three).shape == (3, model.config.vocab_size)
    assert _graphs() == graphs and step.compiled
    from course.engine import row_product

    assert step.kernel is row_product.available()  # the batch ran on the row kernel where it builds


def test_each_step_keeps_its_own_graphs_and_a_fallback_is_said_not_hidden(compiled_tiny, one_thread):
    """Every DecodeStep once compiled the same function, so TorchDynamo counted them all towards one recompile
    limit (8) and, past it, ran the step eagerly while it still said "compiled". Each step now has its own
    graphs: with a limit of 1, a second step on the same model still compiles. A step that cannot compile warns,
    says why in `fallback`, turns `compiled` False and decodes the same."""
    model, first = compiled_tiny
    cache = KVCache(model.config, 1, S)
    first(torch.tensor([[3]]), 0, cache)
    second = DecodeStep(model)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.filterwarnings("error", message="the compiled decode step fell back")
        got = second(torch.tensor([[3]]), 0, KVCache(model.config, 1, S))
    assert second.compiled and second.fallback is None
    torch.testing.assert_close(got, first(torch.tensor([[3]]), 0, KVCache(model.config, 1, S)))
    broken = DecodeStep(model)  # as when Inductor finds no C++ compiler

    def no_compiler(*args):
        raise RuntimeError("Compiler: cc is not found")
    broken._compiled = no_compiler
    with pytest.warns(UserWarning, match="fell back to eager .*cc is not found"):
        logits = broken(torch.tensor([[3]]), 0, KVCache(model.config, 1, S))
    assert not broken.compiled and "cc is not found" in broken.fallback
    torch.testing.assert_close(logits, got, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="overflow"):  # wrong inputs are the caller's error, never a fallback
        DecodeStep(model)(torch.tensor([[3]]), S, KVCache(model.config, 1, S))


def test_with_torchdynamo_turned_off_the_step_says_it_runs_eagerly():
    import os
    import subprocess
    import sys

    code = ("import torch, warnings; warnings.simplefilter('ignore')\n"
            "from course.engine.fast import DecodeStep; from course.engine.kv_cache import KVCache\n"
            "from course.engine.model import tiny_model\n"
            "m = tiny_model(); s = DecodeStep(m); s(torch.tensor([[3]]), 0, KVCache(m.config, 1, 8))\n"
            "print(s.compiled, s.fallback)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert run.stdout.startswith("False ") and re.search("no compiled frames|compiled no graph", run.stdout), run


def test_any_shape_serves_every_batch_context_and_paged_batch_like_the_eager_model(one_thread):
    """lesson 05's engine: serve() on FastModel(model, any_shape=True), contiguous and paged, gives every request the
    eager server's tokens, and a batch of any size, cache length or set of rows compiles no new graph."""
    from course.engine.serving import make_trace, serve

    model = tiny_model(seed=5)
    fast = FastModel(model, any_shape=True)
    trace = make_trace(10, seed=0, prompt_len=(3, 9), new_tokens=(2, 9), mean_gap=0.0, vocab_size=256)
    for policy in ("static", "continuous"):
        want = serve(model, trace, policy, 4, progress=False).outputs()
        assert serve(fast, trace, policy, 4, progress=False).outputs() == want
    assert fast.compiled and fast.step.fallback is None
    prompts = [[5, 9, 2], list(range(7, 20)), [200] * 8, [1, 4]]
    solo = _solo_caches(model, prompts)
    batch = _stack(model, [c for _, c in solo])
    lengths, graphs = [len(p) for p in prompts], None
    for rows in ([0, 1, 2], [1, 2], [3, 1, 0], [2, 0]):  # consecutive rows (views of the cache), any others (gathered)
        tokens = torch.tensor([[7 + r] for r in rows])
        got = fast.step(tokens, [lengths[r] for r in rows], batch, rows=rows)
        for i, r in enumerate(rows):  # each row follows its sequence decoded alone, eagerly
            want = decode_one_token(model, tokens[i:i + 1], lengths[r], solo[r][1])
            torch.testing.assert_close(got[i:i + 1], want, atol=1e-4, rtol=1e-4)
            lengths[r] += 1
        if rows == [3, 1, 0]:
            graphs = _graphs()  # both kinds warm
    assert _graphs() == graphs and fast.compiled  # a batch of another size, or other rows: no new graph
