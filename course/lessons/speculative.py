"""The experiments and plots behind lesson 04 (speculative decoding and prefix caching).

Each function runs one measurement on the real model and returns plain numbers, so the notebook
cells stay one or two lines and the tests can call the same code.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from course.engine.generate import generate
from course.engine.paged_prefix import PagedPrefixCache
from course.engine.sampling import probabilities
from course.engine.speculative import (Draft, empirical_distribution, expected_tokens_per_pass, shallow_copy,
                          speculative_first_token, speculative_generate, total_variation)
from course.lessons.kv_lesson import wrap
from course.lessons.wording import counted

# A text the answer must copy: the case prompt lookup is built for (edits, extraction, RAG, code).
COPY_TEXT = ("The old lighthouse on the northern cape was built in 1871. Its keeper wrote in a logbook "
             "every night: the strength of the wind, the ships that passed, the colour of the sea and "
             "the number of gulls resting on the iron rail.")
COPY_REQUEST = "Copy this paragraph exactly, word for word:\n\n" + COPY_TEXT
OPEN_REQUEST = "Write a short story about a robot who learns to paint."

# A long, stable system prompt shared by many requests: what prefix caching is for.
SYSTEM_PROMPT = """You are Quill, the help-desk assistant of the Harbour Street Public Library.
Answer the visitor's question in one or two short, friendly sentences. Use only the facts below; if the
answer is not in them, say that a librarian at the front desk will help.

Opening hours: Monday to Friday 9:00 to 19:00, Saturday 10:00 to 16:00, closed on Sunday and on public
holidays. The children's room closes one hour before the main library.

Membership: free for everyone who lives, works or studies in the city. Bring a photo ID and a proof of
address dated within the last three months. Children under 14 need a parent or guardian to sign the form.
Lost cards are replaced for 2 euros.

Borrowing: up to 12 items at a time. Books and audiobooks for three weeks, films and games for one week,
magazines for one week (the newest issue stays in the reading room). Renew up to three times online, by
phone or at the desk, unless another member has reserved the item.

Late returns: 20 cents per day for books, 50 cents per day for films and games, capped at 6 euros per item.
Children's items have no late fees. Lost or damaged items are charged at their replacement cost.

Reservations: reserve up to 8 items online. You get an email when an item is ready; it is held for 7 days
at the pick-up shelf near the entrance.

Computers and printing: 20 public computers, 2 hours per day per member, bookable online. Printing costs
10 cents per black-and-white page and 50 cents per colour page. Wi-Fi is free; the network is HarbourLib
and needs no password.

Rooms: three study rooms for 2 to 6 people, bookable for up to 3 hours, free for members. The event hall
holds 80 people and is rented through the events office.

Events: story time for children every Wednesday at 10:30, a book club on the first Thursday of each month
at 18:00, and free digital-skills classes on Saturday mornings. All events are free; some need booking.

Accessibility: step-free entrance on Quay Lane, a lift to every floor, large-print books on the ground floor
and a hearing loop at the front desk. Assistance dogs are welcome.

Food and drink: water in closed bottles is allowed everywhere; the cafe on the ground floor is open from
10:00 to 17:00. No food in the reading rooms."""

QUESTIONS = [
    "Are you open on Sunday?",
    "How many books can I borrow at once?",
    "How much does it cost to print in colour?",
    "What do I need to bring to become a member?",
    "Is there a book club?",
]


def chat_prefix_ids(tokenizer, system: str) -> list[int]:
    """Token ids of the system turn alone: a token prefix of every chat_ids(question, system)."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False)
    return tokenizer.encode(text, add_bos=False)


# ----------------------------------------------------------------------------------- 1. exactness

@dataclass
class GreedyCheck:
    base_tokens: list[int]
    tokens: dict[str, list[int]]  # draft name -> speculative output
    stats: dict[str, object]

    def identical(self, name: str) -> bool:
        return self.tokens[name] == self.base_tokens

    def first_mismatch(self, name: str) -> int | None:
        for i, (a, b) in enumerate(zip(self.tokens[name], self.base_tokens)):
            if a != b:
                return i
        return None if len(self.tokens[name]) == len(self.base_tokens) else min(len(self.tokens[name]),
                                                                                  len(self.base_tokens))


