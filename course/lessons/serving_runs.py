"""Lesson 05, the serving half, on the course model with course.engine.paged and course.engine.serving: the paged
cache (exact, and the bytes it reserves on a mix of requests), continuous against static batching on one trace (every
output checked against its solo run), and a system prompt's blocks shared between requests; each timed run gated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import yaml

from course.engine.generate import decode_one_token, prefill
from course.engine.kv_cache import KVCache
from course.engine.paged import PagedKVCache
from course.engine.serving import Request, ServeResult, make_trace, memory_on_mix, serve, solo_outputs
from course.measure import gates
from course.measure.costs import MiB
from course.measure.display import Printed, Report, verdict
from course.measure.results import record, record_gated

PROMPTS = yaml.safe_load((Path(__file__).parent / "prompts.yaml").read_text(encoding="utf-8"))
SYSTEM_PROMPT, QUESTIONS = PROMPTS["short_system_prompt"], PROMPTS["short_questions"]  # lesson 04's is longer
BATCHING_TOLERANCE = 0.3  # continuous ÷ static throughput against its prediction from the iteration counts
SHARING_TOLERANCE = 0.5  # time to first token saved against the share of prompt tokens shared (queueing blurs it)


@torch.inference_mode()
def paged_vs_contiguous(model, prompt_ids: Sequence[int], n_decode: int = 8, block_size: int = 16) -> dict:
    """Prefill `prompt_ids` and decode n_decode greedy tokens through a PagedKVCache and through a KVCache:
    the largest |logit difference| over every step, whether the greedy tokens agree, and the blocks used."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    T = ids.shape[1]
    contiguous = KVCache(model.config, batch=1, max_seq_len=T + n_decode, dtype=model.dtype, device=model.device)
    paged = PagedKVCache(model.config, -(-(T + n_decode) // block_size), block_size, model.dtype, model.device)
    paged.add_sequence(0)
    view = paged.sequence(0)
    a, b = prefill(model, ids, contiguous), prefill(model, ids, view)
    diffs, tokens_a, tokens_b = [(a - b).abs().max().item()], [], []
    for i in range(n_decode):
        ta, tb = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
        tokens_a.append(int(ta)), tokens_b.append(int(tb))
        a, b = decode_one_token(model, ta, T + i, contiguous), decode_one_token(model, tb, T + i, view)
        diffs.append((a - b).abs().max().item())
    return dict(max_logit_diff=max(diffs), same_tokens=tokens_a == tokens_b, tokens=T + n_decode,
                blocks=len(paged.block_table(0)), block_size=block_size, table=paged.block_table(0))


def mix_requests(n_requests: int = 64, max_seq_len: int = 2048, seed: int = 0) -> list[Request]:
    """A chat-like mix: log-normal prompt (median 300 tokens) and answer (median 200) lengths, a long tail as
    published serving traces show, capped at max_seq_len. Only a request's full length matters for memory: each is a
    one-token prompt and max_new_tokens the rest."""
    rng = np.random.default_rng(seed)
    prompts, answers = rng.lognormal(math.log(300), 1.0, n_requests), rng.lognormal(math.log(200), 0.8, n_requests)
    return [Request(i, (1,), max(1, int(n) - 1)) for i, n in enumerate(np.clip(np.round(prompts + answers), 2,
                                                                                max_seq_len))]


@dataclass(repr=False)  # shown as its __str__ (course.measure.display.Printed)
class MixMemory(Printed):
    used_bytes: int  # what the tokens of the whole mix hold
    paged_bytes: int  # the blocks a PagedKVCache's allocator hands out for them
    preallocated_bytes: int  # one max_seq_len row each
    block_size: int
    max_seq_len: int
    n_requests: int
    budget_bytes: int
    paged_requests: int  # of the mix, in order, at full length, in a pool of budget_bytes
    preallocated_requests: int

    paged_waste = property(lambda self: 1 - self.used_bytes / self.paged_bytes)  # the last blocks' empty tails
    preallocated_waste = property(lambda self: 1 - self.used_bytes / self.preallocated_bytes)

    def __str__(self) -> str:
        return (f"{self.n_requests} requests, every one at its full length:\n"
                f"  used by the tokens               {self.used_bytes / MiB:8.1f} MiB\n"
                f"  paged ({self.block_size}-token blocks)          {self.paged_bytes / MiB:8.1f} MiB, "
                f"{self.paged_waste:.1%} of it empty\n"
                f"  preallocated ({self.max_seq_len:,}-token slots)  {self.preallocated_bytes / MiB:8.1f} MiB, "
                f"{self.preallocated_waste:.0%} of it empty\n"
                f"A {self.budget_bytes / MiB:.0f} MiB pool holds {self.paged_requests} of them paged, "
                f"{self.preallocated_requests} as preallocated slots.")


def mix_memory(config, requests: Sequence[Request], budget_bytes: int = 256 * MiB, block_size: int = 16,
               max_seq_len: int = 2048, dtype: torch.dtype = torch.float32) -> MixMemory:
    """Bytes a real PagedKVCache's allocator hands out for the mix against a KVCache with one max_seq_len row each;
    and how many of the mix's requests, in order, fit a budget_bytes pool each way."""
    m = memory_on_mix(config, requests, block_size=block_size, max_seq_len=max_seq_len, dtype=dtype)
    blocks = PagedKVCache.for_budget(config, budget_bytes, block_size, dtype, device="meta").allocator.num_blocks
    need = np.cumsum([-(-r.max_len // block_size) for r in requests])
    per_row = m["preallocated"] // len(requests)
    out = MixMemory(m["used"], m["paged"], m["preallocated"], block_size, max_seq_len, len(requests), budget_bytes,
                    int((need <= blocks).sum()), int(budget_bytes // per_row))
    record("mix_bytes", dict(paged_over_used=out.paged_bytes / out.used_bytes, paged_waste=out.paged_waste,
                             preallocated_over_used=out.preallocated_bytes / out.used_bytes,
                             preallocated_waste=out.preallocated_waste))
    record("budget_fit", dict(paged_requests=out.paged_requests, preallocated_requests=out.preallocated_requests))
    return out


def pool_example(config, block_size: int = 4, num_blocks: int = 24, seed: int = 0) -> PagedKVCache:
    """A small pool worth drawing (meta device): A, B and C share a two-block system prompt, D′ is a fork of D (a
    second sample of one prompt) that copied its half-filled last block on write, E finished and gave its blocks
    back."""
    cache = PagedKVCache(config, num_blocks, block_size, device="meta")
    system = list(range(100, 100 + 2 * block_size))
    rng = np.random.default_rng(seed)
    for seq, n_own in (("A", 5), ("B", 2), ("C", 9)):
        prompt = system + [int(t) for t in rng.integers(200, 300, n_own)]
        cached = cache.add_sequence(seq, prompt)
        cache.append([seq], [prompt[cached:]])
    cache.add_sequence("D")
    cache.append(["D"], n_new=6)
    cache.fork("D", "D'")
    cache.append(["D'"], [[1, 2, 3]])
    cache.add_sequence("E")
    cache.append(["E"], n_new=7)
    cache.free_sequence("E")
    return cache


def plot_pool(cache: PagedKVCache):
    """Left: each sequence's block table. Right: the pool, one square per block, coloured by holder; a shared block
    is hatched with its reference count; the shading shows how many of its slots are written."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    picture, seqs = cache.pool_picture(), list(cache.sequences)
    colors = dict(zip(seqs, plt.cm.tab10.colors))
    cols = min(12, len(picture))
    rows = math.ceil(len(picture) / cols)
    fig, (tables, pool) = plt.subplots(1, 2, figsize=(11, max(2.6, 0.5 * max(len(seqs), rows) + 1.2)),
                                       gridspec_kw={"width_ratios": [1, 1.6]})
    for i, seq in enumerate(seqs):
        tables.text(0, -i, f"{seq}: {cache.length(seq)} tokens → blocks {cache.block_table(seq)}", fontsize=9,
                    color=colors[seq], va="center", family="monospace")
    tables.set(xlim=(0, 1), ylim=(-max(len(seqs), rows) + 0.5, 0.5), title="block tables (token order)")
    tables.axis("off")
    for cell in picture:
        b, holders = cell["block"], cell["holders"]
        x, y = b % cols, -(b // cols)
        pool.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor="white", edgecolor="black", lw=0.6))
        if holders:
            pool.add_patch(Rectangle((x, y), 0.92 * cell["filled"] / cache.block_size, 0.92, alpha=0.85, lw=0,
                                     facecolor=colors[holders[0]], hatch="///" if cell["ref_count"] > 1 else None))
        pool.text(x + 0.46, y + 0.46, f"{b}" + (f"\n×{cell['ref_count']}" if cell["ref_count"] > 1 else ""),
                  ha="center", va="center", fontsize=7, color="black" if holders else "#999999")
    pool.set(xlim=(-0.1, cols), ylim=(-rows + 0.9, 1), aspect="equal")
    pool.set_title(f"the pool: {cache.allocator.num_free} of {cache.allocator.num_blocks} blocks free (white);\n"
                   "hatched: shared, ×n its reference count; shading: slots written", fontsize=9)
    pool.axis("off")
    fig.tight_layout()
    return fig


def lesson_trace(vocab_size: int, n_requests: int = 10, seed: int = 1, long_share: float = 0.3,
                 short: tuple[int, int] = (2, 6), long: tuple[int, int] = (24, 32),
                 prompt_len: tuple[int, int] = (8, 24)) -> list[Request]:
    """All waiting at the start (a queue), short prompts; most answers short, each long with probability
    long_share: chat traffic's shape, and the case where a static batch waits for its longest member. (The default
    draw holds 4 long answers in 10, and runs a pool of 16 blocks of 4 tokens dry: the lesson's last exercise.)"""
    return make_trace(n_requests, seed=seed, prompt_len=prompt_len, new_tokens=short, vocab_size=vocab_size,
                      low_token=100, long_share=long_share, long_new_tokens=long)


def warm_up(model, requests: Sequence[Request], max_batch: int = 4, progress: bool = True) -> None:
    """Serve a few steps of the first requests, untimed, so that a compiled engine (course.engine.fast.FastModel)
    compiles its steps here and not inside the first timed run."""
    few = [Request(r.id, r.prompt_ids, min(3, r.max_new_tokens)) for r in list(requests)[:2]]
    serve(model, few, "continuous", max_batch=max_batch, progress=False)


def _mean_decoded(result: ServeResult) -> float:
    """Sequences per decode-only iteration, on average."""
    steps = [s.decoded for s in result.timeline if not any(w == "prefill" for _, w in s.slots)]
    return sum(steps) / max(1, len(steps))


def _kinds(result: ServeResult) -> tuple[list[float], list[float]]:
    """Seconds of the run's iterations that carried a prompt, and of its decode-only ones."""
    carry = [any(w == "prefill" for _, w in s.slots) for s in result.timeline]
    return ([s.seconds for s, c in zip(result.timeline, carry) if c],
            [s.seconds for s, c in zip(result.timeline, carry) if not c])


@dataclass
class BatchingRun:
    requests: list[Request]
    static: ServeResult
    continuous: ServeResult
    solo: dict[int, list[int]]

    identical = property(lambda self: {"static": self.static.outputs() == self.solo,
                                       "continuous": self.continuous.outputs() == self.solo})
    throughput_ratio = property(lambda self: self.continuous.throughput / self.static.throughput)

    @property
    def predicted_ratio(self) -> float:
        """Every iteration emits one token per busy slot, so the same tokens take fewer iterations when the slots are
        busier: static batching's time ÷ continuous batching's iterations, each kind at static batching's mean cost."""
        (sp, sd), (cp, cd) = _kinds(self.static), _kinds(self.continuous)
        return (sum(sp) + sum(sd)) / (len(cp) * sum(sp) / len(sp) + len(cd) * sum(sd) / max(1, len(sd)))

    def rules(self, floor_ms: float) -> list:
        """Every iteration reads every weight at least once: none can beat that bandwidth floor. And a decode step
        that carries more sequences cannot be the cheaper one: continuous batching's (fuller) decode-only steps are
        not cheaper on average than static batching's."""
        (_, sd), (_, cd) = _kinds(self.static), _kinds(self.continuous)
        fuller = _mean_decoded(self.continuous) >= _mean_decoded(self.static)
        return [gates.not_below_floor(min(s.seconds for s in r.timeline) * 1e3, floor_ms, f"an iteration of {name}")
                for name, r in (("static batching", self.static), ("continuous batching", self.continuous))] + [
            gates.not_cheaper(1e3 * sum(sd) / len(sd), 1e3 * sum(cd) / len(cd), "a static decode step",
                              "a fuller continuous one") if fuller and sd and cd else None]

    def values(self) -> dict:
        out = {"identical": self.identical, "throughput_ratio": self.throughput_ratio,
               "predicted_ratio": self.predicted_ratio, "trace": [(len(r.prompt_ids), r.max_new_tokens)
                                                                  for r in self.requests]}
        for name, r in (("static", self.static), ("continuous", self.continuous)):
            out[name] = dict(throughput=r.throughput, ttft_p50=r.ttft_p50, latency_p95=r.latency_p95,
                             occupancy=r.slot_occupancy, iterations=len(r.timeline),
                             prompt_iterations=len(_kinds(r)[0]))
        return out


def batching_run(model, requests: Sequence[Request], max_batch: int = 4, rounds: int = 2,
                 progress: bool = True) -> BatchingRun:
    """Serve the trace with static and continuous batching (paged cache, wall clock) in rounds, in the order
    static, continuous, continuous, static, … (neither policy always runs first), keeping each policy's fastest
    run; then every request alone."""
    runs = {"static": [], "continuous": []}
    for r in range(rounds):
        for policy in ("static", "continuous")[::1 if r % 2 == 0 else -1]:
            runs[policy].append(serve(model, requests, policy, max_batch=max_batch, progress=progress))
    best = {policy: min(done, key=lambda res: res.makespan) for policy, done in runs.items()}
    return BatchingRun(list(requests), best["static"], best["continuous"], solo_outputs(model, requests,
                                                                                        progress=progress))


def batching_report(run: gates.Measured) -> Report:
    b: BatchingRun = run.value
    s, c = b.static, b.continuous
    record_gated("batching", run, b.values())
    for key, value in (("continuous_over_static", b.throughput_ratio), ("continuous_p95_s", c.latency_p95),
                       ("static_p95_s", s.latency_p95)):
        record_gated(key, run, value)
    ok, words = verdict(b.predicted_ratio, b.throughput_ratio, BATCHING_TOLERANCE)
    headline = run.headline(f"Continuous batching made {b.throughput_ratio:.2f}× static batching's tokens/s. Its "
                            f"iterations, at static batching's cost each, predicted {b.predicted_ratio:.2f}×: "
                            f"{words}.")
    n_long = sum(r.max_new_tokens >= 24 for r in b.requests)
    (sp, sd), (cp, cd) = _kinds(s), _kinds(c)
    return Report([("continuous ÷ static, tokens/s", f"{b.predicted_ratio:.2f}×",
                    run.shown(f"{b.throughput_ratio:.2f}×"), ""),
                   ("time to first token, median: static", None, run.shown(s.ttft_p50), "s"),
                   ("time to first token, median: continuous", None, run.shown(c.ttft_p50), "s"),
                   ("latency p95: static", None, run.shown(s.latency_p95), "s"),
                   ("latency p95: continuous", None, run.shown(c.latency_p95), "s")], headline, key="batching",
                  details=[run.notice,
        f"{len(b.requests)} requests, {n_long} with a long answer; at most {s.max_batch} at a time. Each policy's "
        "faster of two runs.",
        f"Slots were busy in {c.slot_occupancy:.0%} of slot-iterations against {s.slot_occupancy:.0%}.",
        f"Continuous batching ran {len(c.timeline)} iterations against {len(s.timeline)}; {len(cp)} of them carried a "
        f"prompt, against {len(sp)}.",
        f"Under static batching an iteration carrying prompts cost {1e3 * sum(sp) / len(sp):.0f} ms, a decode-only "
        f"one {1e3 * sum(sd) / max(1, len(sd)):.0f} ms.",
        "Every request's tokens equal its solo greedy run, under both policies." if all(b.identical.values()) else
        "Some outputs differ from their solo runs: batched sums add in another order, and a near-tie flipped."])


def plot_timelines(run: BatchingRun):
    """One row per slot, time to the right: which request each slot served (colour), prefill (hatched) or decode."""
    import matplotlib.pyplot as plt

    results = (("static", run.static), ("continuous", run.continuous))
    end = max(r.makespan for _, r in results)
    fig, axes = plt.subplots(2, 1, figsize=(11, 1.0 + 0.9 * run.static.max_batch), sharex=True)
    for ax, (name, r) in zip(axes, results):
        for step in r.timeline:
            for slot, (rid, what) in enumerate(step.slots):
                if rid is not None and what != "idle":
                    ax.broken_barh([(step.start, step.seconds)], (slot - 0.4, 0.8), facecolors=plt.cm.tab20(rid % 20),
                                   edgecolor="black" if what == "prefill" else "none", linewidth=0.8,
                                   alpha=1.0 if what == "prefill" else 0.7, hatch="xx" if what == "prefill" else None)
        ax.set(ylabel="slot", yticks=range(r.max_batch), xlim=(0, end * 1.01),
               title=f"{name} batching: slots busy {r.slot_occupancy:.0%}")
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("seconds since the first request arrived (colour: which request; hatched: its prompt)")
    fig.tight_layout()
    return fig


@dataclass
class PrefixRun:
    shared: ServeResult
    unshared: ServeResult
    prefix_tokens: int
    block_size: int

    identical = property(lambda self: self.shared.outputs() == self.unshared.outputs())
    ttft_saved = property(lambda self: 1 - self.shared.ttft_p50 / self.unshared.ttft_p50)  # of the median
    cached_tokens = property(lambda self: [c.cached_tokens for c in self.shared.completions])
    # the share of all prompt tokens that came from shared blocks instead of a prefill
    token_share = property(lambda self: sum(self.cached_tokens) / sum(len(c.request.prompt_ids)
                                                                       for c in self.shared.completions))

    def rules(self) -> list:
        """Without sharing, every prompt token is computed: that cannot be the cheaper run."""
        return [gates.not_cheaper(self.shared.ttft_p50 * 1e3, self.unshared.ttft_p50 * 1e3,
                                  "the median time to first token with sharing", "without")]

    def values(self) -> dict:
        return dict(identical=self.identical, prefix_tokens=self.prefix_tokens, block_size=self.block_size,
                    ttft_saved=self.ttft_saved, token_share=self.token_share, cached_tokens=self.cached_tokens,
                    peak_bytes_shared=self.shared.peak_bytes_shared,
                    peak_reserved_shared=self.shared.peak_bytes_reserved,
                    peak_reserved_unshared=self.unshared.peak_bytes_reserved)


def prefix_run(model, tokenizer, system: str = SYSTEM_PROMPT, questions: Sequence[str] = QUESTIONS,
               max_new_tokens: int = 6, max_batch: int = 4, block_size: int = 16, progress: bool = True) -> PrefixRun:
    """The questions as requests that all open with `system`, served continuously without and with sharing."""
    prompts = [tokenizer.chat_ids(q, system=system) for q in questions]
    prefix = 0  # tokens every prompt opens with
    while all(len(p) > prefix and p[prefix] == prompts[0][prefix] for p in prompts):
        prefix += 1
    requests = [Request(i, tuple(p), max_new_tokens) for i, p in enumerate(prompts)]
    runs = {share: serve(model, requests, "continuous", max_batch=max_batch, block_size=block_size,
                         share_prefix=share, progress=progress) for share in (False, True)}
    return PrefixRun(runs[True], runs[False], prefix, block_size)


def prefix_report(run: gates.Measured) -> Report:
    p: PrefixRun = run.value
    record_gated("prefix_sharing", run, p.values())
    record_gated("prefix_ttft_saved", run, p.ttft_saved)
    ok, words = verdict(p.token_share, p.ttft_saved, SHARING_TOLERANCE)
    headline = run.headline(f"Sharing the system prompt's blocks cut the median time to first token by "
                            f"{p.ttft_saved:.0%}; {p.token_share:.0%} of prompt tokens were shared: {words}.")
    hits = sum(1 for n in p.cached_tokens if n)
    return Report([("time to first token, median, unshared", None, run.shown(p.unshared.ttft_p50 * 1e3), "ms"),
                   ("time to first token, median, shared", p.unshared.ttft_p50 * 1e3 * (1 - p.token_share),
                    run.shown(p.shared.ttft_p50 * 1e3), "ms")], headline, key="prefix_sharing", details=[run.notice,
        f"{hits} of {len(p.cached_tokens)} requests found {max(p.cached_tokens)} of the {p.prefix_tokens} prefix "
        f"tokens in shared blocks (whole {p.block_size}-token blocks only).",
        "Time to first token also counts the wait for a free slot, which shorter prefills shorten too.",
        f"Peak cache: {p.shared.peak_bytes_reserved / MiB:.1f} MiB with sharing, "
        f"{p.unshared.peak_bytes_reserved / MiB:.1f} MiB without.",
        f"Answers identical with and without sharing: {p.identical}."])
