"""Bench items: decode against its floor (1 and 2 threads), the compiled batched step, and the bytes line.

The floor of a decode step is the time it takes just to read what the step must read once:
(bytes of weights + bytes of the KV cache) ÷ the streaming-read bandwidth of this machine, probed with the
same number of threads between the rounds (course.measure.timing.ReadProbe, memory_bandwidth's read). Every
figure below is reported as a multiple of its floor (× floor), measured side by side: the configurations take
turns round after round, so a burst of load from another program hits all of them alike. In decode_floor,
× floor is the median over the rounds of each round's step time ÷ the floor probed in that same round, so a
drift of the machine's bandwidth between rounds (other tenants of a shared host) cancels instead of landing on one side;
decode_batch's × B=1 pairs each batch with B = 1 round by round the same way (paired_ratio).

    decode_floor   batch 1, context 64, float32: eager, compiled and torch merely summing every weight
                   (how close torch itself gets to the floor), at 1 and at 2 threads
    decode_batch   the compiled step for B = 1 … 64 sequences (per-sequence positions), and the eager model
                   beside it: where the eager B = 1 → 2 jump comes from; at 1 and at 2 threads, each row also
                   against its roofline (the floor, or the step's arithmetic at the probed peak if that is
                   longer), and the most batching could give on that roofline
    bytes_line     ms per step against bytes per step over models of real published shapes (lesson 01)
"""
from __future__ import annotations

import os
import statistics
import time

from course.measure.bench import Context, Target, bench_item

CONTEXT = 64
# decode_floor's row beside "compiled": the same graph with the other product for one row (DecodeStep's one_row_kernel)
OTHER_ROW = {True: "compiled, streamed reduction for the row", False: "compiled, batch kernel for the row"}
# and the same graph called through torch.compile (TorchDynamo's lookup on every call), where "compiled" calls it
# directly (DecodeStep's direct path)
THROUGH_DYNAMO = "compiled, called through TorchDynamo"
BLAS_PRODUCTS = "eager's products alone (BLAS)"  # every weight matrix times one row through F.linear
SAME = 0.03  # two step times within 3 % of each other are "about as fast"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
QUICK_BATCHES = (1, 2, 4)
STEPS_PER_ROUND = 2  # decode_batch: steps timed per configuration in each round


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def fairness(threads: int, others: float | None = None, cores: int | None = None,
             load: float | None = None) -> tuple[bool, str]:
    """Was the machine quiet enough for a `threads`-thread timing to be fair, and the sentence that says so.

    others: cores' worth of CPU that other programs used during the timing (course.measure.threads.others_busy).
    Fair when they left a core for every thread (course.measure.threads.free_cores, the rule the lessons'
    steady_threads uses too). Where that could not be measured, the 1-minute load average stands in,
    which counts this process too: fair when load <= cores - threads + 1.
    """
    from course.measure.threads import free_cores

    cores = cores or os.cpu_count() or 1
    if others is not None:
        fair = free_cores(others, cores) >= threads
        what = f"other programs used {others:.2f} of {cores} cores during these timings"
    else:
        load = _load() if load is None else load
        fair = load <= cores - threads + 1
        what = f"load average {load:.1f} on {cores} cores (this process included)"
    if fair:
        return True, f"{what}: fair for {threads} thread(s)"
    return False, (f"{what}: NOT fair for {threads} thread(s) (other programs hold the cores; a step's threads "
                   "wait on descheduled partners)")


def _busy_text(r: dict) -> str:
    """A row's 'other programs' cell: their CPU use in cores, or the load average where it was not measured."""
    others = r.get("others_cores")
    return (f"{others:.2f} cores" if others is not None else f"load {r['load_average']:.1f}") \
        + ("" if r.get("fair", True) else " (not fair)")


def _floor_ms(nbytes: float, read_bytes_per_s: float) -> float:
    return nbytes / read_bytes_per_s * 1e3


