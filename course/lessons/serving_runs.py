"""Lesson 05, the serving half: the real paged cache, continuous vs static batching, prefix sharing — run on
the course model with course.engine.paged and course.engine.serving, and drawn.

    paged_vs_contiguous  the same prompt through a PagedKVCache and a KVCache: largest logit difference
    reserved_on_mix      bytes reserved on a seeded mix of requests: preallocated max-length slots vs paged
    fit_in_budget        how many requests a small memory budget holds, each way (real allocations)
    plot_pool            a picture of the block pool: which sequence holds which block, shared blocks marked
    batching_run         static and continuous batching on one seeded trace, every output checked against its solo run
    plot_timelines       what each slot did at each moment, for both policies
    prefix_run           requests that share a system prompt, with and without sharing its blocks
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from course.engine.generate import decode_one_token, prefill
from course.engine.kv_cache import KVCache
from course.engine.paged import PagedKVCache, PoolExhausted, block_bytes
from course.engine.serving import Request, ServeResult, make_trace, memory_on_mix, serve, solo_outputs
from course.lessons.paging import ReservedBytes, sample_request_lengths
from course.lessons.wording import SAME, duration, lower_by
from course.measure.costs import MiB, kv_bytes_per_token
from course.measure.display import Printed

# A short shared system prompt (lesson 04 uses a longer one): every request of the prefix run starts with it.
SYSTEM_PROMPT = ("You are Quill, the help-desk assistant of the Harbour Street Public Library. Answer in one short, "
                 "friendly sentence, using only these facts. Opening hours: Monday to Friday 9:00 to 20:00, Saturday "
                 "10:00 to 17:00, closed on Sunday. Members borrow up to 12 items for three weeks and renew twice "
                 "online. Printing costs 10 cents a page in black and white and 50 cents in colour. The reading room "
                 "on the second floor is silent; group rooms can be booked at the front desk.")
QUESTIONS = ["Are you open on Sunday?", "How many books can I borrow?", "Can I print in colour?",
             "Where can I study quietly?", "How do I renew a loan?", "Can I book a room for my group?"]


# ---------------------------------------------------------------------------------------------
# The paged cache is exact
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def paged_vs_contiguous(model, prompt_ids: Sequence[int], n_decode: int = 8, block_size: int = 16) -> dict:
    """Prefill `prompt_ids` and decode n_decode greedy tokens through a PagedKVCache and through a KVCache.

    Returns the largest |logit difference| over every step, whether the greedy tokens agree, and the blocks used.
    """
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
        a = decode_one_token(model, ta, T + i, contiguous)
        b = decode_one_token(model, tb, T + i, view)
        diffs.append((a - b).abs().max().item())
    return dict(max_logit_diff=max(diffs), same_tokens=tokens_a == tokens_b, tokens=T + n_decode,
                blocks=len(paged.block_table(0)), block_size=block_size, table=paged.block_table(0))


# ---------------------------------------------------------------------------------------------
# Bytes reserved on a mix
# ---------------------------------------------------------------------------------------------

def mix_requests(n_requests: int = 64, max_seq_len: int = 2048, seed: int = 0) -> list[Request]:
    """A seeded chat-like mix (log-normal prompt + answer lengths, as published traces show), capped at max_seq_len.

    Only lengths matter for memory, so every prompt is one token repeated, and max_new_tokens the rest."""
    lengths = sample_request_lengths(n_requests, max_seq_len, seed, prompt_median=300, output_median=200)
    rng = np.random.default_rng(seed + 1)
    out = []
    for i, n in enumerate(int(x) for x in lengths):
        prompt = max(1, min(n - 1, int(n * rng.uniform(0.3, 0.8)))) if n > 1 else 1
        out.append(Request(i, (1,) * prompt, max(1, n - prompt)))
    return out


@dataclass
class MixBytes(Printed, ReservedBytes):
    used_bytes: int
    paged_bytes: int
    preallocated_bytes: int
    block_size: int
    max_seq_len: int
    n_requests: int

    def values(self) -> dict:
        return dict(used=self.used_bytes, paged=self.paged_bytes, preallocated=self.preallocated_bytes,
                    paged_over_used=self.paged_bytes / self.used_bytes, preallocated_over_used=self.preallocated_bytes / self.used_bytes,
                    paged_waste=self.paged_waste, preallocated_waste=self.preallocated_waste,
                    block_size=self.block_size, max_seq_len=self.max_seq_len, n_requests=self.n_requests)

    def __str__(self) -> str:
        return (f"{self.n_requests} requests, every one at its full length:\n"
                f"  used by the tokens          {self.used_bytes / MiB:9.1f} MiB\n"
                f"  paged ({self.block_size}-token blocks)     {self.paged_bytes / MiB:9.1f} MiB  "
                f"({self.paged_bytes / self.used_bytes:.3f}× used, {self.paged_waste:.1%} wasted)\n"
                f"  preallocated ({self.max_seq_len:,} each)  {self.preallocated_bytes / MiB:9.1f} MiB  "
                f"({self.preallocated_bytes / self.used_bytes:.2f}× used, {self.preallocated_waste:.1%} wasted)")


def reserved_on_mix(config, requests: Sequence[Request], block_size: int = 16, max_seq_len: int = 2048,
                    dtype: torch.dtype = torch.float32) -> MixBytes:
    """Bytes a real PagedKVCache's allocator hands out for the mix vs a KVCache with one max_seq_len row each."""
    m = memory_on_mix(config, requests, block_size=block_size, max_seq_len=max_seq_len, dtype=dtype)
    return MixBytes(m["used"], m["paged"], m["preallocated"], block_size, max_seq_len, len(requests))


