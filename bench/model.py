"""The model's other figures: prefill against the matmul FLOP/s, decode against transformers, the KV cache's
speedup, the load time, and the bytes line (decode time against bytes read, over models of published shapes)."""
from __future__ import annotations

import statistics
import time

from bench.core import Item, Target, best, fmt, median_of, side_by_side


# --- prefill ---------------------------------------------------------------------------------------------------
def bench_prefill(ctx) -> dict:
    """Prompt tokens per second at each length; achieved FLOP/s against a large matmul's (same dtype)."""
    import torch

    from course.engine.generate import prefill
    from course.engine.kv_cache import KVCache
    from course.measure.costs import prefill_flops

    steps, flops = {}, {}
    for dtype in ("float32", "bfloat16"):
        model = ctx.model(dtype)  # prefill is eager in every engine: one [T, d] × [d, N] product per matrix
        for T in ctx.sizes["prefill_tokens"]:
            ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
            cache = KVCache(model.config, batch=1, max_seq_len=T, dtype=model.dtype, device=ctx.device)
            steps[(dtype, T)] = lambda m=model, i=ids.to(ctx.device), k=cache: prefill(m, i, k)
            flops[(dtype, T)] = prefill_flops(model.config, T)
    for step in steps.values():
        step()  # warm-up
    times = side_by_side(steps, ctx.device, ctx.sizes["rounds"], 1,
                         before_round=lambda r: [ctx.probe_flops(d) for d in ("float32", "bfloat16")])
    rows = []
    for (dtype, T), ts in times.items():
        s, peak = median_of(ts), statistics.median(ctx.flops_samples[dtype])
        rows.append(dict(dtype=dtype, tokens=T, seconds=s, tokens_per_s=T / s, flops=flops[(dtype, T)],
                         achieved_flops_per_s=flops[(dtype, T)] / s, matmul_flops_per_s=peak,
                         fraction_of_matmul_flops=flops[(dtype, T)] / s / peak, repeats=len(ts)))
    return {"status": "ok", "rows": rows,
            "flops_counted": "2·(linear weights)·T + causal attention 4·L·H·D_h·T(T+1)/2 + the output head once"}


PREFILL = Item(bench_prefill, "Prefill", columns={
    "dtype": "{dtype}", "tokens": "{tokens}", "ms": lambda r: f"{r['seconds'] * 1e3:.0f}",
    "tokens/s": "{tokens_per_s:.0f}", "achieved GFLOP/s": lambda r: f"{r['achieved_flops_per_s'] / 1e9:.1f}",
    "of matmul FLOP/s": "{fraction_of_matmul_flops:.0%}"})


# --- transformers ----------------------------------------------------------------------------------------------
def bench_transformers(ctx) -> dict:
    """Decode tokens/s of our generate() against transformers' generate(): same GGUF weights, dtype, prompt,
    greedy. Both timed as a generation of N new tokens minus one of 1, so prefill cancels: (N - 1) / Δt."""
    if not ctx.real:
        return {"status": "skipped", "reason": "needs the course model (--model tiny was given)"}
    try:
        import transformers
    except ImportError:
        return {"status": "not available", "reason": "transformers is not installed (pip install -e '.[dev]')"}
    import torch

    from course.engine.generate import generate
    from course.engine.weights import default_gguf_path

    model, tok, path = ctx.model("float32"), ctx.tokenizer, default_gguf_path()
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=model.dtype)
    hf = hf.to(ctx.device).eval()
    hf_load_s = time.perf_counter() - t0
    prompt = tok.chat_ids("Explain in a few sentences why the sky is blue.")
    N, ids = ctx.sizes["hf_new_tokens"], torch.tensor([prompt], device=ctx.device)

    def hf_run(n):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=tok.eos_id)[0, len(prompt):].tolist()

    runs = {"transformers": hf_run, **{name: (lambda n, e=e: generate(e, prompt, n).tokens)
                                       for name, e in ctx.engines("float32").items()}}
    tokens = {name: run(N) for name, run in runs.items()}  # warm-up, and the tokens to compare
    steps = {(name, n): (lambda run=run, n=n: run(n)) for name, run in runs.items() for n in (N, 1)}
    times = side_by_side(steps, ctx.device, ctx.sizes["hf_rounds"], 1)
    rows = []
    for name in runs:
        dt = median_of(times[(name, N)]) - median_of(times[(name, 1)])
        agree = next((i for i, (a, b) in enumerate(zip(tokens[name], tokens["transformers"])) if a != b),
                     min(len(tokens[name]), N))
        rows.append(dict(engine=name, dtype="float32", new_tokens=N, prompt_tokens=len(prompt),
                         decode_tokens_per_s=(N - 1) / dt if dt > 0 else None, greedy_tokens_agreeing=agree,
                         repeats=len(times[(name, N)])))
    hf_rate = rows[0]["decode_tokens_per_s"]
    for row in rows:
        row["x_transformers"] = row["decode_tokens_per_s"] / hf_rate if hf_rate and row["decode_tokens_per_s"] else None
    return {"status": "ok", "transformers_version": transformers.__version__, "transformers_load_s": hf_load_s,
            "rows": rows}