def _step_bytes(config, batch: int, context: int, dtype) -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step of `batch` sequences at `context` cached tokens reads: every
    weight once (course.measure.costs.weights_read_bytes) and the K and V of context + 1 positions per sequence."""
    from course.measure.costs import decode_cost, dtype_bytes

    cost = decode_cost(config, context, dtype_bytes(dtype), batch=batch, within_context=False)
    return cost.weight_bytes, cost.kv_bytes


def floor_ms(config, context: int, dtype, read_bytes_per_s: float, batch: int = 1) -> float:
    """The decode floor the bench reports: bytes one step reads ÷ the streaming-read bandwidth, in ms.

    read_bytes_per_s: course.measure.timing.ReadProbe's read (memory_bandwidth's), probed with the thread count
    the step runs with. Lesson 01's breakdown uses this function too, so both quote the same floor.
    """
    if read_bytes_per_s <= 0:
        raise ValueError(f"read_bytes_per_s must be positive, got {read_bytes_per_s}")
    return _floor_ms(sum(_step_bytes(config, batch, context, dtype)), read_bytes_per_s)


def _with_threads(n: int):
    import torch

    torch.set_num_threads(n)


def _decode_setup(ctx: Context, engine, batch: int, context: int, compiled: bool, step=None):
    """A cache of `batch` sequences filled to `context` tokens, and a step that rewrites position `context`."""
    import torch

    from course.engine.generate import decode_one_token, prefill
    from course.engine.kv_cache import KVCache

    c = engine.config
    ids = torch.randint(0, c.vocab_size, (batch, context), generator=torch.Generator().manual_seed(batch))
    ids = ids.to(ctx.device)
    cache = KVCache(c, batch=batch, max_seq_len=context + 1, dtype=engine.dtype, device=ctx.device)
    prefill(ctx.model("float32") if compiled else engine, ids, cache)
    token = ids[:, -1:]  # [B, 1]
    if compiled:
        step = step or ctx.fast("float32").step
        positions = torch.full((batch,), context, dtype=torch.long, device=ctx.device)
        return lambda: step(token, positions, cache)
    return lambda: decode_one_token(engine, token, context, cache)


def _probe(reader, first_step) -> float:
    """The streaming-read bandwidth (bytes/s) from `reader` (a course.measure.timing.ReadProbe, one buffer for all
    of a bench item's rounds), then one untimed step: the probe streams its buffer through memory, and the first
    step after a probe measured about 6 ms slower than the next ones (51–54 against 45–48 ms, the course model at
    1 thread), which would land on whichever configuration is timed first."""
    read = reader()
    first_step()
    return read


def _reader(ctx: Context):
    """The read probe of a bench item's rounds: its buffer is allocated (and faulted in) once, not every round."""
    from course.measure.timing import ReadProbe

    return ReadProbe(ctx.device, nbytes=ctx.sizes["bandwidth_bytes"], repeats=3)


def paired_ratio(times: list[float], base: list[float], per_round: int) -> float:
    """Time ÷ base time, measured side by side: the median over rounds of (this round's median ÷ the base's median
    in the same round). Both lists hold `per_round` samples per round, round after round. A shared host's speed
    drifts between rounds (another tenant's load comes and goes); within a round both saw the same machine, so
    the drift cancels in each round's ratio, where a ratio of the overall medians can pair one's fast round with
    the other's slow one."""
    if len(times) != len(base) or not times or len(times) % per_round:
        raise ValueError(f"paired_ratio needs the same whole rounds of {per_round} samples on both sides; "
                         f"got {len(times)} and {len(base)} samples")
    rounds = range(0, len(times), per_round)
    return statistics.median(statistics.median(times[k:k + per_round]) / statistics.median(base[k:k + per_round])
                             for k in rounds)


def _time(fn, device, n: int) -> list[float]:
    from course.measure.timing import Stopwatch

    out = []
    for _ in range(n):
        with Stopwatch(device) as sw:
            fn()
        out.append(sw.seconds)
    return out


def _target_row(it, **match):
    for r in it.get("rows", []):
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _floor_target(engine, threads, bound):
    def measure(it):
        r = _target_row(it, engine=engine, threads=threads)
        if r is None:
            return None, "not measured"
        return r["x_floor"], "other programs " + _busy_text(r) + _unsteady_note(r.get("read_rounds"))
    return Target(f"{engine}_{threads}t_x_floor", f"decode ctx {CONTEXT}, float32, batch 1, {threads} thread(s), "
                  f"{engine}: time ÷ streaming-read floor", "<=", bound, measure)


def _probe_clause(probes: list[float] | None) -> str:
    """The end of a thread count's sentence: how far its read probes moved between rounds, and what follows."""
    from course.measure.timing import steadiness

    if not probes:
        return "."
    steady, moved = steadiness(probes)
    return f"; {moved}" + ("." if steady else ": the memory system was unsteady, so ratios to the floor are rough.")


def _unsteady_note(probes: list[float] | None) -> str:
    """'; read probe 29.2–51.6 GB/s, unsteady' for a target's note where the run's read probes swung
    (course.measure.timing.steadiness), else ''."""
    from course.measure.timing import steadiness

    probes = probes or []
    if steadiness(probes)[0]:
        return ""
    return f"; read probe {min(probes) / 1e9:.1f}–{max(probes) / 1e9:.1f} GB/s, unsteady"


def _eager_threads_target(it):
    one, two = _target_row(it, engine="eager", threads=1), _target_row(it, engine="eager", threads=2)
    if one is None or two is None:
        return None, "not measured"
    return two["ms_per_step"] / one["ms_per_step"], "other programs " + _busy_text(two)


# --- decode_floor ----------------------------------------------------------------------------------------------
@bench_item("decode_floor", title="Decode against its floor (batch 1, context 64, float32; 1 and 2 threads)",
            columns={"threads": "{threads}", "engine": "{engine}", "ms/step": "{ms_per_step:.1f}",
                     "floor ms": "{floor_ms:.1f}", "× floor": "{x_floor:.2f}",
                     "read GB/s": lambda r: f"{r['read_bytes_per_s'] / 1e9:.1f}",
                     "other programs": _busy_text},
            text=lambda it: it.get("summary", ""),
            targets=[_floor_target("compiled", 1, 1.10), _floor_target("compiled", 2, 1.20),
                     Target("eager_2t_over_1t", "eager decode with 2 threads ÷ with 1 thread", "<=", 1.0,
                            _eager_threads_target)])
def bench_decode_floor(ctx: Context) -> dict:
    """ms per step ÷ floor for eager, compiled and a plain sum over every weight, at 1 and 2 threads."""
    import torch

    from course.measure.threads import cpu_clock, others_busy

    model = ctx.model("float32")
    weight_bytes, kv_bytes = _step_bytes(model.config, 1, CONTEXT, model.dtype)
    tensors = list({id(p): p for p in model.parameters()}.values())  # the tied head once
    sum_bytes = sum(t.numel() * t.element_size() for t in tensors)

    def sum_all():
        with torch.inference_mode():
            for t in tensors:
                t.sum()

    linears = _linear_weights(model)
    one_row = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in linears}

    def blas_products():
        with torch.inference_mode():
            for w in linears:
                torch.nn.functional.linear(one_row[w.shape[1]], w)

    engines = {"eager": (_decode_setup(ctx, model, 1, CONTEXT, compiled=False), weight_bytes + kv_bytes),
               BLAS_PRODUCTS: (blas_products, float(sum(w.numel() * w.element_size() for w in linears)))}
    if ctx.compile and not ctx.quick:
        engines["compiled"] = (_decode_setup(ctx, model, 1, CONTEXT, compiled=True), weight_bytes + kv_bytes)
        from course.engine.fast import DecodeStep

        step = ctx.fast("float32").step
        if step.row_kernel:  # the same graph with the other product for one row (row_product's kernel or Inductor's
            # streamed reduction), beside it
            other = DecodeStep(model, one_row_kernel=not step.one_row_kernel)
            engines[OTHER_ROW[step.one_row_kernel]] = (
                _decode_setup(ctx, model, 1, CONTEXT, compiled=True, step=other), weight_bytes + kv_bytes)
        if step.direct:  # the same graph called through torch.compile, beside the direct call
            dynamo = DecodeStep(model, one_row_kernel=step.one_row_kernel, direct=False)
            engines[THROUGH_DYNAMO] = (
                _decode_setup(ctx, model, 1, CONTEXT, compiled=True, step=dynamo), weight_bytes + kv_bytes)
    engines["torch sum of weights"] = (sum_all, float(sum_bytes))
    thread_counts = (1, 2) if (os.cpu_count() or 1) >= 2 else (1,)
    before = torch.get_num_threads()
    times = {(n, e): [] for n in thread_counts for e in engines}
    probes = {n: [] for n in thread_counts}
    loads = {n: [] for n in thread_counts}
    others = {n: [] for n in thread_counts}  # other programs' CPU use (cores) while each thread count was timed
    ratios = {key: [] for key in times}  # each round's step ÷ the floor probed in that round
    round_ms = {key: [] for key in times}  # each round's median step, ms
    steps, rounds = ctx.sizes.get("steps_per_round", 4), ctx.sizes.get("rounds", 5)
    reader = _reader(ctx)
    try:
        for n in thread_counts:  # warm-up (the first compiled call compiles) at each thread count
            _with_threads(n)
            for fn, _ in engines.values():
                fn(), fn()
        for _ in ctx.progress(range(rounds), "decode floor rounds"):
            for n in thread_counts:
                _with_threads(n)
                loads[n].append(_load())
                clock = cpu_clock()
                probes[n].append(_probe(reader, next(iter(engines.values()))[0]))
                for name, (fn, nbytes) in engines.items():
                    t = _time(fn, ctx.device, steps)
                    times[(n, name)] += t
                    ratios[(n, name)].append(statistics.median(t) / (nbytes / probes[n][-1]))
                    round_ms[(n, name)].append(statistics.median(t) * 1e3)
                busy = others_busy(clock, cpu_clock())
                if busy is not None:
                    others[n].append(busy)
    finally:
        torch.set_num_threads(before)
        reader.close()
    rows = []
    for n in thread_counts:
        read = statistics.median(probes[n])
        load = statistics.median(loads[n])
        busy = statistics.median(others[n]) if others[n] else None
        fair, why = fairness(n, busy, load=load)
        for name, (_, nbytes) in engines.items():
            s = statistics.median(times[(n, name)])
            floor = _floor_ms(nbytes, read)
            rows.append(dict(threads=n, engine=name, ms_per_step=s * 1e3, best_ms=min(times[(n, name)]) * 1e3,
                             bytes_per_step=nbytes, read_bytes_per_s=read, floor_ms=floor,
                             x_floor=statistics.median(ratios[(n, name)]), x_floor_rounds=ratios[(n, name)],
                             ms_rounds=round_ms[(n, name)], read_rounds=probes[n],
                             tokens_per_s=1 / s, load_average=load, others_cores=busy, fair=fair, fairness=why,
                             repeats=len(times[(n, name)])))
    return {"status": "ok", "rows": rows, "context": CONTEXT, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "summary": floor_summary(rows)}


