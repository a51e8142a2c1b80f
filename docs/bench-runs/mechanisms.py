"""Each mechanism of the compiled decode path at commit 17d83f0, side by side with plain torch.compile (one process).

    git worktree add --detach /tmp/kv-old-eb 17d83f0
    PYTHONPATH=/tmp/kv-old-eb python docs/bench-runs/mechanisms.py --out docs/bench-runs/mechanisms-<date>.json

The figure the course shows at B = 1 is the decode step against its bandwidth floor, and at B >= 2 the step of the
batch against B = 1 (lesson 05's sweep). Every variant below compiles its own graph for B = 1 and B = 8 (context 64,
float32, 1 thread); then the variants take turns, round after round, each round probing the streaming-read
bandwidth first (the floor), so a burst of load from another program hits every variant alike. Each variant is
reported as its median step and as the median over rounds of (its step ÷ the full project step in the same round).

    plain           torch.compile of the model's own decode call (generate.decode_one_token), gpt-fast's way
    plain+stream    the same with a one-row Linear written as (x * W).sum(-1) (Inductor streams it), BLAS for batches
    project         DecodeStep as shipped: huge-page arena, fused qkv / gate-up, COMPUTE_ONCE, CPP_WRAPPER,
                    the direct call of warm graphs (Graphs), skip_guard_eval; the C++ row and attention kernels
                    where the CPU has AVX-512
    project -X      the same with one mechanism X turned off
    nothing custom  DecodeStep with every mechanism off (the streamed one-row product alone)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types

import torch
import torch.nn.functional as F
from torch import nn


class StreamLinear(nn.Linear):
    """One row inside torch.compile: (x * W).sum(-1), which Inductor streams; otherwise F.linear."""

    def forward(self, x):
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
            return (x.unsqueeze(-2) * self.weight).sum(-1)
        return F.linear(x, self.weight, self.bias)


def own_code(fn):
    """fn with a code object of its own, so that TorchDynamo keeps a cache (and a recompile count) for it alone."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--only", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # every variant compiles the same decode_step: no eager fallback
    from course.engine import fast, row_product
    from course.engine.fast import DecodeStep
    from course.engine.kv_cache import KVCache
    from course.engine.weights import load_model
    from course.measure.costs import decode_cost
    from course.measure.timing import ReadProbe

    T = 64
    batches = [int(b) for b in args.batches.split(",")]
    models = {}

    def model(kind):  # separate copies: packing and the Linear hook change a model in place
        if kind not in models:
            m = load_model(dtype="float32")
            if kind == "stream":
                for mod in m.modules():
                    if type(mod) is nn.Linear:
                        mod.__class__ = StreamLinear
            models[kind] = m
        return models[kind]

    # the model's own decode call (generate.decode_one_token without its inference_mode decorator, which the
    # compiled frame would otherwise enter itself), called in inference mode
    plain_fn = torch.compile(lambda m, t, pos, c: m(t, start_pos=pos, cache=c, last_only=True), fullgraph=True)
    stream_fn = torch.compile(lambda m, t, pos, c: m(t, start_pos=pos, cache=c, last_only=True), fullgraph=True)

    def plain(kind, fn):
        def make(B):
            m = model(kind)
            cache = KVCache(m.config, B, T + 1)
            tok = torch.ones(B, 1, dtype=torch.long)
            return lambda: fn(m, tok, T, cache)
        return make

    original = fast.decode_step

    def project(kind="packed", compute_once=True, **kw):
        code = own_code(original)  # one code object per variant: TorchDynamo keeps its graphs per code object

        def make(B):
            fast.COMPUTE_ONCE = {"realize_opcount_threshold": 4} if compute_once else {}
            fast.decode_step = code
            step = DecodeStep(model(kind), **kw)
            m = step.model
            cache = KVCache(m.config, B, T + 1)
            tok = torch.ones(B, 1, dtype=torch.long)
            pos = torch.full((B,), T)
            f = lambda: step(tok, pos, cache)
            f.step = step
            return f
        return make

    variants = {
        "plain": plain("small", plain_fn),
        "plain+stream": plain("stream", stream_fn),
        "project": project(),
        "project -direct": project(direct=False),
        "project -direct -skip_guards": project(direct=False, skip_guards=False),
        "project -cpp_wrapper": project(cpp_wrapper=False),
        "project -compute_once": project(compute_once=False),
        "project -fuse (arena kept)": project(fuse=False),
        "project -fuse -arena": project(kind="small", fuse=False),
        "nothing custom": project(kind="small", fuse=False, cpp_wrapper=False, direct=False, skip_guards=False,
                                  compute_once=False),
    }
    if row_product.available():
        variants["project -row_kernel"] = project(row_kernel=False)
    if args.only:
        keep = set(args.only.split("|"))
        variants = {k: v for k, v in variants.items() if k in keep or k == "project"}
    steps, compile_s = {}, {}
    for name, make in variants.items():
        for B in batches:
            t0 = time.perf_counter()
            f = make(B)  # the cache outside inference mode, as the lessons make it
            with torch.inference_mode():
                f(), f(), f()
            compile_s[(name, B)] = time.perf_counter() - t0
            st = getattr(f, "step", None)
            if st is not None and not st.compiled:
                raise SystemExit(f"{name} B={B} fell back to eager")
            steps[(name, B)] = f
            print(f"warm {name} B={B}: {compile_s[(name, B)]:.0f} s", flush=True)
    cfg = model("small").config
    floors = {B: decode_cost(cfg, T, 4, batch=B, within_context=False).bytes for B in batches}
    probe = ReadProbe("cpu", nbytes=1 << 30, repeats=3)
    times = {k: [] for k in steps}
    reads, loads = [], []
    with torch.inference_mode():
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            reads.append(probe())
            next(iter(steps.values()))()  # the first step after a probe is slow: untimed
            order = list(steps.items())
            if r % 2:
                order.reverse()  # alternate the order too
            for key, f in order:
                ts = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t0)
                times[key].append(statistics.median(ts))
            print(f"round {r + 1}/{args.rounds} load {loads[-1]:.1f}", flush=True)
    rows = []
    for (name, B), ts in times.items():
        base = times[("project", B)]
        one = times.get((name, 1))
        rows.append(dict(variant=name, batch=B, ms=statistics.median(ts) * 1e3,
                         x_project=statistics.median(a / b for a, b in zip(ts, base)),
                         x_floor=statistics.median(t / (floors[B] / rd) for t, rd in zip(ts, reads)),
                         x_b1=statistics.median(a / b for a, b in zip(ts, one)) if one else None,
                         compile_s=compile_s[(name, B)], rounds_ms=[t * 1e3 for t in ts]))
    out = dict(commit="17d83f0", torch=torch.__version__, threads=1, context=T, rounds=args.rounds,
               cpu=open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" :\t"),
               row_kernel=row_product.why_not() or "built", read_gb_s=[r / 1e9 for r in reads], load=loads,
               rows=rows)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in rows:
        print(f"{r['variant']:32s} B={r['batch']}  {r['ms']:7.1f} ms  ×project {r['x_project']:.3f}  "
              f"×floor {r['x_floor']:.2f}  compile {r['compile_s']:.0f} s")


if __name__ == "__main__":
    main()
