"""Lesson 01's own helpers: one streamed call and its token timeline, recording values, the interview answers."""
from __future__ import annotations

from dataclasses import dataclass

from course.engine.generate import Generation
from course.engine.streaming import stream_answer


# One chat call, streamed, with the time each token arrived: the engine's prompt → text wiring.
stream_call = stream_answer


def token_latencies(gen: Generation) -> list[float]:
    """Seconds each token waited: token 1 waits for the whole prefill (TTFT), the rest one decode step."""
    if not gen.token_times:
        raise ValueError("this Generation has no tokens: ask for max_new_tokens >= 1")
    return [gen.token_times[0]] + gen.inter_token_latencies


def call_values(gen: Generation) -> dict:
    """The streamed call's clock, for course.measure.results.record."""
    return dict(call_prompt_tokens=len(gen.prompt_ids), call_new_tokens=len(gen.tokens),
                call_ttft_ms=gen.time_to_first_token * 1e3, call_itl_ms=gen.mean_inter_token_latency * 1e3,
                call_stop_reason=gen.stop_reason)


def record_all(values: dict) -> dict:
    """course.measure.results.record every key of a values() dict; returns it."""
    from course.measure.results import record

    for key, value in values.items():
        record(key, value)
    return values


def plot_token_timeline(gen: Generation, tokenizer=None, ax=None):
    """Bar per token: how long it took to arrive. The first bar is the prefill; the rest are decode steps."""
    import matplotlib.pyplot as plt

    lat_ms = [s * 1e3 for s in token_latencies(gen)]
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(10, 3.2))
    colors = ["tab:orange"] + ["tab:blue"] * (len(lat_ms) - 1)
    ax.bar(range(1, len(lat_ms) + 1), lat_ms, color=colors)
    ax.set_xlabel("answer tokens, in the order they arrived")
    ax.set_ylabel("ms waited for this token")
    T = len(gen.prompt_ids)
    itl = gen.mean_inter_token_latency
    ax.set_title(f"Prompt of {T} tokens: first token after {lat_ms[0]:.0f} ms (prefill, orange), "
                 f"then one every {itl * 1e3:.0f} ms (decode, blue)", fontsize=10)
    if tokenizer is not None and len(lat_ms) <= 64:
        ax.set_xticks(range(1, len(lat_ms) + 1))
        ax.set_xticklabels([tokenizer.token_text(t) for t in gen.tokens], rotation=90, fontsize=7)
    fig.tight_layout()
    return fig


def _prefill_bound_clause(v: dict) -> str:
    """Where the measured prefill points fell against the ridge (prefill_bounds, per prefill_lengths)."""
    bounds, lengths = v.get("prefill_bounds"), v.get("prefill_lengths")
    if not bounds or not lengths or len(bounds) != len(lengths):
        return ", towards compute-bound as the prompt grows"
    compute = [t for t, b in zip(lengths, bounds) if b == "compute"]
    if len(compute) == len(lengths):
        return f": every prompt measured, T = {lengths[0]:,} to {lengths[-1]:,}, was compute-bound instead"
    if compute:
        return (f": the measured prompts crossed the ridge at T = {compute[0]:,} and were compute-bound from "
                "there on")
    return (f", yet up to T = {lengths[-1]:,}, the longest prompt measured, it stayed below this machine's ridge: "
            "memory-bound here too")


WEIGHTS_DOMINATE = 2.0  # a step within this many times its weight-read floor is dominated by reading the weights


def cache_rise_resolved(v: dict) -> bool | None:
    """Whether this run measured the cache's cost: latency.itl_slope_sentence's resolve test (theory's rise across
    the decode contexts at least twice the points' scatter around the fit) and a measured rise beyond that scatter
    too. None where the fit's rise and scatter were not recorded."""
    rise, scatter, ms = v.get("itl_theory_rise_ms"), v.get("itl_scatter_ms"), v.get("decode_ms_per_token")
    if rise is None or scatter is None or not ms:
        return None
    return rise >= 2 * scatter and ms[-1] - ms[0] >= 2 * scatter