def floor_summary(rows: list[dict]) -> str:
    """The paragraph under the table: each engine against its floor, and what the thread counts did."""
    by = {(r["threads"], r["engine"]): r for r in rows}
    parts = []
    for n in sorted({r["threads"] for r in rows}):
        engines = [r for r in rows if r["threads"] == n]
        floor = engines[0]["floor_ms"]
        parts.append(f"{n} thread(s): floor {floor:.1f} ms ({engines[0]['bytes_per_step'] / 1e6:.0f} MB at "
                     f"{engines[0]['read_bytes_per_s'] / 1e9:.1f} GB/s); "
                     + ", ".join(f"{r['engine']} {r['ms_per_step']:.1f} ms ({r['x_floor']:.2f}×)" for r in engines)
                     + f" — {engines[0]['fairness']}"
                     + _probe_clause(engines[0].get("read_rounds")))
    if (1, "eager") in by and (2, "eager") in by:
        one, two = by[(1, "eager")]["ms_per_step"], by[(2, "eager")]["ms_per_step"]
        gained = two < one * (1 - SAME)
        verdict = "faster than" if gained else ("about as fast as" if two <= one * (1 + SAME) else "slower than")
        parts.append(f"Eager with 2 threads is {verdict} with 1 ({two:.1f} vs {one:.1f} ms)"
                     + ("." if gained else ": " + _eager_threads_why(by)))
    return " ".join(parts)


