"""The engine's one decode loop and what it is built from: the sampler's (tokens, probs), the logits check, teacher
forcing, the thread context manager, and the bench registry that other modules add items to."""
from __future__ import annotations

import pytest
import torch

from course.engine.device import torch_threads
from course.engine.generate import decode_loop, generate, prompt_tensor, teacher_forced_logits
from course.engine.kv_cache import KVCache
from course.engine.sampling import Sampler, probabilities, sample


def test_sampler_returns_the_distribution_it_drew_from():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ids, probs = Sampler(0.8, top_k=10, top_p=0.9, seed=1)(logits)
    assert ids.shape == (3,) and probs.shape == (3, 50)
    torch.testing.assert_close(probs, probabilities(logits, 0.8, 10, 0.9))
    assert bool((probs.gather(1, ids.view(-1, 1)) > 0).all())  # every drawn token had mass
    # the same seed, the same draws as the plain function
    again = sample(logits, 0.8, 10, 0.9, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ids, again)
    greedy_ids, one_hot = Sampler(temperature=0)(logits)
    assert torch.equal(greedy_ids, logits.argmax(-1)) and torch.equal(one_hot.argmax(-1), greedy_ids)
    assert torch.equal(one_hot.sum(-1), torch.ones(3))


def test_bad_logits_name_the_dtype_the_model_used():
    bad = torch.tensor([[1.0, float("nan"), 0.0]])
    with pytest.raises(ValueError, match="float16") as err:
        Sampler(0.7, dtype=torch.float16)(bad)
    assert "bfloat16 or float32" in str(err.value)
    with pytest.raises(ValueError, match="NaN") as err:
        Sampler(0.7, dtype=torch.float32)(bad)
    assert "float32" in str(err.value) and "overflow" not in str(err.value)


def test_settings_are_checked_when_the_sampler_is_made(tiny):
    with pytest.raises(ValueError, match="top_p"):
        Sampler(1.0, top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny, [1, 2], 3, temperature=-1)


def test_a_tiny_temperature_does_not_overflow():
    logits = torch.tensor([[1e3, 0.0, 2.0]])
    ids, probs = Sampler(1e-40, seed=0)(logits)
    assert int(ids[0]) == 0 and probs[0, 0] == 1


def test_teacher_forcing_gives_the_logits_of_one_pass_over_the_known_tokens(tiny):
    prompt, known = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5]
    forced = teacher_forced_logits(tiny, prompt, known)  # [6, V]
    full = tiny(torch.tensor([prompt + known]))[0, len(prompt) - 1:-1]  # one uncached pass
    torch.testing.assert_close(forced, full, atol=1e-5, rtol=1e-4)


def test_the_loop_feeds_what_it_is_sent_and_stops_where_asked(tiny):
    ids = prompt_tensor(tiny, [1, 2, 3], 4)
    cache = KVCache(tiny.config, batch=1, max_seq_len=7, dtype=tiny.dtype)
    loop = decode_loop(tiny, ids, 4, cache=cache)
    seen = [next(loop)]
    for token in (7, 8, 9):
        seen.append(loop.send(torch.tensor([token])))
    with pytest.raises(StopIteration):  # the 4th token needs no further pass
        loop.send(torch.tensor([10]))
    torch.testing.assert_close(seen[-1], tiny(torch.tensor([[1, 2, 3, 7, 8, 9]]), last_only=True),
                               atol=1e-5, rtol=1e-4)
    uncached = decode_loop(tiny, ids, 2, use_cache=False)
    next(uncached)
    torch.testing.assert_close(uncached.send(torch.tensor([7])), seen[1], atol=1e-5, rtol=1e-4)


def test_generate_keeps_the_logits_it_sampled_from(tiny):
    g = generate(tiny, [5, 6, 7], 6, keep_logits=True)
    assert len(g.logits) == len(g.tokens) == 6
    assert [int(x.argmax()) for x in g.logits] == g.tokens
    assert (g.reused_tokens, g.computed_tokens) == (0, 3)


def test_torch_threads_puts_the_count_back_even_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        with torch_threads(0):
            pass