def cache_rise_clause(v: dict, span: bool = True) -> str:
    """What the decode medians at the shortest and longest context say about the cache's cost, judged by
    cache_rise_resolved: a rise is claimed only when it is beyond the timing's scatter. `span` quotes the medians
    (the recap quotes them itself)."""
    ms, (c_short, c_long) = v["decode_ms_per_token"], (v["decode_contexts"][0], v["decode_contexts"][-1])
    quoted = f"{ms[0]:.1f} → {ms[-1]:.1f} ms per token from {c_short:,} to {c_long:,} tokens" if span else ""
    resolved = cache_rise_resolved(v)
    if resolved:
        return (f"the cache's reads raised it as the context grew ({quoted + ', ' if span else ''}more than twice "
                f"the points' scatter of {v['itl_scatter_ms']:.2f} ms)")
    if resolved is None:
        return ("this run did not record the timing's scatter, so it cannot say whether the cache raised it"
                + (f" ({quoted})" if span else ""))
    return (f"the timing cannot show the cache's cost here ({quoted + '; ' if span else ''}theory's rise is "
            f"{v['itl_theory_rise_ms']:.2f} ms, the points' scatter {v['itl_scatter_ms']:.2f} ms, and a rise "
            "counts only beyond twice the scatter)")


def step_dominance(v: dict) -> str:
    """What dominates a decode step, from the step against its weight-read floor (decode_floor_ms) and, past
    WEIGHTS_DOMINATE× the floor, section 6's split into matrix-vector products and the other operations."""
    ratio = v["decode_ms_per_token"][0] / v["decode_floor_ms"]
    if ratio <= WEIGHTS_DOMINATE:
        return f"reading the weights dominates (the step is {ratio:.1f}× their read floor)"
    linears, other = v.get("breakdown_linears_ms"), v.get("breakdown_other_ms")
    if linears is None or other is None:
        return (f"costs beyond reading the weights dominate here (the step is {ratio:.1f}× the weight-read "
                "floor)")
    if other >= linears:
        return (f"per-operation overhead dominates here (the step is {ratio:.1f}× the weight-read floor; its "
                f"small operations took {other:.0f} ms, its matrix-vector products {linears:.0f} ms)")
    return (f"the matrix-vector products dominate here (the step is {ratio:.1f}× the weight-read floor; they took "
            f"{linears:.0f} ms at {v['breakdown_gemv_gb_s']:.1f} GB/s, the other operations {other:.0f} ms)")