def _eager_threads_why(by: dict) -> str:
    """Why eager did not gain from a second thread, from the rows: a busy machine, BLAS's products themselves,
    or the step's many small operations."""
    if not by[(2, "eager")].get("fair", True):
        return ("other programs held the cores, so its threads waited for a descheduled partner at every "
                "operation (the lessons' steady_threads keeps one thread per core other programs leave free).")
    p1, p2 = by.get((1, BLAS_PRODUCTS)), by.get((2, BLAS_PRODUCTS))
    if p1 and p2 and p2["ms_per_step"] >= (1 - SAME) * p1["ms_per_step"]:
        c1, c2 = by.get((1, "compiled")), by.get((2, "compiled"))
        compiled = (f"; the compiled step, on its own kernels, did ({c2['ms_per_step']:.1f} vs {c1['ms_per_step']:.1f} ms)"
                    if c1 and c2 and c2["ms_per_step"] < (1 - SAME) * c1["ms_per_step"] else "")
        return (f"its matrix products alone (BLAS, what F.linear calls) took {p2['ms_per_step']:.1f} ms with 2 threads "
                f"against {p1['ms_per_step']:.1f} with 1, so the BLAS library did not spread a one-row product over "
                f"the second core on this CPU{_eager_rest(by)}{compiled}.")
    return ("each of its many small operations pays the threads' start and join; the compiled step runs far "
            "fewer, larger kernels.")


def _eager_rest(by: dict) -> str:
    """Where eager with 2 threads was slower than BLAS's products explain: the rest of its step (every operation
    but the products) with each thread count, and how far its rounds with 2 threads spread."""
    e1, e2 = by[(1, "eager")], by[(2, "eager")]
    rest1 = e1["ms_per_step"] - by[(1, BLAS_PRODUCTS)]["ms_per_step"]
    rest2 = e2["ms_per_step"] - by[(2, BLAS_PRODUCTS)]["ms_per_step"]
    if rest2 <= rest1 + SAME * e1["ms_per_step"]:  # the products account for the difference
        return ""
    spread = e2.get("ms_rounds") or []
    rounds = (f"; its rounds with 2 threads ranged from {min(spread):.1f} to {max(spread):.1f} ms, with 1 from "
              f"{min(e1['ms_rounds']):.1f} to {max(e1['ms_rounds']):.1f}"
              if len(spread) >= 2 and len(e1.get("ms_rounds") or []) >= 2 else "")
    return (f", and the rest of its step (every operation but the products) took {rest2:.1f} ms with 2 threads against "
            f"{rest1:.1f} with 1{rounds}: with nothing to gain in the products, the second thread only slowed the rest")


# --- decode_batch ---------------------------------------------------------------------------------------------
def _batch_target(threads: int, name: str, what: str, op: str, bound: float, measure):
    def target(it):
        if not any(r.get("threads") == threads for r in it.get("rows", [])):
            return None, "not measured"
        value = measure(it, threads)
        ceiling = (it.get("ceilings") or {}).get(str(threads)) or {}
        others = _per_threads(it.get("others_cores"), threads)
        fair, _ = fairness(threads, others, load=it.get("load_average", 0.0))
        note = "other programs " + _busy_text(dict(others_cores=others, load_average=it.get("load_average", 0.0),
                                                    fair=fair))
        if name == "best_batch_tokens_x" and ceiling.get("gain"):
            note += f"; the roofline allows {ceiling['gain']:.1f}× here"
        return value, note
    return Target(f"{name}_{threads}t", f"{what}, {threads} thread(s)", op, bound, target)


