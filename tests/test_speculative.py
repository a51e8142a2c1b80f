"""Speculative decoding: the accept/reject step by hand, distribution preservation by statistics,
greedy equality with plain decoding (tiny model, and the real model in the slow set)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from course.engine.generate import generate
from course.engine.model import tiny_model
from course.engine.positions import Positions
from course.engine.speculative import (Draft, ModelDraft, PromptLookupDraft, accept_probability, empirical_distribution,
                                expected_tokens_per_pass, predicted_speedup, residual_distribution, shallow_copy,
                                shallow_draft, speculative_first_token, speculative_generate, total_variation,
                                verify_sampled)



@pytest.fixture(autouse=True)
def _steady(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


P_HAND = torch.tensor([0.5, 0.3, 0.2])
Q_HAND = torch.tensor([0.2, 0.6, 0.2])


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells with small expected counts are pooled into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


# --- the accept / reject step, by hand ---------------------------------------------------------

def test_accept_probability_hand_case():
    # token 1: the draft over-proposes it (0.6 vs 0.3): kept half the time
    assert accept_probability(P_HAND, Q_HAND, 1) == pytest.approx(0.5)
    # tokens the draft under-proposes or matches are always kept
    assert accept_probability(P_HAND, Q_HAND, 0) == 1.0
    assert accept_probability(P_HAND, Q_HAND, 2) == 1.0
    with pytest.raises(ValueError, match="probability 0"):
        accept_probability(P_HAND, torch.tensor([0.0, 0.5, 0.5]), 0)


def test_residual_hand_case():
    # max(0, p - q) = [0.3, 0, 0] -> all the missing mass is on token 0
    assert torch.allclose(residual_distribution(P_HAND, Q_HAND), torch.tensor([1.0, 0.0, 0.0]))
    p, q = torch.tensor([0.4, 0.4, 0.2]), torch.tensor([0.1, 0.3, 0.6])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.75, 0.25, 0.0]))
    # min(p, q) + (1 - sum min(p, q)) * residual = p  (why the output is exact)
    accepted = torch.minimum(p, q)
    assert torch.allclose(accepted + (1 - accepted.sum()) * residual_distribution(p, q), p)
    assert torch.allclose(residual_distribution(p, p), p)  # no residual: defined, never used


def test_verify_sampled_hand_cases():
    p = torch.stack([P_HAND, torch.tensor([0.1, 0.1, 0.8]), torch.tensor([0.0, 1.0, 0.0])])  # [3, V]
    q = torch.stack([Q_HAND, torch.tensor([0.1, 0.1, 0.8])])  # [2, V]
    # u = 0.4 < 0.5 keeps token 1; second row p == q keeps token 2; bonus from p[2] is token 1 surely
    assert verify_sampled(p, q, [1, 2], uniforms=[0.4, 0.99]) == (2, 1)
    # u = 0.6 >= 0.5 rejects token 1 at once; the residual is one-hot on token 0
    assert verify_sampled(p, q, [1, 2], uniforms=[0.6, 0.0]) == (0, 0)
    # deterministic draft (q=None means one-hot): keep token 2 with probability p(2) = 0.2
    assert verify_sampled(p[:2], None, [2], uniforms=[0.19])[0] == 1
    n, token = verify_sampled(p[:2], None, [2], uniforms=[0.21])
    assert n == 0 and token in (0, 1)  # the residual of a one-hot draft excludes the drafted token
    with pytest.raises(ValueError, match="len\\(drafted\\)"):
        verify_sampled(p, q, [1])


def test_greedy_verification_is_the_one_hot_case():
    p = torch.nn.functional.one_hot(torch.tensor([1, 0, 2]), 3).float()  # the target's argmax: 1, 0, 2
    assert verify_sampled(p, None, [1, 0]) == (2, 2)
    assert verify_sampled(p[:2], None, [1]) == (1, 0)
    assert verify_sampled(p[:2], None, [0]) == (0, 1)
    assert verify_sampled(p[:1], None, []) == (0, 1)


# --- distribution preservation, by statistics ---------------------------------------------------

def _markov_pair(V=6, seed=0):
    torch.manual_seed(seed)
    target = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))  # P[prev] -> next
    draft = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))
    return target.double(), draft.double()


def _speculative_two_tokens(target, draft, start, k, gen, verify=verify_sampled):
    """Run speculative steps of a Markov 'model' until two tokens are emitted after `start`."""
    seq = [start]
    while len(seq) < 3:
        drafted, qs, prev = [], [], seq[-1]
        for _ in range(k):
            q = draft[prev]
            x = int(torch.multinomial(q, 1, generator=gen))
            drafted.append(x)
            qs.append(q)
            prev = x
        p = torch.stack([target[t] for t in [seq[-1]] + drafted])  # [k+1, V]
        n, nxt = verify(p, torch.stack(qs), drafted, gen)
        seq += drafted[:n] + [nxt]
    return seq[1], seq[2]


def test_speculative_sampling_preserves_a_markov_target():
    """The joint law of two emitted tokens (across accept, reject and bonus paths) is the target's."""
    target, draft = _markov_pair()
    V, start, n = target.shape[0], 0, 6000
    gen = torch.Generator().manual_seed(1)
    counts = np.zeros(V * V)
    for _ in range(n):
        a, b = _speculative_two_tokens(target, draft, start, k=3, gen=gen)
        counts[a * V + b] += 1
    exact = (target[start][:, None] * target).flatten().numpy()  # P(a) · P(b | a)
    assert chi2_pvalue(counts, exact) > 1e-3
    assert 0.5 * np.abs(counts / n - exact).sum() < 0.06

    # the same test has power: keeping every draft token (no rejection) yields the draft's law
    def accept_all(p, q, drafted, gen):
        return len(drafted), int(torch.multinomial(p[-1], 1, generator=gen))

    wrong = np.zeros(V * V)
    for _ in range(n):
        a, b = _speculative_two_tokens(target, draft, start, k=3, gen=gen, verify=accept_all)
        wrong[a * V + b] += 1
    assert chi2_pvalue(wrong, exact) < 1e-6