def interview_answers(v: dict) -> str:
    """The lesson's two interview answers, phrased with the values the notebook record()ed (keys as there)."""
    decode_ms = v["decode_ms_per_token"]
    prompt_per_output = decode_ms[0] / 1e3 * v["prefill_tokens_per_s_max"]
    first = (
        "Q: Why is the first token slow, then streaming fast?\n"
        f"A: The first token waits for prefill: all {v['call_prompt_tokens']} prompt tokens went through the "
        f"model in one parallel pass, {v['call_ttft_ms']:.0f} ms here, and that pass also filled the KV cache. "
        f"Every later token is one small decode step that reuses the cache: {v['call_itl_ms']:.0f} ms apiece. "
        f"Per token, prefill is the efficient phase - up to {v['prefill_tokens_per_s_max']:,.0f} tokens/s against "
        f"{v['decode_tokens_per_s'][0]:,.0f} tokens/s for decode" + (
            f"; around {v['output_token_exchange_context']:,.0f} tokens of context (the checkpoint above) one output "
            f"token costs as much time as {v['output_token_in_prompt_tokens']:,.0f} prompt tokens."
            if v.get("output_token_in_prompt_tokens") is not None else
            "; the checkpoint above could not price a prompt token in this run (its prefill fit was flat)."
            if "output_token_in_prompt_tokens" in v else
            f", so one output token costs about as much time as {prompt_per_output:,.0f} prompt tokens.") +
        " The first token is slow only because it pays for the whole "
        f"prompt at once; a longer prompt lengthens the wait (TTFT), more output lengthens the stream.")
    ridge = v["ridge_flop_per_byte"]
    c_short, c_long = v["decode_contexts"][0], v["decode_contexts"][-1]
    kv_short = v["decode_bytes_mb"] - v["weight_mb"]  # decode_bytes_mb: weights + K and V at c_short
    decode_memory = v.get("decode_bound", "memory" if v["decode_intensity"] < ridge else "compute") == "memory"
    second = (
        "Q: Why is decode memory-bandwidth-bound?\n"
        # every figure of the step is at the shortest context, the one decode_gflop and decode_intensity are at
        f"A: At {c_short:,} tokens of context one decode step reads every weight ({v['weight_mb']:.0f} MB here in "
        f"{v.get('dtype', 'this dtype')}) plus the K and V of every cached token ({kv_short:.2f} MB) to do only "
        f"{v['decode_gflop']:.2f} GFLOP: {v['decode_intensity']:.2f} FLOPs per byte, "
        f"{'below' if v['decode_intensity'] < ridge else 'above'} this machine's ridge of {ridge:.1f} FLOPs per "
        f"byte. The arithmetic would take {v['decode_gflop'] / v['matmul_gflop_s'] * 1e3:.1f} ms at "
        f"{v['matmul_gflop_s']:.0f} GFLOP/s, moving the bytes {v['decode_floor_ms']:.1f} ms at "
        f"{v['bandwidth_gb_s']:.1f} GB/s, so "
        + (f"memory is the wall the step hits first. The cache adds {v['kv_mb_at_max_context']:.1f} MB of K and V "
           f"at {c_long:,} tokens to each step's reads, and {cache_rise_clause(v)}. "
           if decode_memory else
           "on this machine's measured roofs the arithmetic, not memory, is the wall the step hits first: in this "
           "run decode measured compute-bound, and the question's premise does not hold here. ")
        + "Prefill reads the same weights once for all T tokens, so its FLOPs per byte grow with T"
        + _prefill_bound_clause(v) + ".")
    if "breakdown_step_ms" in v:
        second += (
            f"\n   Honest footnote: the measured step ({v['breakdown_step_ms']:.1f} ms) is "
            f"{v['breakdown_step_ms'] / v['breakdown_floor_ms']:.1f}× the bandwidth floor. The "
            f"{v['breakdown_n_matmuls']} matrix-vector products alone moved weights at "
            f"{v['breakdown_gemv_gb_s']:.1f} GB/s (the probe: {v['bandwidth_gb_s']:.1f} GB/s), and the other "
            f"{v['breakdown_n_ops'] - v['breakdown_n_matmuls']:,} small operations cost "
            f"{v['breakdown_other_us_per_op']:.1f} µs each. Serving stacks fuse those into few kernels, which is "
            f"how they get close to the floor.")
    return first + "\n\n" + second


# ------------------------------------------------------------------ section 7: the ITL slope against theory
FAR_OFF = 2.0  # a fitted slope more than this many times theory's (or less than 1/this) is "far" from it
MISMATCH = 1.2  # attention timed alone above this share of the fitted slope: a part bigger than the whole
ATTENTION_ROUNDS = 9  # interleaved rounds of the attention timing (lo, hi, hi, lo, ...): about a second


@dataclass(frozen=True)
class AttentionTiming:
    """What the model's attention call alone adds per cached token, from `rounds` interleaved rounds."""
    seconds_per_token: float  # median over the rounds of (time at hi − time at lo) ÷ (hi − lo)
    scatter_per_token: float  # standard deviation of that difference over the rounds, same units
    rounds: int

    @property
    def resolved(self) -> bool:
        """The rise is beyond the rounds' own scatter: otherwise it says nothing about the slope."""
        return self.seconds_per_token > self.scatter_per_token