def plot_mix(requests: Sequence[Request], mix: MixBytes, show: int = 24):
    """The first `show` requests of the mix as bars: tokens used, the paged reservation, the preallocated slot."""
    import matplotlib.pyplot as plt

    lengths = [r.max_len for r in requests[:show]]
    paged = [math.ceil(n / mix.block_size) * mix.block_size for n in lengths]
    y = np.arange(len(lengths))
    fig, ax = plt.subplots(figsize=(9, 0.22 * len(lengths) + 1.4))
    ax.barh(y, [mix.max_seq_len] * len(lengths), color="#eeeeee", edgecolor="#bbbbbb", label="preallocated slot")
    ax.barh(y, paged, color="#9ecae1", label=f"paged: whole {mix.block_size}-token blocks")
    ax.barh(y, lengths, color="tab:blue", label="tokens the request holds")
    ax.set(xlabel="tokens", ylabel="request", yticks=[],
           title=f"The first {len(lengths)} of the mix's {mix.n_requests} requests; over the whole mix paged "
                 f"wastes {mix.paged_waste:.1%}, preallocated {mix.preallocated_waste:.0%}")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


@dataclass
class BudgetFit:
    budget_bytes: int
    paged_requests: int
    preallocated_requests: int
    formula_preallocated: int
    max_seq_len: int
    block_size: int
    blocks: int

    def values(self) -> dict:
        return self.__dict__.copy()


def fit_in_budget(config, requests: Sequence[Request], budget_bytes: int = 64 * MiB, block_size: int = 16,
                  max_seq_len: int = 2048, dtype: torch.dtype = torch.float32) -> BudgetFit:
    """Admit the mix's requests, in order, at their full length into a real budget_bytes pool until it refuses;
    count them. Preallocated: KVCache rows of max_seq_len allocated until the next row would exceed the budget."""
    cache = PagedKVCache.for_budget(config, budget_bytes, block_size, dtype)
    admitted = 0
    for r in requests:
        if cache.blocks_needed(r.id, r.max_len) > cache.allocator.num_free:
            break
        cache.add_sequence(r.id)
        try:
            cache.append([r.id], n_new=r.max_len)
        except PoolExhausted:
            break
        admitted += 1
    per_row = KVCache(config, batch=1, max_seq_len=max_seq_len, dtype=dtype, device="meta").nbytes
    rows = budget_bytes // per_row
    elt = torch.empty((), dtype=dtype).element_size()
    formula = budget_bytes // (max_seq_len * kv_bytes_per_token(config, elt))
    return BudgetFit(budget_bytes, admitted, int(rows), int(formula), max_seq_len, block_size, cache.allocator.num_blocks)


