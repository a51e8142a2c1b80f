"""Bench items for serving many requests (lesson 05): batched decode, continuous vs static batching, paged bytes.

    batching       total decode tokens/s at the best batch ÷ at B = 1, and the prediction
                   max((W + B·KV) / bandwidth, B·F / FLOP/s) at that batch (course.lessons.serving.batch_sweep)
    serving        continuous ÷ static throughput on one seeded trace, both p95 latencies, outputs identical
    paged_memory   KV bytes a paged pool reserves ÷ the bytes a mix of requests uses, and the same for
                   preallocated max-length slots (course.engine.serving.memory_on_mix)

Registered by name in course/cli/bench.py's ITEM_MODULES; they live here, at the top layer, because the batch
sweep is the lesson's own helper (one sweep, not two).
"""
from __future__ import annotations

import statistics

from course.measure.bench import Target, bench_item

# sizes: full run, --quick (tiny model sizes are used when the suite runs on the tiny model)
FULL = dict(batch_contexts=[64], batches=[1, 2, 4, 8, 16, 32, 64], batch_rounds=3,
            trace_requests=32, trace_prompt=(8, 24), trace_new=(2, 8), trace_long_share=0.25,
            trace_long_new=(48, 96), trace_gap=0.0, serve_batch=8,
            serve_rounds=3, mix_requests=200, mix_prompt=(16, 512), mix_new=(16, 512), mix_max_seq_len=2048,
            block_size=16)
QUICK = dict(batch_contexts=[16], batches=[1, 2, 4], batch_rounds=1,
             trace_requests=6, trace_prompt=(3, 8), trace_new=(2, 4), trace_long_share=0.3,
             trace_long_new=(8, 12), trace_gap=0.0, serve_batch=3,
             serve_rounds=1, mix_requests=40, mix_prompt=(4, 64), mix_new=(4, 64), mix_max_seq_len=128,
             block_size=16)


def _sizes(ctx) -> dict:
    return QUICK if ctx.quick or not ctx.real else FULL


def _item(it: dict, key: str, note: str = "") -> tuple:
    return (it.get(key), note.format(**it) if key in it else "")


# --- batched decode ---------------------------------------------------------------------------------------------
@bench_item("batching", title="Batched decode: total tokens/s against the batch size", columns={
    "context": "{context}", "B": "{batch}", "ms/step": "{ms:.1f}", "predicted ms": "{predicted_ms:.1f}",
    "predicted ÷ measured": "{predicted_over_measured:.2f}", "total tokens/s": "{tokens_per_s:.1f}",
    "× B = 1": "{x_batch1:.2f}"},
    text=lambda it: (f"At context {it['context']}, the best batch (B = {it['best_batch']}) gave "
                     f"{it['speedup']:.1f}× the total tokens/s of B = 1; the prediction was "
                     f"{it['best_predicted_over_measured']:.2f}× the measured step there. The step first cost twice "
                     f"B = 1's at B = {it['knee']} (predicted B = {it['predicted_knee']})."),
    targets=[Target("batch_speedup", "decode float32: total tokens/s at the best batch ÷ B = 1", ">=", 6.0,
                    lambda it: _item(it, "speedup", "best B = {best_batch}")),
             Target("batch_prediction_error", "|predicted ÷ measured − 1| of the step at the best batch", "<=", 0.30,
                    lambda it: _item(it, "best_prediction_error", "B = {best_batch}"))])
