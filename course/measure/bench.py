"""Benchmark items: each measures one figure of the engine against this machine's limits, and says how to show it.

An item is a function `fn(ctx) -> dict` registered with `@bench_item(...)`; `kvcourse bench` (course/cli/bench.py)
runs every registered item in order, writes their dicts to JSON, and renders each as a Markdown section. The dict
has "status" ("ok", "skipped", "not available", "error") and, when not ok, a "reason"; an ok one usually has "rows".

To add an item from your own module (any layer from `measure` up), decorate its function:

    from course.measure.bench import bench_item

    @bench_item("batch", title="Batched decode", slow=False,
                columns={"batch": "{batch}", "tokens/s": "{tokens_per_s:.1f}"})
    def bench_batch(ctx) -> dict:
        ...
        return {"status": "ok", "rows": [...]}

and name the module in course/cli/bench.py's ITEM_MODULES (so the command imports it). `ctx` (a Context) gives the
device, the sizes (`ctx.quick`, `ctx.sizes`), the models (`ctx.model("float32")`, `ctx.engines(dtype)`), the
tokenizer, the bandwidth / FLOP/s probes, and `ctx.progress(iterable, desc)` for a progress bar.

Every figure is measured in one run, side by side: the configurations of an item take turns round after round (so
a burst of load from another program hits all of them alike), and each figure is the median over its repeats.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

STATUSES = ("ok", "skipped", "not available", "error")

# Sizes: full run, and --quick (seconds, for the smoke test). Items may add their own keys with ctx.sizes.get(k, d).
FULL = dict(decode_contexts=[64, 1024], prefill_tokens=[32, 128, 512, 1024], rounds=5, steps_per_round=4,
            batch_rounds=8, bandwidth_bytes=1 << 30, matmul_n=1024, hf_new_tokens=64, hf_rounds=3,
            cache_prompt=128, cache_new=256, cache_rounds=2, load_rounds=3, widget_moves=40)
QUICK = dict(decode_contexts=[16], prefill_tokens=[8, 32], rounds=2, steps_per_round=2,
             batch_rounds=2, bandwidth_bytes=64 << 20, matmul_n=256, hf_new_tokens=8, hf_rounds=1,
             cache_prompt=8, cache_new=8, cache_rounds=1, load_rounds=1, widget_moves=6)


# --- the registry ----------------------------------------------------------------------------------------------
@dataclass
class Target:
    """A bound one item's figure should meet: `measure(item_result)` gives (value or None, note)."""
    name: str
    what: str
    op: str  # "<=" or ">="
    bound: float
    measure: Callable[[dict], tuple]


@dataclass
class Item:
    name: str
    run: Callable  # (ctx) -> dict
    title: str
    slow: bool = False  # --quick leaves it out
    columns: dict | None = None  # Markdown table: header → format string over a row, or a function of the row
    text: Callable[[dict], str] | None = None  # Markdown paragraph under the table, from the item's dict
    targets: list[Target] = field(default_factory=list)


REGISTRY: dict[str, Item] = {}


def bench_item(name: str, *, title: str, slow: bool = False, columns: dict | None = None,
               text: Callable[[dict], str] | None = None, targets: list[Target] | None = None):
    """Register `fn(ctx) -> dict` as the bench item `name` (see the module docstring)."""
    if not name.isidentifier():
        raise ValueError(f"a bench item's name must be an identifier (letters, digits, _), got {name!r}")

    def register(fn):
        if name in REGISTRY and REGISTRY[name].run is not fn:
            raise ValueError(f"bench item {name!r} is registered twice ({REGISTRY[name].run.__module__} and "
                             f"{fn.__module__}); choose another name")
        REGISTRY[name] = Item(name, fn, title, slow, columns, text, list(targets or []))
        return fn
    return register


def cell(spec, row: dict) -> str:
    """One Markdown table cell: a format string over the row's keys, or a function of the row."""
    return str(spec(row)) if callable(spec) else spec.format(**row)