@bench_item("decode_batch", title="Batched decode, compiled (context 64 per sequence, float32, 1 and 2 threads)",
            columns={"threads": "{threads}", "engine": "{engine}", "batch": "{batch}", "ms/step": "{ms_per_step:.1f}",
                     "× B=1 time": "{x_b1_time:.2f}", "tokens/s": "{tokens_per_s:.0f}",
                     "× B=1 tokens/s": "{x_b1_tokens:.1f}", "× floor": "{x_floor:.2f}",
                     "× roofline": "{x_roofline:.2f}"},
            text=lambda it: it.get("summary", ""),
            targets=[t for n in (1, 2) for t in (
                _batch_target(n, "batch8_over_batch1_time", "compiled step time at B=8 ÷ at B=1", "<=", 1.4,
                              lambda it, n: _ratio(it, "compiled", 8, "x_b1_time", n)),
                _batch_target(n, "best_batch_tokens_x", "compiled best-batch total tokens/s ÷ B=1", ">=", 10.0,
                              lambda it, n: _best_tokens(it, n)))])
def bench_decode_batch(ctx: Context) -> dict:
    """Step time and total tokens/s for B sequences decoded together, compiled and eager, at 1 and 2 threads,
    each against its roofline: the read floor and the time the step's arithmetic takes at the machine's peak."""
    import torch

    from course.measure.costs import decode_cost

    model = ctx.model("float32")
    batches = QUICK_BATCHES if ctx.quick else BATCHES
    configs = []
    any_shape = None
    if ctx.compile and not ctx.quick:  # the serving lesson's step: compiled groups of layers for every shape
        from course.engine.fast import DecodeStep

        any_shape = DecodeStep(model, any_shape=True)
    for B in batches:
        w, kv = _step_bytes(model.config, B, CONTEXT, model.dtype)
        if ctx.compile and not ctx.quick:
            configs.append(dict(engine="compiled", batch=B, bytes=w + kv,
                                step=_decode_setup(ctx, model, B, CONTEXT, compiled=True)))
            configs.append(dict(engine="compiled, any shape", batch=B, bytes=w + kv,
                                step=_decode_setup(ctx, model, B, CONTEXT, compiled=True, step=any_shape)))
        if B <= 8:  # the eager model beside it, where its jump happens
            configs.append(dict(engine="eager", batch=B, bytes=w + kv,
                                step=_decode_setup(ctx, model, B, CONTEXT, compiled=False)))
    from course.measure.threads import cpu_clock, others_busy

    flops_per_token = decode_cost(model.config, CONTEXT, model.dtype.itemsize).flops
    thread_counts = (1, 2) if (os.cpu_count() or 1) >= 2 and ctx.device.type == "cpu" else (1,)
    before = torch.get_num_threads()
    times = {(n, i): [] for n in thread_counts for i in range(len(configs))}
    probes = {n: [] for n in thread_counts}
    loads, others, gemv, peaks = [], {n: [] for n in thread_counts}, {}, {}
    reader = _reader(ctx)
    try:
        _with_threads(1)
        for cfg in ctx.progress(configs, "batch warm-up"):  # B = 1 and B >= 2 compile one graph each
            cfg["step"](), cfg["step"]()
        for n in thread_counts:
            _with_threads(n)
            gemv[n] = _head_products(model)
            peaks[n] = arithmetic_peak(model)
        for _ in ctx.progress(range(ctx.sizes.get("batch_rounds", 8)), "batch rounds"):  # ~6 s each, both thread counts
            loads.append(_load())
            for n in thread_counts:  # the thread counts take turns within each round
                _with_threads(n)
                clock = cpu_clock()
                probes[n].append(_probe(reader, configs[0]["step"]))
                for i, cfg in enumerate(configs):
                    times[(n, i)] += _time(cfg["step"], ctx.device, STEPS_PER_ROUND)
                busy = others_busy(clock, cpu_clock())
                if busy is not None:
                    others[n].append(busy)
    finally:
        torch.set_num_threads(before)
        reader.close()
    rows, ceilings = [], {}
    for n in thread_counts:
        read = statistics.median(probes[n])
        peak = max(peaks[n].values())
        for i, cfg in enumerate(configs):
            s = statistics.median(times[(n, i)])
            roof = roofline_ms(cfg["bytes"], cfg["batch"] * flops_per_token, read, peak)
            rows.append(dict(threads=n, engine=cfg["engine"], batch=cfg["batch"], ms_per_step=s * 1e3,
                             tokens_per_s=cfg["batch"] / s, bytes_per_step=cfg["bytes"],
                             floor_ms=_floor_ms(cfg["bytes"], read), x_floor=s * 1e3 / _floor_ms(cfg["bytes"], read),
                             roofline_ms=roof, x_roofline=s * 1e3 / roof, repeats=len(times[(n, i)])))
        mine = [r for r in rows if r["threads"] == n]
        for i, r in enumerate(mine):  # rows were appended in the order of configs
            base = next(j for j, b in enumerate(mine) if b["engine"] == r["engine"] and b["batch"] == 1)
            r["x_b1_time"] = paired_ratio(times[(n, i)], times[(n, base)], STEPS_PER_ROUND)
            r["x_b1_tokens"] = r["batch"] / r["x_b1_time"]
        compiled_b1 = next((r for r in mine if r["engine"] == "compiled" and r["batch"] == 1), mine[0])
        ceilings[str(n)] = batch_ceiling(
            {c["batch"]: c["bytes"] for c in configs}, flops_per_token, read, peak, compiled_b1["ms_per_step"])
        ceilings[str(n)].update(peaks={k: v for k, v in peaks[n].items()}, read_bytes_per_s=read)
    out = {"status": "ok", "rows": rows, "context": CONTEXT, "threads": list(thread_counts),
           "read_bytes_per_s": {str(n): statistics.median(probes[n]) for n in thread_counts},
           "flops_per_token": flops_per_token, "ceilings": ceilings, "load_average": statistics.median(loads),
           "others_cores": {str(n): statistics.median(o) if o else None for n, o in others.items()},
           "head_products": {str(n): g for n, g in gemv.items()}}
    out["summary"] = batch_summary(out)
    return out