def pool_example(config, block_size: int = 4, num_blocks: int = 24, seed: int = 0) -> PagedKVCache:
    """A small pool in a state worth drawing: three requests sharing a 2-block system prompt, one forked (two
    samples of one prompt), one finished (its blocks back on the free list), on the meta device."""
    cache = PagedKVCache(config, num_blocks, block_size, device="meta")
    system = list(range(100, 100 + 2 * block_size))  # two full blocks of "system prompt"
    rng = np.random.default_rng(seed)
    for seq, n_own in (("A", 5), ("B", 2), ("C", 9)):
        prompt = system + [int(t) for t in rng.integers(200, 300, n_own)]
        cached = cache.add_sequence(seq, prompt)
        cache.append([seq], [prompt[cached:]])
    cache.add_sequence("D")
    cache.append(["D"], n_new=6)
    cache.fork("D", "D'")  # a second sample of D's prompt: every block shared
    cache.append(["D'"], [[1, 2, 3]])  # D' writes on: its half-filled last block is copied first
    cache.add_sequence("E")
    cache.append(["E"], n_new=7)
    cache.free_sequence("E")  # E finished
    return cache


def plot_pool(cache: PagedKVCache, title: str = ""):
    """Left: each sequence's block table. Right: the pool, one square per block, coloured by holder; a shared
    block is hatched and shows its reference count; the shade inside shows how many of its slots are written."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    picture = cache.pool_picture()
    seqs = list(cache.sequences)
    colors = dict(zip(seqs, plt.cm.tab10.colors))
    cols = min(12, len(picture))
    rows = math.ceil(len(picture) / cols)
    fig, (tables, pool) = plt.subplots(1, 2, figsize=(11, max(2.6, 0.5 * max(len(seqs), rows) + 1.2)),
                                       gridspec_kw={"width_ratios": [1, 1.6]})
    for i, seq in enumerate(seqs):
        table = cache.block_table(seq)
        tables.text(0, -i, f"{seq}: {cache.length(seq)} tokens → blocks {table}", fontsize=9, color=colors[seq],
                    va="center", family="monospace")
    tables.set(xlim=(0, 1), ylim=(-max(len(seqs), rows) + 0.5, 0.5), title="block tables (token order)")
    tables.axis("off")
    bs = cache.block_size
    for cell in picture:
        b = cell["block"]
        x, y = b % cols, -(b // cols)
        holders = cell["holders"]
        face = colors[holders[0]] if holders else "white"
        pool.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor="white", edgecolor="black", lw=0.6))
        if holders:
            pool.add_patch(Rectangle((x, y), 0.92 * cell["filled"] / bs, 0.92, facecolor=face, alpha=0.85,
                                     hatch="///" if cell["ref_count"] > 1 else None, edgecolor="black", lw=0))
        label = f"{b}" + (f"\n×{cell['ref_count']}" if cell["ref_count"] > 1 else "")
        pool.text(x + 0.46, y + 0.46, label, ha="center", va="center", fontsize=7,
                  color="black" if holders else "#999999")
    pool.set(xlim=(-0.1, cols), ylim=(-rows + 0.9, 1), aspect="equal")
    pool.set_title(title or f"the pool: {cache.allocator.num_free} of {cache.allocator.num_blocks} blocks free (white);\n"
                            "hatched: shared, ×n its reference count; shading: slots written", fontsize=9)
    pool.axis("off")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Continuous vs static batching
# ---------------------------------------------------------------------------------------------

@dataclass
class BatchingRun(Printed):
    requests: list[Request]
    static: ServeResult
    continuous: ServeResult
    solo: dict[int, list[int]]

    @property
    def identical(self) -> dict[str, bool]:
        return {name: r.outputs() == self.solo for name, r in (("static", self.static), ("continuous", self.continuous))}

    def differing(self) -> list[int]:
        """Ids of requests whose tokens differ from the solo run under either policy."""
        return sorted({i for r in (self.static, self.continuous) for i, t in r.outputs().items() if t != self.solo[i]})

    @property
    def throughput_ratio(self) -> float:
        return self.continuous.throughput / self.static.throughput

    def values(self) -> dict:
        out = {"identical": self.identical, "throughput_ratio": self.throughput_ratio,
               "requests": len(self.requests), "generated_tokens": self.continuous.generated_tokens,
               "trace": [(len(r.prompt_ids), r.max_new_tokens) for r in self.requests]}
        for name, r in (("static", self.static), ("continuous", self.continuous)):
            out[name] = dict(throughput=r.throughput, ttft_p50=r.ttft_p50, ttft_p95=r.ttft_p95,
                             latency_p50=r.latency_p50, latency_p95=r.latency_p95, makespan=r.makespan,
                             occupancy=r.slot_occupancy, iterations=len(r.timeline), preemptions=r.preemptions,
                             prefill_s=time_split(r).prefill_s, decode_s=time_split(r).decode_s)
        return out

    def __str__(self) -> str:
        head = f"{'':11} {'tokens/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'latency p50':>12} {'latency p95':>12} " \
               f"{'slots busy':>10} {'same as solo':>12}"
        lines = [head]
        for name, r in (("static", self.static), ("continuous", self.continuous)):
            lines.append(f"{name:11} {r.throughput:>8.1f} {r.ttft_p50:>8.2f}s {r.ttft_p95:>8.2f}s "
                         f"{r.latency_p50:>11.2f}s {r.latency_p95:>11.2f}s {r.slot_occupancy:>10.0%} "
                         f"{str(self.identical[name]):>12}")
        return "\n".join(lines)


def lesson_trace(vocab_size: int, n_requests: int = 10, seed: int = 0, long_share: float = 0.3,
                 short: tuple[int, int] = (2, 6), long: tuple[int, int] = (24, 32),
                 prompt_len: tuple[int, int] = (8, 24)) -> list[Request]:
    """The lesson's trace, all waiting at the start (a queue): short prompts; most answers short, about
    `long_share` of them long — chat traffic's shape, and the case where a batch waits for its longest member."""
    import random

    if not 0 <= long_share <= 1:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    rng = random.Random(seed)
    base = make_trace(n_requests, seed=seed, prompt_len=prompt_len, new_tokens=(1, 1), vocab_size=vocab_size,
                      low_token=100)
    return [Request(r.id, r.prompt_ids, rng.randint(*(long if rng.random() < long_share else short)), r.arrival)
            for r in base]


