"""Lesson 01's helpers (and lesson 00's first calls). Each timed section measures, passes its figures through a physics gate
(course.measure.gates), records only what passed (course.measure.results) and returns a Report
(course.measure.display): predicted beside measured, one headline, the details folded. The ideas are the
notebook's Markdown; nothing here explains, it only puts numbers in their places.
"""
from __future__ import annotations

import torch

from course.engine.generate import Generation
from course.engine.streaming import stream_answer
from course.measure import bytes_line as BL, gates, latency, machine
from course.measure.costs import decode_cost, dtype_bytes, kv_bytes_per_token, prefill_cost
from course.measure.display import Report, verdict
from course.measure.results import record, record_all, record_gated
from course.measure.roofline import Machine, compare
from course.measure.sweeps import decode_sweep, prefill_sweep, prepare_context

stream_call = stream_answer  # one chat call, streamed, with the time each token arrived


def token_latencies(gen: Generation) -> list[float]:
    """Seconds each token waited: token 1 waits for the whole prefill (TTFT), the rest one decode step."""
    if not gen.token_times:
        raise ValueError("this Generation has no tokens: ask for max_new_tokens >= 1")
    return [gen.token_times[0]] + gen.inter_token_latencies


def _record_run(run: gates.Measured, values: dict) -> None:
    """Record every value of a gated measurement, or list them all as unreliable."""
    for key, value in values.items():
        record_gated(key, run, value)


def _flagged(run: gates.Measured, rows, key: str, headline: str = "Not compared: this machine was too busy.") -> Report:
    """A figure its gate flagged: its one notice printed, its measured column left blank, nothing claimed."""
    print(run.notice)
    return Report([(w, p, None, u) for w, p, _, u in rows], headline, key=key)


def plot_token_timeline(gen: Generation, tokenizer=None, ax=None):
    """Bar per token: how long it waited. The first bar is the prefill; the rest are decode steps."""
    import matplotlib.pyplot as plt

    lat_ms = [s * 1e3 for s in token_latencies(gen)]
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(10, 3.2))
    ax.bar(range(1, len(lat_ms) + 1), lat_ms, color=["tab:orange"] + ["tab:blue"] * (len(lat_ms) - 1))
    ax.set(xlabel="answer tokens, in the order they arrived", ylabel="ms waited for this token",
           title=f"A {len(gen.prompt_ids)}-token prompt: prefill (orange), then one decode step per token (blue)")
    if tokenizer is not None and len(lat_ms) <= 64:
        ax.set_xticks(range(1, len(lat_ms) + 1))
        ax.set_xticklabels([tokenizer.token_text(t) for t in gen.tokens], rotation=90, fontsize=7)
    fig.tight_layout()
    return fig


def cost_table(config, contexts, prompts, dtype=torch.float32) -> str:
    """The bytes and FLOPs of a decode step at each context C and a prefill at each prompt length T."""
    b = dtype_bytes(dtype)
    return "\n".join([f"{'':16}{'GFLOP':>8}{'MB read':>9}{'FLOP/byte':>11}"]
                     + [f"{c.phase + (' C=' if c.phase == 'decode' else ' T=') + str(c.length):16}"
                        f"{c.flops / 1e9:>8.2f}{c.bytes / 1e6:>9.0f}{c.intensity:>11.1f}"
                        for c in [decode_cost(config, n, b) for n in contexts]
                        + [prefill_cost(config, n, b) for n in prompts]])


# --------------------------------------------------------------- predict one decode step, then the bytes line
def decode_question(model, prof) -> str:
    """The prediction's prompt, with the two numbers it needs: bytes per step and this machine's bandwidth."""
    mb = BL.read_bytes(model.config, BL.CONTEXT, model.dtype) / 1e6
    return (f"ms per compiled decode step of {model.config.name}: it reads {mb:.0f} MB, "
            f"and this machine streams {prof.bandwidth_gb_s:.1f} GB/s")


def measure_bytes_line(model, prof, tries: int = 2) -> gates.Measured:
    """The bytes line on the lesson's device and dtype, each point gated: not under its bandwidth floor (bytes ÷ the
    profile's bandwidth), not faster than a smaller model. A compiled step of the course model's shape that passed
    is kept in the profile as its "compiled" figure."""
    def rules(line):
        pts = line.points
        return ([gates.not_below_floor(p.ms_per_step, prof.gate_floor_ms(p.bytes_per_step), f"{p.name}'s step")
                 for p in pts] +  # and a model that reads more bytes is not faster
                [gates.not_cheaper(a.ms_per_step, b.ms_per_step, a.name, b.name) for a, b in zip(pts, pts[1:])])

    run = gates.measured(lambda: BL.bytes_line(device=model.device, dtype=model.dtype), rules, "the bytes line",
                         tries=tries)
    line = run.value
    _record_run(run, {"bytes_line": line.values(), "bytes_line_gb_s": line.fit.bandwidth_bytes_per_s / 1e9})
    if run.ok and line.compiled:
        machine.remember(prof, "compiled", line.points[0].ms_per_step)
        record("decode_compiled_ms", line.points[0].ms_per_step)
    return run