PEAK_ROWS, PEAK_WEIGHT_ROWS = 64, 256  # the arithmetic probe: 64 rows of x by a 256-row weight that stays in cache


def arithmetic_peak(model, repeats: int = 5) -> dict:
    """FLOP/s of two products with nothing to wait for from memory: the compiled batched step's own product
    (course.engine.row_product's kernel on the CPU in float32, else F.linear) of 64 rows by a 256 × d weight
    that stays in cache, and BLAS's 1024 × 1024 square (course.measure.timing.matmul_flops). The larger is the
    roofline's roof: what a step of many sequences cannot beat."""
    import torch
    import torch.nn.functional as F

    from course.engine import row_product
    from course.measure.timing import matmul_flops, measure

    p = next(model.parameters())
    d = model.config.dim
    w = torch.randn(PEAK_WEIGHT_ROWS, d, dtype=p.dtype, device=p.device)
    x = torch.randn(PEAK_ROWS, d, dtype=p.dtype, device=p.device)
    kernel = row_product.computes(p)
    product = row_product.row_product if kernel else F.linear
    reps = 50  # ~0.5 ms of arithmetic each on a CPU core: long enough to time, short enough to stay in cache

    def run():
        for _ in range(reps):
            product(x, w)

    with torch.inference_mode():
        t = measure(run, p.device, warmup=1, repeats=repeats).median
    step = 2 * PEAK_ROWS * PEAK_WEIGHT_ROWS * d * reps / t
    return {"step's product" if kernel else "F.linear": step, "BLAS square": matmul_flops(p.device, dtype=p.dtype)}


def roofline_ms(nbytes: float, flops: float, read_bytes_per_s: float, flops_per_s: float) -> float:
    """The least time a step can take (ms): reading its bytes at the probe's rate, or its arithmetic at the peak,
    whichever is longer (the roofline model: Williams, Waterman and Patterson, CACM 2009)."""
    return max(nbytes / read_bytes_per_s, flops / flops_per_s) * 1e3


def batch_ceiling(bytes_by_batch: dict, flops_per_token: float, read_bytes_per_s: float, flops_per_s: float,
                  b1_ms: float) -> dict:
    """The most total tokens/s any batch of those measured can give on this roofline, and that as a multiple of
    the measured B = 1 tokens/s (1000 / b1_ms): the ceiling the best-batch gain is held to. ridge: the batch at
    which arithmetic starts to take longer than reading (bytes grow with B too: each sequence's K and V)."""
    best_batch, best = None, 0.0
    ridge = None
    for B, nbytes in sorted(bytes_by_batch.items()):
        ms = roofline_ms(nbytes, B * flops_per_token, read_bytes_per_s, flops_per_s)
        if ridge is None and B * flops_per_token / flops_per_s > nbytes / read_bytes_per_s:
            ridge = B
        if B / ms > best:
            best_batch, best = B, B / ms
    tokens = best * 1e3
    return {"batch": best_batch, "tokens_per_s": tokens, "gain": tokens * b1_ms / 1e3, "ridge_batch": ridge,
            "flops_per_s": flops_per_s}