def attention_timing(model, lo: int, hi: int, rounds: int = ATTENTION_ROUNDS) -> AttentionTiming:
    """The same scaled_dot_product_attention a decode step runs over all L layers (one query, every layer's cached
    K and V, GQA as the model has it), on a cache of the model's shape filled with random numbers, timed at contexts
    lo and hi in interleaved rounds, so that a change in the machine's load hits both alike."""
    import statistics

    import torch
    import torch.nn.functional as F

    from course.engine.kv_cache import KVCache
    from course.measure.timing import measure

    c = model.config
    cache = KVCache(c, max_seq_len=hi + 1, dtype=model.dtype, device=model.device)
    for layer in cache:
        layer.k.normal_(), layer.v.normal_()  # real numbers, never denormals from uninitialised memory
    q = torch.randn(1, c.n_heads, 1, c.head_dim, dtype=model.dtype, device=model.device)  # [B, H, 1, D_h]
    gqa = c.n_kv_heads != c.n_heads

    def attend(C):  # as Attention.forward does for one new token with C cached: keys 0..C
        return lambda: [F.scaled_dot_product_attention(q, layer.k[:, :, :C + 1], layer.v[:, :, :C + 1],
                                                       enable_gqa=gqa) for layer in cache]

    rises = []
    with torch.inference_mode():
        for r in range(rounds):
            order = (lo, hi) if r % 2 == 0 else (hi, lo)  # neither context always goes first
            t = {C: measure(attend(C), model.device, warmup=1, repeats=5).median for C in order}
            rises.append((t[hi] - t[lo]) / (hi - lo))
    return AttentionTiming(statistics.median(rises), statistics.pstdev(rises), rounds)


def itl_slope_cause(fitted_s: float, theory_s: float, rise_s: float, scatter_s: float, lo: int, hi: int,
                    attention_s: float | None = None, cache_mb_at_hi: float | None = None,
                    attention_scatter_s: float | None = None) -> str:
    """Why the fitted ITL slope (seconds per cached token) sits where it does against theory's, phrased from the
    values: "" where the sweep cannot resolve the slope (rise under twice the scatter: the fit's own sentence says
    so). Far above theory, `attention_s` (attention_timing, with the scatter of its rounds) says how much the
    attention call alone explains; far below, the cache's size at `hi` says whether it could have stayed in the
    CPU's caches."""
    if rise_s < 2 * scatter_s or theory_s <= 0:
        return ""
    ratio = fitted_s / theory_s
    if ratio > FAR_OFF:
        head = (f"Far above theory ({ratio:.1f}×): each cached token costs the eager step more than one read of its "
                "K and V at the probe's bandwidth.")
        if attention_s is None:
            return head + " This run did not time the attention call alone, so the cause is not measured here."
        spread = (f" ± {attention_scatter_s * 1e6:.2f}" if attention_scatter_s is not None else "")
        if attention_scatter_s is not None and attention_s <= attention_scatter_s:
            return head + (f" Timed alone in interleaved rounds, the model's attention call rose by "
                           f"{attention_s * 1e6:.2f}{spread} µs per cached token (median ± the rounds' scatter): "
                           "no more than its own scatter, so this timing cannot say how much of the slope is "
                           "attention, and nothing is attributed here.")
        share, theirs = attention_s / fitted_s, attention_s / theory_s
        span_ms = (fitted_s - attention_s) * (hi - lo) * 1e3
        out = (head + f" Timed alone, the model's attention call (scaled_dot_product_attention over every layer's "
               f"cached K and V) added {attention_s * 1e6:.2f}{spread} µs per cached token, {theirs:.1f}× theory: "
               f"{share:.0%} of the fitted slope.")
        if share > MISMATCH:
            return out + (" A part cannot cost more than the whole: the attention call timed alone does not behave "
                          "as it does inside the step, so this lesson cannot attribute the slope.")
        if share >= 0.8:
            return out + " So the attention call is where the time goes."
        if span_ms <= 2 * scatter_s * 1e3:
            return out + (f" The rest ({span_ms:.2f} ms from C = {lo:,} to {hi:,}) is within twice the points' "
                          f"scatter ({scatter_s * 1e3:.2f} ms): timing noise can account for it.")
        return out + (f" The rest ({span_ms:.2f} ms from C = {lo:,} to {hi:,}) is more than the points' scatter "
                      "explains; this lesson does not measure where it goes.")
    if ratio < 1 / FAR_OFF:
        where = (f" At C = {hi:,} the whole cache is {cache_mb_at_hi:.1f} MB, which "
                 + ("a CPU's last-level cache can hold, so its reads need not reach memory."
                    if cache_mb_at_hi <= 32 else "is larger than most CPUs' caches, so this is not the reason.")
                 if cache_mb_at_hi is not None else "")
        return (f"Far below theory ({ratio:.2f}×): a cached token cost less than a read of its K and V at the "
                "probe's bandwidth." + where)
    return (f"Close to theory ({ratio:.2f}×, within {FAR_OFF:g}× either way): each cached token costs about one "
            "read of its K and V at the probe's bandwidth, as the lesson's byte count says.")


