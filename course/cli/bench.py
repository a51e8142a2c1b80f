"""`kvcourse bench`: how close the engine runs to this machine's limits, and how it compares.

Every figure is measured in one run, side by side: the configurations of an item take turns round
after round (so a burst of load from another program hits all of them alike), and each figure is
the median over its repeats. The roofline bound of a decode step is (bytes it must read) ÷ (this
machine's memory bandwidth, probed between the rounds); prefill is compared with the FLOP/s of a
large matrix multiply measured the same way.

    kvcourse bench                 # everything: tens of minutes on 2 CPU cores (mostly the uncached
                                   # generation, the notebooks and the first torch.compile)
    kvcourse bench --quick         # tiny sizes, slow items skipped (the smoke test)
    kvcourse bench --skip notebooks --threads 1 --out DIR

Writes bench-<time>.json and bench-<time>.md (plus latest.json / latest.md) into --out
(bench-results/ by default). Items whose code is not part of this checkout are reported as
"not available", never given a number.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata, util
from pathlib import Path

SCHEMA = "kvcourse-bench/1"
ITEMS = ("decode", "prefill", "transformers", "cache_speedup", "load", "notebooks", "grading", "widgets")
SLOW_ITEMS = ("transformers", "notebooks", "grading")  # skipped by --quick
STATUSES = ("ok", "skipped", "not available", "error")

# Sizes: full run, and --quick (seconds, for the smoke test).
FULL = dict(decode_contexts=[64, 1024], prefill_tokens=[32, 128, 512, 1024], rounds=5, steps_per_round=4,
            bandwidth_bytes=1 << 30, matmul_n=1024, hf_new_tokens=64, hf_rounds=3,
            cache_prompt=128, cache_new=256, cache_rounds=2, load_rounds=3, widget_moves=40)
QUICK = dict(decode_contexts=[16], prefill_tokens=[8, 32], rounds=2, steps_per_round=2,
             bandwidth_bytes=64 << 20, matmul_n=256, hf_new_tokens=8, hf_rounds=1,
             cache_prompt=8, cache_new=8, cache_rounds=1, load_rounds=1, widget_moves=6)

TARGETS = {  # name: (what, comparison, bound)
    "decode_x_roofline": ("decode ctx 64, float32, batch 1: time ÷ roofline bound", "<=", 1.18),
    "vs_transformers": ("decode tokens/s ÷ transformers generate tokens/s", ">=", 1.5),
    "cache_speedup": ("256 new tokens after a 128-token prompt: uncached ÷ cached time", ">=", 10.0),
    "warm_load_s": ("model load from the local cache, seconds", "<=", 2.0),
    "notebooks_s": ("all lessons + solutions executed headless, seconds", "<=", 600.0),
    "grade_s_per_submission": ("autograde seconds per submission", "<=", 10.0),
    "widget_redraw_ms": ("slowest widget's median slider redraw, ms", "<=", 200.0),
}


# --- command line --------------------------------------------------------------------------------------------
def add_arguments(p):
    p.add_argument("--quick", action="store_true", help="tiny sizes, slow items skipped (seconds; the smoke test)")
    p.add_argument("--out", default=None, help="folder for the JSON and Markdown results (default: bench-results/)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; on a busy shared machine 1 is steadier)")
    p.add_argument("--skip", action="append", default=[], choices=ITEMS, metavar="ITEM",
                   help=f"leave an item out (repeatable): {', '.join(ITEMS)}")
    p.add_argument("--only", action="append", default=[], choices=ITEMS, metavar="ITEM", help="run only these items")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd engine (course/fast.py)")
    p.add_argument("--grade-samples", type=int, default=6,
                   help="students of autograde/samples/ whose submissions are graded (default 6)")
    p.add_argument("--model", default="course", choices=("course", "tiny"),
                   help="course: SmolLM2-135M (default); tiny: a random tiny model, to test the suite itself")


def run(args) -> int:
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.grade_samples < 1:
        raise ValueError(f"--grade-samples must be >= 1, got {args.grade_samples}")
    items = [i for i in (args.only or ITEMS) if i not in args.skip]
    result = run_suite(items=items, quick=args.quick, device=args.device, threads=args.threads,
                       compile=not args.no_compile, grade_samples=args.grade_samples, model=args.model)
    json_path, md_path = write_results(result, args.out)
    print(render_markdown(result))
    print(f"\nwrote {json_path}\n      {md_path}")
    return 0


# --- the suite -----------------------------------------------------------------------------------------------
def run_suite(items=ITEMS, quick: bool = False, device="auto", threads: int | None = None, compile: bool = True,
              grade_samples: int = 6, model: str = "course", log=print) -> dict:
    import torch

    from course.engine.device import pick_device

    if model not in ("course", "tiny"):
        raise ValueError(f"model must be 'course' or 'tiny', got {model!r}")
    unknown = [i for i in items if i not in ITEMS]
    if unknown:
        raise ValueError(f"unknown bench items {unknown}; choose from {list(ITEMS)}")
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    elif os.cpu_count() and _loadavg()[0] >= os.cpu_count():
        log(f"[bench] load average {_loadavg()[0]:.1f} on {os.cpu_count()} cores: multi-threaded timings will "
            "suffer from waiting on descheduled threads; --threads 1 (or OMP_WAIT_POLICY=PASSIVE) is steadier")
    device = pick_device(device)
    try:
        return _run_items(items, quick, device, compile, grade_samples, model, log)
    finally:
        torch.set_num_threads(threads_before)


def _run_items(items, quick, device, compile, grade_samples, model, log) -> dict:
    sizes = QUICK if quick else FULL
    result = {"schema": SCHEMA, "meta": _meta(device, quick, compile, sizes), "hardware": {}, "items": {}}
    result["meta"]["model"] = model
    ctx = _Context(device, sizes, compile, log, model)
    t_start = time.perf_counter()
    for name in ITEMS:
        if name not in items:
            result["items"][name] = {"status": "skipped", "reason": "not selected"}
            continue
        if quick and name in SLOW_ITEMS:
            result["items"][name] = {"status": "skipped", "reason": "--quick leaves out the slow items"}
            continue
        log(f"[bench] {name} …")
        t0 = time.perf_counter()
        try:
            item = globals()[f"bench_{name}"](ctx, **({"grade_samples": grade_samples} if name == "grading" else {}))
        except Exception as exc:  # one broken item must not hide the others' figures
            item = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=6)}
        item["wall_s"] = time.perf_counter() - t0
        result["items"][name] = item
    result["hardware"] = ctx.hardware()
    result["meta"]["wall_s"] = time.perf_counter() - t_start
    result["meta"]["load_average_after"] = _loadavg()
    result["targets"] = evaluate_targets(result)
    return result


class _Context:
    """What the items share: the device, sizes, loaded models and the bandwidth / FLOP/s probes."""

    def __init__(self, device, sizes, compile, log, model_name="course"):
        self.device, self.sizes, self.compile, self.log = device, sizes, compile, log
        self.real = model_name == "course"  # False: a random tiny model (tests of the suite itself)
        self._models, self._fast, self.tokenizer = {}, {}, None
        self.bandwidth_samples: list[float] = []  # bytes/s, one per probe
        self.read_copy_samples: list[tuple[float, float]] = []
        self.flops_samples: dict[str, list[float]] = {}

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

    def engines(self, dtype: str) -> dict:
        engines = {"eager": self.model(dtype)}
        if self.compile and self.sizes is not QUICK:
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
            out["memory_bandwidth_bytes_per_s"] = _summary(self.bandwidth_samples)
            out["memory_bandwidth_probe_bytes"] = self.sizes["bandwidth_bytes"]
            out["memory_read_bytes_per_s"] = _summary([r for r, _ in self.read_copy_samples])
            out["memory_copy_bytes_per_s"] = _summary([c for _, c in self.read_copy_samples])
        if self.flops_samples:
            out["matmul_flops_per_s"] = {d: _summary(v) for d, v in self.flops_samples.items()}
            out["matmul_n"] = self.sizes["matmul_n"]
        return out


# --- 1. decode -----------------------------------------------------------------------------------------------
def bench_decode(ctx: _Context) -> dict:
    """ms per token at each context, for each dtype and engine; bytes read per step ÷ time vs bandwidth."""
    import torch

    from course.engine.generate import decode_one_token, prefill
    from course.engine.kv_cache import KVCache
    from course.measure.costs import kv_cache_bytes
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
                kv_read = kv_cache_bytes(c.n_layers, 1, T + 1, c.n_kv_heads, c.head_dim, _elem(engine.dtype))
                configs.append(dict(engine=engine_name, dtype=dtype, context=T, batch=1,
                                    weight_bytes=_param_bytes(engine), kv_bytes=kv_read,
                                    step=lambda e=engine, t=token, T=T, k=cache: decode_one_token(e, t, T, k),
                                    times=[]))
    for cfg in configs:  # warm-up: allocator, lazy init, and torch.compile's first compilation
        t0 = time.perf_counter()
        for _ in range(3):
            cfg["step"]()
        cfg["warmup_s"] = time.perf_counter() - t0
    for _ in _progress(range(ctx.sizes["rounds"]), "decode rounds"):
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
    if not ctx.compile or ctx.sizes is QUICK:
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


# --- 2. prefill ----------------------------------------------------------------------------------------------
def bench_prefill(ctx: _Context) -> dict:
    """Prompt tokens per second at each length; achieved FLOP/s vs a large matmul's FLOP/s (same dtype)."""
    import torch

    from course.engine.generate import prefill
    from course.engine.kv_cache import KVCache
    from course.measure.timing import Stopwatch

    configs = []
    for dtype in ("float32", "bfloat16"):
        model = ctx.model(dtype)  # prefill is eager in every engine: one [T, d] × [d, N] product per matrix
        c = model.config
        for T in ctx.sizes["prefill_tokens"]:
            ids = torch.randint(0, c.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(ctx.device)
            cache = KVCache(c, batch=1, max_seq_len=T, dtype=model.dtype, device=ctx.device)
            configs.append(dict(dtype=dtype, tokens=T, flops=prefill_flops(c, T), times=[],
                                run=lambda m=model, i=ids, k=cache: prefill(m, i, k)))
    for cfg in configs:
        cfg["run"]()  # warm-up
    for _ in _progress(range(ctx.sizes["rounds"]), "prefill rounds"):
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


def prefill_flops(c, T: int) -> int:
    """Multiply-add FLOPs of a prefill of T tokens with last_only=True (matmuls only)."""
    per_layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim \
        + 3 * c.dim * c.ffn_dim  # Q, K, V, O and gate, up, down weights
    attention = 4 * c.n_layers * c.n_heads * c.head_dim * T * (T + 1) // 2  # QKᵀ and PV over the causal half
    return 2 * c.n_layers * per_layer * T + attention + 2 * c.dim * c.vocab_size


# --- 3. transformers -----------------------------------------------------------------------------------------
def bench_transformers(ctx: _Context) -> dict:
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
    for _ in _progress(range(ctx.sizes["hf_rounds"]), "vs transformers"):
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


# --- 4. cache speedup ----------------------------------------------------------------------------------------
def bench_cache_speedup(ctx: _Context) -> dict:
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
    for _ in _progress(range(ctx.sizes["cache_rounds"]), "cache speedup"):
        for name in runs:
            g = generate(model, prompt, N, use_cache=name == "cached")
            runs[name].append(g.total_time)
    uncached, cached = statistics.median(runs["uncached"]), statistics.median(runs["cached"])
    return {"status": "ok", "prompt_tokens": len(prompt), "new_tokens": N, "uncached_s": uncached,
            "cached_s": cached, "speedup": uncached / cached, "repeats": len(runs["cached"])}


# --- 5. load -------------------------------------------------------------------------------------------------
def bench_load(ctx: _Context) -> dict:
    """load_model: cold parses and dequantizes the GGUF; warm reads the local safetensors cache.

    The warm load memory-maps the cache file, so its pages are read on first use (the first prefill).
    """
    from course.engine.weights import cached_weights_path, default_gguf_path, load_model

    if not ctx.real:
        return {"status": "skipped", "reason": "needs the course model (--model tiny was given)"}
    load_model(device=ctx.device)  # make sure the cache file exists
    kinds = {"warm": True} if ctx.sizes is QUICK else {"cold": False, "warm": True}
    times = {k: [] for k in kinds}
    for _ in _progress(range(ctx.sizes["load_rounds"]), "load"):
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


# --- 6. notebooks --------------------------------------------------------------------------------------------
def notebook_paths() -> list[Path]:
    from course.paths import LESSONS, SOLUTIONS

    found = sorted(LESSONS.glob("*.ipynb")) + sorted(SOLUTIONS.glob("**/*.ipynb"))
    return [p for p in found if ".ipynb_checkpoints" not in p.parts]


def bench_notebooks(ctx: _Context) -> dict:
    """Execute every lesson and solution notebook headless (nbclient), one at a time, and time each."""
    import nbformat
    from nbclient import NotebookClient

    from course.paths import PROJECT_ROOT, jupyter_env

    paths = notebook_paths()
    if not paths:
        return {"status": "not available", "reason": "no notebooks in lessons/ or solutions/ yet"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-nb-") as tmp:
        env = jupyter_env(state=Path(tmp) / "jupyter")
        env.update({"KVCOURSE_RESULTS": str(Path(tmp) / "results.json"), "MPLBACKEND": "Agg",
                    "PYTHONPATH": str(PROJECT_ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
        for path in _progress(paths, "notebooks"):
            nb = nbformat.read(path, as_version=4)
            client = NotebookClient(nb, timeout=900, kernel_name="python3",
                                    resources={"metadata": {"path": str(path.parent)}})
            t0 = time.perf_counter()
            try:
                client.execute(env=env)
                error = None
            except Exception as exc:  # a failing notebook is reported, with its time until the failure
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            rows.append(dict(notebook=str(path.relative_to(PROJECT_ROOT)), seconds=time.perf_counter() - t0,
                             ok=error is None, error=error))
    total = sum(r["seconds"] for r in rows)
    lessons = sum(r["seconds"] for r in rows if r["notebook"].startswith("lessons"))
    return {"status": "ok", "rows": rows, "total_s": total, "lessons_s": lessons,
            "all_ok": all(r["ok"] for r in rows), "repeats": 1}


# --- 7. grading ----------------------------------------------------------------------------------------------
def bench_grading(ctx: _Context, grade_samples: int = 6) -> dict:
    """`kvcourse grade` over a copy of the first sample submissions (adversarial ones left out)."""
    from course.paths import AUTOGRADE, PROJECT_ROOT

    if util.find_spec("course.grade.grading") is None:
        return {"status": "not available", "reason": "course/grading.py (kvcourse grade) is not part of this checkout"}
    samples = AUTOGRADE / "samples"
    students = sorted(p for p in samples.iterdir() if p.is_dir()) if samples.is_dir() else []
    manifest = samples / "manifest.json"
    if manifest.exists():  # keep the manifest's order: reference, blank, then the planted bugs
        order = list(dict.fromkeys(e["student"] for e in json.loads(manifest.read_text())))
        students = sorted(students, key=lambda p: order.index(p.name) if p.name in order else len(order))
    students = [p for p in students if not p.name.startswith("adv-")][:grade_samples]
    if not students:
        return {"status": "not available", "reason": "no sample submissions in autograde/samples/"}
    n_subs = sum(len(list(p.glob("**/*.ipynb"))) for p in students)  # one per student and assignment
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-grade-") as tmp:
        folder = Path(tmp) / "submitted"
        for p in students:
            shutil.copytree(p, folder / p.name)
        # A fresh course folder, so the real autograde/ state is left alone. The first run also generates the
        # assignments into the new gradebook; the second (--force) regrades everything: the per-class cost.
        cmd = [sys.executable, "-m", "course.cli", "grade", str(folder), "--course", str(Path(tmp) / "course"),
               "--force", "--quiet"]
        for run_name in ("first", "regrade"):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=3600)
            runs[run_name] = time.perf_counter() - t0
            if proc.returncode not in (0, 1):  # 1: graded, but some submission needs a look
                return {"status": "error", "reason": f"`kvcourse grade` exited {proc.returncode}",
                        "output_tail": (proc.stdout + proc.stderr)[-2000:], "seconds": runs}
    return {"status": "ok", "students": [p.name for p in students], "submissions": n_subs,
            "first_run_s": runs["first"], "seconds": runs["regrade"], "s_per_submission": runs["regrade"] / n_subs,
            "exit_code": proc.returncode, "output_tail": proc.stdout[-1500:], "repeats": 1,
            "includes": "one `kvcourse grade --force` of every submission (serial, --jobs 1), after a first run "
                        "that also generated the assignments into a fresh gradebook"}


# --- 8. widgets ----------------------------------------------------------------------------------------------
def bench_widgets(ctx: _Context) -> dict:
    """Median and worst slider-redraw latency of the sampling explorer and the KV-cache calculator."""
    rows, missing = [], []
    moves = ctx.sizes["widget_moves"]
    if not ctx.real:
        missing.append("sampling explorer (needs the course model; --model tiny was given)")
    elif util.find_spec("course.widgets.sampling_explorer") is not None:
        from course.widgets.sampling_explorer import SamplingExplorer

        explorer = SamplingExplorer(ctx.model("float32"), ctx.tokenizer)
        temps = [0.2 + 1.6 * i / max(1, moves - 1) for i in range(moves)]
        settings = [(t, [0, 5, 40][i % 3], [1.0, 0.9, 0.5][i % 3], "factual") for i, t in enumerate(temps)]
        explorer.redraw(*settings[0])  # computes the prompt's logits once, as the widget does on open
        times = [explorer.redraw(*s).redraw_ms for s in settings]
        rows.append(_widget_row("sampling_explorer", "SamplingExplorer.redraw", times))
    else:
        missing.append("sampling explorer (course/widgets/sampling_explorer.py)")
    if util.find_spec("course.widgets.kv_calculator") is not None:
        from matplotlib.figure import Figure

        from course.widgets.kv_calculator import calculator_view, figure_png

        fig = Figure(figsize=(6.4, 3.2), dpi=90)  # the widget redraws one figure in place
        contexts = [2 ** (7 + i % 11) for i in range(moves)]  # the context slider, 128 to 128k tokens
        figure_png(calculator_view(T=contexts[0], fig=fig)["figure"])
        times = []
        for T in contexts:
            t0 = time.perf_counter()
            figure_png(calculator_view(T=T, fig=fig)["figure"])  # numbers, text, redraw, PNG: one slider move
            times.append((time.perf_counter() - t0) * 1e3)
        rows.append(_widget_row("kv_calculator", "calculator_view + figure_png", times))
    else:
        missing.append("KV-cache calculator (course/widgets/kv_calculator.py)")
    if not rows:
        return {"status": "not available", "reason": "; ".join(missing) + " not part of this checkout"}
    return {"status": "ok", "rows": rows, "not_available": missing}


def _widget_row(name, callback, times_ms):
    times_ms = sorted(times_ms)
    return dict(widget=name, callback=callback, median_ms=statistics.median(times_ms),
                p90_ms=times_ms[int(0.9 * (len(times_ms) - 1))], max_ms=times_ms[-1], moves=len(times_ms))


# --- targets, output -----------------------------------------------------------------------------------------
def evaluate_targets(result: dict) -> list[dict]:
    items = result["items"]
    measured: dict[str, tuple[float | None, str]] = {}
    dec = items.get("decode", {})
    if dec.get("status") == "ok":
        rows = [r for r in dec["rows"] if r["dtype"] == "float32" and r["context"] == 64 and r["batch"] == 1]
        if rows:
            best = min(rows, key=lambda r: r["x_roofline"])
            measured["decode_x_roofline"] = (best["x_roofline"], best["engine"])
    hf = items.get("transformers", {})
    if hf.get("status") == "ok":
        ours = [r for r in hf["rows"] if r["engine"] != "transformers" and r["x_transformers"]]
        if ours:
            best = max(ours, key=lambda r: r["x_transformers"])
            measured["vs_transformers"] = (best["x_transformers"], best["engine"])
    cs = items.get("cache_speedup", {})
    if cs.get("status") == "ok":
        measured["cache_speedup"] = (cs["speedup"], f"{cs['new_tokens']} after {cs['prompt_tokens']}")
    ld = items.get("load", {})
    if ld.get("status") == "ok":
        measured["warm_load_s"] = (ld["warm_s"], "")
    nb = items.get("notebooks", {})
    if nb.get("status") == "ok":
        measured["notebooks_s"] = (nb["total_s"], "" if nb["all_ok"] else "some notebooks failed")
    gr = items.get("grading", {})
    if gr.get("status") == "ok":
        measured["grade_s_per_submission"] = (gr["s_per_submission"], f"{gr['submissions']} submissions")
    wd = items.get("widgets", {})
    if wd.get("status") == "ok":
        worst = max(wd["rows"], key=lambda r: r["median_ms"])
        measured["widget_redraw_ms"] = (worst["median_ms"], worst["widget"])
    quick = result["meta"]["quick"]
    out = []
    for name, (what, op, bound) in TARGETS.items():
        value, note = measured.get(name, (None, ""))
        met = None if value is None or quick else (value <= bound if op == "<=" else value >= bound)
        out.append(dict(name=name, what=what, target=f"{op} {bound:g}", value=value, met=met, note=note))
    return out


def write_results(result: dict, out_dir=None) -> tuple[Path, Path]:
    from course.paths import PROJECT_ROOT

    out = Path(out_dir) if out_dir else PROJECT_ROOT / "bench-results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["meta"]["started"].replace(":", "").replace("-", "")[:15]
    json_path, md_path = out / f"bench-{stamp}.json", out / f"bench-{stamp}.md"
    json_path.write_text(json.dumps(result, indent=1, default=_jsonable))
    md_path.write_text(render_markdown(result))
    shutil.copyfile(json_path, out / "latest.json")
    shutil.copyfile(md_path, out / "latest.md")
    return json_path, md_path


def render_markdown(result: dict) -> str:
    m, items, hw = result["meta"], result["items"], result["hardware"]
    lines = [f"## Benchmark — {m['device_name']} ({m['device']}, {m['threads']} threads)", "",
             f"{m['started']} · torch {m['torch']} · {'quick sizes' if m['quick'] else 'full sizes'} · "
             f"load average {m['load_average_before'][0]:.1f} → {m['load_average_after'][0]:.1f} · "
             f"{m['wall_s']:.0f} s"]
    if "memory_bandwidth_bytes_per_s" in hw:
        bw = hw["memory_bandwidth_bytes_per_s"]
        lines.append(f"Memory bandwidth (probe {hw['memory_bandwidth_probe_bytes'] / 2**20:.0f} MiB): median "
                     f"{bw['median'] / 1e9:.1f} GB/s (range {bw['min'] / 1e9:.1f}–{bw['max'] / 1e9:.1f}, "
                     f"{bw['n']} probes; streaming read {hw['memory_read_bytes_per_s']['median'] / 1e9:.1f}, "
                     f"copy {hw['memory_copy_bytes_per_s']['median'] / 1e9:.1f}).")
    for dtype, f in hw.get("matmul_flops_per_s", {}).items():
        lines.append(f"Matmul {hw['matmul_n']}² {dtype}: median {f['median'] / 1e9:.1f} GFLOP/s.")
    lines.append("")

    def table(header, rows):
        lines.extend(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)])
        lines.extend("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
        lines.append("")

    def section(title, name, header=None, rowfn=None, extra=None):
        item = items.get(name, {})
        lines.append(f"### {title}")
        if item.get("status") != "ok":
            lines.extend([f"{item.get('status', 'skipped')}: {item.get('reason', '')}", ""])
            return
        if header:
            table(header, [rowfn(r) for r in item["rows"]])
        text = extra(item) if extra else ""
        if text:
            lines.extend([text, ""])

    section("1. Decode (batch 1)", "decode",
            ["engine", "dtype", "context", "ms/token", "tokens/s", "bytes/step", "achieved GB/s",
             "of bandwidth", "× roofline"],
            lambda r: [r["engine"], r["dtype"], r["context"], f"{r['ms_per_token']:.1f}", f"{r['tokens_per_s']:.1f}",
                       f"{r['bytes_per_step'] / 1e6:.0f} MB", f"{r['achieved_bytes_per_s'] / 1e9:.1f}",
                       f"{r['fraction_of_bandwidth']:.0%}", f"{r['x_roofline']:.2f}"],
            lambda it: (f"Compiled vs eager logits: max |Δ| = {it['compiled_vs_eager_max_abs_logit_diff']:.1e}."
                        if "compiled_vs_eager_max_abs_logit_diff" in it else ""))
    section("2. Prefill", "prefill",
            ["dtype", "tokens", "ms", "tokens/s", "achieved GFLOP/s", "of matmul FLOP/s"],
            lambda r: [r["dtype"], r["tokens"], f"{r['seconds'] * 1e3:.0f}", f"{r['tokens_per_s']:.0f}",
                       f"{r['achieved_flops_per_s'] / 1e9:.1f}", f"{r['fraction_of_matmul_flops']:.0%}"])
    section("3. Decode vs transformers generate (float32, greedy)", "transformers",
            ["engine", "new tokens", "decode tokens/s", "× transformers", "greedy tokens agreeing"],
            lambda r: [r["engine"], r["new_tokens"], _fmt(r["decode_tokens_per_s"], ".1f"),
                       _fmt(r["x_transformers"], ".2f"), f"{r['greedy_tokens_agreeing']}/{r['new_tokens']}"])
    section("4. KV-cache speedup", "cache_speedup", extra=lambda it: (
        f"{it['new_tokens']} new tokens after a {it['prompt_tokens']}-token prompt: {it['uncached_s']:.3g} s "
        f"without the cache, {it['cached_s']:.3g} s with it → **{it['speedup']:.1f}×**."))
    section("5. Model load", "load", extra=lambda it: (
        f"cold (GGUF parse + dequantize): {_fmt(it['cold_s'], '.1f')} s · warm (local safetensors cache): "
        f"{_fmt(it['warm_s'], '.2f')} s (memory-mapped: the pages are read on first use)"))
    section("6. Notebooks executed headless", "notebooks", ["notebook", "seconds", "ok"],
            lambda r: [r["notebook"], f"{r['seconds']:.0f}", "yes" if r["ok"] else f"no — {r['error']}"],
            lambda it: f"Total {it['total_s']:.0f} s (lessons {it['lessons_s']:.0f} s).")
    section("7. Autograde", "grading", extra=lambda it: (
        f"{it['submissions']} submissions ({len(it['students'])} students × their assignments) regraded in "
        f"{it['seconds']:.0f} s → **{it['s_per_submission']:.1f} s per submission** (first run, with a fresh "
        f"gradebook: {it['first_run_s']:.0f} s)."))
    section("8. Widget redraw", "widgets", ["widget", "callback", "median ms", "p90 ms", "max ms", "moves"],
            lambda r: [r["widget"], r["callback"], f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}",
                       f"{r['max_ms']:.1f}", r["moves"]],
            lambda it: ("Not available: " + "; ".join(it["not_available"])) if it["not_available"] else "")
    lines.append("### Targets")
    table(["target", "bound", "measured", "met"],
          [[t["what"], t["target"], _fmt(t["value"], ".2f") + (f" ({t['note']})" if t["note"] else ""),
            {True: "yes", False: "**no**", None: "—"}[t["met"]]] for t in result.get("targets", [])])
    return "\n".join(lines)


# --- helpers -------------------------------------------------------------------------------------------------
def _meta(device, quick, compile, sizes) -> dict:
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    versions = {}
    for pkg in ("transformers", "nbclient", "nbgrader"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"started": _dt.datetime.now().isoformat(timespec="seconds"), "device": str(device),
            "device_name": name, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "versions": versions,
            "quick": quick, "compile": compile, "sizes": dict(sizes), "load_average_before": _loadavg()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return [float("nan")] * 3


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _param_bytes(model) -> int:
    """Bytes of every distinct parameter (the tied embedding / output matrix counted once)."""
    m = getattr(model, "model", model)
    seen, total = set(), 0
    for p in m.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _elem(dtype) -> int:
    import torch

    return torch.tensor([], dtype=dtype).element_size()


def _fmt(value, spec) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _progress(iterable, desc):
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False, file=sys.stderr)