def trace_sentence(requests: Sequence[Request], short: tuple[int, int] = (2, 6),
                   long: tuple[int, int] = (24, 32)) -> str:
    """How many of the trace's answers are long, counted from the trace (lesson_trace draws each one long with
    probability long_share, so a small trace need not hold that share)."""
    n_long = sum(long[0] <= r.max_new_tokens <= long[1] for r in requests)
    n = len(requests)
    if n_long == 0:
        return (f"None of the {n} answers is long ({long[0]}–{long[1]} tokens) in this trace: a static batch has "
                "no long member to wait for here.")
    longs = "1 answer is" if n_long == 1 else f"{n_long} answers are"
    return (f"{longs} long ({long[0]}–{long[1]} tokens) and {n - n_long} short ({short[0]}–{short[1]}), of {n}: "
            "a batch that holds a long one waits for it.")


def warm_up(model, requests: Sequence[Request], max_batch: int = 4, progress: bool = True) -> None:
    """Serve a few steps of the first requests, untimed, so that a compiled engine (course.engine.fast.FastModel)
    compiles its steps here and not inside the first timed run; for the eager model it costs a few steps."""
    from tqdm.auto import tqdm

    few = [Request(r.id, r.prompt_ids, min(3, r.max_new_tokens)) for r in list(requests)[:2]]
    with tqdm(total=1, desc="warm-up, untimed (a compiled engine compiles here, once)", disable=not progress) as bar:
        serve(model, few, "continuous", max_batch=max_batch, progress=False)
        bar.update(1)


