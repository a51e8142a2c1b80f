"""What each piece of the compiled decode step (course/engine/fast.py, this commit) buys, side by side in one process.

    python docs/bench-runs/pieces.py --out docs/bench-runs/pieces-<date>.json

Every variant compiles its own graphs; then they take turns, round after round (the order reversed every other
round), each round probing the streaming-read bandwidth first, so a burst of load from another program hits them
alike. Reported: each variant's median, and the median over rounds of its time ÷ plain torch.compile's in the same
round. The course model, float32, 1 thread.

    step       the whole-step graph at B = 1 and B = 8, context 64 (decode ÷ floor, the batch figure): plain
               torch.compile of the model's forward, the model's blocks alone (DecodeStep without hooks, weights left
               on small pages), + the streamed one-row product and the row kernel, + one query's attention as sums,
               + the weights on huge pages (course.engine.arena: the step as shipped), two candidates on top
               (Inductor's C++ wrapper, skipping guard evaluation once warm), and the any-shape step (one compiled block, called per layer) that lesson
               05's server and lesson 01's bytes line use
    sweep      lesson 05's batch sweep (course.lessons.serving.batch_sweep, B = 1 … 64, context 64) on the any-shape
               engine with and without hooks, and the eager model
    serve      tokens per CPU-second of continuous batching on the bench's trace (bench/serving.py's sizes) on the
               same three engines
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def rounds(steps: dict, n: int, per_round: int, probe=None, log=print) -> tuple[dict, list]:
    """{name: [median seconds per round]} with the steps taking turns, and the read probe of each round."""
    times, reads = {k: [] for k in steps}, []
    for r in range(n):
        if probe is not None:
            reads.append(probe())
            next(iter(steps.values()))()
        order = list(steps.items())[::-1 if r % 2 else 1]
        for name, step in order:
            ts = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
            times[name].append(statistics.median(ts))
        log(f"round {r + 1}/{n} load {os.getloadavg()[0]:.1f}")
    return times, reads


def table(times: dict, base: str, extra=lambda name: {}) -> list[dict]:
    return [dict(variant=name, ms=statistics.median(ts) * 1e3, rounds_ms=[t * 1e3 for t in ts],
                 x_base=statistics.median(a / b for a, b in zip(ts, times[base])), **extra(name))
            for name, ts in times.items()]


def part_step(args, out):
    from course.engine import fast
    from course.engine.fast import DecodeStep
    from course.engine.kv_cache import KVCache
    from course.engine.weights import load_model
    from course.measure.costs import decode_cost
    from course.measure.timing import ReadProbe

    T, small, model = 64, load_model(dtype="float32"), load_model(dtype="float32")  # small: never packed
    plain = torch.compile(lambda m, t, pos, c: m(t, start_pos=pos, cache=c, last_only=True), fullgraph=True)

    def unpacked(hooks=None):  # a DecodeStep that leaves the weights where they are (small pages); hooks: _Products'
        pack, fast.pack_parameters = fast.pack_parameters, lambda m: False
        try:
            step = DecodeStep(small)
        finally:
            fast.pack_parameters = pack
        step.hooks = hooks or step.hooks
        return small, step

    def options(**inductor):  # the step as shipped, compiled with other Inductor options
        def make():
            step = DecodeStep(model)
            fn = fast._own_code(fast._step)
            step._compiled, step._code = torch.compile(fn, fullgraph=True, options=inductor), [fn.__code__]
            return model, step
        return make

    def skip_guards():
        step, warm = DecodeStep(model), set()

        def call(tok, pos, cache):
            if tok.shape[0] not in warm:
                warm.add(tok.shape[0])
                return step(tok, pos, cache)
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return step(tok, pos, cache)
        return model, call

    def step_of(make):
        def build(B):
            m, step = make()
            cache = KVCache(m.config, B, T + 1)
            tok, pos = torch.ones(B, 1, dtype=torch.long), torch.full((B,), T)
            return lambda: step(tok, pos, cache)
        return build

    def plain_step(B):
        cache = KVCache(small.config, B, T + 1)
        tok = torch.ones(B, 1, dtype=torch.long)
        return lambda: plain(small, tok, T, cache)

    variants = {"plain torch.compile": plain_step,
                "blocks alone": step_of(lambda: unpacked((False, False, False))),
                "+ stream + kernel": step_of(lambda: unpacked((True, True, False))),
                "+ attention sums": step_of(unpacked),
                "+ arena (as shipped)": step_of(lambda: (model, DecodeStep(model))),
                "+ cpp_wrapper": step_of(options(cpp_wrapper=True)),
                "+ skip guard eval": step_of(skip_guards),
                "any shape (lessons 01 and 05)": step_of(lambda: (model, DecodeStep(model, any_shape=True)))}
    steps = {}
    for name, build in variants.items():
        for B in (1, 8):
            t0 = time.perf_counter()
            f = build(B)
            with torch.inference_mode():
                f(), f(), f()
            out["compile_s"][f"{name} B={B}"] = time.perf_counter() - t0
            print(f"warm {name} B={B}: {time.perf_counter() - t0:.0f} s", flush=True)
            steps[(name, B)] = f
    probe = ReadProbe("cpu", nbytes=1 << 30, repeats=3)
    with torch.inference_mode():
        times, reads = rounds(steps, args.rounds, 3, probe)
    floor = {B: decode_cost(model.config, T, 4, batch=B, within_context=False).bytes for B in (1, 8)}
    for B in (1, 8):
        mine = {name: times[(name, B)] for name in variants}
        out["step"][f"B={B}"] = table(mine, "plain torch.compile", lambda name: dict(
            x_floor=statistics.median(t / (floor[B] / r) for t, r in zip(mine[name], reads)),
            x_shipped=statistics.median(a / b for a, b in zip(mine[name], mine["+ arena (as shipped)"]))))
    out["read_gb_s"] = [r / 1e9 for r in reads]


def part_serving(args, out):
    from bench.core import FULL
    from course.engine.fast import FastModel
    from course.engine.serving import make_trace, serve
    from course.engine.weights import load_model
    from course.lessons.serving import batch_sweep
    from course.lessons.serving_runs import warm_up
    from course.measure.roofline import Machine

    model = load_model(dtype="float32")
    engines = {"eager": model, "any shape, blocks alone": FastModel(model, any_shape=True),
               "any shape as shipped": FastModel(model, any_shape=True)}
    engines["any shape, blocks alone"].step.hooks = (False, False, False)
    machine = Machine("cpu", "float32", 1e10, 1e11)  # the prediction is not read here
    sweeps = {name: [] for name in engines}
    for r in range(args.sweep_rounds):  # each sweep times every B once per round; the engines take turns
        for name, engine in list(engines.items())[::-1 if r % 2 else 1]:
            sweep = batch_sweep(engine, machine, contexts=[64], batches=FULL["batches"], rounds=1, progress=False)
            sweeps[name].append({p.batch: p.seconds for p in sweep.at(64)})
            print(f"sweep round {r + 1} {name}", flush=True)
    out["sweep"] = {name: {str(B): statistics.median(s[B] for s in runs) * 1e3 for B in FULL["batches"]}
                    for name, runs in sweeps.items()}
    trace = make_trace(FULL["trace_requests"], seed=0, prompt_len=FULL["trace_prompt"], new_tokens=FULL["trace_new"],
                       mean_gap=0.0, vocab_size=model.config.vocab_size, low_token=1000, long_share=0.25,
                       long_new_tokens=FULL["trace_long_new"])
    for engine in engines.values():
        warm_up(engine, trace, FULL["serve_batch"], progress=False)
    runs = {name: [] for name in engines}
    for r in range(args.serve_rounds):
        for name, engine in list(engines.items())[::-1 if r % 2 else 1]:
            res = serve(engine, trace, "continuous", FULL["serve_batch"], progress=False)
            runs[name].append(res.cpu_throughput)
            print(f"serve round {r + 1} {name}: {res.cpu_throughput:.1f} tokens per CPU-s", flush=True)
    out["serve_tokens_per_cpu_s"] = runs
    out["compiled"] = {name: getattr(e, "compiled", None) for name, e in engines.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("step", "serving", "both"), default="both")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--sweep-rounds", type=int, default=3)
    p.add_argument("--serve-rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    from course.engine import row_product

    out = dict(torch=torch.__version__, threads=1, row_kernel=row_product.why_not() or "built", compile_s={}, step={},
               cpu=open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" :\t"),
               load_before=os.getloadavg())
    if args.part in ("step", "both"):
        part_step(args, out)
    if args.part in ("serving", "both"):
        part_serving(args, out)
    out["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for B, rows in out["step"].items():
        for r in rows:
            print(f"{B} {r['variant']:30s} {r['ms']:7.1f} ms  ×plain {r['x_base']:.3f}  ×shipped {r['x_shipped']:.3f}  "
                  f"×floor {r['x_floor']:.2f}")
    print(json.dumps({k: out[k] for k in ("sweep", "serve_tokens_per_cpu_s") if k in out}, indent=1))


if __name__ == "__main__":
    main()
