"""Serving many requests (lesson 05): the batch sweep, continuous against static batching, paged KV bytes.

    batching       total decode tokens/s at the best batch ÷ at B = 1, and the prediction
                   max((W + B·KV) / bandwidth, B·F / FLOP/s) there (course.lessons.serving.batch_sweep, the lesson's own)
    serving        continuous ÷ static throughput on one trace, both p95 latencies, outputs identical
    paged_memory   KV bytes a paged pool reserves ÷ the bytes a mix of requests uses, and the same for
                   preallocated max-length slots (course.engine.serving.memory_on_mix)

batching and serving time the eager model and, beside it (unless --quick or --no-compile), the serving lesson's
engine FastModel(model, any_shape=True); the targets read the compiled rows when they are there.
"""
from __future__ import annotations

import statistics

from bench.core import QUICK, Item, Target, refused

ANY_SHAPE = "compiled, any shape"


def _sizes(ctx) -> dict:
    return QUICK if ctx.quick or not ctx.real else ctx.sizes  # the tiny model's short context takes the small sizes


def _primary(it: dict) -> dict:
    return it["engines"].get(it["primary"], {})


def _of_primary(key: str, note: str = ""):
    def measure(it):
        e = _primary(it)
        return (e.get(key), note.format(**e) if key in e else "refused or not measured")
    return measure


# --- batched decode --------------------------------------------------------------------------------------------
def bench_batching(ctx) -> dict:
    from course.lessons.serving import batch_sweep
    from course.measure.roofline import Machine

    s = _sizes(ctx)
    machine = Machine(str(ctx.device), "float32", ctx.bandwidth, ctx.probe_flops("float32"))
    rows, summaries = [], {}
    engines = ctx.engines("float32", any_shape=True)
    for name, engine in engines.items():
        sweep = batch_sweep(engine, machine, contexts=[16 if s is QUICK else 64], batches=s["batches"],
                            rounds=s["sweep_rounds"], progress=False)
        no = refused(name, engine)
        if no:
            rows.append(no)
            continue
        c = sweep.contexts[0]
        points = sweep.at(c)
        rows += [dict(engine=name, context=c, batch=p.batch, ms=p.seconds * 1e3, predicted_ms=p.predicted_s * 1e3,
                      predicted_over_measured=p.predicted_s / p.seconds, tokens_per_s=p.tokens_per_s,
                      x_batch1=p.tokens_per_s / points[0].tokens_per_s) for p in points]
        top = sweep.best(c)
        ratio = top.predicted_s / top.seconds
        summaries[name] = dict(context=c, best_batch=top.batch, speedup=sweep.speedup(c),
                               best_predicted_over_measured=ratio, best_prediction_error=abs(ratio - 1),
                               knee=sweep.knee(c), predicted_knee=sweep.predicted_knee(c))
    return {"status": "ok", "rows": rows, "engines": summaries, "primary": list(engines)[-1],
            "bandwidth_bytes_per_s": machine.bytes_per_s, "matmul_flops_per_s": machine.flops_per_s}


BATCHING = Item(bench_batching, "Batched decode: total tokens/s against the batch size", columns={
    "engine": "{engine}", "context": "{context}", "B": "{batch}", "ms/step": "{ms:.1f}",
    "predicted ms": "{predicted_ms:.1f}", "predicted ÷ measured": "{predicted_over_measured:.2f}",
    "total tokens/s": "{tokens_per_s:.1f}", "× B = 1": "{x_batch1:.2f}"},
    text=lambda it: " ".join(f"{name}: best B = {e['best_batch']} gave {e['speedup']:.1f}× the total tokens/s of "
                             f"B = 1; knee at B = {e['knee']} (predicted {e['predicted_knee']})."
                             for name, e in it["engines"].items()),
    targets=[Target("batch_speedup", "decode float32: total tokens/s at the best batch ÷ B = 1", ">=", 6.0,
                    _of_primary("speedup", "best B = {best_batch}")),
             Target("batch_prediction_error", "|predicted ÷ measured − 1| of the step at the best batch", "<=", 0.30,
                    _of_primary("best_prediction_error", "B = {best_batch}"))])