# --- what the items share --------------------------------------------------------------------------------------
class Context:
    """What the items share: the device, sizes, loaded models and the bandwidth / FLOP/s probes."""

    def __init__(self, device, sizes, compile, log, model_name="course", options: dict | None = None):
        self.device, self.sizes, self.compile, self.log = device, sizes, compile, log
        self.real = model_name == "course"  # False: a random tiny model (tests of the suite itself)
        self.options = dict(options or {})  # command-line settings for particular items (e.g. grade_samples)
        self._models, self._fast, self.tokenizer = {}, {}, None
        self.bandwidth_samples: list[float] = []  # bytes/s, one per probe
        self.read_copy_samples: list[tuple[float, float]] = []
        self.flops_samples: dict[str, list[float]] = {}

    @property
    def quick(self) -> bool:
        return self.sizes is QUICK

    @staticmethod
    def progress(iterable, desc):
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, leave=False, file=sys.stderr)


    def model(self, dtype: str):
        if dtype not in self._models and not self.real:
            from course.engine.device import pick_dtype
            from course.engine.model import tiny_model

            self._models[dtype] = tiny_model(seed=0).to(device=self.device, dtype=pick_dtype(dtype))
        if dtype not in self._models:
            from course.engine.tokenizer import load_tokenizer
            from course.engine.weights import load_model

            self._models[dtype] = load_model(device=self.device, dtype=dtype)
            self.tokenizer = self.tokenizer or load_tokenizer()
        return self._models[dtype]

    def fast(self, dtype: str):
        if dtype not in self._fast:
            from course.engine.fast import FastModel

            self._fast[dtype] = FastModel(self.model(dtype))  # shares the eager model's weights
        return self._fast[dtype]

    def serving_engine(self, dtype: str):
        """The serving lesson's engine: FastModel(model, any_shape=True), compiled groups of layers for any batch,
        context and paged batch (course.engine.fast), sharing the eager model's weights."""
        key = ("any shape", dtype)
        if key not in self._fast:
            from course.engine.fast import FastModel

            self._fast[key] = FastModel(self.model(dtype), any_shape=True)
        return self._fast[key]

    def engines(self, dtype: str) -> dict:
        engines = {"eager": self.model(dtype)}
        if self.compile and not self.quick:
            engines["compiled"] = self.fast(dtype)
        return engines

    def probe_bandwidth(self) -> float:
        from course.measure.timing import memory_bandwidth

        probe = memory_bandwidth(self.device, nbytes=self.sizes["bandwidth_bytes"], repeats=3)
        self.bandwidth_samples.append(probe.bytes_per_s)  # the better of a streaming read and a copy
        self.read_copy_samples.append((probe.read_bytes_per_s, probe.copy_bytes_per_s))
        return probe.bytes_per_s

    def probe_flops(self, dtype: str) -> float:
        from course.engine.device import pick_dtype
        from course.measure.timing import matmul_flops

        f = matmul_flops(self.device, n=self.sizes["matmul_n"], dtype=pick_dtype(dtype), repeats=3)
        self.flops_samples.setdefault(dtype, []).append(f)
        return f

    @property
    def bandwidth(self) -> float:
        if not self.bandwidth_samples:
            self.probe_bandwidth()
        return statistics.median(self.bandwidth_samples)

    def hardware(self) -> dict:
        out = {}
        if self.bandwidth_samples:
            out["memory_bandwidth_bytes_per_s"] = summary(self.bandwidth_samples)
            out["memory_bandwidth_probe_bytes"] = self.sizes["bandwidth_bytes"]
            out["memory_read_bytes_per_s"] = summary([r for r, _ in self.read_copy_samples])
            out["memory_copy_bytes_per_s"] = summary([c for _, c in self.read_copy_samples])
        if self.flops_samples:
            out["matmul_flops_per_s"] = {d: summary(v) for d, v in self.flops_samples.items()}
            out["matmul_n"] = self.sizes["matmul_n"]
        return out


