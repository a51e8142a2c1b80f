"""Decode against this machine's limits: per token (decode), against its bandwidth floor (decode_floor), batched
(decode_batch). Each figure is measured side by side: the engines take turns round after round.

The floor of a step is the time it takes just to read what it must read once, (weight bytes + KV bytes) ÷ the
streaming-read bandwidth probed with the same thread count in the same round; × floor is the median over rounds
of each round's step ÷ that round's floor, so a drift of the machine's bandwidth cancels instead of landing on one
engine. Beside the course's compiled step runs plain torch.compile of the model's own decode call (gpt-fast's
way), so every run shows what the compiled path buys; a compiled engine that fell back to eager is refused.
"""
from __future__ import annotations

import os
import statistics

from bench.core import CONTEXT, Item, Target, best, fmt, median_of, paired_ratio, refused, side_by_side

PLAIN = "plain torch.compile"


def plain_compile(model):
    """torch.compile of the model's own decode call, gpt-fast's way (its mode for the device), as a step with the
    compiled engine's `compiled` flag: False once TorchDynamo fell back to eager."""
    import torch

    mode = "reduce-overhead" if model.device.type == "cuda" else None
    fn = torch.compile(lambda m, t, pos, c: m(t, start_pos=pos, cache=c, last_only=True), mode=mode, fullgraph=True)

    class Plain:
        compiled, config, dtype, device = True, model.config, model.dtype, model.device

        def __call__(self, tokens, start_pos=0, cache=None, last_only=False):
            with torch.inference_mode():
                if tokens.shape[1] != 1 or cache is None:
                    return model(tokens, start_pos=start_pos, cache=cache, last_only=last_only)
                try:
                    out = fn(model, tokens, start_pos, cache)
                except Exception as exc:  # the row is refused, not timed eagerly under this label
                    self.compiled, self.fallback = False, f"{type(exc).__name__}: {exc}"[:300]
                    out = model(tokens, start_pos=start_pos, cache=cache, last_only=True)
                return out if last_only else out[:, None]
    return Plain()


def step_bytes(config, batch: int, context: int, dtype) -> float:
    """Bytes one decode step of `batch` sequences at `context` cached tokens reads: every weight once and the K and
    V of context + 1 positions per sequence (course.measure.costs.decode_cost)."""
    from course.measure.costs import decode_cost, dtype_bytes

    return decode_cost(config, context, dtype_bytes(dtype), batch=batch, within_context=False).bytes


def decode_setup(ctx, engine, batch: int, context: int):
    """A cache of `batch` sequences prefilled (eagerly) to `context` tokens, and a step that rewrites position
    `context`: what a decode step of the engine costs there."""
    import torch

    from course.engine.generate import decode_one_token, prefill
    from course.engine.kv_cache import KVCache

    c = engine.config
    ids = torch.randint(0, c.vocab_size, (batch, context), generator=torch.Generator().manual_seed(batch))
    ids = ids.to(ctx.device)
    cache = KVCache(c, batch=batch, max_seq_len=context + 1, dtype=engine.dtype, device=ctx.device)
    prefill(ctx.model(str(engine.dtype).removeprefix("torch.")), ids, cache)  # the eager model's prefill
    return lambda: decode_one_token(engine, ids[:, -1:], context, cache)


# --- decode ----------------------------------------------------------------------------------------------------
def bench_decode(ctx) -> dict:
    """ms per token at each context, for each dtype and engine; bytes read per step ÷ time against bandwidth."""
    configs, rows = {}, []
    for dtype in ("float32", "bfloat16"):
        for name, engine in ctx.engines(dtype).items():
            for T in [T for T in ctx.sizes["decode_contexts"] if T < engine.config.max_seq_len]:
                configs[(name, dtype, T)] = (engine, decode_setup(ctx, engine, 1, T), step_bytes(engine.config, 1, T, engine.dtype))
    steps = {k: v[1] for k, v in configs.items()}
    for step in steps.values():  # warm-up: allocator, lazy init, torch.compile's first compilation
        step(), step(), step()
    times = side_by_side(steps, ctx.device, ctx.sizes["rounds"], ctx.sizes["steps_per_round"],
                         before_round=lambda r: ctx.probe_bandwidth())
    for (name, dtype, T), (engine, _, nbytes) in configs.items():
        no = refused(name, engine, dtype=dtype, context=T)
        if no:
            rows.append(no)
            continue
        s = median_of(times[(name, dtype, T)])
        roofline_s = nbytes / ctx.bandwidth
        rows.append(dict(engine=name, dtype=dtype, context=T, batch=1, ms_per_token=s * 1e3, tokens_per_s=1 / s,
                         bytes_per_step=nbytes, achieved_bytes_per_s=nbytes / s, roofline_ms=roofline_s * 1e3,
                         x_roofline=s / roofline_s, fraction_of_bandwidth=roofline_s / s,
                         repeats=sum(map(len, times[(name, dtype, T)]))))
    return {"status": "ok", "bandwidth_bytes_per_s": ctx.bandwidth, "rows": rows, **_equivalence(ctx)}


