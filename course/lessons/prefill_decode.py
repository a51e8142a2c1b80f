"""Lesson 01's own helpers: one streamed call and its token timeline, recording values, the interview answers."""
from __future__ import annotations

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
    decode_memory = v.get("decode_bound", "memory" if v["decode_intensity"] < ridge else "compute") == "memory"
    second = (
        "Q: Why is decode memory-bandwidth-bound?\n"
        f"A: One decode step reads every weight ({v['weight_mb']:.0f} MB here in {v.get('dtype', 'this dtype')}) "
        f"plus the K and V of every cached token ({v['kv_mb_at_max_context']:.1f} MB at "
        f"{v['decode_contexts'][-1]:,} tokens) to do only {v['decode_gflop']:.2f} GFLOP: "
        f"{v['decode_intensity']:.2f} FLOPs per byte, {'below' if v['decode_intensity'] < ridge else 'above'} this "
        f"machine's ridge of {ridge:.1f} FLOPs per byte. The arithmetic would take "
        f"{v['decode_gflop'] / v['matmul_gflop_s'] * 1e3:.1f} ms at {v['matmul_gflop_s']:.0f} GFLOP/s, moving the bytes "
        f"{v['decode_floor_ms']:.1f} ms at {v['bandwidth_gb_s']:.1f} GB/s, so "
        + (("memory is the wall the step hits first, "
            + (f"and the cache raises it as the context grows ({decode_ms[0]:.1f} → {decode_ms[-1]:.1f} ms per token "
               f"from {v['decode_contexts'][0]:,} to {v['decode_contexts'][-1]:,} tokens). "
               if decode_ms[-1] > decode_ms[0] else
               f"and the cache raises it as the context grows - though here the cache at {v['decode_contexts'][-1]:,} "
               f"tokens is small next to the weights, and timing noise hid its cost ({decode_ms[0]:.1f} → "
               f"{decode_ms[-1]:.1f} ms per token). "))
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