def greedy_check(model, prompt_ids, drafts: list[tuple[Draft, int]], max_new_tokens: int = 32) -> GreedyCheck:
    """Plain greedy decoding vs greedy speculative decoding with each (draft, k)."""
    base = generate(model, prompt_ids, max_new_tokens, temperature=0).tokens
    tokens, stats = {}, {}
    for draft, k in tqdm(drafts, desc="greedy speculative runs", leave=False):
        out = speculative_generate(model, draft, prompt_ids, max_new_tokens, k=k)
        tokens[draft.name], stats[draft.name] = out.tokens, out.stats
    return GreedyCheck(base, tokens, stats)


def binomial_mean_abs_deviation(n: int, p: torch.Tensor) -> torch.Tensor:
    """E|X − np| for X ~ Binomial(n, p), elementwise over p, exactly (de Moivre's closed form):

        E|X − np| = 2 m C(n, m) p^m (1 − p)^(n−m+1),  m = ⌊np⌋ + 1   (0 when m > n)

    computed in logs, so it holds for n = 20,000 and p = 1e-7 alike. The normal approximation
    sqrt(2 n p (1 − p) / π) overstates it for the many tokens with np ≪ 1, where it is about 2np.
    """
    p = p.double().clamp(0, 1)
    m = torch.floor(n * p) + 1
    ok = (m <= n) & (p > 0) & (p < 1)
    m_, p_ = torch.where(ok, m, torch.ones_like(m)), torch.where(ok, p, torch.full_like(p, 0.5))
    log = (torch.log(2 * m_) + torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64)) - torch.lgamma(m_ + 1)
           - torch.lgamma(n - m_ + 1) + m_ * torch.log(p_) + (n - m_ + 1) * torch.log1p(-p_))
    return torch.where(ok, log.exp(), torch.zeros_like(p))


def exact_draw_tvs(p: torch.Tensor, n: int, batches: int, seed: int = 1) -> torch.Tensor:
    """TV(histogram of n exact draws from p, p) for `batches` independent batches: the noise's spread. [batches]"""
    g = torch.Generator(device=p.device).manual_seed(seed)
    V = p.numel()
    return torch.tensor([total_variation(empirical_distribution(torch.multinomial(p, n, replacement=True,
                                                                                  generator=g), V), p)
                         for _ in range(batches)], dtype=torch.float64)


# The verdict passes up to the exact draws' mean TV + 4 SDs of it. The TV of exact draws is right-skewed (skewness
# ~0.4), so its false-alarm rate is nearer 1 in 1,000-2,000 than the 1 in 30,000 a normal tail would give.
NOISE_SDS = 4
NOISE_BATCHES = 300  # simulated batches of exact draws that give the noise's SD (30 let the limit move by ±3%)