# --- decode -----------------------------------------------------------------------------------------------
@bench_item("decode", title="Decode (batch 1)", columns={
    "engine": "{engine}", "dtype": "{dtype}", "context": "{context}", "ms/token": "{ms_per_token:.1f}",
    "tokens/s": "{tokens_per_s:.1f}", "bytes/step": lambda r: f"{r['bytes_per_step'] / 1e6:.0f} MB",
    "achieved GB/s": lambda r: f"{r['achieved_bytes_per_s'] / 1e9:.1f}", "of bandwidth": "{fraction_of_bandwidth:.0%}",
    "× roofline": "{x_roofline:.2f}"},
    text=lambda it: (f"Compiled vs eager logits: max |Δ| = {it['compiled_vs_eager_max_abs_logit_diff']:.1e}."
                     if "compiled_vs_eager_max_abs_logit_diff" in it else ""),
    targets=[Target("decode_x_roofline", "decode ctx 64, float32, batch 1: time ÷ roofline bound", "<=", 1.18,
                    lambda it: _best(it, lambda r: r["dtype"] == "float32" and r["context"] == 64 and r["batch"] == 1,
                                     "x_roofline", min))])
def bench_decode(ctx: Context) -> dict:
    """ms per token at each context, for each dtype and engine; bytes read per step ÷ time vs bandwidth."""
    import torch

    from course.engine.generate import decode_one_token, prefill
    from course.engine.kv_cache import KVCache
    from course.measure.costs import dtype_bytes, kv_cache_bytes
    from course.measure.timing import Stopwatch

    configs = []
    for dtype in ("float32", "bfloat16"):
        for engine_name, engine in ctx.engines(dtype).items():
            for T in ctx.sizes["decode_contexts"]:
                c = engine.config
                gen = torch.Generator().manual_seed(T)
                ids = torch.randint(0, c.vocab_size, (1, T), generator=gen).to(ctx.device)  # [1, T]
                cache = KVCache(c, batch=1, max_seq_len=T + 1, dtype=engine.dtype, device=ctx.device)
                prefill(engine, ids, cache)
                token = ids[:, -1:]  # [1, 1]
                kv_read = kv_cache_bytes(c.n_layers, 1, T + 1, c.n_kv_heads, c.head_dim, dtype_bytes(engine.dtype))
                configs.append(dict(engine=engine_name, dtype=dtype, context=T, batch=1,
                                    weight_bytes=param_bytes(engine), kv_bytes=kv_read,
                                    step=lambda e=engine, t=token, T=T, k=cache: decode_one_token(e, t, T, k),
                                    times=[]))
    for cfg in configs:  # warm-up: allocator, lazy init, and torch.compile's first compilation
        t0 = time.perf_counter()
        for _ in range(3):
            cfg["step"]()
        cfg["warmup_s"] = time.perf_counter() - t0
    for _ in ctx.progress(range(ctx.sizes["rounds"]), "decode rounds"):
        ctx.probe_bandwidth()
        for cfg in configs:
            for _ in range(ctx.sizes["steps_per_round"]):
                with Stopwatch(ctx.device) as sw:
                    cfg["step"]()
                cfg["times"].append(sw.seconds)
    bandwidth = ctx.bandwidth
    rows = []
    for cfg in configs:
        s = statistics.median(cfg["times"])
        step_bytes = cfg["weight_bytes"] + cfg["kv_bytes"]
        roofline_s = step_bytes / bandwidth
        rows.append(dict(engine=cfg["engine"], dtype=cfg["dtype"], context=cfg["context"], batch=cfg["batch"],
                         ms_per_token=s * 1e3, tokens_per_s=1 / s, best_ms_per_token=min(cfg["times"]) * 1e3,
                         bytes_per_step=step_bytes, weight_bytes=cfg["weight_bytes"], kv_bytes=cfg["kv_bytes"],
                         achieved_bytes_per_s=step_bytes / s, roofline_ms=roofline_s * 1e3,
                         x_roofline=s / roofline_s, fraction_of_bandwidth=roofline_s / s,
                         repeats=len(cfg["times"]), warmup_s=cfg["warmup_s"]))
    return {"status": "ok", "bandwidth_bytes_per_s": bandwidth, "rows": rows, **_equivalence(ctx)}