def bench_batching(ctx) -> dict:
    from course.lessons.serving import batch_sweep
    from course.measure.roofline import Machine

    s = _sizes(ctx)
    model = ctx.model("float32")
    machine = Machine(str(ctx.device), "float32", ctx.bandwidth, ctx.probe_flops("float32"))
    sweep = batch_sweep(model, machine, contexts=s["batch_contexts"], batches=s["batches"],
                        rounds=s["batch_rounds"], progress=False)
    rows = []
    for c in sweep.contexts:
        points = sweep.at(c)
        for p in points:
            rows.append(dict(context=c, batch=p.batch, ms=p.seconds * 1e3, predicted_ms=p.predicted_s * 1e3,
                             predicted_over_measured=p.predicted_s / p.seconds, tokens_per_s=p.tokens_per_s,
                             x_batch1=p.tokens_per_s / points[0].tokens_per_s))
    c = sweep.contexts[0]
    best = sweep.best(c)
    ratio = best.predicted_s / best.seconds
    return {"status": "ok", "rows": rows, "context": c, "best_batch": best.batch, "speedup": sweep.speedup(c),
            "best_predicted_over_measured": ratio, "best_prediction_error": abs(ratio - 1),
            "knee": sweep.knee(c), "predicted_knee": sweep.predicted_knee(c),
            "bandwidth_bytes_per_s": machine.bytes_per_s, "matmul_flops_per_s": machine.flops_per_s}


# --- continuous vs static batching ------------------------------------------------------------------------------
@bench_item("serving", title="Continuous vs static batching on one trace", columns={
    "round": "{round}", "policy": "{policy}", "tokens/s": "{throughput:.1f}",
    "tokens per CPU-s": "{cpu_throughput:.1f}", "TTFT p50 s": "{ttft_p50:.2f}",
    "TTFT p95 s": "{ttft_p95:.2f}", "latency p50 s": "{latency_p50:.2f}", "latency p95 s": "{latency_p95:.2f}",
    "slot occupancy": "{slot_occupancy:.0%}", "iterations": "{iterations}",
    "KV reserved ÷ used (peak)": "{reserved_over_used:.3f}"},
    text=lambda it: (f"{it['requests']} requests waiting at the start, most answers short and a quarter long, at most "
                     f"{it['max_batch']} at a time: continuous batching gave "
                     f"{it['throughput_ratio']:.2f}× static batching's throughput in tokens per {it['ratio_clock']} "
                     f"(median of the rounds; {it['wall_ratio']:.2f}× in wall-clock tokens/s), p95 latency "
                     f"{it['continuous_latency_p95']:.2f} s vs {it['static_latency_p95']:.2f} s. Independent of the machine's "
                     f"load: static batching needed {it['iterations_ratio']:.2f}× as many forward passes, its slots busy "
                     f"{it['occupancy']['static']:.0%} of the time against {it['occupancy']['continuous']:.0%}. "
                     f"Every request's tokens "
                     f"{'were identical' if it['outputs_identical'] else 'DIFFERED'} under both policies."),
    targets=[Target("continuous_over_static", "trace throughput: continuous ÷ static batching (tokens per CPU-second "
                    "on a CPU, per second on a GPU)", ">=", 1.5,
                    lambda it: _item(it, "throughput_ratio", "p95 {continuous_latency_p95:.2f} s vs "
                                                              "{static_latency_p95:.2f} s")),
             Target("continuous_p95_over_static", "trace p95 latency: continuous ÷ static", "<=", 1.0,
                    lambda it: _item(it, "p95_ratio"))])