def _equivalence(ctx) -> dict:
    """max |Δ| of the compiled engine's decode logits against the eager model's (float32, context 64)."""
    if not ctx.compile or ctx.quick:
        return {}
    import torch

    from course.engine.generate import decode_one_token, prefill
    from course.engine.kv_cache import KVCache

    model = ctx.model("float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    out = []
    for engine in (model, ctx.fast("float32")):
        cache = KVCache(model.config, 1, 66, model.dtype, ctx.device)
        prefill(model, ids.to(ctx.device), cache)
        out.append(decode_one_token(engine, ids[:, -1:].to(ctx.device), 64, cache))
    return {"compiled_vs_eager_max_abs_logit_diff": float((out[0] - out[1]).abs().max())}


DECODE = Item(bench_decode, "Decode (batch 1)", columns={
    "engine": "{engine}", "dtype": "{dtype}", "context": "{context}", "ms/token": "{ms_per_token:.1f}",
    "tokens/s": "{tokens_per_s:.1f}", "bytes/step": lambda r: f"{r['bytes_per_step'] / 1e6:.0f} MB",
    "achieved GB/s": lambda r: f"{r['achieved_bytes_per_s'] / 1e9:.1f}",
    "of bandwidth": "{fraction_of_bandwidth:.0%}", "× roofline": "{x_roofline:.2f}"},
    text=lambda it: (f"Compiled vs eager logits: max |Δ| = {it['compiled_vs_eager_max_abs_logit_diff']:.1e}."
                     if "compiled_vs_eager_max_abs_logit_diff" in it else ""),
    targets=[Target("decode_x_roofline", "decode ctx 64, float32, batch 1: time ÷ roofline bound", "<=", 1.18,
                    lambda it: best(it, lambda r: r["dtype"] == "float32" and r["context"] == 64, "x_roofline", min))])


# --- decode_floor ----------------------------------------------------------------------------------------------
def _thread_counts(ctx) -> tuple:
    return (1, 2) if (os.cpu_count() or 1) >= 2 and ctx.device.type == "cpu" else (1,)


def _rounds_by_threads(ctx, steps: dict, counts: tuple, rounds: int, per_round: int):
    """side_by_side at every thread count, the counts taking turns within each round; returns ({n: times},
    {n: read probes}, {n: other programs' cores}, load averages)."""
    import torch

    from course.measure.threads import cpu_clock, others_busy
    from course.measure.timing import ReadProbe

    from bench.core import load_average

    before = torch.get_num_threads()
    times = {n: {k: [] for k in steps} for n in counts}
    reads, others, loads = {n: [] for n in counts}, {n: [] for n in counts}, []
    reader = ReadProbe(ctx.device, nbytes=ctx.sizes["bandwidth_bytes"], repeats=3)
    try:
        for n in counts:  # warm-up at each thread count (the first compiled call compiles)
            torch.set_num_threads(n)
            for step in steps.values():
                step(), step()
        for _ in ctx.progress(range(rounds), "rounds"):
            loads.append(load_average())
            for n in counts:
                torch.set_num_threads(n)
                clock = cpu_clock()
                got = side_by_side(steps, ctx.device, 1, per_round, before_round=lambda r: reads[n].append(reader()))
                for k, ts in got.items():
                    times[n][k] += ts
                busy = others_busy(clock, cpu_clock())
                if busy is not None:
                    others[n].append(busy)
    finally:
        torch.set_num_threads(before)
        reader.close()
    return times, reads, others, loads


def _busy(others: list) -> float | None:
    return statistics.median(others) if others else None


def bench_decode_floor(ctx) -> dict:
    """ms per step ÷ floor at batch 1, context 64, float32: eager, plain torch.compile, the compiled step, and two
    references: every weight matrix times one row through BLAS (F.linear), and torch summing every weight."""
    import torch
    import torch.nn.functional as F

    model = ctx.model("float32")
    nbytes = step_bytes(model.config, 1, CONTEXT, model.dtype)
    weights = list({id(p): p.detach() for p in model.parameters()}.values())  # the tied head once
    linears = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows1 = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in linears}
    engines = {"eager": model}
    if ctx.compile and not ctx.quick:
        engines.update({PLAIN: plain_compile(model), "compiled": ctx.fast("float32")})
    steps = {name: decode_setup(ctx, e, 1, CONTEXT) for name, e in engines.items()}
    steps["eager's products alone (BLAS)"] = lambda: [F.linear(rows1[w.shape[1]], w) for w in linears]
    steps["torch sum of weights"] = lambda: [w.sum() for w in weights]
    sizes = {name: nbytes for name in engines}
    sizes["eager's products alone (BLAS)"] = sum(w.numel() * w.element_size() for w in linears)
    sizes["torch sum of weights"] = sum(w.numel() * w.element_size() for w in weights)
    counts = _thread_counts(ctx)
    with torch.inference_mode():
        times, reads, others, loads = _rounds_by_threads(ctx, steps, counts, ctx.sizes["rounds"],
                                                         ctx.sizes["steps_per_round"])
    rows = []
    for n in counts:
        read = statistics.median(reads[n])
        for name, step_times in times[n].items():
            no = refused(name, engines.get(name), threads=n)
            if no:
                rows.append(no)
                continue
            ratios = [statistics.median(ts) / (sizes[name] / r) for ts, r in zip(step_times, reads[n])]
            rows.append(dict(threads=n, engine=name, ms_per_step=median_of(step_times) * 1e3,
                             bytes_per_step=sizes[name], read_bytes_per_s=read, floor_ms=sizes[name] / read * 1e3,
                             x_floor=statistics.median(ratios), x_floor_rounds=ratios,
                             ms_rounds=[statistics.median(ts) * 1e3 for ts in step_times], read_rounds=reads[n],
                             others_cores=_busy(others[n]), repeats=sum(map(len, step_times))))
    return {"status": "ok", "rows": rows, "context": CONTEXT, "load_average": statistics.median(loads)}