def _equivalence(ctx) -> dict:
    """max |Δ| of the compiled engine's decode logits against the eager model's (float32, context 64)."""
    if not ctx.compile or ctx.quick:
        return {}
    import torch

    from course.engine.generate import decode_one_token, prefill
    from course.engine.kv_cache import KVCache

    model, fast = ctx.model("float32"), ctx.fast("float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    ids = ids.to(ctx.device)
    out = []
    for engine in (model, fast):
        cache = KVCache(model.config, 1, 66, model.dtype, ctx.device)
        prefill(engine, ids, cache)
        out.append(decode_one_token(engine, ids[:, -1:], 64, cache))
    return {"compiled_vs_eager_max_abs_logit_diff": float((out[0] - out[1]).abs().max())}


# --- prefill ----------------------------------------------------------------------------------------------
@bench_item("prefill", title="Prefill", columns={
    "dtype": "{dtype}", "tokens": "{tokens}", "ms": lambda r: f"{r['seconds'] * 1e3:.0f}", "tokens/s": "{tokens_per_s:.0f}",
    "achieved GFLOP/s": lambda r: f"{r['achieved_flops_per_s'] / 1e9:.1f}",
    "of matmul FLOP/s": "{fraction_of_matmul_flops:.0%}"})
def bench_prefill(ctx: Context) -> dict:
    """Prompt tokens per second at each length; achieved FLOP/s vs a large matmul's FLOP/s (same dtype)."""
    import torch

    from course.engine.generate import prefill
    from course.engine.kv_cache import KVCache
    from course.measure import costs
    from course.measure.timing import Stopwatch

    configs = []
    for dtype in ("float32", "bfloat16"):
        model = ctx.model(dtype)  # prefill is eager in every engine: one [T, d] × [d, N] product per matrix
        c = model.config
        for T in ctx.sizes["prefill_tokens"]:
            ids = torch.randint(0, c.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(ctx.device)
            cache = KVCache(c, batch=1, max_seq_len=T, dtype=model.dtype, device=ctx.device)
            configs.append(dict(dtype=dtype, tokens=T, flops=costs.prefill_flops(c, T), times=[],
                                run=lambda m=model, i=ids, k=cache: prefill(m, i, k)))
    for cfg in configs:
        cfg["run"]()  # warm-up
    for _ in ctx.progress(range(ctx.sizes["rounds"]), "prefill rounds"):
        for dtype in ("float32", "bfloat16"):
            ctx.probe_flops(dtype)
        for cfg in configs:
            with Stopwatch(ctx.device) as sw:
                cfg["run"]()
            cfg["times"].append(sw.seconds)
    rows = []
    for cfg in configs:
        s = statistics.median(cfg["times"])
        peak = statistics.median(ctx.flops_samples[cfg["dtype"]])
        rows.append(dict(dtype=cfg["dtype"], tokens=cfg["tokens"], seconds=s, tokens_per_s=cfg["tokens"] / s,
                         flops=cfg["flops"], achieved_flops_per_s=cfg["flops"] / s,
                         matmul_flops_per_s=peak, fraction_of_matmul_flops=cfg["flops"] / s / peak,
                         repeats=len(cfg["times"])))
    return {"status": "ok", "rows": rows,
            "flops_counted": "2·(linear weights)·T + causal attention 4·L·H·D_h·T(T+1)/2 + the output head once"}


# --- transformers -----------------------------------------------------------------------------------------
@bench_item("transformers", title="Decode vs transformers generate (float32, greedy)", slow=True, columns={
    "engine": "{engine}", "new tokens": "{new_tokens}", "decode tokens/s": lambda r: fmt(r["decode_tokens_per_s"], ".1f"),
    "× transformers": lambda r: fmt(r["x_transformers"], ".2f"),
    "greedy tokens agreeing": "{greedy_tokens_agreeing}/{new_tokens}"},
    targets=[Target("vs_transformers", "decode tokens/s ÷ transformers generate tokens/s", ">=", 1.5,
                    lambda it: _best(it, lambda r: r["engine"] != "transformers" and r["x_transformers"],
                                     "x_transformers", max))])
def bench_transformers(ctx: Context) -> dict:
    """Decode tokens/s of our generate() vs transformers' generate(): same GGUF weights, dtype, prompt, greedy.

    Both are timed the same way: a generation of N new tokens minus one of 1 new token, so prefill
    cancels and (N - 1) / Δt is the decode rate.
    """
    if not ctx.real:
        return {"status": "skipped", "reason": "needs the course model (--model tiny was given)"}
    try:
        import transformers
    except ImportError:
        return {"status": "not available", "reason": "transformers is not installed (pip install -e '.[dev]')"}
    import torch

    from course.engine.generate import generate
    from course.measure.timing import Stopwatch
    from course.engine.weights import default_gguf_path

    dtype = "float32"
    model = ctx.model(dtype)
    tok = ctx.tokenizer
    p = default_gguf_path()
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=model.dtype)
    hf = hf.to(ctx.device).eval()
    hf_load_s = time.perf_counter() - t0
    prompt = tok.chat_ids("Explain in a few sentences why the sky is blue.")
    N = ctx.sizes["hf_new_tokens"]
    ids = torch.tensor([prompt], device=ctx.device)

    def hf_run(n):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=tok.eos_id)[0, len(prompt):].tolist()

    engines = {"transformers": hf_run}
    for name, engine in ctx.engines(dtype).items():
        engines[name] = lambda n, e=engine: generate(e, prompt, n).tokens
    tokens = {name: run_(N) for name, run_ in engines.items()}  # warm-up, and the texts to compare
    times = {name: {"n": [], "1": []} for name in engines}
    for _ in ctx.progress(range(ctx.sizes["hf_rounds"]), "vs transformers"):
        for name, run_ in engines.items():
            for key, n in (("n", N), ("1", 1)):
                with Stopwatch(ctx.device) as sw:
                    run_(n)
                times[name][key].append(sw.seconds)
    rows = []
    for name in engines:
        dt = statistics.median(times[name]["n"]) - statistics.median(times[name]["1"])
        rows.append(dict(engine=name, dtype=dtype, new_tokens=N, prompt_tokens=len(prompt),
                         seconds_n=statistics.median(times[name]["n"]), seconds_1=statistics.median(times[name]["1"]),
                         decode_tokens_per_s=(N - 1) / dt if dt > 0 else None,
                         greedy_tokens_agreeing=_agree(tokens[name], tokens["transformers"]),
                         repeats=len(times[name]["n"])))
    hf_rate = rows[0]["decode_tokens_per_s"]
    for row in rows:
        row["x_transformers"] = row["decode_tokens_per_s"] / hf_rate if hf_rate and row["decode_tokens_per_s"] else None
    del hf
    return {"status": "ok", "transformers_version": transformers.__version__, "transformers_load_s": hf_load_s,
            "rows": rows}


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading greedy tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --- cache speedup ----------------------------------------------------------------------------------------
@bench_item("cache_speedup", title="KV-cache speedup", text=lambda it: (
    f"{it['new_tokens']} new tokens after a {it['prompt_tokens']}-token prompt: {it['uncached_s']:.3g} s "
    f"without the cache, {it['cached_s']:.3g} s with it → **{it['speedup']:.1f}×**."),
    targets=[Target("cache_speedup", "256 new tokens after a 128-token prompt: uncached ÷ cached time", ">=", 10.0,
                    lambda it: (it["speedup"], f"{it['new_tokens']} after {it['prompt_tokens']}"))])