def batching_run(model, requests: Sequence[Request], max_batch: int = 4, progress: bool = True) -> BatchingRun:
    """Serve the trace with static then continuous batching (paged cache, wall clock), and every request alone."""
    requests = list(requests)
    warm_up(model, requests, max_batch, progress)
    static = serve(model, requests, "static", max_batch=max_batch, progress=progress)
    continuous = serve(model, requests, "continuous", max_batch=max_batch, progress=progress)
    solo = solo_outputs(model, requests, progress=progress)
    return BatchingRun(requests, static, continuous, solo)


@dataclass(frozen=True)
class TimeSplit:
    """A served run's iterations in two kinds: those that carried a prompt (they also decode every running
    request, as Orca's selective batching does) and decode-only ones, with their wall time in seconds and the
    tokens they emitted (one per busy slot)."""
    prefill_s: float
    decode_s: float
    prefill_iterations: int
    decode_iterations: int
    decode_tokens: int = 0  # tokens the decode-only iterations emitted
    carried_decode_tokens: int = 0  # decode tokens emitted in the iterations that carried a prompt
    prompts: int = 0  # prompts prefilled (each emits its first token)

    @property
    def prefill_share(self) -> float:
        """Share of the iterations' time spent in those that carried a prompt."""
        total = self.prefill_s + self.decode_s
        return self.prefill_s / total if total else math.nan

    @property
    def iterations(self) -> int:
        return self.prefill_iterations + self.decode_iterations

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def mean_s(self) -> float:
        """Seconds per iteration, both kinds together."""
        return self.seconds / self.iterations if self.iterations else math.nan

    @property
    def decode_rate(self) -> float:
        """Decode tokens per second of decode-only iterations."""
        return self.decode_tokens / self.decode_s if self.decode_s else math.nan


def time_split(result: ServeResult) -> TimeSplit:
    """Split a run's timeline into prompt-carrying and decode-only iterations, and count what each emitted."""
    def carries(s) -> bool:
        return any(what == "prefill" for _, what in s.slots)

    def n(s, kind: str) -> int:
        return sum(what == kind for _, what in s.slots)

    pre = [s for s in result.timeline if carries(s)]
    dec = [s for s in result.timeline if not carries(s)]
    return TimeSplit(sum(s.seconds for s in pre), sum(s.seconds for s in dec), len(pre), len(dec),
                     decode_tokens=sum(n(s, "decode") for s in dec),
                     carried_decode_tokens=sum(n(s, "decode") for s in pre), prompts=sum(n(s, "prefill") for s in pre))


def _cost_rise(ts: TimeSplit, tc: TimeSplit) -> tuple[float, str] | None:
    """Where the cost of an iteration rose from static (ts) to continuous (tc), split exactly into three parts:
    more of the iterations carry a prompt, each prompt-carrying one costs more, each decode-only one costs more.
    Returns the largest part (seconds per iteration) and its name; None when a kind is missing from either run."""
    if not (ts.prefill_iterations and ts.decode_iterations and tc.prefill_iterations and tc.decode_iterations):
        return None
    ps, pc = ts.prefill_s / ts.prefill_iterations, tc.prefill_s / tc.prefill_iterations
    ds, dc = ts.decode_s / ts.decode_iterations, tc.decode_s / tc.decode_iterations
    fs, fc = ts.prefill_iterations / ts.iterations, tc.prefill_iterations / tc.iterations
    parts = [((fc - fs) * (ps - ds), f"more iterations carrying a prompt ({fc:.0%} of them against {fs:.0%})"),
             (fc * (pc - ps), f"costlier prompt-carrying iterations ({duration(pc)} each against {duration(ps)})"),
             ((1 - fc) * (dc - ds), f"wider decode-only steps ({duration(dc)} each against {duration(ds)})")]
    return max(parts)