@dataclass
class SamplingCheck:
    """Next-token samples at one fixed context: speculative vs the target's own sampler."""
    p: torch.Tensor  # [V] target distribution
    q: torch.Tensor  # [V] draft distribution
    speculative: torch.Tensor  # [n] tokens from speculative sampling
    direct: torch.Tensor  # [n] tokens drawn from p directly
    temperature: float
    accepted_share: float  # share of the n speculative draws that kept the draft's token
    context: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.speculative.numel()

    @property
    def tv_speculative(self) -> float:
        """TV(empirical speculative histogram, p): sampling noise only, if the method is exact."""
        return total_variation(empirical_distribution(self.speculative, self.p.numel()), self.p)

    @property
    def tv_direct(self) -> float:
        """TV(empirical histogram of n direct draws from p, p): one draw of the noise floor for n samples."""
        return total_variation(empirical_distribution(self.direct, self.p.numel()), self.p)

    @property
    def expected_noise_tv(self) -> float:
        """E[TV] of n exact draws from p, exactly: ½ Σ_x E|count(x) − n p(x)| / n, each count binomial."""
        return float(0.5 * binomial_mean_abs_deviation(self.n, self.p).sum() / self.n)

    @functools.cached_property
    def noise_tvs(self) -> torch.Tensor:
        """TVs of NOISE_BATCHES simulated batches of n exact draws from p (a fixed seed: the same every run)."""
        return exact_draw_tvs(self.p, self.n, NOISE_BATCHES)

    @property
    def noise_sd(self) -> float:
        return float(self.noise_tvs.std())

    @property
    def noise_limit(self) -> float:
        """The largest TV exact sampling plausibly leaves: mean + NOISE_SDS standard deviations."""
        return self.expected_noise_tv + NOISE_SDS * self.noise_sd

    @property
    def within_noise(self) -> bool:
        return self.tv_speculative <= self.noise_limit

    @property
    def tv_draft(self) -> float:
        """TV(q, p): how far off we would be if we simply kept the draft's tokens."""
        return total_variation(self.q, self.p)

    @property
    def predicted_acceptance(self) -> float:
        """P(first draft token kept) = Σ_x min(p(x), q(x)) = 1 − TV(p, q)."""
        return float(torch.minimum(self.p, self.q).sum())

    @property
    def accepted_sd(self) -> float:
        """Binomial SD of the kept share over n draws, if the keep rate is Σ min(p, q)."""
        a = self.predicted_acceptance
        return math.sqrt(a * (1 - a) / self.n)

    @property
    def accepted_within(self) -> bool:
        return abs(self.accepted_share - self.predicted_acceptance) <= NOISE_SDS * max(self.accepted_sd, 1e-12)

    def sentences(self) -> list[str]:
        """The check's numbers and its verdict, every word chosen by the values."""
        tv, mean, sd, limit = self.tv_speculative, self.expected_noise_tv, self.noise_sd, self.noise_limit
        near = ("as close to p as exact sampling's" if self.within_noise else
                f"FARTHER from p than exact sampling leaves ({tv:.4f} > {limit:.4f})")
        gap = abs(self.accepted_share - self.predicted_acceptance) * 100  # percentage points
        return [wrap(line) for line in [
            f"TV(speculative samples, p) = {tv:.4f}   TV({self.n:,} direct draws from p, p) = {self.tv_direct:.4f}",
            f"exact sampling's noise for n = {self.n:,}: mean {mean:.4f} (exact, from the binomial per token), "
            f"SD {sd:.4f} (over {self.noise_tvs.numel()} simulated batches of exact draws)",
            f"The draft alone is {self.tv_draft:.2f} away from p; the speculative histogram is {near}.",
            f"Draft token kept in {self.accepted_share:.1%} of the draws; predicted Σ min(p, q) = 1 − TV(p, q) = "
            f"{self.predicted_acceptance:.1%} (one SD over {self.n:,} draws: {self.accepted_sd:.1%})",
            "verdict: speculative samples are " + ("within" if self.within_noise else "OUTSIDE") +
            f" the noise of exact sampling (TV {tv:.4f} {'≤' if self.within_noise else '>'} mean + {NOISE_SDS} SD "
            f"= {limit:.4f}); the kept share is off its prediction by {gap:.2f} percentage points, "
            + ("within" if self.accepted_within else "OUTSIDE")
            + f" {NOISE_SDS} SD ({NOISE_SDS * self.accepted_sd * 100:.1f} points)",
        ]]


@torch.inference_mode()
def pick_context(model, draft_model, prompt_ids, continuation, temperature: float = 1.0,
                 target_acceptance: float = 0.5) -> list[int]:
    """The prefix of prompt + continuation after which the draft's acceptance Σ min(p, q) is closest to
    target_acceptance: a context where both branches of the rule (keep, resample) matter."""
    seq = list(prompt_ids) + list(continuation)
    ids = torch.tensor([seq], device=model.device)
    P = len(prompt_ids)
    p = probabilities(model(ids)[0, P - 1:], temperature)  # [N+1, V]
    q = probabilities(draft_model(ids)[0, P - 1:], temperature)
    overlap = torch.minimum(p, q).sum(-1)  # [N+1]
    i = int((overlap - target_acceptance).abs().argmin())
    return seq[:P + i]


@torch.inference_mode()
def sampling_check(model, draft_model, context_ids, temperature: float = 1.0, n: int = 20_000,
                   seed: int = 0) -> SamplingCheck:
    """Run target and draft once at the context, then draw n speculative and n direct samples."""
    ids = torch.tensor([list(context_ids)], device=model.device)
    p = probabilities(model(ids, last_only=True)[0], temperature).double()  # [V]
    q = probabilities(draft_model(ids, last_only=True)[0], temperature).double()
    g = torch.Generator(device=p.device).manual_seed(seed)
    spec, accepted = speculative_first_token(p, q, n, generator=g, return_accepted=True)
    direct = torch.multinomial(p, n, replacement=True, generator=g)
    return SamplingCheck(p.cpu(), q.cpu(), spec.cpu(), direct.cpu(), temperature,
                         accepted_share=float(accepted.float().mean()), context=list(context_ids))