def itl_slope_explained(model, latency_model, decode_sweep, machine) -> str:
    """itl_slope_cause for the lesson's fit and sweep, timing the attention call where the slope is far above
    theory (about a second); records the resolve test's rise and scatter for cache_rise_clause."""
    from course.measure.costs import dtype_bytes, kv_bytes_per_token
    from course.measure.latency import itl_scatter

    per_token = kv_bytes_per_token(model.config, dtype_bytes(model.dtype))
    theory = per_token / machine.bytes_per_s
    lo, hi = min(decode_sweep.lengths), max(decode_sweep.lengths)
    scatter = itl_scatter(latency_model, decode_sweep)  # as latency.itl_slope_sentence measures it
    fitted = latency_model.itl_coef[1]
    attention = attention_timing(model, lo, hi) if fitted > FAR_OFF * theory else None
    from course.measure.results import record

    record("itl_attention_us_per_token", None if attention is None else attention.seconds_per_token * 1e6)
    record("itl_attention_scatter_us_per_token", None if attention is None else attention.scatter_per_token * 1e6)
    # the resolve test of latency.itl_slope_sentence, for the interview answer and the recap
    record("itl_theory_rise_ms", theory * (hi - lo) * 1e3)
    record("itl_scatter_ms", scatter * 1e3)
    return itl_slope_cause(fitted, theory, theory * (hi - lo), scatter, lo, hi,
                           None if attention is None else attention.seconds_per_token, per_token * hi / 1e6,
                           None if attention is None else attention.scatter_per_token)


# ----------------------------------------------------------------------- section 10: two probes, one memory
def probe_spread_sentence(section4_read_gb_s: float, line_probe_gb_s: float, line_probes_gb_s: list[float],
                          fitted_gb_s: float, tolerance: float) -> str:
    """The bytes line re-probes the memory between its models (its verdict uses the median, `line_probe_gb_s`);
    say so, print both probes and their spread, and judge the line's slope against each (within `tolerance`, as
    the line's own verdict counts "at the probe's bandwidth")."""
    spread = abs(line_probe_gb_s - section4_read_gb_s) / min(line_probe_gb_s, section4_read_gb_s)
    mine, theirs = fitted_gb_s / section4_read_gb_s, fitted_gb_s / line_probe_gb_s
    near = [name for name, r in (("section 4's probe", mine), ("the line's probe", theirs))
            if abs(r - 1) <= tolerance]
    verdict = (f"within ±{tolerance:.0%} of both, so the slope streams at the probe's bandwidth whichever probe is "
               "taken." if len(near) == 2 else
               f"within ±{tolerance:.0%} of {near[0]} only, so whether the slope streams at the probe's bandwidth "
               "depends on which probe is taken: read the line's verdict with that spread in mind." if near else
               f"more than ±{tolerance:.0%} off both probes.")
    probes = sorted(line_probes_gb_s)
    rng = f" (median of {len(probes)} rounds, {probes[0]:.1f} to {probes[-1]:.1f})" if len(probes) > 1 else ""
    return (f"Two probes of the same memory: section 4's streaming read gave {section4_read_gb_s:.1f} GB/s; the "
            f"bytes line read it again between its models, minutes later, at {line_probe_gb_s:.1f} GB/s{rng}: "
            f"{spread:.0%} apart. The slope's {fitted_gb_s:.1f} GB/s is {mine:.0%} of "
            f"section 4's probe and {theirs:.0%} of the line's: " + verdict)


def probes_of(machine, line) -> str:
    """probe_spread_sentence for the lesson's machine (section 4) and bytes line (section 10)."""
    from course.measure.bytes_line import BANDWIDTH_TOLERANCE

    read = machine.read_bytes_per_s or machine.bytes_per_s
    return probe_spread_sentence(read / 1e9, line.probe_bytes_per_s / 1e9, [p / 1e9 for p in line.probes],
                                 line.fit.bandwidth_bytes_per_s / 1e9, BANDWIDTH_TOLERANCE)