def bench_serving(ctx) -> dict:
    from course.engine.serving import make_trace, serve

    s = _sizes(ctx)
    model = ctx.model("float32")
    low = 1000 if ctx.real else 0  # past the special and byte tokens of the real vocabulary
    trace = make_trace(s["trace_requests"], seed=0, prompt_len=s["trace_prompt"], new_tokens=s["trace_new"],
                       mean_gap=s["trace_gap"], vocab_size=model.config.vocab_size, low_token=low,
                       long_share=s["trace_long_share"], long_new_tokens=s["trace_long_new"])
    rows, outputs, results = [], {}, {"continuous": [], "static": []}
    serve(model, trace[:2], "continuous", 2, block_size=s["block_size"], progress=False)  # warm-up
    for r in ctx.progress(range(s["serve_rounds"]), "serving rounds"):
        for policy in ("static", "continuous"):  # side by side, round after round
            res = serve(model, trace, policy, s["serve_batch"], block_size=s["block_size"], progress=False)
            outputs.setdefault(policy, res.outputs())
            results[policy].append(res)
            rows.append(dict(round=r + 1, **res.summary(),
                             reserved_over_used=res.peak_bytes_reserved / res.peak_bytes_used))
    pairs = list(zip(results["continuous"], results["static"]))
    wall = [c.throughput / st.throughput for c, st in pairs]
    cpu = [c.cpu_throughput / st.cpu_throughput for c, st in pairs]
    # On a CPU shared with other programs, CPU time is the steadier clock: it counts only this server's work
    on_cpu = str(ctx.device).startswith("cpu")
    ratios = cpu if on_cpu else wall
    p95 = {p: statistics.median(x.latency_p95 for x in results[p]) for p in results}
    return {"status": "ok", "rows": rows, "requests": len(trace), "max_batch": s["serve_batch"],
            "throughput_ratio": statistics.median(ratios), "throughput_ratios": ratios,
            "ratio_clock": "CPU-second" if on_cpu else "second", "wall_ratio": statistics.median(wall),
            "wall_ratios": wall, "cpu_ratios": cpu,
            "continuous_latency_p95": p95["continuous"], "static_latency_p95": p95["static"],
            "p95_ratio": p95["continuous"] / p95["static"],
            "outputs_identical": outputs["continuous"] == outputs["static"],
            "iterations_ratio": len(results["static"][0].timeline) / len(results["continuous"][0].timeline),
            "occupancy": {p: results[p][0].slot_occupancy for p in results}}


# --- paged vs preallocated bytes --------------------------------------------------------------------------------
@bench_item("paged_memory", title="KV bytes on a mix of requests: paged blocks vs preallocated slots", columns={
    "requests": "{requests}", "block size": "{block_size}", "max_seq_len": "{max_seq_len}",
    "used MB": lambda r: f"{r['used'] / 1e6:.1f}", "paged MB": lambda r: f"{r['paged'] / 1e6:.1f}",
    "preallocated MB": lambda r: f"{r['preallocated'] / 1e6:.1f}", "paged ÷ used": "{paged_over_used:.3f}",
    "preallocated ÷ used": "{preallocated_over_used:.2f}", "paged ÷ preallocated": "{paged_over_preallocated:.3f}"},
    text=lambda it: (f"Every request resident at its full length; a preallocating server reserves max_seq_len = "
                     f"{it['max_seq_len']} positions per request (the longest it accepts). Paged blocks waste "
                     f"{it['paged_over_used'] - 1:.1%} of the bytes used, preallocated slots "
                     f"{1 - 1 / it['preallocated_over_used']:.0%} of what they reserve. Even slots cut to this mix's "
                     f"longest request ({it['longest_request']} positions, known only afterwards) reserve "
                     f"{it['preallocated_at_longest_over_used']:.2f}× the bytes used."),
    targets=[Target("paged_over_used", "paged KV bytes ÷ bytes the requests use", "<=", 1.05,
                    lambda it: _item(it, "paged_over_used")),
             Target("preallocated_over_used", "preallocated KV bytes ÷ bytes used", ">=", 2.0,
                    lambda it: _item(it, "preallocated_over_used"))])
def bench_paged_memory(ctx) -> dict:
    from course.engine.serving import make_trace, memory_on_mix

    s = _sizes(ctx)
    config = ctx.model("float32").config
    mix = make_trace(s["mix_requests"], seed=1, prompt_len=s["mix_prompt"], new_tokens=s["mix_new"],
                     vocab_size=config.vocab_size)
    m = memory_on_mix(config, mix, block_size=s["block_size"], max_seq_len=s["mix_max_seq_len"])
    tight = memory_on_mix(config, mix, block_size=s["block_size"])  # slots only as long as the longest request
    row = dict(requests=len(mix), **m, paged_over_preallocated=m["paged"] / m["preallocated"],
               longest_request=tight["max_seq_len"], preallocated_at_longest_over_used=tight["preallocated_over_used"])
    return {"status": "ok", "rows": [row], **row}