def test_vectorised_first_token_matches_target():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    p = torch.distributions.Dirichlet(torch.full((40,), 0.3)).sample().double()
    q = torch.distributions.Dirichlet(torch.full((40,), 0.3)).sample().double()
    tokens = speculative_first_token(p, q, 40_000, generator=g)
    counts = torch.bincount(tokens, minlength=40).numpy()
    assert chi2_pvalue(counts, p.numpy()) > 1e-3
    emp = empirical_distribution(tokens, 40)
    assert total_variation(emp, p) < 0.03 < total_variation(q, p)


@pytest.mark.slow
def test_speculative_generate_sampling_matches_target_on_tiny_model():
    """End to end (draft model, KV caches, verify pass): the second token's law is the target's."""
    target = tiny_model(seed=0)
    draft = shallow_draft(target, 1)
    prompt = [5, 17, 99, 3, 42]
    temperature, n = 0.3, 1500
    V = target.config.vocab_size
    with torch.inference_mode():
        p0 = (target(torch.tensor([prompt]))[0, -1] / temperature).softmax(-1).double()  # [V]
        batch = torch.tensor([prompt + [y] for y in range(V)])  # every possible first token
        p1 = (target(batch)[:, -1] / temperature).softmax(-1).double()  # [V, V]
    second = (p0[:, None] * p1).sum(0).numpy()  # marginal law of token 2
    counts0, counts1 = np.zeros(V), np.zeros(V)
    accepted = 0
    for i in range(n):
        out = speculative_generate(target, draft, prompt, max_new_tokens=3, k=3, temperature=temperature, seed=i)
        counts0[out.tokens[0]] += 1
        counts1[out.tokens[1]] += 1
        accepted += out.stats.accepted
    assert accepted > 0  # the test exercised the accept path, not only resampling
    assert chi2_pvalue(counts0, p0.numpy()) > 1e-3
    assert chi2_pvalue(counts1, second) > 1e-3


# --- greedy equality and the loop's bookkeeping ---------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_greedy_target_tiny(tiny, k):
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7]
    base = generate(tiny, prompt, 40, temperature=0).tokens
    drafts = [shallow_draft(tiny, 1), PromptLookupDraft(), ModelDraft(tiny_model(seed=1), "other tiny"),
              ModelDraft(tiny, "the target itself")]
    for draft in drafts:
        out = speculative_generate(tiny, draft, prompt, 40, k=k)
        assert out.tokens == base, draft.name
        s = out.stats
        assert len(out.tokens) == 1 + s.emitted
        assert s.proposed <= k * s.target_passes
    # a draft that IS the target is always right: k+1 tokens per pass until the limit
    s = speculative_generate(tiny, ModelDraft(tiny), prompt, 40, k=k).stats
    assert s.acceptance_rate == 1.0