def compiled_ms(run: gates.Measured) -> float | None:
    """The compiled step of the course model's shape (the line's first point); None when unreliable or eager."""
    return run.value.points[0].ms_per_step if run.ok and run.value.compiled else None


def bytes_line_report(run: gates.Measured, prof) -> Report:
    line = run.value
    rows = [(f"{p.name}, {p.bytes_per_step / 1e6:,.0f} MB", prof.floor_ms(p.bytes_per_step), p.ms_per_step, "ms")
            for p in line.points]
    if not run.ok:
        return _flagged(run, rows, "bytes_line", "Not judged: this machine was too busy for the line.")
    head = line.verdict(prof.bandwidth_gb_s * 1e9, "the machine profile")
    return Report(rows, head, ["Predicted: bytes ÷ the profile's bandwidth, with no fixed cost."] + line.details(),
                  title="One decode step per model shape: the bandwidth floor against the measured time",
                  key="bytes_line")


def plot_bytes_line(run: gates.Measured, prof):
    return run.value.plot(reference_bytes_per_s=prof.bandwidth_gb_s * 1e9, reference="machine profile") if run.ok else None


# ------------------------------------------------------------------------------------ eager against compiled
def count_ops(model, context: int = 16) -> tuple[int, int]:
    """(all tensor operations, matrix products) one eager decode step dispatches, counted at the ATen level."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        total = matmuls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.total += 1
            self.matmuls += func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "matmul", "linear")
            return func(*args, **(kwargs or {}))

    cache, _ = prepare_context(model, context)
    token = torch.ones(1, 1, dtype=torch.long, device=model.device)
    with torch.inference_mode(), Counter() as counter:
        model(token, start_pos=context, cache=cache, last_only=True)
    return counter.total, counter.matmuls


def eager_vs_compiled(model, prof, line_run: gates.Measured) -> Report:
    """The profile's eager step beside the bytes line's compiled step of the same shape: same bytes, two engines."""
    floor_e = prof.floor_ms(machine.step_bytes(model.config, prof.dtype))
    eager = prof.decode_ms["eager"]
    compiled = compiled_ms(line_run)
    floor_c = prof.floor_ms(line_run.value.points[0].bytes_per_step)
    n_ops, n_mm = count_ops(model)
    record("eager_over_floor", eager / floor_e)
    rows = [("eager step (16 cached)", floor_e, eager, "ms"), ("compiled step (64 cached)", floor_c, compiled, "ms")]
    if compiled is None:
        return Report(rows, f"The eager step took {eager / floor_e:.1f}× its bandwidth floor; no reliable compiled "
                            "step to set beside it in this run.", key="eager_vs_compiled")
    record("compiled_over_floor", compiled / floor_c)
    head = f"Same bytes, two engines: eager took {eager / floor_e:.1f}× the floor, compiled {compiled / floor_c:.1f}×."
    details = [f"An eager step dispatches {n_ops:,} tensor operations, {n_mm} of them matrix products.",
               "Eager: the machine profile's step. Compiled: the bytes line's point for this shape."]
    if eager <= compiled * (1 + gates.NOISE):
        return Report(rows, head + " No gap between them in this run.", details, key="eager_vs_compiled")
    details.insert(1, f"Spread over the other {n_ops - n_mm:,}, the {eager - compiled:.0f} ms gap is "
                      f"{(eager - compiled) / (n_ops - n_mm) * 1e3:.0f} µs per operation.")
    return Report(rows, head + " The gap is per-operation overhead, not memory traffic.", details,
                  key="eager_vs_compiled")


# ------------------------------------------------------------------------------------------------ the sweeps
def measure_sweeps(model, prof, sizes, tries: int = 2) -> gates.Measured:
    """Both sweeps (eager), gated: a longer prompt or context is never cheaper, and no point beats its roofline
    time on the machine profile's roofs."""
    roofs = Machine.from_profile(prof)

    def rules(sw):
        pre, dec = sw
        out = [gates.not_cheaper(a, b, f"T = {s:,}", f"T = {t:,}")
               for (s, a), (t, b) in zip(zip(pre.lengths, pre.ms), list(zip(pre.lengths, pre.ms))[1:])]
        out.append(gates.not_cheaper(dec.ms[0], dec.ms[-1], f"C = {dec.lengths[0]:,}", f"C = {dec.lengths[-1]:,}"))
        out += [gates.not_below_floor(p.measured_s * 1e3, p.predicted_s * 1e3, f"{p.phase} at {p.tokens:,}")
                for p in compare(model.config, pre, dec, roofs) if not prof.busy]  # a busy profile's roofs sit low
        return out

    run = gates.measured(lambda: (prefill_sweep(model, sizes.prefill), decode_sweep(model, sizes.decode)), rules,
                         "the sweep of both phases", tries=tries)
    pre, dec = run.value
    floor = prof.floor_ms(decode_cost(model.config, dec.lengths[0], dtype_bytes(model.dtype)).bytes)
    record("bandwidth_gb_s", prof.bandwidth_gb_s)  # the one figure every lesson quotes (the quiz cites it)
    record("decode_floor_ms", floor)
    _record_run(run, {**pre.values(), **dec.values()})
    return run