def plot_sampling_check(check: SamplingCheck, tokenizer, top: int = 12):
    import matplotlib.pyplot as plt

    V = check.p.numel()
    order = torch.argsort(check.p, descending=True)[:top]
    spec = empirical_distribution(check.speculative, V)[order]
    direct = empirical_distribution(check.direct, V)[order]
    x = torch.arange(top).float()
    fig, ax = plt.subplots(figsize=(11, 3.4))
    w = 0.2
    ax.bar(x - 1.5 * w, check.p[order], w, label="target p (exact)", color="black")
    ax.bar(x - 0.5 * w, spec, w, label=f"speculative, {check.n:,} draws", color="tab:green")
    ax.bar(x + 0.5 * w, direct, w, label=f"target sampler, {check.n:,} draws", color="tab:blue")
    ax.bar(x + 1.5 * w, check.q[order], w, label="draft q", color="tab:orange", alpha=0.7)
    ax.set_xticks(x, [tokenizer.token_text(int(t)) for t in order], rotation=30)
    ax.set_ylabel("probability")
    ax.set_title(f"Next-token distribution at one context (T={check.temperature}): "
                 f"TV speculative {check.tv_speculative:.3f}, direct {check.tv_direct:.3f}, draft {check.tv_draft:.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------- 2. the economics

@dataclass
class DepthRow:
    n_layers: int
    greedy_agreement: float  # P(draft argmax == target argmax) along the target's greedy path
    sampled_acceptance: float  # mean Σ min(p, q) at temperature 1 along the same path
    bytes_share: float  # weights read by one draft pass / one target pass (the bandwidth model)


@torch.inference_mode()
def draft_depth_curve(model, prompt_ids, continuation, depths) -> list[DepthRow]:
    """How often each shallow draft agrees with the target, teacher-forced along one sequence.

    One forward pass per depth over prompt + continuation: at every generated position, compare the
    draft's next-token choice with the target's. That per-token agreement α is what speculative
    decoding's acceptance test sees whenever the earlier drafts in the round were right.
    """
    seq = torch.tensor([list(prompt_ids) + list(continuation)], device=model.device)
    P = len(prompt_ids)
    p = model(seq)[0, P - 1:-1].softmax(-1)  # [N, V] target at each generated position
    cfg = model.config
    per_layer = sum(t.numel() for t in model.layers[0].parameters())
    head = model.output.weight.numel()
    rows = []
    for n in tqdm(depths, desc="shallow drafts", leave=False):
        q = shallow_copy(model, n)(seq)[0, P - 1:-1].softmax(-1)
        rows.append(DepthRow(
            n_layers=n,
            greedy_agreement=float((q.argmax(-1) == p.argmax(-1)).float().mean()),
            sampled_acceptance=float(torch.minimum(p, q).sum(-1).mean()),
            bytes_share=(n * per_layer + head) / (cfg.n_layers * per_layer + head)))
    return rows


@dataclass
class Costs:
    """Seconds of the passes speculative decoding is made of, on this machine."""
    target_step: float  # one target decode step (1 token)
    verify: dict[int, float]  # k -> one target pass over k + 1 tokens
    draft_step: dict[int, float]  # draft depth -> one draft decode step

    def verify_ratio(self, k: int) -> float:
        return self.verify[k] / self.target_step

    def monotone(self) -> bool:
        """Whether the measured v_k never fall as k grows (a longer pass does no less work)."""
        v = [self.verify_ratio(k) for k in sorted(self.verify)]
        return all(b >= a for a, b in zip(v, v[1:]))

    def verify_line(self) -> tuple[float, float]:
        """(a, b) of the least-squares line v_k = a + b·k through the measured v_k, with b ≥ 0 (a longer pass
        does no less work; a falling fit is noise, and the best flat line is the mean). One outlier moves a
        line over all the k far less than it moves a fit that must pass near every point."""
        ks = sorted(self.verify)
        vs = [self.verify_ratio(k) for k in ks]
        mk, mv = sum(ks) / len(ks), sum(vs) / len(vs)
        var = sum((k - mk) ** 2 for k in ks)
        b = max(0.0, sum((k - mk) * (v - mv) for k, v in zip(ks, vs)) / var) if var else 0.0
        return mv - b * mk, b

    def verify_fit(self, m: int) -> float:
        """v_m from the least-squares line over the measured v_k (at least 1): the cost of a pass that checks
        m drafted tokens. m = 0 is a pass over the last token alone, one plain step: 1 by definition."""
        if m <= 0:
            return 1.0
        a, b = self.verify_line()
        return max(1.0, a + b * m)

    def noise_note(self) -> str:
        """A sentence when the measured v_k are not monotone in k (timing noise), else ''."""
        if self.monotone():
            return ""
        ks = sorted(self.verify)
        drops = [(a, b) for a, b in zip(ks, ks[1:]) if self.verify_ratio(b) < self.verify_ratio(a)]
        a, b = drops[0]
        line_a, line_b = self.verify_line()
        line = (f"v_k = {line_a:.2f} + {line_b:.3f}·k" if line_b > 0 else
                f"flat at their mean, {line_a:.2f}, as the best line through them falls")
        return (f"Timing noise: a longer pass cannot cost less, yet v_{b} = {self.verify_ratio(b):.2f} < "
                f"v_{a} = {self.verify_ratio(a):.2f}. The predictions below use the least-squares line through all "
                f"the measured v_k instead ({line}): " +
                ", ".join(f"k={k}: {self.verify_fit(k):.2f}" for k in ks) + ".")

    def draft_ratio(self, n_layers: int) -> float:
        return self.draft_step[n_layers] / self.target_step


def draft_weight_share(model, n_layers: int) -> float:
    """Share of the target's weights a shallow draft of n_layers blocks reads per step: its blocks and the
    output head (tied to the embedding in SmolLM2, so read by every step whatever the depth)."""
    block = sum(p.numel() for p in model.layers[0].parameters())
    return (n_layers * block + model.output.weight.numel()) / sum(p.numel() for p in model.parameters())


def cost_sentences(costs: Costs, model, n_layers: int) -> list[str]:
    """What the measured pass costs say, on this device: is a (k+1)-token pass nearly free, is the draft cheap."""
    where = {"cpu": "on this CPU", "cuda": "on this GPU"}.get(torch.device(model.device).type, f"on {model.device}")
    k = max(costs.verify)
    v, c = costs.verify_ratio(k), costs.draft_ratio(n_layers)
    params = sum(p.numel() for p in model.parameters())
    head = model.output.weight
    share = draft_weight_share(model, n_layers)
    verify = (f"A pass over k + 1 = {k + 1} tokens cost {v:.2f}× one step {where}: " + (
        "not free. One row goes through a matrix-vector kernel that streams the weights once, several rows through "
        "a matrix-matrix kernel with more overhead per call, although the extra arithmetic is tiny "
        f"(2 · {params / 1e6:.0f} M FLOPs per token)." if v > 1.15 else
        "close to free, as the cost model hopes: reading the weights once serves all of them."))
    draft = (f"The shallow draft's step cost {c:.2f}× the target's; its weights predict {share:.2f} "
             f"({n_layers} block{'s' * (n_layers != 1)} + the {head.shape[0]:,} × {head.shape[1]:,} output head, "
             f"{head.numel() / 1e6:.0f} M of the {params / 1e6:.0f} M parameters, read by every draft step "
             "whatever its depth)" + (": the draft is not cheap here." if c > 0.5 else
                                      ": cheap enough to leave room for a speedup."))
    return [verify, draft]


def measure_costs(model, ks, depths, context: int = 128, repeats: int = 5) -> Costs:
    """Time a target step, a verification pass for each k, and a draft step for each depth.

    The passes are timed in interleaved rounds and each keeps its fastest time, so a burst of load
    from other programs hits all of them alike instead of inflating one ratio.
    """
    from course.engine.kv_cache import KVCache
    from course.measure.timing import Stopwatch

    def pass_fn(m, n_tokens):
        cache = KVCache(m.config, batch=1, max_seq_len=context + n_tokens, dtype=m.dtype, device=m.device)
        ids = torch.zeros(1, context + n_tokens, dtype=torch.long, device=m.device)
        with torch.inference_mode():
            m(ids[:, :context], start_pos=0, cache=cache)  # the context, cached once

        def run():
            with torch.inference_mode():
                m(ids[:, context:], start_pos=context, cache=cache)
        return run

    from course.measure.display import working

    with working(f"Caching a {context}-token context, then timing one target step, {len(ks)} verification passes "
                 f"and {counted(len(depths), 'draft step')} in {repeats} interleaved rounds",
                 "several seconds on a 2-core CPU"):
        jobs = {("t", 1): pass_fn(model, 1)}
        jobs.update({("v", k): pass_fn(model, k + 1) for k in ks})
        jobs.update({("d", n): pass_fn(shallow_copy(model, n), 1) for n in depths})
        best = {key: float("inf") for key in jobs}
        for run in tqdm(jobs.values(), desc="warm-up passes", unit="pass", leave=False):
            run()  # warm-up
        for _ in tqdm(range(repeats), desc="timing rounds", unit="round", leave=False):
            for key, run in jobs.items():
                with Stopwatch(model.device) as sw:
                    run()
                best[key] = min(best[key], sw.seconds)
    return Costs(target_step=best[("t", 1)], verify={k: best[("v", k)] for k in ks},
                 draft_step={n: best[("d", n)] for n in depths})


@dataclass
class SweepRow:
    draft: str
    k: int
    acceptance_rate: float  # accepted / proposed
    agreement: float  # accepted / (accepted + rejections): the per-token α
    tokens_per_pass: float
    decode_seconds: float
    baseline_decode_seconds: float
    identical: bool  # output equal to plain greedy decoding
    proposal_share: float = float("nan")  # share of target passes that had at least one draft token to check
    predicted_speedup: float = float("nan")
    passes_by_drafted: dict[int, int] = field(default_factory=dict)  # m drafted tokens -> target passes with m
    emitted: int = 0  # tokens the target passes produced (accepted drafts + one of the target's own per pass)

    @property
    def speedup(self) -> float:
        return self.baseline_decode_seconds / self.decode_seconds


@dataclass
class DraftSweep:
    """Speculative decoding at several k for several drafts, on one prompt, against plain greedy decoding."""
    prompt: str
    baseline_decode_seconds: float
    baseline_tokens: list[int]
    rows: list[SweepRow] = field(default_factory=list)

    def best(self) -> SweepRow:
        return max(self.rows, key=lambda r: r.speedup)

    def row(self, draft_prefix: str, k: int) -> SweepRow:
        return next(r for r in self.rows if r.draft.startswith(draft_prefix) and r.k == k)


def speedup_sweep(model, prompt_ids, drafts: list[tuple[Draft, list[int]]], max_new_tokens: int = 32,
                  repeats: int = 1, costs: Costs | None = None, name: str = "") -> DraftSweep:
    """Greedy decode the same prompt plainly and with each (draft, k); time the decode phase.

    EOS is ignored so every run produces exactly max_new_tokens. The runs go in interleaved rounds (plain
    decoding, then every (draft, k), once per round), so a burst of load from other programs hits the
    baseline and the speculative runs alike; each timing is the fastest of its repeats.
    """
    jobs = [(d, k) for d, ks in drafts for k in ks]
    base_times, base_tokens = [], None
    times: list[list[float]] = [[] for _ in jobs]
    outs: list = [None] * len(jobs)
    bar = tqdm(total=repeats * (len(jobs) + 1), desc=f"speculative sweep {name}".strip(), unit="run", leave=False)
    for _ in range(repeats):
        g = generate(model, prompt_ids, max_new_tokens, temperature=0)
        base_times.append(g.total_time - g.time_to_first_token)
        base_tokens = g.tokens
        bar.update()
        for i, (draft, k) in enumerate(jobs):
            outs[i] = speculative_generate(model, draft, prompt_ids, max_new_tokens, k=k)
            times[i].append(outs[i].stats.decode_seconds)
            bar.update()
    bar.close()
    sweep = DraftSweep(prompt=name, baseline_decode_seconds=min(base_times), baseline_tokens=base_tokens)
    for (draft, k), out, t in zip(jobs, outs, times):
        s = out.stats
        row = SweepRow(draft=s.draft_name, k=k, acceptance_rate=s.acceptance_rate, agreement=s.agreement,
                       tokens_per_pass=s.tokens_per_target_pass, decode_seconds=min(t),
                       baseline_decode_seconds=sweep.baseline_decode_seconds, identical=out.tokens == base_tokens,
                       proposal_share=sum(n > 0 for n in s.proposed_per_pass) / max(1, s.target_passes),
                       passes_by_drafted=dict(Counter(s.proposed_per_pass)), emitted=s.emitted)
        if costs is not None:
            row.predicted_speedup = predicted_from_costs(row, costs, draft)
        sweep.rows.append(row)
    return sweep


def predicted_from_costs(row: SweepRow, costs: Costs, draft: Draft) -> float:
    """Tokens the target passes yielded ÷ what those passes cost, in target-step units, pass by pass:
    a pass that checks m drafted tokens costs m draft steps + v_m (from Costs.verify_fit, the least-squares
    line through the measured v_k); a pass with nothing drafted (prompt lookup found no match) is one plain step."""
    cfg = getattr(getattr(draft, "model", None), "config", None)
    c = costs.draft_ratio(cfg.n_layers) if cfg is not None and cfg.n_layers in costs.draft_step else 0.0
    cost = sum(n * (m * c + costs.verify_fit(m)) for m, n in row.passes_by_drafted.items())
    if not cost:
        return float("nan")
    return row.emitted / cost


def plot_sweep(sweeps: list[DraftSweep]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for sweep in sweeps:
        for name in dict.fromkeys(r.draft for r in sweep.rows):
            rows = [r for r in sweep.rows if r.draft == name]
            label = f"{name} · {sweep.prompt}"
            ks = [r.k for r in rows]
            axes[0].plot(ks, [r.tokens_per_pass for r in rows], "o-", label=label)
            line, = axes[1].plot(ks, [r.speedup for r in rows], "o-", label=label)
            if any(r.predicted_speedup == r.predicted_speedup for r in rows):
                axes[1].plot(ks, [r.predicted_speedup for r in rows], "x--", color=line.get_color(), alpha=0.6)
    axes[0].set(xlabel="k (draft tokens per target pass)", ylabel="tokens per target pass",
                title="What one target pass yields")
    axes[1].axhline(1.0, color="gray", lw=1)
    axes[1].set(xlabel="k", ylabel="decode speedup vs plain (×)", title="Wall clock (o measured, x predicted)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_depth_curve(rows: list[DepthRow], costs: Costs | None = None, k: int = 4):
    """Agreement vs depth, and the best speedup each depth could give by the formula."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    n = [r.n_layers for r in rows]
    ax.plot(n, [r.greedy_agreement for r in rows], "o-", label="greedy agreement α")
    ax.plot(n, [r.sampled_acceptance for r in rows], "s-", label="sampling acceptance Σmin(p,q), T=1")
    ax.plot(n, [r.bytes_share for r in rows], "--", color="gray", label="draft cost ÷ target (weight bytes)")
    ax.set(xlabel="draft depth (first N of 30 layers)", ylim=(0, 1.02), ylabel="share")
    ax.set_title("Shallow SmolLM2 drafts: agreement with the full model vs cost")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def best_predicted_speedup(alpha: float, draft_cost: float, verify_ratio: dict[int, float]) -> tuple[int, float]:
    """(k, predicted speedup) for the k ≥ 1 that maximises E[tokens per pass] / (k · draft_cost + v_k).
    A result below 1 means no k pays: plain decoding is faster."""
    alpha = min(max(alpha, 0.0), 1.0)
    options = [(k, expected_tokens_per_pass(alpha, k) / (k * draft_cost + v))
               for k, v in verify_ratio.items() if k >= 1]
    return max(options, key=lambda kv: kv[1])


# -------------------------------------------------------------------------------- 3. prefix caching

@dataclass
class PrefixRow:
    question: str
    prompt_tokens: int
    reused_tokens: int
    ttft_plain: float  # seconds, full prefill
    ttft_cached: float  # seconds, through the prefix store
    identical: bool

    @property
    def saved(self) -> float:
        return 1 - self.ttft_cached / self.ttft_plain


@dataclass
class MissCheck:
    """Where a miss's time goes: the first request's prompt timed again, side by side (seconds to first token)."""
    plain: float  # full prefill into a contiguous cache
    fresh_miss: float  # the first miss through a new store (a fresh pool)
    warm_miss: float  # a second miss through that store (same length, matching no cached block)


@dataclass
class PrefixExperiment:
    prefix_tokens: int
    entry_bytes: int
    rows: list[PrefixRow]
    store: PagedPrefixCache
    miss_check: MissCheck | None = None

    @property
    def hits(self) -> list[PrefixRow]:
        return [r for r in self.rows if r.reused_tokens > 0]

    @property
    def token_share_reused(self) -> float:
        hits = self.hits
        return sum(r.reused_tokens for r in hits) / sum(r.prompt_tokens for r in hits)

    @property
    def time_share_saved(self) -> float:
        """1 − Σ TTFT with reuse / Σ TTFT without, over the requests that hit the store."""
        hits = self.hits
        return 1 - sum(r.ttft_cached for r in hits) / sum(r.ttft_plain for r in hits)


def prefix_experiment(model, tokenizer, system: str = SYSTEM_PROMPT, questions=QUESTIONS, max_new_tokens: int = 12,
                      max_bytes: int = 256 << 20) -> PrefixExperiment:
    """Answer each question with and without a prefix store holding the system prompt's K/V.

    The first request through the store is a miss (it computes and stores the prefix); the rest hit.
    """
    prefix = chat_prefix_ids(tokenizer, system)
    store = PagedPrefixCache(model, max_bytes=max_bytes)  # shared blocks, nothing copied
    rows = []
    from course.measure.display import working

    with working(f"Answering {len(questions)} questions twice each ({len(prefix)}-token system prompt, "
                 f"{max_new_tokens} new tokens): full prefill, then through the prefix store; then the first request's "
                 "miss timed again",
                 "under a minute on a 2-core CPU"):
        for question in tqdm(questions, desc="questions answered", unit="question", leave=False):
            ids = tokenizer.chat_ids(question, system=system)
            if ids[:len(prefix)] != prefix:
                raise ValueError("the system turn does not tokenize as a prefix of the request; check the chat "
                                 "template")
            plain = generate(model, ids, max_new_tokens, eos_id=tokenizer.eos_id)
            cached = generate(model, ids, max_new_tokens, prefix_cache=store, prefix_len=len(prefix),
                              eos_id=tokenizer.eos_id)
            rows.append(PrefixRow(question, len(ids), cached.reused_tokens, plain.time_to_first_token,
                                  cached.time_to_first_token, plain.tokens == cached.tokens))
        # the first request again, to see where a miss's time goes: plain, a miss through a new store, then a
        # second miss through that store (its first token moved to the end: same length, no block matches)
        ids = tokenizer.chat_ids(questions[0], system=system)
        fresh = PagedPrefixCache(model, max_bytes=max_bytes)
        check = MissCheck(*(generate(model, i, 1, eos_id=tokenizer.eos_id, **kw).time_to_first_token for i, kw in
                            ((ids, {}), (ids, dict(prefix_cache=fresh, prefix_len=len(prefix))),
                             (ids[1:] + ids[:1], dict(prefix_cache=fresh)))))
    return PrefixExperiment(len(prefix), store.entry_bytes(len(prefix)), rows, store, check)


def plot_prefix(exp: PrefixExperiment):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = torch.arange(len(exp.rows)).float()
    ax.bar(x - 0.2, [r.ttft_plain * 1e3 for r in exp.rows], 0.4, label="full prefill", color="tab:blue")
    hit = [r.reused_tokens > 0 for r in exp.rows]
    for is_hit, label, style in ((True, "through the store, a hit: K/V reused", dict(color="tab:orange")),
                                 (False, "through the store, a miss: computes and stores the prefix",
                                  dict(color="lightgray", edgecolor="dimgray", hatch="//"))):
        xs = [float(i) + 0.2 for i, h in enumerate(hit) if h == is_hit]
        if xs:
            ax.bar(xs, [r.ttft_cached * 1e3 for r, h in zip(exp.rows, hit) if h == is_hit], 0.4, label=label, **style)
    ax.set_xticks(x, [f"#{i + 1}" + (" (miss)" if r.reused_tokens == 0 else f" (reused {r.reused_tokens})")
                      for i, r in enumerate(exp.rows)])
    bs = exp.store.block_size
    ax.set(ylabel="time to first token (ms)",
           title=f"{exp.prefix_tokens}-token system prompt, {len(exp.rows)} requests; "
                 f"reuse in whole {bs}-token blocks")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