def bench_cache_speedup(ctx: Context) -> dict:
    """Generate N new tokens after a P-token prompt, without and with the KV cache (greedy, float32)."""
    from course.engine.generate import generate

    model, tok = ctx.model("float32"), ctx.tokenizer
    P, N = ctx.sizes["cache_prompt"], ctx.sizes["cache_new"]
    if tok is None:  # the tiny model has no tokenizer: any ids will do for timing
        prompt = [(7 * i) % model.config.vocab_size for i in range(P)]
    else:
        text = " ".join(["The key-value cache keeps every earlier token's keys and values so a new token"
                         " attends over them without recomputing them."] * (P // 10 + 2))
        prompt = tok.encode(text)[:P]
    runs = {"uncached": [], "cached": []}
    for _ in ctx.progress(range(ctx.sizes["cache_rounds"]), "cache speedup"):
        for name in runs:
            g = generate(model, prompt, N, use_cache=name == "cached")
            runs[name].append(g.total_time)
    uncached, cached = statistics.median(runs["uncached"]), statistics.median(runs["cached"])
    return {"status": "ok", "prompt_tokens": len(prompt), "new_tokens": N, "uncached_s": uncached,
            "cached_s": cached, "speedup": uncached / cached, "repeats": len(runs["cached"])}


# --- load -------------------------------------------------------------------------------------------------
@bench_item("load", title="Model load", text=lambda it: (
    f"cold (GGUF parse + dequantize): {fmt(it['cold_s'], '.1f')} s · warm (local safetensors cache): "
    f"{fmt(it['warm_s'], '.2f')} s (memory-mapped: the pages are read on first use)"),
    targets=[Target("warm_load_s", "model load from the local cache, seconds", "<=", 2.0,
                    lambda it: (it["warm_s"], ""))])
def bench_load(ctx: Context) -> dict:
    """load_model: cold parses and dequantizes the GGUF; warm reads the local safetensors cache.

    The warm load memory-maps the cache file, so its pages are read on first use (the first prefill).
    """
    from course.engine.weights import cached_weights_path, default_gguf_path, load_model

    if not ctx.real:
        return {"status": "skipped", "reason": "needs the course model (--model tiny was given)"}
    load_model(device=ctx.device)  # make sure the cache file exists
    kinds = {"warm": True} if ctx.quick else {"cold": False, "warm": True}
    times = {k: [] for k in kinds}
    for _ in ctx.progress(range(ctx.sizes["load_rounds"]), "load"):
        for kind, use_cache in kinds.items():
            t0 = time.perf_counter()
            m = load_model(device=ctx.device, use_cache=use_cache)
            times[kind].append(time.perf_counter() - t0)
            del m
    out = {"status": "ok", "gguf_bytes": default_gguf_path().stat().st_size,
           "cache_bytes": cached_weights_path(default_gguf_path()).stat().st_size}
    for kind in ("cold", "warm"):
        out[f"{kind}_s"] = statistics.median(times[kind]) if kind in times else None
    out["repeats"] = ctx.sizes["load_rounds"]
    if "cold" not in kinds:
        out["cold_note"] = "--quick leaves out the cold load"
    return out


def _best(item: dict, keep, key: str, pick) -> tuple:
    """(the best row's `key`, its engine) over the rows `keep` accepts, for a target; (None, "") when none."""
    rows = [r for r in item.get("rows", []) if keep(r)]
    if not rows:
        return None, ""
    best = pick(rows, key=lambda r: r[key])
    return best[key], best.get("engine", "")


def fmt(value, spec) -> str:
    """A number for a table, or — when it was not measured."""
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def param_bytes(model) -> int:
    """Bytes of every distinct parameter (the tied embedding / output matrix counted once)."""
    m = getattr(model, "model", model)
    seen, total = set(), 0
    for p in m.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