def gain_sentence(run: BatchingRun) -> str:
    """Why continuous batching did (or did not) beat static batching in this run. Every iteration emits one token
    per busy slot, so busier slots mean fewer iterations for the same tokens; the iteration time is then
    (fewer iterations) ÷ (cost of each), and the cost of each is split into its measured parts. Claims only what
    that arithmetic shows."""
    s, c = run.static, run.continuous
    if not s.timeline or not c.timeline:
        return (f"Its slots were busy in {c.slot_occupancy:.0%} of slot-iterations against {s.slot_occupancy:.0%}; "
                "no iterations were timed, so this run cannot say where the time went.")
    ts, tc = time_split(s), time_split(c)
    fewer, costlier = ts.iterations / tc.iterations, tc.mean_s / ts.mean_s
    rate = (f"{tc.decode_rate:.0f} decode tokens per second against {ts.decode_rate:.0f}"
            if tc.decode_s and ts.decode_s else "no decode-only rate to compare")
    parts = (f"Every iteration emits one token per busy slot; its slots were busy in {c.slot_occupancy:.0%} of "
             f"slot-iterations against {s.slot_occupancy:.0%}, so it ran {tc.iterations} iterations against "
             f"{ts.iterations}, at {duration(tc.mean_s)} each on average against {duration(ts.mean_s)}. "
             f"Decode-only iterations ({tc.decode_iterations} against {ts.decode_iterations}) made {rate}. "
             f"Iterations that carried a prompt ({tc.prefill_iterations} against {ts.prefill_iterations}) also "
             f"decoded the running requests, {tc.carried_decode_tokens} tokens against {ts.carried_decode_tokens}, "
             f"and took {duration(tc.prefill_s)} against {duration(ts.prefill_s)} ({tc.prefill_share:.0%} of its "
             f"iterations' time against {ts.prefill_share:.0%}).")
    rise = _cost_rise(ts, tc)
    rise_text = ""
    total = tc.mean_s - ts.mean_s
    if rise is not None and costlier >= 1 + SAME and rise[0] > 0:
        rise_text = (f"; of the {duration(total)} more per iteration, the largest part, {duration(rise[0])}, is "
                     f"{rise[1]}" if rise[0] <= total * (1 + 1e-9) else
                     f"; {rise[1]} added {duration(rise[0])} per iteration, more than the whole {duration(total)} "
                     f"rise: the other parts took {duration(rise[0] - total)} back")
    sums = f"its iterations took {duration(tc.seconds)} in all against {duration(ts.seconds)}"
    if run.throughput_ratio >= 1 + SAME:
        if fewer >= 1 + SAME and costlier >= 1 + SAME:
            verdict = (f"The gain is the {fewer:.2f}× fewer iterations at {costlier:.2f}× the cost each: {sums}"
                       f"{rise_text}.")
        elif fewer >= 1 + SAME:
            verdict = f"The gain is the {fewer:.2f}× fewer iterations, at no higher cost each: {sums}."
        elif costlier <= 1 - SAME:
            verdict = (f"The gain came from cheaper iterations ({costlier:.2f}× the cost each), not fewer: "
                       f"{sums}.")
        else:
            verdict = ("Neither fewer nor cheaper iterations account for the gain, so it lies in the time between "
                       "them; a busy machine moves differences this small, so run the cell again.")
    elif fewer >= 1 + SAME and costlier >= 1 + SAME:
        verdict = (f"No gain in this run: {fewer:.2f}× fewer iterations, but at {costlier:.2f}× the cost each: "
                   f"{sums}{rise_text}.")
    elif fewer < 1 + SAME:
        verdict = ("No gain in this run: it ran no fewer iterations, although its slots were busier; a busy "
                   "machine can hide the gain, so run the cell again.")
    else:
        verdict = (f"No gain in this run, although {sums}: the time between them, or a busy machine, ate it; "
                   "run the cell again.")
    return f"{parts} {verdict}"