def _linear_weights(model) -> list:
    """Every weight matrix a decode step multiplies by (the tied head once: one nn.Linear holds it)."""
    import torch

    return [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _head_products(model, repeats: int = 3) -> list[dict]:
    """The products of M rows with every weight matrix of one step (the step's matrix work), M = 1, 2, 4, 8, 16:
    BLAS (F.linear, what the eager step calls) and, where it builds, course.engine.row_product's kernel (what
    the compiled batched step calls), side by side. Where the eager B = 1 → 2 jump comes from, and what the
    kernel does about it."""
    import torch
    import torch.nn.functional as F

    from course.engine import row_product

    weights = _linear_weights(model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    kernel = row_product.computes(weights[0])
    kinds = {"blas": F.linear, **({"row kernel": row_product.row_product} if kernel else {})}
    out = []
    for M in (1, 2, 4, 8, 16):
        xs = {w.shape[1]: torch.randn(M, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
        times = {k: [] for k in kinds}
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first round warms up; then the two take turns
                for k, product in kinds.items():
                    times[k] += _time(lambda: [product(xs[w.shape[1]], w) for w in weights], weights[0].device, 1)
        row = dict(rows=M)
        for k, ts in times.items():
            s = statistics.median(ts[1:])
            row["ms" if k == "blas" else "kernel_ms"] = s * 1e3
            row["bytes_per_s" if k == "blas" else "kernel_bytes_per_s"] = nbytes / s
        out.append(row)
    return out


def _ratio(it, engine, batch, key, threads=None):
    r = _target_row(it, engine=engine, batch=batch, **({} if threads is None else {"threads": threads}))
    return None if r is None else r[key]


def _best_tokens(it, threads=None):
    xs = [r["x_b1_tokens"] for r in it.get("rows", [])
          if r["engine"] == "compiled" and (threads is None or r.get("threads") == threads)]
    return max(xs) if xs else None


def _per_threads(value, n):
    """An item's per-thread-count entry ({"1": …, "2": …}); an older item's single value stands for every count."""
    return value.get(str(n)) if isinstance(value, dict) else value


def batch_summary(it: dict) -> str:
    counts = it.get("threads") or sorted({r.get("threads", 1) for r in it["rows"]})
    parts = []
    for n in counts:
        rows = [r for r in it["rows"] if r.get("threads", 1) == n]
        if len(counts) > 1:
            parts.append(f"With {n} thread{'s' if n > 1 else ''}:")
        parts += _batch_sentences(it, n, rows)
    return " ".join(parts)


def _batch_sentences(it: dict, n: int, rows: list[dict]) -> list[str]:
    parts = []
    for engine in ("compiled", "compiled, any shape", "eager"):
        er = [r for r in rows if r["engine"] == engine]
        if len(er) < 2:
            continue
        best = max(er, key=lambda r: r["tokens_per_s"])
        b1 = er[0]
        parts.append(f"{engine}: B=1 {b1['ms_per_step']:.1f} ms/step ({b1['x_floor']:.2f}× floor), B=2 "
                     f"{er[1]['ms_per_step']:.1f} ms (×{er[1]['x_b1_time']:.2f}); best B={best['batch']}: "
                     f"{best['tokens_per_s']:.0f} tokens/s = {best['x_b1_tokens']:.1f}× B=1.")
    whole = {r["batch"]: r for r in rows if r["engine"] == "compiled"}
    anys = {r["batch"]: r for r in rows if r["engine"] == "compiled, any shape"}
    both = sorted(set(whole) & set(anys))
    if both:
        diffs = ", ".join(f"{anys[b]['ms_per_step'] - whole[b]['ms_per_step']:+.1f} ms at B={b}" for b in both)
        parts.append(f"The serving lesson's any-shape step (compiled groups of layers, one graph for every "
                     f"batch and context) against the whole-step graphs: {diffs}.")
    prods = _per_threads(it.get("head_products"), n) or []
    eager = {r["batch"]: r for r in rows if r["engine"] == "eager"}
    if len(prods) >= 2 and 1 in eager and 2 in eager:
        p1, p2 = prods[0]["ms"], prods[1]["ms"]
        step_jump = eager[2]["ms_per_step"] - eager[1]["ms_per_step"]
        prod_jump = p2 - p1
        grew = step_jump > 0.05 * eager[1]["ms_per_step"]  # more than noise
        parts.append(f"Where the eager B = 1 → 2 step goes: BLAS's products with every weight matrix take {p1:.1f} ms "
                     f"for 1 row (its matrix-vector kernel, {prods[0]['bytes_per_s'] / 1e9:.1f} GB/s) and {p2:.1f} ms "
                     f"for 2 (a matrix-matrix kernel, {prods[1]['bytes_per_s'] / 1e9:.1f} GB/s): "
                     + ((f"{prod_jump:+.1f} ms of the step's {step_jump:+.1f} ms ({prod_jump / step_jump:.0%})."
                         if prod_jump < step_jump else
                         f"{prod_jump:+.1f} ms, more than the whole step's {step_jump:+.1f} ms (the products were timed "
                         "alone, apart from the step), so they account for all of it.")
                        if grew else f"in this run the eager step changed by only {step_jump:+.1f} ms from B = 1 to 2 "
                        f"(under 5 % of its {eager[1]['ms_per_step']:.1f} ms, within noise), so there was no jump to "
                        "explain."))
    if prods and "kernel_ms" in prods[0]:
        by_m = {p["rows"]: p for p in prods}
        m8 = by_m.get(8, prods[-1])
        parts.append(f"The compiled batched step uses the row kernel instead (course/engine/row_product.cpp): the same "
                     f"products of {m8['rows']} rows take {m8['kernel_ms']:.1f} ms there against BLAS's "
                     f"{m8['ms']:.1f} ms ({m8['kernel_ms'] / prods[0]['kernel_ms']:.2f}× its 1-row time, BLAS "
                     f"{m8['ms'] / prods[0]['ms']:.2f}×).")
    ceiling = (it.get("ceilings") or {}).get(str(n))
    if ceiling and whole:
        parts.append(ceiling_sentence(ceiling, it["flops_per_token"], whole, n))
    fair, why = fairness(n, _per_threads(it.get("others_cores"), n), load=it["load_average"])
    parts.append(why[0].upper() + why[1:] + ("" if fair else "; timings are inflated") + ".")
    return parts


def ceiling_sentence(c: dict, flops_per_token: float, compiled: dict, threads: int) -> str:
    """What the roofline allows at this thread count, against the compiled rows (batch → row), from the values."""
    peaks = c.get("peaks") or {}
    where = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items())
    best = max(compiled.values(), key=lambda r: r["tokens_per_s"])
    b1 = compiled.get(1)
    text = (f"Roofline: reading at {c['read_bytes_per_s'] / 1e9:.1f} GB/s (the probe) and multiplying at "
            f"{c['flops_per_s'] / 1e9:.0f} GFLOP/s (the faster of: {where}), each token's "
            f"{flops_per_token / 1e6:.0f} MFLOP make a step ")
    text += (f"bound by arithmetic from B = {c['ridge_batch']} on" if c.get("ridge_batch")
             else "bound by reading at every batch measured")
    text += (f"; the batches measured can give at most {c['tokens_per_s']:.0f} tokens/s (B = {c['batch']}), "
             f"{c['gain']:.1f}× the compiled B = 1's measured tokens/s, and the best measured is "
             f"{best['x_b1_tokens']:.1f}× ({best['x_b1_tokens'] / c['gain']:.0%} of that ceiling)")
    if 8 in compiled and b1:
        roof8 = compiled[8]["roofline_ms"]
        text += (f"; at B = 8 the roofline allows {roof8:.1f} ms, {roof8 / b1['ms_per_step']:.2f}× B = 1's measured "
                 f"time (measured {compiled[8]['x_b1_time']:.2f}×)")
    text += "."
    if c["gain"] < 10:
        text += (f" Even a step on the roofline would reach only {c['gain']:.1f}×, so the ≥ 10× target is out of "
                 f"reach with {threads} thread{'s' if threads > 1 else ''} on this machine: its arithmetic is too "
                 "slow beside its memory for batching to pay more.")
    return text


# --- bytes_line ------------------------------------------------------------------------------------------------
@bench_item("bytes_line", title="Decode time against bytes read per step (random weights, real shapes)", slow=True,
            columns={"model": "{name}", "MB/step": lambda r: f"{r['bytes_per_step'] / 1e6:.0f}",
                     "ms/step": "{ms_per_step:.1f}", "GB/s": lambda r: f"{r['achieved_bytes_per_s'] / 1e9:.1f}",
                     "bound by": "{dominated_by}"},
            text=lambda it: it.get("verdict", ""),
            targets=[Target("bytes_line_r2", "bytes line: R² of time = bytes ÷ bandwidth + fixed", ">=", 0.98,
                            lambda it: (it.get("r2"), f"{len(it.get('rows', []))} shapes")),
                     Target("bytes_line_bandwidth", "bytes line: |fitted ÷ probed bandwidth − 1|", "<=", 0.25,
                            lambda it: (abs(it["bandwidth_ratio"] - 1) if "bandwidth_ratio" in it else None,
                                        f"{it.get('bandwidth_ratio', float('nan')):.0%} of the probe"
                                        + _unsteady_note(it.get("probes"))))])
def bench_bytes_line(ctx: Context) -> dict:
    """course.measure.bytes_line over the default shapes (KVCOURSE_FULL=1 for the bigger ones)."""
    from course.measure.bytes_line import bytes_line

    t0 = time.perf_counter()
    line = bytes_line(device=ctx.device, compile=ctx.compile, probe_bytes=ctx.sizes["bandwidth_bytes"],
                      progress=False, log=ctx.log)
    v = line.values()
    return {"status": "ok", "rows": v.pop("points"), **v, "verdict": line.verdict(), "wall_s": time.perf_counter() - t0}
