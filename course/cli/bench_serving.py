"""Bench items for serving many requests (lesson 05): batched decode, continuous vs static batching, paged bytes.

    batching       total decode tokens/s at the best batch ÷ at B = 1, and the prediction
                   max((W + B·KV) / bandwidth, B·F / FLOP/s) at that batch (course.lessons.serving.batch_sweep)
    serving        continuous ÷ static throughput on one seeded trace, both p95 latencies, outputs identical
    paged_memory   KV bytes a paged pool reserves ÷ the bytes a mix of requests uses, and the same for
                   preallocated max-length slots (course.engine.serving.memory_on_mix)

batching and serving time the eager model and, beside it (unless --quick or --no-compile), the serving lesson's
engine, FastModel(model, any_shape=True); the targets read the compiled rows when they are there.

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


ANY_SHAPE = "compiled, any shape"


def _engines(ctx) -> dict:
    """The eager model, and beside it (unless --quick or --no-compile) the serving lesson's compiled engine,
    FastModel(model, any_shape=True); the last one listed is the one the targets read."""
    model = ctx.model("float32")
    engines = {"eager": model}
    if ctx.compile and not ctx.quick:
        engines[ANY_SHAPE] = ctx.serving_engine("float32")
    return engines


def _primary(it: dict) -> dict:
    return it["engines"][it["primary"]]


# --- batched decode ---------------------------------------------------------------------------------------------
def _batching_text(it: dict) -> str:
    parts = []
    for name, e in it["engines"].items():
        parts.append(f"{name}: at context {e['context']}, the best batch (B = {e['best_batch']}) gave "
                     f"{e['speedup']:.1f}× the total tokens/s of B = 1; the prediction was "
                     f"{e['best_predicted_over_measured']:.2f}× the measured step there. The step first cost twice "
                     f"the one-sequence step (the faster of B = 1 and B = 2) at B = {e['knee']} (predicted B = "
                     f"{e['predicted_knee']}).")
    if len(it["engines"]) > 1:
        parts.append(f"The targets read the {it['primary']} rows (the serving lesson's engine).")
    return " ".join(parts)


@bench_item("batching", title="Batched decode: total tokens/s against the batch size", columns={
    "engine": "{engine}", "context": "{context}", "B": "{batch}", "ms/step": "{ms:.1f}",
    "predicted ms": "{predicted_ms:.1f}", "predicted ÷ measured": "{predicted_over_measured:.2f}",
    "total tokens/s": "{tokens_per_s:.1f}", "× B = 1": "{x_batch1:.2f}"},
    text=_batching_text,
    targets=[Target("batch_speedup", "decode float32: total tokens/s at the best batch ÷ B = 1", ">=", 6.0,
                    lambda it: _item(_primary(it), "speedup", it["primary"] + ", best B = {best_batch}")),
             Target("batch_prediction_error", "|predicted ÷ measured − 1| of the step at the best batch", "<=", 0.30,
                    lambda it: _item(_primary(it), "best_prediction_error", it["primary"] + ", B = {best_batch}"))])
def bench_batching(ctx) -> dict:
    from course.lessons.serving import batch_sweep
    from course.measure.roofline import Machine

    s = _sizes(ctx)
    machine = Machine(str(ctx.device), "float32", ctx.bandwidth, ctx.probe_flops("float32"))
    rows, summaries = [], {}
    for name, engine in _engines(ctx).items():
        sweep = batch_sweep(engine, machine, contexts=s["batch_contexts"], batches=s["batches"],
                            rounds=s["batch_rounds"], progress=False)
        for c in sweep.contexts:
            points = sweep.at(c)
            for p in points:
                rows.append(dict(engine=name, context=c, batch=p.batch, ms=p.seconds * 1e3,
                                 predicted_ms=p.predicted_s * 1e3, predicted_over_measured=p.predicted_s / p.seconds,
                                 tokens_per_s=p.tokens_per_s, x_batch1=p.tokens_per_s / points[0].tokens_per_s))
        c = sweep.contexts[0]
        best = sweep.best(c)
        ratio = best.predicted_s / best.seconds
        summaries[name] = dict(context=c, best_batch=best.batch, speedup=sweep.speedup(c),
                               best_predicted_over_measured=ratio, best_prediction_error=abs(ratio - 1),
                               knee=sweep.knee(c), predicted_knee=sweep.predicted_knee(c))
    return {"status": "ok", "rows": rows, "engines": summaries, "primary": list(summaries)[-1],
            "bandwidth_bytes_per_s": machine.bytes_per_s, "matmul_flops_per_s": machine.flops_per_s}


# --- continuous vs static batching ------------------------------------------------------------------------------
def _serving_text(it: dict) -> str:
    parts = [f"{it['requests']} requests waiting at the start, most answers short and a quarter long, at most "
             f"{it['max_batch']} at a time."]
    for name, e in it["engines"].items():
        parts.append(f"{name}: continuous batching gave {e['throughput_ratio']:.2f}× static batching's throughput in "
                     f"tokens per {e['ratio_clock']} (median of the rounds; {e['wall_ratio']:.2f}× in wall-clock "
                     f"tokens/s), p95 latency {e['continuous_latency_p95']:.2f} s vs {e['static_latency_p95']:.2f} s; "
                     f"every request's tokens {'were identical' if e['outputs_identical'] else 'DIFFERED'} under "
                     "both policies.")
    e = _primary(it)
    parts.append(f"Independent of the machine's load: static batching needed {e['iterations_ratio']:.2f}× as many "
                 f"forward passes, its slots busy {e['occupancy']['static']:.0%} of the time against "
                 f"{e['occupancy']['continuous']:.0%}.")
    if "compiled_over_eager" in it:
        parts.append(f"Continuous batching on the compiled engine took {it['compiled_over_eager']:.2f}× the "
                     f"{it['ratio_clock']}s of the eager model (median of the rounds; its iterations that carry a "
                     f"prompt run eagerly on both); its tokens "
                     f"{'were identical to' if it['engines_agree'] else 'differed from'} the eager model's.")
    return " ".join(parts)


@bench_item("serving", title="Continuous vs static batching on one trace", columns={
    "engine": "{engine}", "round": "{round}", "policy": "{policy}", "tokens/s": "{throughput:.1f}",
    "tokens per CPU-s": "{cpu_throughput:.1f}", "TTFT p50 s": "{ttft_p50:.2f}",
    "TTFT p95 s": "{ttft_p95:.2f}", "latency p50 s": "{latency_p50:.2f}", "latency p95 s": "{latency_p95:.2f}",
    "slot occupancy": "{slot_occupancy:.0%}", "iterations": "{iterations}",
    "KV reserved ÷ used (peak)": "{reserved_over_used:.3f}"},
    text=_serving_text,
    targets=[Target("continuous_over_static", "trace throughput: continuous ÷ static batching (tokens per CPU-second "
                    "on a CPU, per second on a GPU)", ">=", 1.5,
                    lambda it: _item(_primary(it), "throughput_ratio",
                                     it["primary"] + ", p95 {continuous_latency_p95:.2f} s vs "
                                     "{static_latency_p95:.2f} s")),
             Target("continuous_p95_over_static", "trace p95 latency: continuous ÷ static", "<=", 1.0,
                    lambda it: _item(_primary(it), "p95_ratio", it["primary"]))])
def bench_serving(ctx) -> dict:
    from course.engine.serving import make_trace, serve
    from course.lessons.serving_runs import warm_up

    s = _sizes(ctx)
    model = ctx.model("float32")
    low = 1000 if ctx.real else 0  # past the special and byte tokens of the real vocabulary
    trace = make_trace(s["trace_requests"], seed=0, prompt_len=s["trace_prompt"], new_tokens=s["trace_new"],
                       mean_gap=s["trace_gap"], vocab_size=model.config.vocab_size, low_token=low,
                       long_share=s["trace_long_share"], long_new_tokens=s["trace_long_new"])
    engines = _engines(ctx)
    for engine in engines.values():  # untimed: a compiled engine compiles its steps here
        warm_up(engine, trace, s["serve_batch"], progress=False)
    rows, outputs = [], {}
    results = {(name, policy): [] for name in engines for policy in ("static", "continuous")}
    for r in ctx.progress(range(s["serve_rounds"]), "serving rounds"):
        for name, engine in engines.items():  # side by side, round after round
            for policy in ("static", "continuous"):
                res = serve(engine, trace, policy, s["serve_batch"], block_size=s["block_size"], progress=False)
                outputs.setdefault((name, policy), res.outputs())
                results[(name, policy)].append(res)
                rows.append(dict(engine=name, round=r + 1, **res.summary(),
                                 reserved_over_used=res.peak_bytes_reserved / res.peak_bytes_used))
    # On a CPU shared with other programs, CPU time is the steadier clock: it counts only this server's work
    on_cpu = str(ctx.device).startswith("cpu")
    clock = "CPU-second" if on_cpu else "second"
    summaries = {}
    for name in engines:
        cont, stat = results[(name, "continuous")], results[(name, "static")]
        wall = [c.throughput / st.throughput for c, st in zip(cont, stat)]
        cpu = [c.cpu_throughput / st.cpu_throughput for c, st in zip(cont, stat)]
        ratios = cpu if on_cpu else wall
        p95 = {p: statistics.median(x.latency_p95 for x in results[(name, p)]) for p in ("continuous", "static")}
        summaries[name] = dict(throughput_ratio=statistics.median(ratios), throughput_ratios=ratios,
                               ratio_clock=clock, wall_ratio=statistics.median(wall), wall_ratios=wall,
                               cpu_ratios=cpu, continuous_latency_p95=p95["continuous"],
                               static_latency_p95=p95["static"], p95_ratio=p95["continuous"] / p95["static"],
                               outputs_identical=outputs[(name, "continuous")] == outputs[(name, "static")],
                               iterations_ratio=len(stat[0].timeline) / len(cont[0].timeline),
                               occupancy={"continuous": cont[0].slot_occupancy, "static": stat[0].slot_occupancy})
    out = {"status": "ok", "rows": rows, "requests": len(trace), "max_batch": s["serve_batch"],
           "engines": summaries, "primary": list(engines)[-1], "ratio_clock": clock}
    if ANY_SHAPE in engines:  # the same continuous runs, compiled against eager, round by round
        rate = (lambda x: x.cpu_throughput) if on_cpu else (lambda x: x.throughput)
        per_round = [rate(e) / rate(c) for c, e in zip(results[(ANY_SHAPE, "continuous")],
                                                         results[("eager", "continuous")])]
        out["compiled_over_eager"] = statistics.median(per_round)
        out["engines_agree"] = outputs[(ANY_SHAPE, "continuous")] == outputs[("eager", "continuous")]
    return out


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