def _middle_prompt(pre) -> int:
    return 256 if 256 in pre.lengths else pre.lengths[len(pre.lengths) // 2]


def prefill_over_decode(run: gates.Measured) -> float | None:
    """Prefill's tokens/s at T = 256 over eager decode's at the shortest context; None when the sweeps were flagged."""
    pre, dec = run.value
    T = _middle_prompt(pre)
    return T / pre.at(T) / dec.tokens_per_s[0] if run.ok else None


def sweeps_report(run: gates.Measured, model, prof) -> Report:
    pre, dec = run.value
    T = _middle_prompt(pre)
    points = {(p.phase, p.tokens): p for p in compare(model.config, pre, dec, Machine.from_profile(prof))}
    shown = [("prefill", T, f"prefill, T = {T:,} (whole prompt)")] + [
        ("decode", c, f"decode step, C = {c:,} (eager)") for c in (dec.lengths[0], dec.lengths[-1])]
    rows = [(label, points[k, n].predicted_s * 1e3, points[k, n].measured_s * 1e3, "ms") for k, n, label in shown]
    if not run.ok:
        return _flagged(run, rows, "sweeps", "Not compared: the sweeps were unreliable on this busy machine.")
    ratio = record("prefill_over_decode_tokens_per_s", prefill_over_decode(run))
    kv_ms = prof.floor_ms(kv_bytes_per_token(model.config, dtype_bytes(model.dtype))) * (dec.lengths[-1] - dec.lengths[0])
    return Report(rows, f"Per token, prefill at T = {T} ran {ratio:.0f}× faster than eager decode: one read of the "
                        f"weights served all {T} prompt tokens.",
                  ["Predicted: the roofline time, the slower of bytes ÷ bandwidth and FLOPs ÷ FLOP/s: a lower bound.",
                   f"From C = {dec.lengths[0]:,} to {dec.lengths[-1]:,} the cache adds {kv_ms:.2f} ms of reads at "
                   f"{prof.bandwidth_gb_s:.1f} GB/s; measured: {dec.ms[-1] - dec.ms[0]:+.2f} ms.",
                   f"Same step, another moment: the sweep's C = {dec.lengths[0]} step took {dec.ms[0]:.0f} ms, the "
                   f"machine profile's {prof.decode_ms['eager']:.0f} ms.",
                   "Each point is a median of repeats; decode steps were timed in rounds across the contexts."],
                  key="sweeps")


def plot_sweeps(run: gates.Measured):
    from course.measure.sweeps import plot_sweeps as plot

    return plot(*run.value) if run.ok else None


def roofline_report(run: gates.Measured, model, prof) -> Report:
    """Where each phase sits against the ridge, and the roofline plot (drawn only from figures that passed)."""
    from course.measure.roofline import plot_roofline

    if not run.ok:
        return Report([], "Not drawn: the sweeps were unreliable on this busy machine.", key="roofline")
    roofs = Machine.from_profile(prof)
    points = compare(model.config, *run.value, roofs)
    plot_roofline(roofs, points)
    dec, pre = points[len(run.value[0].lengths)], points[len(run.value[0].lengths) - 1]
    record("ridge_flop_per_byte", roofs.ridge)
    record("decode_intensity", dec.cost.intensity)
    record("decode_bound", dec.bound)
    return Report([], f"Decode at C = {dec.tokens}: {dec.cost.intensity:.2f} FLOP/byte, {dec.bound}-bound. Prefill at "
                      f"T = {pre.tokens:,}: {pre.cost.intensity:.0f} FLOP/byte, {pre.bound}-bound. "
                      f"Ridge: {roofs.ridge:.1f}.",
                  [f"Roofs from the machine profile: {prof.bandwidth_gb_s:.1f} GB/s and {prof.gflop_s:.0f} GFLOP/s.",
                   f"Eager decode reached {dec.predicted_s / dec.measured_s:.0%} of its memory roof."],
                  key="roofline")


# --------------------------------------------------------------------------- the latency model and the checkpoint
def fit(run: gates.Measured) -> latency.LatencyModel | None:
    """The latency model fitted to the sweeps (None when they were unreliable); its two formulas print."""
    if not run.ok:
        print("No fit: the sweeps it would be fitted to were unreliable.")
        return None
    lm = latency.fit_latency_model(*run.value)
    record_all(lm.values())
    print(lm)
    return lm


def held_out(model, lm, sizes, prof, tries: int = 2) -> gates.Measured | None:
    """A generate() call at sizes the sweeps never measured (None without a fit), gated: a long prompt's first
    token takes at least one decode step, and no step beats its bandwidth floor."""
    if lm is None:
        return None
    floor = prof.gate_floor_ms(decode_cost(model.config, sizes.held_out_prompt, dtype_bytes(model.dtype)).bytes)
    return gates.measured(
        lambda: latency.held_out_check(model, lm, sizes.held_out_prompt, sizes.held_out_new, sizes.held_out_repeats),
        lambda h: [gates.at_least(h.measured_ttft_s, h.measured_itl_s, f"TTFT of a {h.prompt_len}-token prompt",
                                  "one decode step"),
                   gates.not_below_floor(h.measured_itl_s * 1e3, floor, "a decode step")],
        "the held-out run", tries=tries)


def held_out_report(run: gates.Measured | None, tolerance: float) -> Report:
    """The held-out run against the fit: it holds when every figure lands within ±tolerance of its prediction."""
    if run is None:
        return Report([], "Not checked: there is no fit in this run.", key="held_out")
    ho, rows = run.value, run.value.rows()
    if not run.ok:
        return _flagged(run, rows, "held_out", "Not checked: the held-out run was unreliable here.")
    judged = [(what, *verdict(p, m, tolerance)) for what, p, m, _ in rows]
    record_all({**ho.values(), "heldout_within": all(ok for _, ok, _ in judged)})
    misses = [(what, words) for what, ok, words in judged if not ok]
    head = (f"The fit predicted a run it never saw: all three figures within ±{tolerance:.0%}." if not misses else
            f"The fit missed a run it never saw: {misses[0][0]} came out {misses[0][1]}.")
    return Report(rows, head, [f"Held-out run: a {ho.prompt_len:,}-token prompt, {ho.n_out} tokens out, median of "
                               "a few runs, eager.", "Its prompt length is one the prefill sweep never measured."],
                  key="held_out")


def plot_fit(run: gates.Measured, lm, held: gates.Measured | None = None):
    if lm is None:
        return None
    return latency.plot_latency_fit(*run.value, lm, held.value if held is not None and held.ok else None)


def checkpoint_report(lm, held: gates.Measured | None = None) -> Report:
    """The checkpoint's two requests priced by the fit; the held-out run's error on the whole call (when it passed
    its gate) decides whether the gap between them is larger than the fit's own miss."""
    held_error = held.value.predicted_s / held.value.measured_s - 1 if held is not None and held.ok else None
    if lm is None:
        return Report([], "Not answered with numbers: there is no fit in this run.", key="checkpoint")
    ab = latency.checkpoint_ab(lm)
    record_all(latency.ab_values(ab))
    A, B, x = ab["A"], ab["B"], ab["exchange"]
    rows = [(f"{k}: {r['prompt_tokens']:,} in, {r['output_tokens']:,} out", r["total_s"], None, "s")
            for k, r in (("A", A), ("B", B))]
    slow, fast = max(A["total_s"], B["total_s"]), min(A["total_s"], B["total_s"])
    e = min(abs(held_error or 0.0), 0.95)
    details = [f"A: {A['ttft_s']:.1f} s of prefill, {A['decode_s']:.1f} s of decode. "
               f"B: {B['ttft_s']:.1f} s and {B['decode_s']:.1f} s.",
               "Both lie beyond the swept lengths: the fit extrapolates (dashed in the plot)."]
    if slow * (1 - e) <= fast * (1 + e):
        return Report(rows, f"Too close to call here: the fit missed its held-out run by {e:.0%}, more than the "
                            "gap between A and B.", details, key="checkpoint")
    record("ab_ratio", slow / fast)
    price = x["output_in_prompt_tokens"]
    if price is not None:
        record("output_token_in_prompt_tokens", price)
        details.insert(1, f"Around {x['context']:,.0f} tokens of context: one output token {x['per_output_token_s'] * 1e3:.1f}"
                          f" ms, one more prompt token {x['per_prompt_token_s'] * 1e3:.2f} ms.")
    why = (f"one output token costs as much time as {price:,.0f} prompt tokens here." if price is not None
           else "its output tokens are sequential decode steps.")
    other = "A" if ab["slower"] == "B" else "B"
    return Report(rows, f"{ab['slower']} takes {slow / fast:.1f}× as long as {other}: {why}", details,
                  key="checkpoint")


# ------------------------------------------------------------------------------- lesson 00: the first calls
def first_calls_report(model, tokenizer, prompt_ids, cold: Generation, answer: Generation, prof) -> Report:
    """The cold call's first token against a warm one (a cold call is never faster beyond noise) and each later
    token against the machine profile's eager step; a violation times the warm call again."""
    from course.engine.generate import generate

    first = iter([answer])
    run = gates.measured(
        lambda: next(first, None) or generate(model, prompt_ids, 8, eos_id=tokenizer.eos_id),
        lambda g: [gates.at_least(cold.time_to_first_token, g.time_to_first_token, "the cold first token",
                                  "a warm one"),
                   gates.not_below_floor(g.mean_inter_token_latency * 1e3,
                                         prof.gate_floor_ms(machine.step_bytes(model.config, prof.dtype)),
                                         "a later token")],
        "the first calls' timing")
    warm, cold_ms = run.value, cold.time_to_first_token * 1e3
    warm_ms, itl_ms = warm.time_to_first_token * 1e3, warm.mean_inter_token_latency * 1e3
    _record_run(run, {"start_cold_ttft_ms": cold_ms, "start_ttft_ms": warm_ms, "start_itl_ms": itl_ms,
                      "start_tokens_per_s": 1e3 / itl_ms})
    rows = [("first token, cold", None, cold_ms, "ms"), ("first token, warm", None, warm_ms, "ms"),
            ("each later token, eager", prof.decode_ms["eager"], itl_ms, "ms")]
    if not run.ok:
        return _flagged(run, rows, "first_calls")
    ratio = cold_ms / warm_ms
    head = (f"The cold call's first token took {ratio:.1f}× a warm one: costs paid once after loading, not the "
            "model's speed." if ratio >= 1 + gates.NOISE else
            f"Cold and warm first tokens took the same time within noise ({ratio:.2f}×): the one-off costs were too "
            "small to see here.")
    return Report(rows, head, ["Predicted for a later token: the machine profile's eager decode step.",
                               f"The short question's first token took {warm_ms / itl_ms:.1f}× a later one: its "
                               f"{len(prompt_ids)} prompt tokens are few."], key="first_calls")


def long_prompt(model, n_tokens: int = 600, n_out: int = 8) -> gates.Measured:
    """One call with an `n_tokens` prompt of random ids (speed depends on how many tokens, not which), gated: its
    first token takes at least one decode step."""
    from course.engine.generate import generate
    from course.measure.sweeps import random_prompt

    ids = random_prompt(model, n_tokens)[0].tolist()
    return gates.measured(lambda: generate(model, ids, n_out),
                          lambda g: [gates.at_least(g.time_to_first_token, g.mean_inter_token_latency,
                                                    f"TTFT of a {n_tokens}-token prompt", "one decode step")],
                          "the long prompt's timing")


def long_prompt_report(run: gates.Measured, prof) -> Report:
    g = run.value
    ttft, itl = g.time_to_first_token * 1e3, g.mean_inter_token_latency * 1e3
    n = len(g.prompt_ids)
    _record_run(run, {"start_long_prompt_tokens": n, "start_long_ttft_ms": ttft, "start_long_itl_ms": itl})
    rows = [(f"first token, {n}-token prompt", None, ttft, "ms"), ("each later token, eager", prof.decode_ms["eager"],
                                                                    itl, "ms")]
    if not run.ok:
        return _flagged(run, rows, "long_prompt")
    plot_token_timeline(g)
    return Report(rows, f"With a {n}-token prompt the first token took {ttft / itl:.0f}× a later one: prefill reads "
                        "the whole prompt before anything streams.",
                  ["The prompt is random token ids: speed depends on how many tokens, not which."], key="long_prompt")