# --- continuous vs static batching -----------------------------------------------------------------------------
def bench_serving(ctx) -> dict:
    from course.engine.serving import make_trace, serve
    from course.lessons.serving_runs import warm_up

    s, model = _sizes(ctx), ctx.model("float32")
    trace = make_trace(s["trace_requests"], seed=0, prompt_len=s["trace_prompt"], new_tokens=s["trace_new"],
                       mean_gap=0.0, vocab_size=model.config.vocab_size, low_token=1000 if ctx.real else 0,
                       long_share=0.25, long_new_tokens=s["trace_long_new"])
    engines = ctx.engines("float32", any_shape=True)
    for engine in engines.values():  # untimed: a compiled engine compiles its steps here
        warm_up(engine, trace, s["serve_batch"], progress=False)
    rows, outputs = [], {}
    results = {(name, policy): [] for name in engines for policy in ("static", "continuous")}
    for r in ctx.progress(range(s["serve_rounds"]), "serving rounds"):
        for name, engine in engines.items():  # side by side, round after round
            for policy in ("static", "continuous"):
                res = serve(engine, trace, policy, s["serve_batch"], block_size=16, progress=False)
                outputs.setdefault((name, policy), res.outputs())
                results[(name, policy)].append(res)
                rows.append(dict(engine=name, round=r + 1, **res.summary(),
                                 reserved_over_used=res.peak_bytes_reserved / res.peak_bytes_used))
    on_cpu = ctx.device.type == "cpu"  # on a shared CPU, CPU time counts only this server's work: the steadier clock
    rate = (lambda x: x.cpu_throughput) if on_cpu else (lambda x: x.throughput)
    summaries, refusals = {}, [no for name, e in engines.items() if (no := refused(name, e))]
    for name in engines:
        if any(no["engine"] == name for no in refusals):
            continue
        cont, stat = results[(name, "continuous")], results[(name, "static")]
        p95 = {p: statistics.median(x.latency_p95 for x in results[(name, p)]) for p in ("continuous", "static")}
        summaries[name] = dict(throughput_ratio=statistics.median(rate(c) / rate(st) for c, st in zip(cont, stat)),
                               wall_ratio=statistics.median(c.throughput / st.throughput for c, st in zip(cont, stat)),
                               continuous_latency_p95=p95["continuous"], static_latency_p95=p95["static"],
                               p95_ratio=p95["continuous"] / p95["static"],
                               outputs_identical=outputs[(name, "continuous")] == outputs[(name, "static")],
                               iterations_ratio=len(stat[0].timeline) / len(cont[0].timeline))
    out = {"status": "ok", "rows": [r for r in rows if not any(r["engine"] == no["engine"] for no in refusals)]
           + refusals, "requests": len(trace), "max_batch": s["serve_batch"], "engines": summaries,
           "primary": list(engines)[-1], "ratio_clock": "CPU-second" if on_cpu else "second"}
    if ANY_SHAPE in summaries:  # the same continuous runs, compiled against eager, round by round
        out["compiled_over_eager"] = statistics.median(
            rate(e) / rate(c) for c, e in zip(results[(ANY_SHAPE, "continuous")], results[("eager", "continuous")]))
        out["engines_agree"] = outputs[(ANY_SHAPE, "continuous")] == outputs[("eager", "continuous")]
    return out