TRANSFORMERS = Item(bench_transformers, "Decode vs transformers generate (float32, greedy)", slow=True, columns={
    "engine": "{engine}", "new tokens": "{new_tokens}",
    "decode tokens/s": lambda r: fmt(r["decode_tokens_per_s"], ".1f"), "× transformers": lambda r: fmt(r["x_transformers"], ".2f"),
    "greedy tokens agreeing": "{greedy_tokens_agreeing}/{new_tokens}"},
    targets=[Target("vs_transformers", "decode tokens/s ÷ transformers generate tokens/s", ">=", 1.5,
                    lambda it: best(it, lambda r: r["engine"] != "transformers" and r["x_transformers"],
                                    "x_transformers", max))])


# --- cache_speedup ---------------------------------------------------------------------------------------------
def bench_cache_speedup(ctx) -> dict:
    """Generate N new tokens after a P-token prompt, without and with the KV cache (greedy, float32)."""
    from course.engine.generate import generate

    model, tok = ctx.model("float32"), ctx.tokenizer
    P, N = ctx.sizes["cache_prompt"], ctx.sizes["cache_new"]
    if tok is None:  # the tiny model has no tokenizer: any ids will do for timing
        prompt = [(7 * i) % model.config.vocab_size for i in range(P)]
    else:
        prompt = tok.encode(" ".join(["The key-value cache keeps every earlier token's keys and values so a new "
                                      "token attends over them without recomputing them."] * (P // 10 + 2)))[:P]
    runs = {"uncached": [], "cached": []}
    for _ in ctx.progress(range(ctx.sizes["cache_rounds"]), "cache speedup"):
        for name in runs:
            runs[name].append(generate(model, prompt, N, use_cache=name == "cached").total_time)
    uncached, cached = statistics.median(runs["uncached"]), statistics.median(runs["cached"])
    return {"status": "ok", "prompt_tokens": len(prompt), "new_tokens": N, "uncached_s": uncached,
            "cached_s": cached, "speedup": uncached / cached, "repeats": len(runs["cached"])}


CACHE_SPEEDUP = Item(bench_cache_speedup, "KV-cache speedup", text=lambda it: (
    f"{it['new_tokens']} new tokens after a {it['prompt_tokens']}-token prompt: {it['uncached_s']:.3g} s "
    f"without the cache, {it['cached_s']:.3g} s with it → **{it['speedup']:.1f}×**."),
    targets=[Target("cache_speedup", "256 new tokens after a 128-token prompt: uncached ÷ cached time", ">=", 10.0,
                    lambda it: (it["speedup"], f"{it['new_tokens']} after {it['prompt_tokens']}"))])


# --- load ------------------------------------------------------------------------------------------------------
def bench_load(ctx) -> dict:
    """load_model: cold parses and dequantizes the GGUF; warm memory-maps the local safetensors cache (its pages
    are read on first use)."""
    from course.engine.weights import cached_weights_path, default_gguf_path, load_model

    if not ctx.real:
        return {"status": "skipped", "reason": "needs the course model (--model tiny was given)"}
    load_model(device=ctx.device)  # make sure the cache file exists
    kinds = {"warm": True} if ctx.quick else {"cold": False, "warm": True}
    times = {k: [] for k in kinds}
    for _ in ctx.progress(range(ctx.sizes["load_rounds"]), "load"):
        for kind, use_cache in kinds.items():
            t0 = time.perf_counter()
            load_model(device=ctx.device, use_cache=use_cache)
            times[kind].append(time.perf_counter() - t0)
    return {"status": "ok", "gguf_bytes": default_gguf_path().stat().st_size,
            "cache_bytes": cached_weights_path(default_gguf_path()).stat().st_size, "repeats": ctx.sizes["load_rounds"],
            **{f"{k}_s": statistics.median(times[k]) if k in times else None for k in ("cold", "warm")}}


LOAD = Item(bench_load, "Model load", text=lambda it: (
    f"cold (GGUF parse + dequantize): {fmt(it['cold_s'], '.1f')} s · warm (local safetensors cache): "
    f"{fmt(it['warm_s'], '.2f')} s (memory-mapped: the pages are read on first use)"),
    targets=[Target("warm_load_s", "model load from the local cache, seconds", "<=", 2.0, lambda it: (it["warm_s"], ""))])


# --- bytes_line ------------------------------------------------------------------------------------------------
def bench_bytes_line(ctx) -> dict:
    """course.measure.bytes_line over the default shapes (KVCOURSE_FULL=1 for the bigger ones)."""
    from course.measure.bytes_line import bytes_line

    line = bytes_line(device=ctx.device, compile=ctx.compile, probe_bytes=ctx.sizes["bandwidth_bytes"],
                      progress=False, log=ctx.log)
    v = line.values()
    return {"status": "ok", "rows": v.pop("points"), **v, "verdict": line.verdict()}


UNSTEADY = 1.25  # read probes whose fastest round beat the slowest by more than this: an unsteady memory system


def _bandwidth_note(it) -> str:
    """The slope's share of the probe, and whether the streaming-read probe (bytes/s, one per round) held still:
    on a shared host other tenants' memory traffic comes and goes, and a probe that swings by more than UNSTEADY
    between rounds makes the floor itself uncertain."""
    probes = it.get("probes") or []
    return f"{it.get('bandwidth_ratio', float('nan')):.0%} of the probe" + (
        "" if len(probes) < 2 or max(probes) <= UNSTEADY * min(probes)
        else f"; read probe {min(probes) / 1e9:.1f}–{max(probes) / 1e9:.1f} GB/s, unsteady")


BYTES_LINE = Item(bench_bytes_line, "Decode time against bytes read per step (random weights, real shapes)", slow=True,
                  columns={"model": "{name}", "MB/step": lambda r: f"{r['bytes_per_step'] / 1e6:.0f}",
                           "ms/step": "{ms_per_step:.1f}", "GB/s": lambda r: f"{r['achieved_bytes_per_s'] / 1e9:.1f}",
                           "bound by": "{dominated_by}"},
                  text=lambda it: it.get("verdict", ""),
                  targets=[Target("bytes_line_r2", "bytes line: R² of time = bytes ÷ bandwidth + fixed", ">=", 0.98,
                                  lambda it: (it.get("r2"), f"{len(it.get('rows', []))} shapes")),
                           Target("bytes_line_bandwidth", "bytes line: |fitted ÷ probed bandwidth − 1|", "<=", 0.25,
                                  lambda it: (abs(it["bandwidth_ratio"] - 1) if "bandwidth_ratio" in it else None,
                                              _bandwidth_note(it)))])
