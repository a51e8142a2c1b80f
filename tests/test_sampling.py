"""The reference sampler against transformers' logits warpers, a chi-square test of its draws, and its edge cases."""
import math

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from course.engine.sampling import (apply_temperature, check_params, entropy_bits, kept_mask, nucleus_size, probabilities,
                             sample, top_k_filter, top_p_filter, transform_logits)

V = 50
NO_IDS = torch.zeros(1, 1, dtype=torch.long)  # the warpers take input_ids but these three ignore them


def logit_vectors(n=60, seed=0):
    """Peaked, flat, ordinary, tied and partly -inf logit rows, each [V]."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        kind = i % 5
        x = torch.randn(V, generator=g)
        if kind == 0:
            x = x * 8  # peaked: one token holds most of the mass
        elif kind == 1:
            x = x * 0.05  # flat: nearly uniform
        elif kind == 2:
            x = x * 2
        elif kind == 3:
            x = torch.randint(-3, 4, (V,), generator=g).float()  # heavy ties (only 7 distinct values)
        else:
            x = x * 3
            x[torch.randperm(V, generator=g)[: V // 3]] = float("-inf")  # tokens already ruled out
        rows.append(x)
    return rows


def hf(logits, temperature=None, top_k=None, top_p=None):
    """transformers' warpers in generate()'s order, on a [V] row."""
    scores = logits.view(1, -1).clone()
    if temperature is not None:
        scores = TemperatureLogitsWarper(float(temperature))(NO_IDS, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(NO_IDS, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(float(top_p))(NO_IDS, scores)
    return scores[0]


def close_under_ties(logits, kept):
    """The kept set grown by every token tied with its smallest member (our rule: never split a tie)."""
    return logits >= logits[kept].min()


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
def test_temperature_matches_transformers(temperature):
    for x in logit_vectors():
        ours, theirs = apply_temperature(x, temperature), hf(x, temperature=temperature)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


@pytest.mark.parametrize("k", [1, 2, 5, 13, 49, 50, 200])
def test_top_k_matches_transformers(k):
    for x in logit_vectors():
        ours, theirs = top_k_filter(x, k), hf(x, top_k=k)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))  # same kept set, ties included
        torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


@pytest.mark.parametrize("p", [0.01, 0.1, 0.3, 0.5, 0.75, 0.9, 0.95, 0.999, 1.0])
def test_top_p_matches_transformers(p):
    n_tie_cases = 0
    for i, x in enumerate(logit_vectors()):
        ours, theirs = top_p_filter(x, p), hf(x, top_p=p)
        kept, hf_kept = torch.isfinite(ours), torch.isfinite(theirs)
        if i % 5 != 3:  # continuous logits: no ties, so the sets must be identical
            assert torch.equal(kept, hf_kept), f"row {i}"
            torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))
        else:  # transformers may split a tie by sort position; we keep the whole tie
            assert hf_kept.sum() <= kept.sum()
            assert torch.equal(kept, close_under_ties(x, hf_kept)), f"row {i}"
            n_tie_cases += int(not torch.equal(kept, hf_kept))
            expected = x.masked_fill(~kept, float("-inf")).softmax(-1)
            torch.testing.assert_close(ours.softmax(-1), expected)
    if p in (0.3, 0.5, 0.75):
        assert n_tie_cases > 0  # the tie rows did exercise a split tie


def test_top_p_is_smallest_set_reaching_p():
    """Definition check, independent of any library: the kept mass reaches p, one token fewer would not."""
    for x in logit_vectors(seed=1):
        for p in (0.2, 0.5, 0.8, 0.95):
            probs = x.softmax(-1)
            kept = torch.isfinite(top_p_filter(x, p))
            assert probs[kept].sum() >= p - 1e-6
            smallest = probs[kept].min()
            without_ties = probs[kept & (probs > smallest)].sum()
            assert without_ties < p + 1e-6  # dropping the boundary tie group falls short of p


@pytest.mark.parametrize("temperature,k,p", [(0.7, 40, 0.9), (1.3, 10, 0.5), (0.5, 3, 1.0), (1.0, 0, 0.8),
                                             (2.0, 100, 0.3)])
def test_composition_matches_transformers(temperature, k, p):
    for i, x in enumerate(logit_vectors(seed=2)):
        if i % 5 == 3:
            continue  # tie handling is covered above
        ours = probabilities(x, temperature, k, p)
        theirs = hf(x, temperature=temperature, top_k=k, top_p=p).softmax(-1)
        assert torch.equal(ours > 0, theirs > 0)
        torch.testing.assert_close(ours, theirs)


def test_batched_rows_match_one_at_a_time():
    rows = logit_vectors(20, seed=3)
    batch = torch.stack(rows)  # [B, V]
    got = probabilities(batch, 0.8, 10, 0.9)
    assert got.shape == batch.shape
    for b, x in enumerate(rows):
        torch.testing.assert_close(got[b], probabilities(x, 0.8, 10, 0.9))
    torch.testing.assert_close(got.sum(-1), torch.ones(len(rows)))
    ids = sample(batch, 0.8, 10, 0.9, torch.Generator().manual_seed(0))
    assert ids.shape == (len(rows),)
    assert bool(got.gather(1, ids[:, None]).gt(0).all())  # every draw came from its own row's kept set
    assert nucleus_size(batch, 0.8, 10, 0.9).shape == (len(rows),)


def chi_square_pvalue(counts, probs):
    """Pearson chi-square p-value of observed counts against probabilities, pooling cells expected < 5."""
    counts, probs = counts.double(), probs.double()
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs.numpy(), exp.numpy()).pvalue


def test_sampled_frequencies_match_the_distribution():
    """Chi-square goodness of fit: 40 000 seeded draws against the renormalised probabilities."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(30, generator=g) * 1.5
    n = 40_000
    for temperature, k, p in [(1.0, None, None), (0.7, 10, None), (1.2, None, 0.8), (0.9, 8, 0.9)]:
        probs = probabilities(x, temperature, k, p)
        draws = sample(x.expand(n, -1), temperature, k, p, generator=torch.Generator().manual_seed(7))
        counts = torch.bincount(draws, minlength=30)
        kept = probs > 0
        assert counts[~kept].sum() == 0  # filtered tokens are never drawn
        assert chi_square_pvalue(counts[kept], probs[kept]) > 1e-3, (temperature, k, p)
        if (temperature, k, p) != (1.0, None, None):  # the same test rejects a wrong target: the plain softmax
            assert chi_square_pvalue(counts[kept], x.softmax(-1)[kept]) < 1e-6, (temperature, k, p)