def test_model_draft_proposals_match_its_own_uncached_greedy(tiny):
    """The draft's KV-cache bookkeeping (reuse, overwrite of rejected rows) never changes its guesses."""
    draft_model = tiny_model(seed=1)

    class Checked(ModelDraft):
        def propose(self, seq, k, *args, **kwargs):
            drafted, q = super().propose(seq, k, *args, **kwargs)
            ids = list(seq)
            for x in drafted:
                with torch.inference_mode():
                    assert int(draft_model(torch.tensor([ids]))[0, -1].argmax()) == x
                ids.append(x)
            return drafted, q

    out = speculative_generate(tiny, Checked(draft_model), [3, 1, 4, 1, 5], 30, k=4)
    assert out.stats.draft_passes > 0


def test_eos_and_length_limits(tiny):
    prompt = [7, 7, 7, 7]
    base = generate(tiny, prompt, 25, temperature=0).tokens
    eos = base[10]
    stop = base.index(eos)
    out = speculative_generate(tiny, ModelDraft(tiny), prompt, 25, k=4, eos_id=eos)
    assert out.tokens == base[:stop + 1] and out.stop_reason == "eos"
    out = speculative_generate(tiny, ModelDraft(tiny), prompt, 7, k=4)
    assert out.tokens == base[:7] and out.stop_reason == "length"


def test_prompt_lookup_draft():
    d = PromptLookupDraft(max_ngram=2)
    assert d.propose([1, 2, 3, 4, 1, 2], 3)[0] == [3, 4, 1]
    assert d.propose([1, 2, 3, 4, 1, 2], 1)[0] == [3]
    assert d.propose([5, 6, 7], 3)[0] == []  # nothing repeats: nothing proposed
    assert d.propose([9, 1, 2, 8, 1, 2], 2)[0] == [8, 1]  # the latest match wins
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDraft(max_ngram=1, min_ngram=2)


def test_shallow_copy_shares_parameters(tiny):
    draft = shallow_copy(tiny, 1)
    assert draft.config.n_layers == 1 and len(draft.layers) == 1
    target_ptrs = {p.data_ptr() for p in tiny.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in draft.parameters())  # no copies
    assert draft.output.weight.data_ptr() == tiny.tok_embeddings.weight.data_ptr()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        x = tiny.tok_embeddings(ids)
        x = tiny.layers[0](x, tiny.rope_cos[:5], tiny.rope_sin[:5], Positions.at(0, 5), None)
        manual = tiny.output(tiny.norm(x))
        assert torch.allclose(draft(ids), manual, atol=1e-6)
    with pytest.raises(ValueError, match="n_layers"):
        shallow_copy(tiny, 0)
    with pytest.raises(ValueError, match="n_layers"):
        shallow_copy(tiny, tiny.config.n_layers + 1)


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="k \\(draft tokens"):
        speculative_generate(tiny, PromptLookupDraft(), [1, 2], 5, k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(tiny, PromptLookupDraft(), [1, 2], 0)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(tiny, PromptLookupDraft(), [1, 2], 5, temperature=-1)
    with pytest.raises(ValueError, match="context"):
        speculative_generate(tiny, PromptLookupDraft(), [1] * 100, 50)
    with pytest.raises(NotImplementedError):
        Draft().propose([1], 2)


def test_economics_formulas():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)
    # a free draft that is always right at a bandwidth-bound verify: k+1 times faster
    assert predicted_speedup(1.0, 3, draft_cost=0.0) == pytest.approx(4.0)
    # a draft as slow as the target never pays, even when it is always right
    assert predicted_speedup(1.0, 3, draft_cost=1.0) == pytest.approx(1.0)
    assert predicted_speedup(0.9, 3, draft_cost=1.0) < 1.0
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens_per_pass(1.5, 2)


# --- the real model ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_greedy_speculative_equals_greedy_target_real(real_model, tokenizer):
    text = ("The lighthouse keeper wrote in his log every night: the wind, the ships, "
            "the colour of the sea and the number of gulls on the rail.")
    prompt = tokenizer.chat_ids("Repeat this sentence exactly:\n" + text)
    base = generate(real_model, prompt, 24, temperature=0).tokens
    for draft, k in [(PromptLookupDraft(), 4), (shallow_draft(real_model, 8), 2)]:
        out = speculative_generate(real_model, draft, prompt, 24, k=k)
        assert out.tokens == base, draft.name
    lookup = speculative_generate(real_model, PromptLookupDraft(), prompt, 24, k=4).stats
    assert lookup.tokens_per_target_pass > 1.5  # the answer copies the prompt: drafts get accepted
