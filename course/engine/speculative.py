"""Speculative decoding: a cheap draft proposes k tokens, the target checks them all in ONE pass.

Decode is bandwidth-bound: each target pass streams every weight once to produce one token. If a
draft guesses the next k tokens, the target can score all k+1 positions in a single pass (like a
small prefill) and keep the longest run it agrees with, so one weight read yields 1..k+1 tokens.

    draft      x_1..x_k ~ q            k cheap passes (or a free n-gram lookup)
    verify     p_1..p_{k+1}            ONE target pass over [last, x_1..x_k] against its KV cache
    accept     x_i with probability min(1, p_i(x_i) / q_i(x_i)), left to right
    on reject  draw from the residual  max(0, p_i - q_i) / sum(max(0, p_i - q_i)), then stop
    all kept   draw a bonus token from p_{k+1}

Every emitted token is distributed exactly as the target alone would have sampled it
(Leviathan et al. 2023, Chen et al. 2023). Greedy decoding is the special case where p and q are
one-hot (the same verify_sampled): keep drafted tokens while they equal the target's argmax, then take
the target's argmax.

Rejected positions need no clean-up in either KV cache: the next pass writes at the first rejected
position, and attention only reads keys up to start_pos + T (see KVCache.update).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from course.engine.config import whole
from course.engine.device import synchronize
from course.engine.generate import Generation, decode_loop, prefill, prompt_tensor
from course.engine.kv_cache import KVCache
from course.engine.sampling import Sampler


# --------------------------------------------------- The accept / reject step (pure functions of two distributions)
def accept_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(x) / q(x)) for a token x the draft drew from q. p, q: [V] probabilities."""
    q_x = float(q[token])
    if q_x <= 0:
        raise ValueError(f"the draft gave token {token} probability 0, so it cannot have drawn it; "
                         "pass the distribution the draft actually sampled from")
    return min(1.0, float(p[token]) / q_x)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to sample after a rejection: max(0, p - q), renormalised. p, q: [..., V].

    This is the part of p the draft under-proposes; adding it to the accepted mass min(p, q)
    gives back p exactly. If p == q there is no residual (and no rejection can happen); p is
    returned so the function is total.
    """
    residual = (p - q).clamp_min(0)  # [..., V]
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def verify_sampled(p: torch.Tensor, q: torch.Tensor | None, drafted: list[int],
                   generator: torch.Generator | None = None,
                   uniforms: list[float] | None = None) -> tuple[int, int]:
    """Speculative sampling: how many drafted tokens to keep, and the one token the target adds.

    p: [m+1, V] target probabilities at each drafted position plus one; q: [m, V] the draft's
    probabilities (None for a deterministic draft: one-hot at each drafted token).
    uniforms: optional fixed u_i in [0, 1) for the accept tests (to check a step by hand).
    Returns (n_accepted, next_token): keep drafted[:n_accepted], then append next_token.
    """
    m = len(drafted)
    if p.dim() != 2 or p.shape[0] != m + 1:
        raise ValueError(f"p must be [len(drafted)+1, V] = [{m + 1}, V], got {tuple(p.shape)}")
    if q is not None and tuple(q.shape) != (m, p.shape[1]):
        raise ValueError(f"q must be [len(drafted), V] = [{m}, {p.shape[1]}], got {tuple(q.shape)}")
    for i, x in enumerate(drafted):
        q_i = q[i] if q is not None else F.one_hot(torch.tensor(x, device=p.device), p.shape[1]).to(p.dtype)
        u = uniforms[i] if uniforms is not None else float(torch.rand((), generator=generator))
        if u < accept_probability(p[i], q_i, x):
            continue  # keep x_i, test the next one
        residual = residual_distribution(p[i], q_i)
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return m, int(torch.multinomial(p[m], 1, generator=generator))  # every draft kept: a bonus token


def speculative_first_token(p: torch.Tensor, q: torch.Tensor, n: int, generator: torch.Generator | None = None,
                            return_accepted: bool = False):
    """n independent draws of the first emitted token at one fixed context, vectorised.

    The same rule as verify_sampled (draft x ~ q, keep it if u < p(x)/q(x), else draw from the
    residual), applied to n parallel copies of the same step: how the lesson collects thousands
    of samples from the real model's p and q in a second. p, q: [V]. Returns [n] token ids
    (and, with return_accepted, a [n] bool mask of the draws that kept the draft's token).
    """
    whole("n (draws)", n)
    x = torch.multinomial(q, n, replacement=True, generator=generator)  # [n] drafted tokens
    ratio = (p[x] / q[x]).clamp(max=1.0)  # [n] accept probabilities
    accept = torch.rand(n, generator=generator, device=p.device) < ratio
    fallback = torch.multinomial(residual_distribution(p, q), n, replacement=True, generator=generator)
    tokens = torch.where(accept, x, fallback)
    return (tokens, accept) if return_accepted else tokens


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """TV distance ½·Σ|p − q| between two distributions over the same support (0 = identical)."""
    return 0.5 * float((p.double() - q.double()).abs().sum())


def empirical_distribution(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Histogram of sampled token ids, normalised: [V]."""
    return torch.bincount(tokens.flatten(), minlength=vocab_size).double() / tokens.numel()


# ----------------------------------------------------------------------------------------------------------- Drafts
class Draft:
    """What speculative_generate needs from a draft. Subclasses propose up to k tokens."""

    name = "draft"

    def reset(self, prompt_ids: list[int], capacity: int) -> None:
        """Start a new sequence. capacity: the most tokens the sequence can reach (for KV buffers)."""

    def propose(self, seq: list[int], k: int, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None
                ) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens to follow seq, and the [len, V] distributions they were drawn from
        (None if the draft is deterministic: then q is one-hot at each proposed token)."""
        raise NotImplementedError


class ModelDraft(Draft):
    """A smaller language model with the same tokenizer, running with its own KV cache."""

    def __init__(self, model: nn.Module, name: str | None = None):
        self.model = model
        self.name = name or f"model ({model.config.n_layers} layers)"
        self.cache: KVCache | None = None
        self.fed: list[int] = []  # tokens whose K/V sit in self.cache, in order
        self.passes = 0

    def reset(self, prompt_ids: list[int], capacity: int) -> None:
        cfg = self.model.config
        if self.cache is None or self.cache.max_seq_len < capacity:
            self.cache = KVCache(cfg, batch=1, max_seq_len=capacity, dtype=self.model.dtype, device=self.model.device)
        self.fed, self.passes = [], 0

    @torch.inference_mode()
    def propose(self, seq, k, temperature=0.0, top_k=None, top_p=None, generator=None):
        if k <= 0:
            return [], None
        # Reuse the cached K/V of the longest prefix of seq already fed; re-feed at least the last token
        # (its logits were not kept). Stale rows past that point are overwritten.
        same = [a == b for a, b in zip(self.fed, seq[:-1])]
        valid = same.index(False) if False in same else len(same)
        new = torch.tensor([seq[valid:]], dtype=torch.long, device=self.model.device)  # [1, T_new]
        sampler = Sampler(temperature, top_k, top_p, generator, dtype=self.model.dtype)
        loop = decode_loop(self.model, new, k, cache=self.cache, start_pos=valid)  # the engine's decode loop
        logits, drafted, dists = next(loop), [], []
        for i in range(k):
            self.passes += 1
            token, q = sampler(logits[0])  # a token and the distribution it was drawn from
            drafted.append(int(token))
            if not sampler.greedy:
                dists.append(q)
            if i < k - 1:
                logits = loop.send(token)
        loop.close()
        self.fed = list(seq) + drafted[:-1]  # the last drafted token was never fed
        return drafted, (torch.stack(dists) if dists else None)


def shallow_copy(model: nn.Module, n_layers: int) -> nn.Module:
    """The first n_layers blocks of `model` plus its final norm and (tied) head, as a Transformer.

    No weights are copied: the new model's modules ARE the original's (same parameter tensors), so
    the draft costs no memory beyond its own KV cache. An 'early exit' draft: it reads the residual
    stream after n_layers blocks through the head that was trained to read it after all of them.
    """
    from course.engine.model import Transformer

    total = model.config.n_layers
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be an integer in [1, {total}] (the target's layers), got {n_layers!r}")
    config = model.config.with_(n_layers=n_layers)
    with torch.device("meta"):  # build the skeleton without allocating weights, then plug in the real ones
        draft = Transformer(config)
    draft.tok_embeddings = model.tok_embeddings
    draft.layers = nn.ModuleList(model.layers[:n_layers])
    draft.norm = model.norm
    draft.output = model.output
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    return draft.eval()


def shallow_draft(model: nn.Module, n_layers: int) -> ModelDraft:
    return ModelDraft(shallow_copy(model, n_layers), f"shallow SmolLM2 ({n_layers}/{model.config.n_layers} layers)")


class PromptLookupDraft(Draft):
    """Prompt-lookup (n-gram) drafting: find the latest earlier place where the last n tokens
    occurred and propose what followed them there. Free to run, no model; it shines when the
    answer copies from the context (edits, extraction, RAG, code) and proposes nothing otherwise.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                             f"max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"prompt lookup ({min_ngram}..{max_ngram}-gram)"
        self.passes = 0

    def reset(self, prompt_ids, capacity):
        self.passes = 0

    def propose(self, seq, k, temperature=0.0, top_k=None, top_p=None, generator=None):
        if k <= 0:
            return [], None
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            tail = seq[n_seq - n:]
            for start in range(n_seq - n - 1, -1, -1):  # latest match first; never the tail itself
                if seq[start:start + n] == tail:
                    follow = seq[start + n:start + n + k]
                    if follow:
                        return list(follow), None
        return [], None


# ---------------------------------------------------------------------------------------------- The generation loop
@dataclass
class SpeculativeStats:
    """Counts and seconds for one speculative generation (the prefill pass is counted apart)."""
    k: int
    draft_name: str
    draft_passes: int = 0  # draft model forward passes (0 for prompt lookup)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    wall_seconds: float = 0.0  # the whole call, prefill included
    accepted_per_pass: list[int] = field(default_factory=list)  # one entry per verification pass
    proposed_per_pass: list[int] = field(default_factory=list)

    @property
    def target_passes(self):
        """Verification passes (decode phase)."""
        return len(self.accepted_per_pass)

    @property
    def proposed(self):
        """Draft tokens offered to the target."""
        return sum(self.proposed_per_pass)

    @property
    def accepted(self):
        """Of the draft tokens proposed, those the target kept."""
        return sum(self.accepted_per_pass)

    @property
    def emitted(self):
        """Each pass adds one token to those kept."""
        return self.accepted + self.target_passes

    @property
    def acceptance_rate(self):
        """Share of proposed draft tokens the target kept (nan if nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def agreement(self) -> float:
        """Per-token acceptance α: kept / tested. A round stops testing at its first rejection, so
        the drafts after it are proposed but never tested; α counts only tested ones."""
        tested = self.accepted + sum(a < p for a, p in zip(self.accepted_per_pass, self.proposed_per_pass))
        return self.accepted / tested if tested else float("nan")

    @property
    def tokens_per_target_pass(self):
        """Decode-phase tokens per target pass: 1 for plain decoding, up to k+1 here."""
        return self.emitted / self.target_passes if self.target_passes else float("nan")

    @property
    def decode_seconds(self):
        return self.wall_seconds - self.prefill_seconds


@dataclass
class SpeculativeGeneration(Generation):
    stats: SpeculativeStats | None = None


@torch.inference_mode()
def speculative_generate(target: nn.Module, draft: Draft, prompt_ids, max_new_tokens: int = 64, k: int = 4, *,
                         temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                         seed: int | None = None, eos_id: int | None = None,
                         on_token: Callable[[int], None] | None = None) -> SpeculativeGeneration:
    """Generate like course.engine.generate.generate, but with a draft proposing k tokens per target pass.

    temperature 0: greedy speculative decoding (output equals greedy target decoding token for token).
    temperature > 0: speculative sampling (output distributed exactly as the target's sampler).
    """
    whole("k (draft tokens per target pass)", k)
    generator = torch.Generator(device=target.device).manual_seed(seed) if seed is not None else None
    sampler = Sampler(temperature, top_k, top_p, generator, dtype=target.dtype)  # settings checked once
    whole("max_new_tokens", max_new_tokens)
    ids = prompt_tensor(target, prompt_ids, max_new_tokens)  # [1, T], the context checked
    prompt = ids[0].tolist()
    capacity = min(len(prompt) + max_new_tokens + k + 1, target.config.max_seq_len)
    stats = SpeculativeStats(k=k, draft_name=getattr(draft, "name", type(draft).__name__))
    result = SpeculativeGeneration(prompt_ids=prompt, stats=stats, stop_reason="length")
    cache = KVCache(target.config, batch=1, max_seq_len=capacity, dtype=target.dtype, device=target.device)
    draft.reset(prompt, capacity)
    synchronize(target.device)
    t0 = time.perf_counter()
    new = [int(sampler(prefill(target, ids, cache)[0])[0])]  # the prefill pass, and its token
    stats.prefill_seconds = time.perf_counter() - t0
    seq = prompt + new  # invariant: the target's cache holds K/V for seq[:-1]
    while True:
        for token in new:  # emit, timestamped now
            result.tokens.append(token)
            result.token_times.append(time.perf_counter() - t0)
            if on_token is not None:
                on_token(token)
            if eos_id is not None and token == eos_id:
                result.stop_reason = "eos"
                break
        if result.stop_reason == "eos" or len(result.tokens) >= max_new_tokens:
            break
        t_draft = time.perf_counter()
        drafted, q = draft.propose(seq, min(k, max_new_tokens - len(result.tokens) - 1),  # never past the limit
                                   temperature, top_k, top_p, generator)
        stats.draft_seconds += time.perf_counter() - t_draft
        x = torch.tensor([[seq[-1]] + drafted], dtype=torch.long, device=target.device)  # [1, m+1]
        logits = prefill(target, x, cache, start_pos=len(seq) - 1, last_only=False)[0]  # [m+1, V]: ONE pass, all m+1
        n_ok, nxt = verify_sampled(sampler.probs(logits), q, drafted, generator)  # one-hot p and q when greedy
        new = drafted[:n_ok] + [nxt]
        stats.accepted_per_pass.append(n_ok)
        stats.proposed_per_pass.append(len(drafted))
        seq += new
    synchronize(target.device)
    stats.wall_seconds = time.perf_counter() - t0
    stats.draft_passes = getattr(draft, "passes", 0)
    return result


# ---------------------------------------------------------------------------------------------------- The economics
def expected_tokens_per_pass(acceptance: float, k: int) -> float:
    """Mean tokens per target pass if each draft token is kept independently with probability α:
    1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)."""
    whole("k (draft tokens per target pass)", k)
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if acceptance == 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def predicted_speedup(acceptance: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Tokens per second relative to plain decoding.

    draft_cost: seconds of one draft pass / seconds of one target decode step (0 for prompt lookup).
    verify_cost: seconds of one target pass over k+1 tokens / one target decode step (1 if the pass
    is purely bandwidth-bound; more on a CPU, where k+1 tokens also cost arithmetic).
    """
    return expected_tokens_per_pass(acceptance, k) / (k * draft_cost + verify_cost)