def _floor_target(threads, bound):
    def measure(it):
        r = next((r for r in it.get("rows", []) if r.get("engine") == "compiled" and r.get("threads") == threads
                  and "refused" not in r), None)
        return (None, "not measured") if r is None else (r["x_floor"], f"other programs {fmt(r['others_cores'], '.2f')} cores")
    return Target(f"compiled_{threads}t_x_floor", f"decode ctx {CONTEXT}, float32, batch 1, {threads} thread(s), "
                  "compiled: time ÷ streaming-read floor", "<=", bound, measure)


def _eager_threads(it):
    ms = {r["threads"]: r["ms_per_step"] for r in it.get("rows", []) if r.get("engine") == "eager"}
    return (ms[2] / ms[1], "") if 1 in ms and 2 in ms else (None, "not measured")


DECODE_FLOOR = Item(bench_decode_floor, "Decode against its floor (batch 1, context 64, float32; 1 and 2 threads)",
                    columns={"threads": "{threads}", "engine": "{engine}", "ms/step": "{ms_per_step:.1f}",
                             "floor ms": "{floor_ms:.1f}", "× floor": "{x_floor:.2f}",
                             "read GB/s": lambda r: f"{r['read_bytes_per_s'] / 1e9:.1f}",
                             "other programs (cores)": lambda r: fmt(r["others_cores"], ".2f")},
                    targets=[_floor_target(1, 1.10), _floor_target(2, 1.20),
                             Target("eager_2t_over_1t", "eager decode with 2 threads ÷ with 1 thread", "<=", 1.0,
                                    _eager_threads)])