def test_seeded_generator_repeats_draws():
    x = torch.randn(4, 100)
    a = sample(x, 1.0, generator=torch.Generator().manual_seed(3))
    b = sample(x, 1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_temperature_zero_is_argmax_and_lowest_id_on_ties():
    for x in logit_vectors(seed=4):
        assert int(sample(x, temperature=0)) == int(x.argmax())
        assert int(probabilities(x, temperature=0).argmax()) == int(x.argmax())
        assert probabilities(x, temperature=0).sum() == 1
    tied = torch.tensor([1.0, 5.0, 2.0, 5.0])
    assert int(sample(tied, temperature=0)) == 1
    batch = torch.randn(6, 20)
    assert torch.equal(sample(batch, 0, top_k=5, top_p=0.3), batch.argmax(-1))


def test_top_k_one_is_argmax():
    g = torch.Generator().manual_seed(5)
    for x in logit_vectors(seed=5):
        if x.eq(x.max()).sum() > 1:
            continue  # a tied maximum is a set of more than one token (covered below)
        for _ in range(3):
            assert int(sample(x, 1.3, top_k=1, generator=g)) == int(x.argmax())
        assert int(nucleus_size(x, top_k=1)) == 1


def test_tiny_top_p_keeps_exactly_the_top_token():
    for x in logit_vectors(seed=6):
        kept = kept_mask(x, top_p=1e-6)
        assert kept.sum() == x.eq(x.max()).sum()  # one token, or the tied maxima
        assert kept[x.argmax()]


def test_ties_are_never_split():
    x = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0])
    assert kept_mask(x, top_k=2).tolist() == [True, True, True, True, False]
    p_top = float(x.softmax(-1)[0])
    assert kept_mask(x, top_p=p_top + 0.01).tolist() == [True, True, True, True, False]
    assert kept_mask(x, top_p=p_top - 0.01).tolist() == [True, False, False, False, False]
    uniform = torch.zeros(8)
    assert kept_mask(uniform, top_p=0.5).all()  # eight equal tokens: no way to pick half of them fairly
    torch.testing.assert_close(probabilities(uniform, top_p=0.5), torch.full((8,), 1 / 8))


