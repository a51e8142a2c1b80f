"""Lesson 04's measurements: speculative decoding (is it exact, does it pay) and prefix caching. Each `*_report`
turns a gated measurement (course.measure.gates) into one Report: predicted against measured, one headline, details
folded; the idea lives in the notebook's Markdown, the texts sent to the model in prompts.yaml beside this file.
"""
from __future__ import annotations

import functools
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from course.engine.generate import generate
from course.engine.paged_prefix import PagedPrefixCache
from course.engine.sampling import probabilities
from course.engine.speculative import (Draft, empirical_distribution, expected_tokens_per_pass, predicted_speedup,
                                       shallow_copy, speculative_first_token, speculative_generate, total_variation)
from course.measure import gates
from course.measure.display import Report, verdict
from course.measure.results import record, record_gated

PROMPTS = yaml.safe_load((Path(__file__).parent / "prompts.yaml").read_text(encoding="utf-8"))
COPY_REQUEST, OPEN_REQUEST = PROMPTS["copy_request"], PROMPTS["open_request"]  # the answer copies its prompt, or not
SYSTEM_PROMPT, QUESTIONS = PROMPTS["library_system_prompt"], PROMPTS["library_questions"]
SPEED_TOLERANCE = 0.3  # a speedup within ±30 % of its prediction agrees with it on a shared machine


def greedy_check(model, prompt_ids, drafts: list[tuple[Draft, int]], max_new_tokens: int = 32) -> None:
    """Plain greedy decoding against greedy speculative decoding with each (draft, k): the same tokens?"""
    base = generate(model, prompt_ids, max_new_tokens).tokens
    same = {f"{d.name}, k = {k}": speculative_generate(model, d, prompt_ids, max_new_tokens, k=k).tokens == base
            for d, k in drafts}
    record("greedy_identical", same)
    print(f"{len(base)} new tokens, plain greedy decoding against speculative decoding with:")
    for name, ok in same.items():
        print(f"  {name}: " + ("identical" if ok else "DIFFERENT: a near-tie between the top two tokens flipped"))


NOISE_SDS = 4  # the verdict passes up to exact sampling's mean TV + 4 SD
NOISE_BATCHES = 300  # simulated batches of exact draws that give that mean and SD


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    return total_variation(empirical_distribution(tokens, p.numel()), p)


@dataclass
class SamplingCheck:
    """Next-token samples at one fixed context by the speculative rule, against the noise exact sampling leaves."""
    p: torch.Tensor  # [V] the target's distribution
    q: torch.Tensor  # [V] the draft's
    speculative: torch.Tensor  # [n] tokens from the speculative rule
    accepted_share: float  # share of them that kept the draft's token

    n = property(lambda self: self.speculative.numel())
    tv_speculative = property(lambda self: _tv(self.speculative, self.p))
    tv_draft = property(lambda self: total_variation(self.q, self.p))  # keeping the draft's tokens unchecked
    predicted_acceptance = property(lambda self: float(torch.minimum(self.p, self.q).sum()))  # Σ min(p, q)

    @functools.cached_property
    def noise(self) -> torch.Tensor:
        """TV(n exact draws from p, p) in NOISE_BATCHES simulated batches (a fixed generator): noise alone."""
        g = torch.Generator().manual_seed(1)
        return torch.tensor([_tv(torch.multinomial(self.p, self.n, replacement=True, generator=g), self.p)
                             for _ in range(NOISE_BATCHES)], dtype=torch.float64)

    noise_limit = property(lambda self: float(self.noise.mean() + NOISE_SDS * self.noise.std()))
    within_noise = property(lambda self: self.tv_speculative <= self.noise_limit)

    def report(self) -> Report:
        tv, limit, ok = self.tv_speculative, self.noise_limit, self.within_noise
        for key, value in dict(spec_tv_distance=tv, spec_tv_noise=float(self.noise.mean()), spec_tv_noise_limit=limit,
                               spec_within_noise=ok, spec_tv_draft=self.tv_draft,
                               spec_accepted_share=self.accepted_share,
                               spec_predicted_acceptance=self.predicted_acceptance).items():
            record(key, value)
        headline = (f"Speculative samples are {'within' if ok else 'OUTSIDE'} exact sampling's noise: TV "
                    f"{tv:.4f} {'≤' if ok else '>'} {limit:.4f}. The draft alone is {self.tv_draft:.2f} away.")
        sd = math.sqrt(self.predicted_acceptance * (1 - self.predicted_acceptance) / self.n)
        return Report([("TV(samples, p)", f"≤ {limit:.4f}", f"{tv:.4f}", ""),
                       ("draft token kept", f"{self.predicted_acceptance:.1%}", f"{self.accepted_share:.1%}", "")],
                      headline, key="sampling_check", details=[
            f"{self.n:,} speculative draws. {NOISE_BATCHES} batches of {self.n:,} exact draws from p left TV "
            f"{float(self.noise.mean()):.4f} on average, SD {float(self.noise.std()):.4f}.",
            f"The limit is that mean + {NOISE_SDS} SD: a sampler that let a few points of the draft's bias through "
            "would land outside.",
            f"The kept share is predicted by Σ min(p, q), give or take {NOISE_SDS * sd:.1%} ({NOISE_SDS} SD)."])