def batching_sentences(run: BatchingRun) -> list[str]:
    s, c = run.static, run.continuous
    same = all(run.identical.values())
    p95 = "no worse" if c.latency_p95 <= s.latency_p95 else "worse"
    return [
        f"Continuous batching produced {c.throughput:.1f} tokens/s against static batching's {s.throughput:.1f}: "
        f"{run.throughput_ratio:.2f}× the throughput.",
        gain_sentence(run),
        f"Time to first token, median: {duration(c.ttft_p50)} against {duration(s.ttft_p50)}; latency p95: "
        f"{duration(c.latency_p95)} against {duration(s.latency_p95)} ({p95} for the slowest requests).",
        ("Every request's tokens equal its solo greedy run, under both policies." if same else
         f"Some outputs differ from their solo runs (requests {run.differing()}): batched products add in another "
         f"order, so a near-tie between the two best tokens (float32) can flip; the rest agree."),
    ]


def plot_timelines(run: BatchingRun):
    """One row per slot, time to the right: which request each slot served (colour), prefill (dark) vs decode."""
    import matplotlib.pyplot as plt

    results = (("static", run.static), ("continuous", run.continuous))
    end = max(r.makespan for _, r in results)
    fig, axes = plt.subplots(2, 1, figsize=(11, 1.0 + 0.45 * run.static.max_batch * 2), sharex=True)
    cmap = plt.cm.tab20.colors
    for ax, (name, r) in zip(axes, results):
        for step in r.timeline:
            for slot, (rid, what) in enumerate(step.slots):
                if rid is None or what == "idle":
                    continue
                ax.broken_barh([(step.start, step.seconds)], (slot - 0.4, 0.8), facecolors=cmap[rid % 20],
                               edgecolor="black" if what == "prefill" else "none", linewidth=0.8,
                               alpha=1.0 if what == "prefill" else 0.7, hatch="xx" if what == "prefill" else None)
        ax.set(ylabel="slot", yticks=range(r.max_batch), xlim=(0, end * 1.01),
               title=f"{name} batching: {r.throughput:.1f} tokens/s, slots busy {r.slot_occupancy:.0%}")
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("seconds since the first request arrived   (colour: which request; hatched: its prompt "
                        "being prefilled; pale: decoding)")
    fig.tight_layout()
    return fig