def test_neg_inf_logits_are_never_sampled():
    x = torch.tensor([float("-inf"), 0.0, float("-inf"), -1.0, float("-inf")])
    assert kept_mask(x).tolist() == [False, True, False, True, False]
    assert kept_mask(x, top_k=4).tolist() == [False, True, False, True, False]
    assert kept_mask(x, top_p=0.999).tolist() == [False, True, False, True, False]
    draws = sample(x.expand(2000, -1), 2.0, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {1, 3}
    only = torch.full((6,), float("-inf"))
    only[4] = -100.0
    assert int(sample(only, 1.0, top_p=0.1)) == 4


def test_top_k_larger_than_vocab_clamps():
    x = torch.randn(2, 10)
    torch.testing.assert_close(probabilities(x, top_k=10_000), x.softmax(-1))
    assert nucleus_size(x, top_k=10_000).tolist() == [10, 10]


def test_tiny_temperature_does_not_overflow():
    x = torch.tensor([30.0, 29.0, -5.0])
    probs = probabilities(x, temperature=1e-39)
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [1.0, 0.0, 0.0]


def test_half_precision_logits_are_accepted():
    x = torch.randn(3, 40)
    torch.testing.assert_close(probabilities(x.half(), 0.7, 5, 0.9), probabilities(x.half().float(), 0.7, 5, 0.9))


def test_entropy_bits():
    assert float(entropy_bits(torch.tensor([0.0, 1.0, 0.0]))) == 0.0
    assert math.isclose(float(entropy_bits(torch.full((8,), 1 / 8))), 3.0, rel_tol=1e-6)
    x = torch.randn(100)
    h = [float(entropy_bits(probabilities(x, t))) for t in (0.5, 1.0, 2.0)]
    assert h == sorted(h) and len(set(h)) == 3  # hotter is flatter


@pytest.mark.parametrize("kwargs,name,valid", [
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=float("nan")), "temperature", ">= 0"),
    (dict(temperature=float("inf")), "temperature", ">= 0"),
    (dict(temperature="hot"), "temperature", ">= 0"),
    (dict(top_k=-1), "top_k", ">= 0"),
    (dict(top_k=2.5), "top_k", "integer"),
    (dict(top_k=True), "top_k", "integer"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_p=-0.2), "top_p", "(0, 1]"),
    (dict(top_p=float("nan")), "top_p", "(0, 1]"),
])
def test_bad_settings_name_the_argument_and_range(kwargs, name, valid):
    x = torch.randn(10)
    for call in (lambda: check_params(**kwargs), lambda: sample(x, **kwargs), lambda: probabilities(x, **kwargs),
                 lambda: transform_logits(x, **kwargs)):
        with pytest.raises(ValueError) as err:
            call()
        assert name in str(err.value) and valid in str(err.value)


@pytest.mark.parametrize("logits,needle", [
    (torch.tensor([1.0, float("nan"), 0.0]), "NaN"),
    (torch.tensor([1.0, float("inf")]), "+inf"),
    (torch.full((2, 3), float("-inf")), "-inf"),
    (torch.randn(2, 3, 4), "[B, V]"),
    (torch.tensor(1.0), "[B, V]"),
    (torch.zeros(0), "[B, V]"),
    (torch.zeros(0, 5), "[B, V]"),
    (torch.tensor([1, 2, 3]), "floating point"),
    ([1.0, 2.0], "torch.Tensor"),
])
def test_bad_logits_raise(logits, needle):
    with pytest.raises(ValueError, match="logits") as err:
        sample(logits)
    assert needle in str(err.value)
    with pytest.raises(ValueError):
        probabilities(logits, temperature=0)


def test_apply_temperature_zero_points_to_greedy():
    with pytest.raises(ValueError, match="greedy"):
        apply_temperature(torch.randn(5), 0)