# --- decode_batch ----------------------------------------------------------------------------------------------
def bench_decode_batch(ctx) -> dict:
    """Step time and total tokens/s for B sequences decoded together (context 64 each, float32) at 1 and 2 threads:
    the compiled step (one graph for B = 1, one for every B >= 2), the serving lesson's any-shape step, plain
    torch.compile and the eager model (up to B = 8), each against its roofline: reading the step's bytes at the
    probed bandwidth, or its arithmetic at the probed matmul FLOP/s, whichever takes longer."""
    import torch

    from course.measure.costs import decode_cost

    model = ctx.model("float32")
    engines = {"eager": model}
    if ctx.compile and not ctx.quick:
        engines.update({"compiled": ctx.fast("float32"), "compiled, any shape": ctx.fast("float32", any_shape=True),
                        PLAIN: plain_compile(model)})
    steps = {(name, B): decode_setup(ctx, e, B, CONTEXT) for B in ctx.sizes["batches"]
             for name, e in engines.items() if name != "eager" or B <= 8}
    counts = _thread_counts(ctx)
    flops = {n: 0.0 for n in counts}
    for n in counts:
        torch.set_num_threads(n)
        flops[n] = ctx.probe_flops("float32")
    torch.set_num_threads(max(counts))
    per_token = decode_cost(model.config, CONTEXT, 4).flops
    with torch.inference_mode():
        times, reads, others, loads = _rounds_by_threads(ctx, steps, counts, ctx.sizes["batch_rounds"], 2)
    rows, ceilings = [], {}
    for n in counts:
        read = statistics.median(reads[n])
        roof = {B: max(step_bytes(model.config, B, CONTEXT, model.dtype) / read, B * per_token / flops[n]) * 1e3
                for B in ctx.sizes["batches"]}
        for (name, B), ts in times[n].items():
            no = refused(name, engines[name], threads=n, batch=B)
            if no:
                rows.append(no)
                continue
            s = median_of(ts)
            x_b1 = paired_ratio(ts, times[n][(name, 1)])
            rows.append(dict(threads=n, engine=name, batch=B, ms_per_step=s * 1e3, tokens_per_s=B / s,
                             x_b1_time=x_b1, x_b1_tokens=B / x_b1,
                             x_floor=s * 1e3 / (step_bytes(model.config, B, CONTEXT, model.dtype) / read * 1e3),
                             roofline_ms=roof[B], x_roofline=s * 1e3 / roof[B], repeats=sum(map(len, ts))))
        b1 = next((r["ms_per_step"] for r in rows if r.get("threads") == n and r["engine"] == "compiled"
                   and r.get("batch") == 1), None)
        if b1:  # the most total tokens/s any measured batch can give on the roofline, as a multiple of B = 1's
            ceilings[str(n)] = max(B / roof[B] for B in roof) * b1
    return {"status": "ok", "rows": rows, "context": CONTEXT, "threads": list(counts), "ceilings": ceilings,
            "read_bytes_per_s": {str(n): statistics.median(reads[n]) for n in counts},
            "flops_per_s": {str(n): f for n, f in flops.items()}, "load_average": statistics.median(loads),
            "others_cores": {str(n): _busy(others[n]) for n in counts}}


def _batch_target(threads: int, name: str, what: str, op: str, bound: float, value):
    def measure(it):
        rows = [r for r in it.get("rows", []) if r.get("threads") == threads and r.get("engine") == "compiled"
                and "refused" not in r]
        if not rows:
            return None, "not measured"
        ceiling = (it.get("ceilings") or {}).get(str(threads))
        return value(rows), (f"the roofline allows {ceiling:.1f}×" if ceiling else "")
    return Target(f"{name}_{threads}t", f"{what}, {threads} thread(s)", op, bound, measure)


def _b8(rows):
    return next((r["x_b1_time"] for r in rows if r["batch"] == 8), None)


DECODE_BATCH = Item(bench_decode_batch, "Batched decode (context 64 per sequence, float32, 1 and 2 threads)", columns={
    "threads": "{threads}", "engine": "{engine}", "batch": "{batch}", "ms/step": "{ms_per_step:.1f}",
    "× B=1 time": "{x_b1_time:.2f}", "tokens/s": "{tokens_per_s:.0f}", "× B=1 tokens/s": "{x_b1_tokens:.1f}",
    "× floor": "{x_floor:.2f}", "× roofline": "{x_roofline:.2f}"},
    targets=[t for n in (1, 2) for t in (
        _batch_target(n, "batch8_over_batch1_time", "compiled step time at B=8 ÷ at B=1", "<=", 1.4, _b8),
        _batch_target(n, "best_batch_tokens_x", "compiled best-batch total tokens/s ÷ B=1", ">=", 10.0,
                      lambda rows: max(r["x_b1_tokens"] for r in rows)))])