@torch.inference_mode()
def sampling_check(model, draft_model, prompt_ids, answer, n: int = 20_000, target_acceptance: float = 0.5,
                   seed: int = 0) -> SamplingCheck:
    """At the point of prompt + answer where the draft's Σ min(p, q) is closest to target_acceptance (so keeping
    and resampling both carry weight), draw n tokens by the speculative rule and n straight from p (T = 1)."""
    seq = list(prompt_ids) + list(answer)
    P, ids = len(prompt_ids), torch.tensor([seq], device=model.device)
    p_all = probabilities(model(ids)[0, P - 1:], 1.0).double()  # [N+1, V]
    q_all = probabilities(draft_model(ids)[0, P - 1:], 1.0).double()
    i = int((torch.minimum(p_all, q_all).sum(-1) - target_acceptance).abs().argmin())
    p, q = p_all[i].cpu(), q_all[i].cpu()
    g = torch.Generator().manual_seed(seed)
    spec, kept = speculative_first_token(p, q, n, generator=g, return_accepted=True)
    return SamplingCheck(p, q, spec, float(kept.float().mean()))


def plot_sampling_check(check: SamplingCheck, tokenizer, top: int = 12):
    import matplotlib.pyplot as plt

    order = torch.argsort(check.p, descending=True)[:top]
    x, w = torch.arange(top).float(), 0.27
    fig, ax = plt.subplots(figsize=(11, 3.4))
    for dx, values, label, color in ((-1, check.p, "target p (exact)", "black"),
                                     (0, empirical_distribution(check.speculative, check.p.numel()),
                                      f"speculative, {check.n:,} draws", "tab:green"),
                                     (1, check.q, "draft q", "tab:orange")):
        ax.bar(x + dx * w, values[order], w, label=label, color=color)
    ax.set_xticks(x, [tokenizer.token_text(int(t)) for t in order], rotation=30)
    ax.set(ylabel="probability", title="Next-token distribution at one context (temperature 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


@dataclass
class Costs:
    """Seconds of the passes speculative decoding is made of, on this machine (eager model)."""
    target_step: float  # one target decode step (1 token)
    verify: dict[int, float]  # k -> one target pass over k + 1 tokens
    draft_step: float  # one step of the shallow draft
    draft_layers: int
    draft_share: float  # the draft's share of the target's weight bytes

    def v(self, m: int) -> float:
        """A pass that checks m drafted tokens ÷ one step (m = 0: a plain step)."""
        return 1.0 if m <= 0 else self.verify[min(m, max(self.verify))] / self.target_step

    c = property(lambda self: self.draft_step / self.target_step)

    def rules(self, floor_ms: float) -> list:
        """No pass under its bandwidth floor, and no pass over several tokens cheaper than one step: it reads the
        same weights and does more. (Between two multi-token passes the order may flip: BLAS picks its kernel by the
        number of rows.)"""
        ms = self.target_step * 1e3
        return ([gates.not_below_floor(ms, floor_ms, "a target step"),
                 gates.not_below_floor(self.draft_step * 1e3, floor_ms * self.draft_share, "a draft step")]
                + [gates.not_cheaper(ms, self.verify[k] * 1e3, "one step", f"a pass over {k + 1} tokens")
                   for k in sorted(self.verify)])

    def values(self) -> dict:
        return dict(target_step_ms=self.target_step * 1e3, verify_ratio={k: self.v(k) for k in self.verify},
                    draft_cost_ratio=self.c, draft_layers=self.draft_layers)


def measure_costs(model, ks=(1, 2, 3, 4), depth: int = 8, context: int = 128, rounds: int = 9) -> Costs:
    """Time a target step, a pass over k + 1 tokens for each k, and a step of a depth-layer draft, each after a
    cached context, in interleaved rounds (a burst of load hits them all alike); each keeps its fastest time."""
    from course.engine.kv_cache import KVCache
    from course.measure.timing import Stopwatch

    def pass_fn(m, n_tokens):
        cache = KVCache(m.config, batch=1, max_seq_len=context + n_tokens, dtype=m.dtype, device=m.device)
        ids = torch.zeros(1, context + n_tokens, dtype=torch.long, device=m.device)
        with torch.inference_mode():
            m(ids[:, :context], start_pos=0, cache=cache)
        return lambda: m(ids[:, context:], start_pos=context, cache=cache)

    jobs = {0: pass_fn(model, 1), **{k: pass_fn(model, k + 1) for k in ks},
            "draft": pass_fn(shallow_copy(model, depth), 1)}
    best = dict.fromkeys(jobs, math.inf)
    with torch.inference_mode():
        for run in jobs.values():
            run()  # warm-up
        for _ in tqdm(range(rounds), desc="timing rounds", leave=False):
            for key, run in jobs.items():
                with Stopwatch(model.device) as sw:
                    run()
                best[key] = min(best[key], sw.seconds)
    # the draft reads its blocks and the output head (tied to the embedding in SmolLM2: read whatever the depth)
    share = (depth * sum(p.numel() for p in model.layers[0].parameters()) + model.output.weight.numel()) / sum(
        p.numel() for p in model.parameters())
    return Costs(best[0], {k: best[k] for k in ks}, best["draft"], depth, share)


def costs_report(run: gates.Measured, floor_ms: float) -> Report:
    c: Costs = run.value
    for key, value in c.values().items():
        record_gated(key, run, value)
    k = max(c.verify)
    ok, words = verdict(1.0, c.v(k), 0.15)
    headline = run.headline(f"A pass over {k + 1} tokens cost {c.v(k):.2f}× one step: "
                            f"{'close to free' if ok else 'not free'} here. The {c.draft_layers}-layer draft cost "
                            f"{c.c:.2f}× a target step.")
    return Report([("target step (eager)", floor_ms or None, run.shown(c.target_step * 1e3), "ms")]
                  + [(f"pass over {m + 1} tokens ÷ step", 1.0, run.shown(c.v(m)), "") for m in sorted(c.verify)]
                  + [(f"{c.draft_layers}-layer draft step ÷ step", c.draft_share, run.shown(c.c), "")],
                  headline, key="costs", details=[run.notice,
        f"Predicted: the bandwidth floor for the step, 1.0 for a pass if reading the weights were all it cost, "
        f"and the draft's share of the weight bytes ({c.draft_share:.2f}).",
        run.shown(f"Against 1.0, a pass over {k + 1} tokens was {words}.") or "",
        "Each figure is the fastest of several interleaved rounds, after a cached context of 128 tokens.",
        "A pass need not cost more than a shorter one: BLAS picks its kernel by the number of rows."])


class OracleDraft(Draft):
    """A stand-in for a well-matched draft model: it knows the target's greedy answer and proposes its next tokens,
    each one wrong with probability 1 − alpha. It runs no model; speedup_sweep charges each drafted token `cost`
    plain decode steps instead of its own (tiny) time: a simulation, from measured target passes."""

    def __init__(self, answer: list[int], alpha: float, vocab_size: int, cost: float, seed: int = 0):
        self.answer, self.alpha, self.vocab, self.cost, self.seed = list(answer), alpha, vocab_size, cost, seed
        self.name = f"simulated draft (α = {alpha:.0%}, c = {cost:.2f})"

    def reset(self, prompt_ids, capacity):
        self.start, self.rng, self.passes = len(prompt_ids), random.Random(self.seed), 0

    def propose(self, seq, k, temperature=0.0, top_k=None, top_p=None, generator=None):
        nxt = self.answer[len(seq) - self.start:][:k]  # greedy speculative output is the target's: positions match
        self.passes += len(nxt)
        return [t if self.rng.random() < self.alpha else (t + 1) % self.vocab for t in nxt], None


def _x(value: float) -> str | None:
    return f"{value:.2f}×" if value == value else None  # NaN: no prediction


def _versus(predicted: float, measured: float) -> str:
    """Verdict words against ±SPEED_TOLERANCE, or why there are none."""
    if predicted != predicted:  # NaN: the pass costs behind the prediction failed their physics gate
        return "with no prediction, as the pass costs were unreliable"
    return verdict(predicted, measured, SPEED_TOLERANCE)[1]


def simulated_report(run: gates.Measured, draft: OracleDraft, costs: Costs | None) -> Report:
    r: SweepRow = run.value[0]
    record_gated("simulated_speedup", run, r.speedup)
    formula = predicted_speedup(draft.alpha, r.k, draft.cost, costs.v(r.k)) if costs else math.nan
    said = (f"the formula said {formula:.2f}×: {_versus(formula, r.speedup)}" if costs else
            "no formula to compare, as the pass costs were unreliable")
    headline = run.headline(f"Simulated draft (α = {draft.alpha:.0%}, c = {draft.cost:.2f}, k = {r.k}): "
                            f"{r.speedup:.2f}× plain decoding; {said}.")
    return Report([("tokens per target pass", expected_tokens_per_pass(draft.alpha, r.k), r.tokens_per_pass, ""),
                   ("speedup over plain decoding", _x(formula), run.shown(_x(r.speedup)), "")], headline,
                  key="simulated", details=[run.notice,
        "Simulated, not measured whole: the target's passes are real and timed; the draft is an oracle, charged "
        f"c = {draft.cost:.2f} of a plain step per drafted token.",
        f"The formula used the pass cost measured above, v_{r.k} = {costs.v(r.k):.2f}; a GPU's would be near 1."
        if costs else "",
        "Its acceptance is random, so tokens per pass lands near the formula's, not on it."])


@dataclass
class SweepRow:
    prompt: str
    draft: str
    k: int
    acceptance_rate: float  # accepted / proposed
    tokens_per_pass: float
    speedup: float  # plain decode time ÷ speculative decode time, fastest of the rounds each
    predicted_speedup: float  # from the measured pass costs, pass by pass
    identical: bool  # output equal to plain greedy decoding


def predicted_from_costs(proposed_per_pass: list[int], emitted: int, costs: Costs | None, c: float) -> float:
    """Tokens the target passes yielded ÷ what they cost in plain steps: a pass checking m drafted tokens costs
    m draft steps (c each) + v_m; a pass with nothing drafted (prompt lookup found no match) is one plain step.
    NaN without reliable pass costs (costs None: they failed their physics gate)."""
    cost = sum(m * c + costs.v(m) for m in proposed_per_pass) if costs else 0
    return emitted / cost if cost else math.nan


def speedup_sweep(model, tasks: dict[str, list[int]], jobs: list[tuple[str, Draft, int]], costs: Costs | None,
                  n_new: int = 32, rounds: int = 2) -> list[SweepRow]:
    """Greedy decoding of each task's prompt, plainly and with each (task, draft, k) of `jobs`, timed (decode
    phase only) in interleaved rounds; every run generates n_new tokens."""
    plain, base, best, outs = {}, {}, [math.inf] * len(jobs), [None] * len(jobs)
    for _ in tqdm(range(rounds), desc="speculative runs", leave=False):
        for task, ids in tasks.items():
            g = generate(model, ids, n_new)
            plain[task], base[task] = min(plain.get(task, math.inf), g.total_time - g.time_to_first_token), g.tokens
        for i, (task, draft, k) in enumerate(jobs):
            outs[i] = speculative_generate(model, draft, tasks[task], n_new, k=k)
            s, step = outs[i].stats, plain[task] / (n_new - 1)
            charged = draft.passes * draft.cost * step - s.draft_seconds if hasattr(draft, "cost") else 0.0
            best[i] = min(best[i], s.decode_seconds + charged)
    rows = []
    for (task, draft, k), out, t in zip(jobs, outs, best):
        s, c = out.stats, (costs.c if costs and hasattr(draft, "model") else getattr(draft, "cost", 0.0))
        rows.append(SweepRow(task, s.draft_name, k, s.acceptance_rate, s.tokens_per_target_pass, plain[task] / t,
                             predicted_from_costs(s.proposed_per_pass, s.emitted, costs, c), out.tokens == base[task]))
    return rows


def sweep_rules(rows: list[SweepRow]) -> list:
    """A verify pass costs at least one plain step, so no run can beat its own tokens per pass."""
    return [gates.at_least(r.tokens_per_pass, r.speedup, f"{r.draft}'s tokens per pass", "its speedup") for r in rows]


def sweep_report(run: gates.Measured) -> Report:
    rows: list[SweepRow] = run.value
    copy = [r for r in rows if r.prompt == "copy task"]
    lookup = next(r for r in copy if r.draft.startswith("prompt lookup"))
    shallow = next(r for r in copy if r.draft.startswith("shallow"))
    record_gated("sweep", run, [r.__dict__ for r in rows])
    record("acceptance_rate", lookup.acceptance_rate)
    record("shallow_acceptance_rate", shallow.acceptance_rate)
    record_gated("spec_speedup", run, lookup.speedup)
    record_gated("shallow_speedup", run, shallow.speedup)
    headline = run.headline(f"Prompt lookup on the copy task ran {lookup.speedup:.2f}× plain decoding, "
                            f"{_versus(lookup.predicted_speedup, lookup.speedup)}. The shallow draft ran "
                            f"{shallow.speedup:.2f}×.")
    same = all(r.identical for r in rows)
    return Report([(f"{r.prompt}: {r.draft.split(' (')[0]}, k = {r.k}", _x(r.predicted_speedup),
                    run.shown(_x(r.speedup)), "") for r in rows], headline, key="sweep", details=[run.notice] + [
        f"{r.prompt}, {r.draft.split(' (')[0]}: kept {r.acceptance_rate:.0%} of its drafts, "
        f"{r.tokens_per_pass:.2f} tokens per target pass." for r in rows] + [
        "Predicted: the tokens the passes yielded ÷ what those passes cost, from the pass costs measured above.",
        "Each speedup is the fastest of its rounds, plain and speculative runs taking turns.",
        "Every run's output equals plain greedy decoding." if same else
        "A run's output differed from plain greedy decoding: a near-tie flipped in float32."])


def chat_prefix_ids(tokenizer, system: str) -> list[int]:
    """Token ids of the system turn alone: a token prefix of every chat_ids(question, system)."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False)
    return tokenizer.encode(text, add_bos=False)


@dataclass
class PrefixExperiment:
    """Each question answered twice, by full prefill and through a prefix store (the first request is a miss)."""
    prefix_tokens: int
    prompt_tokens: list[int]
    reused: list[int]  # prompt tokens whose K/V came from the store
    plain: list[float]  # time to first token, full prefill, seconds
    cached: list[float]  # time to first token through the store, seconds
    identical: bool  # every answer through the store equals its full-prefill answer
    store: PagedPrefixCache = field(repr=False)

    hits = property(lambda self: [i for i, n in enumerate(self.reused) if n])
    token_share = property(lambda self: sum(self.reused) / sum(self.prompt_tokens[i] for i in self.hits))
    saved = property(lambda self: 1 - sum(self.cached[i] for i in self.hits) / sum(self.plain[i] for i in self.hits))

    def medians_ms(self) -> tuple[float, float]:
        """Median time to first token over the hits: (full prefill, through the store), ms."""
        return tuple(statistics.median(x[i] for i in self.hits) * 1e3 for x in (self.plain, self.cached))

    def rules(self) -> list:
        """A full prefill computes every token a hit computes, and more: it cannot be the cheaper one."""
        plain, hit = self.medians_ms()
        return [gates.not_cheaper(hit, plain, "a hit", "a full prefill")]


def prefix_experiment(model, tokenizer, system: str = SYSTEM_PROMPT, questions=QUESTIONS, max_new_tokens: int = 8,
                      max_bytes: int = 256 << 20) -> PrefixExperiment:
    prefix = chat_prefix_ids(tokenizer, system)
    store, runs = PagedPrefixCache(model, max_bytes=max_bytes), []
    for question in tqdm(questions, desc="questions", leave=False):
        ids = tokenizer.chat_ids(question, system=system)
        if ids[:len(prefix)] != prefix:
            raise ValueError("the system turn does not tokenize as a prefix of the request; check the chat template")
        runs.append((len(ids), generate(model, ids, max_new_tokens, eos_id=tokenizer.eos_id),
                     generate(model, ids, max_new_tokens, prefix_cache=store, prefix_len=len(prefix),
                              eos_id=tokenizer.eos_id)))
    return PrefixExperiment(len(prefix), [n for n, _, _ in runs], [c.reused_tokens for _, _, c in runs],
                            [p.time_to_first_token for _, p, _ in runs], [c.time_to_first_token for _, _, c in runs],
                            all(p.tokens == c.tokens for _, p, c in runs), store)


def prefix_report(run: gates.Measured) -> Report:
    e: PrefixExperiment = run.value
    s, (plain, hit) = e.store.stats, e.medians_ms()
    for key, value in dict(prefix_tokens=e.prefix_tokens, prefix_identical=e.identical, prefix_hits=s.hits,
                           prefix_misses=s.misses, prefix_token_share=e.token_share).items():
        record(key, value)
    record_gated("prefix_prefill_saved", run, e.saved)
    ok, words = verdict(e.token_share, e.saved, 0.25)
    headline = run.headline(f"A hit reused {e.token_share:.0%} of its prompt's tokens and cut time to first token by "
                            f"{e.saved:.0%}: {words}.")
    return Report([("time to first token, full prefill", None, run.shown(plain), "ms"),
                   ("time to first token, a hit", plain * (1 - e.token_share), run.shown(hit), "ms"),
                   ("share of the time saved", f"{e.token_share:.0%}", run.shown(f"{e.saved:.0%}"), "")], headline,
                  key="prefix", details=[run.notice,
        f"Predicted: the time saved equals the share of prompt tokens reused ({e.prefix_tokens}-token system prompt).",
        "A hit still prefills its own question; a short suffix uses the CPU less well than a long prompt.",
        f"Reuse comes in whole {e.store.block_size}-token blocks: up to {max(e.reused)} tokens here.",
        f"The first request was the miss: {e.cached[0] * 1e3:.0f} ms through the store, "
        f"{e.plain[0] * 1e3:.0f} ms plain.",
        f"The store: {s.hits} hits, {s.misses} miss{'es' * (s.misses != 1)}, {s.bytes / 2**20:.1f} MiB held. "
        "A hit copies nothing.",
        "Every answer through the store equals its full-prefill answer." if e.identical else
        "An answer through the store differed from its full-prefill answer: a near-tie flipped."])