def plot_latencies(run: BatchingRun):
    """Each request's time to first token and latency under both policies (sorted), with the p50 and p95 marks."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.3))
    for ax, metric, label in ((axes[0], "ttfts", "time to first token (s)"), (axes[1], "latencies", "latency (s)")):
        for name, r, color in (("static", run.static, "tab:gray"), ("continuous", run.continuous, "tab:blue")):
            xs = sorted(getattr(r, metric)())
            ax.plot(range(1, len(xs) + 1), xs, "o-", color=color, label=name, ms=3)
        ax.set(xlabel="requests, sorted", ylabel=label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Prefix sharing through the block table
# ---------------------------------------------------------------------------------------------

@dataclass
class PrefixRun:
    shared: ServeResult
    unshared: ServeResult
    prefix_tokens: int
    block_size: int

    @property
    def identical(self) -> bool:
        return self.shared.outputs() == self.unshared.outputs()

    @property
    def ttft_saved(self) -> float:
        """Share of the median time to first token that sharing removed."""
        return 1 - self.shared.ttft_p50 / self.unshared.ttft_p50

    @property
    def cached_tokens(self) -> list[int]:
        return [c.cached_tokens for c in self.shared.completions]

    def values(self) -> dict:
        return dict(identical=self.identical, prefix_tokens=self.prefix_tokens, block_size=self.block_size,
                    ttft_p50_shared=self.shared.ttft_p50, ttft_p50_unshared=self.unshared.ttft_p50,
                    ttft_saved=self.ttft_saved, cached_tokens=self.cached_tokens,
                    peak_bytes_shared=self.shared.peak_bytes_shared,
                    peak_reserved_shared=self.shared.peak_bytes_reserved,
                    peak_reserved_unshared=self.unshared.peak_bytes_reserved)

    def sentences(self) -> list[str]:
        hits = sum(1 for n in self.cached_tokens if n)
        return [
            f"{hits} of {len(self.cached_tokens)} requests found the system prompt's full blocks in the pool "
            f"and prefilled only the rest: up to {max(self.cached_tokens)} of the {self.prefix_tokens} system-prompt "
            f"tokens came from shared blocks (whole {self.block_size}-token blocks only).",
            f"Median time to first token {duration(self.shared.ttft_p50)} with sharing against "
            f"{duration(self.unshared.ttft_p50)} without: "
            + (f"{self.ttft_saved:.0%} saved" if self.ttft_saved >= SAME else lower_by(self.ttft_saved, "with sharing"))
            + f". At the peak, the cache held {self.shared.peak_bytes_reserved / MiB:.1f} MiB with sharing against "
            f"{self.unshared.peak_bytes_reserved / MiB:.1f} MiB without; the shared blocks spared up to "
            f"{self.shared.peak_bytes_shared / MiB:.1f} MiB of copies (blocks that would otherwise be held once more "
            "for every further request that reads them). "
            f"Answers identical: {self.identical}.",
        ]


def prefix_run(model, tokenizer, system: str = SYSTEM_PROMPT, questions: Sequence[str] = QUESTIONS,
               max_new_tokens: int = 6, max_batch: int = 4, block_size: int = 16, gap_s: float = 0.0,
               progress: bool = True) -> PrefixRun:
    """The questions as requests that all open with `system`, served continuously with and without sharing."""
    prompts = [tokenizer.chat_ids(q, system=system) for q in questions]
    prefix = 0
    while all(len(p) > prefix and p[prefix] == prompts[0][prefix] for p in prompts):
        prefix += 1
    requests = [Request(i, tuple(p), max_new_tokens, arrival=i * gap_s) for i, p in enumerate(prompts)]
    from course.measure.display import working

    with working(f"Serving {len(requests)} requests that open with the same {prefix}-token prefix, continuously, "
                 "without and then with shared blocks, after an untimed warm-up", "under a minute on a 2-core CPU"):
        warm_up(model, requests, max_batch, progress)
        runs = {}
        for share in (False, True):
            runs[share] = serve(model, requests, "continuous", max_batch=max_batch, block_size=block_size,
                                share_prefix=share, progress=progress)
    return PrefixRun(runs[True], runs[False], prefix, block_size)


def recap_bullets(sweep_values: dict, fit: BudgetFit, mix: MixBytes, run: BatchingRun, prefix: PrefixRun) -> list[str]:
    """The lesson's recap bullets (for course.lessons.recap.recap), one per section, from the learner's own numbers."""
    contexts = sorted(sweep_values, key=int)
    c = run.continuous

    def batching(k: str, first: bool) -> str:
        v = sweep_values[k]
        rule = " (the first step at twice the one-sequence baseline)" if first else ""
        knee = (f"and the knee{rule} came at B = {v['knee']}" if v.get("knee_found", True) else
                f"and no step reached the knee{rule} up to B = {v['batch'][-1]}")
        return f"at C = {k}, B = {v['best_batch']} gave {v['speedup']:.1f}× the total tokens/s of B = 1 {knee}"

    return [
        "Batching decode: " + "; ".join(batching(k, i == 0) for i, k in enumerate(contexts)) + ".",
        f"The cache is the limit: a {fit.budget_bytes / MiB:.0f} MiB budget held {fit.paged_requests} requests of the "
        f"mix paged, {fit.preallocated_requests} as {fit.max_seq_len:,}-token preallocated slots.",
        f"Paging reserved {mix.paged_bytes / mix.used_bytes:.3f}× the bytes the mix used ({mix.paged_waste:.1%} wasted); "
        f"preallocation {mix.preallocated_bytes / mix.used_bytes:.2f}× ({mix.preallocated_waste:.0%} wasted).",
        f"Continuous batching: {run.throughput_ratio:.2f}× static batching's throughput, latency p95 "
        f"{duration(c.latency_p95)} against {duration(run.static.latency_p95)}; outputs equal the solo runs: "
        f"{all(run.identical.values())}.",
        f"Prefix sharing: median {lower_by(prefix.ttft_saved, 'time to first token')}, "
        f"{prefix.shared.peak_bytes_shared / MiB:.1f} MiB of copies spared at the peak.",
    ]