def _serving_text(it: dict) -> str:
    parts = [f"{name}: continuous batching gave {e['throughput_ratio']:.2f}× static batching's tokens per "
             f"{it['ratio_clock']} ({e['wall_ratio']:.2f}× wall-clock), p95 latency {e['continuous_latency_p95']:.2f} s "
             f"vs {e['static_latency_p95']:.2f} s, static needed {e['iterations_ratio']:.2f}× the forward passes; "
             f"outputs {'identical' if e['outputs_identical'] else 'DIFFERED'} under both policies."
             for name, e in it["engines"].items()]
    if "compiled_over_eager" in it:
        parts.append(f"Continuous batching on the compiled engine took {it['compiled_over_eager']:.2f}× the eager "
                     f"model's {it['ratio_clock']}s; tokens {'identical' if it['engines_agree'] else 'DIFFERED'}.")
    return " ".join(parts)


SERVING = Item(bench_serving, "Continuous vs static batching on one trace", columns={
    "engine": "{engine}", "round": "{round}", "policy": "{policy}", "tokens/s": "{throughput:.1f}",
    "tokens per CPU-s": "{cpu_throughput:.1f}", "TTFT p50 s": "{ttft_p50:.2f}", "TTFT p95 s": "{ttft_p95:.2f}",
    "latency p50 s": "{latency_p50:.2f}", "latency p95 s": "{latency_p95:.2f}",
    "slot occupancy": "{slot_occupancy:.0%}", "iterations": "{iterations}",
    "KV reserved ÷ used (peak)": "{reserved_over_used:.3f}"},
    text=_serving_text,
    targets=[Target("continuous_over_static", "trace throughput: continuous ÷ static batching (tokens per CPU-second "
                    "on a CPU, per second on a GPU)", ">=", 1.5,
                    _of_primary("throughput_ratio", "p95 {continuous_latency_p95:.2f} s vs {static_latency_p95:.2f} s")),
             Target("continuous_p95_over_static", "trace p95 latency: continuous ÷ static", "<=", 1.0,
                    _of_primary("p95_ratio"))])


# --- paged vs preallocated bytes -------------------------------------------------------------------------------
def bench_paged_memory(ctx) -> dict:
    from course.engine.serving import make_trace, memory_on_mix

    s, config = _sizes(ctx), ctx.model("float32").config
    mix = make_trace(s["mix_requests"], seed=1, prompt_len=s["mix_prompt"], new_tokens=s["mix_new"],
                     vocab_size=config.vocab_size)
    m = memory_on_mix(config, mix, block_size=16, max_seq_len=s["mix_max_seq_len"])
    tight = memory_on_mix(config, mix, block_size=16)  # slots only as long as the longest request
    row = dict(requests=len(mix), **m, paged_over_preallocated=m["paged"] / m["preallocated"],
               longest_request=tight["max_seq_len"], preallocated_at_longest_over_used=tight["preallocated_over_used"])
    return {"status": "ok", "rows": [row], **row}


PAGED_MEMORY = Item(bench_paged_memory, "KV bytes on a mix of requests: paged blocks vs preallocated slots", columns={
    "requests": "{requests}", "block size": "{block_size}", "max_seq_len": "{max_seq_len}",
    "used MB": lambda r: f"{r['used'] / 1e6:.1f}", "paged MB": lambda r: f"{r['paged'] / 1e6:.1f}",
    "preallocated MB": lambda r: f"{r['preallocated'] / 1e6:.1f}", "paged ÷ used": "{paged_over_used:.3f}",
    "preallocated ÷ used": "{preallocated_over_used:.2f}", "paged ÷ preallocated": "{paged_over_preallocated:.3f}"},
    text=lambda it: (f"Every request resident at its full length; preallocated slots reserve max_seq_len = "
                     f"{it['max_seq_len']} positions each. Slots cut to this mix's longest request "
                     f"({it['longest_request']} positions, known only afterwards) still reserve "
                     f"{it['preallocated_at_longest_over_used']:.2f}× the bytes used."),
    targets=[Target("paged_over_used", "paged KV bytes ÷ bytes the requests use", "<=", 1.05,
                    lambda it: (it.get("paged_over_used"), "")),
             Target("preallocated_over_used", "preallocated KV bytes ÷ bytes used", ">=", 2.0,
                    lambda it: (it.get("preallocated_over_used"), ""))])
