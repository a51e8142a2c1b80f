"""`kvcourse bench`: how close the engine runs to this machine's limits, and how it compares.

The items are registered functions (course/measure/bench.py says how to add one): the engine's figures
live in course.measure.bench, the course checks that need the upper layers (notebooks, grading, widgets)
here, with the command line and the JSON / Markdown writing. The roofline bound of a decode step is
(bytes it must read) ÷ (this machine's memory bandwidth, probed between the rounds); prefill is compared
with the FLOP/s of a large matrix multiply measured the same way.

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
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata, util
from pathlib import Path

from course.cli.args import check_writable_dir, writable_dir
from course.measure.bench import (FULL, QUICK, REGISTRY, STATUSES, Context, Target,  # noqa: F401  (re-exported)
                                  bench_item, cell, fmt, summary)

SCHEMA = "kvcourse-bench/1"
# Modules whose @bench_item functions the command runs, after course.measure.bench's engine items and this
# module's course checks. Add yours here (one line) to put your item in `kvcourse bench`.
ITEM_MODULES: tuple[str, ...] = (
    "course.grade.bench",  # grading time per submission, sealed vs unsealed
    "course.measure.decode_floor",  # decode ÷ floor at 1 and 2 threads, compiled batches, the bytes line
    "course.cli.bench_serving",  # batched decode ÷ B = 1, continuous ÷ static batching, paged ÷ preallocated bytes
)
_Context = Context  # the name the tests know


# --- command line -------------------------------------------------------------------------------------------
def add_arguments(p):
    p.add_argument("--quick", action="store_true", help="tiny sizes, slow items skipped (seconds; the smoke test)")
    p.add_argument("--out", type=writable_dir, default=None,  # checked before the suite runs, not after
                   help="folder for the JSON and Markdown results (default: bench-results/)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; on a busy shared machine 1 is steadier)")
    p.add_argument("--skip", action="append", default=[], choices=list(REGISTRY), metavar="ITEM",
                   help=f"leave an item out (repeatable): {', '.join(REGISTRY)}")
    p.add_argument("--only", action="append", default=[], choices=list(REGISTRY), metavar="ITEM", help="run only these items")
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
    from course.paths import PROJECT_ROOT

    both = sorted(set(args.only) & set(args.skip))
    if both:  # the suite would run nothing and write an empty report as a success
        raise ValueError(f"{', '.join(both)} given to both --only and --skip, which contradict each other: "
                         "drop it from one of them")
    items = [i for i in (args.only or list(REGISTRY)) if i not in args.skip]
    if not items:
        raise ValueError(f"--skip leaves no item to run (items: {', '.join(REGISTRY)}): skip fewer")
    check_writable_dir(args.out or PROJECT_ROOT / "bench-results")  # before the suite, never after it
    result = run_suite(items=items, quick=args.quick, device=args.device, threads=args.threads,
                       compile=not args.no_compile, grade_samples=args.grade_samples, model=args.model)
    json_path, md_path = write_results(result, args.out)
    print(render_markdown(result))
    print(f"\nwrote {json_path}\n      {md_path}")
    return 0


# --- the suite ----------------------------------------------------------------------------------------------
def run_suite(items=None, quick: bool = False, device="auto", threads: int | None = None, compile: bool = True,
              grade_samples: int = 6, model: str = "course", log=print) -> dict:
    from course.engine.device import pick_device, torch_threads

    items = list(REGISTRY) if items is None else list(items)
    if model not in ("course", "tiny"):
        raise ValueError(f"model must be 'course' or 'tiny', got {model!r}")
    unknown = [i for i in items if i not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown bench items {unknown}; choose from {list(REGISTRY)}")
    if threads is None and os.cpu_count() and _loadavg()[0] >= os.cpu_count():
        log(f"[bench] load average {_loadavg()[0]:.1f} on {os.cpu_count()} cores: multi-threaded timings will "
            "suffer from waiting on descheduled threads; --threads 1 (or OMP_WAIT_POLICY=PASSIVE) is steadier")
    device = pick_device(device)
    with torch_threads(threads):
        return _run_items(items, quick, device, compile, grade_samples, model, log)


def _run_items(items, quick, device, compile, grade_samples, model, log) -> dict:
    sizes = QUICK if quick else FULL
    result = {"schema": SCHEMA, "meta": _meta(device, quick, compile, sizes), "hardware": {}, "items": {}}
    result["meta"]["model"] = model
    ctx = Context(device, sizes, compile, log, model, options={"grade_samples": grade_samples})
    t_start = time.perf_counter()
    for name, spec in REGISTRY.items():
        if name not in items:
            result["items"][name] = {"status": "skipped", "reason": "not selected"}
            continue
        if quick and spec.slow:
            result["items"][name] = {"status": "skipped", "reason": "--quick leaves out the slow items"}
            continue
        log(f"[bench] {name} …")
        t0 = time.perf_counter()
        try:
            item = spec.run(ctx)
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


# --- notebooks ----------------------------------------------------------------------------------------------
def notebook_paths() -> list[Path]:
    from course.paths import LESSONS, SOLUTIONS

    found = sorted(LESSONS.glob("*.ipynb")) + sorted(SOLUTIONS.glob("**/*.ipynb"))
    return [p for p in found if ".ipynb_checkpoints" not in p.parts]


@bench_item("notebooks", title="Notebooks executed headless", slow=True, columns={
    "notebook": "{notebook}", "seconds": "{seconds:.0f}",
    "stated": lambda r: f"under {r['stated_min']:g} min" if r.get("stated_min") else "—",
    "ok": lambda r: "yes" if r["ok"] else f"no — {r['error']}"},
    text=lambda it: f"Total {it['total_s']:.0f} s (lessons {it['lessons_s']:.0f} s).",
    targets=[Target("notebooks_s", "all lessons + solutions executed headless, seconds", "<=", 600.0,
                    lambda it: (it["total_s"], "" if it["all_ok"] else "some notebooks failed")),
             Target("lesson_over_stated", "slowest lesson ÷ the run time its header states", "<=", 1.0,
                    lambda it: (it["worst_over_stated"], it["worst_lesson"]))])
def bench_notebooks(ctx: Context) -> dict:
    """Execute every lesson and solution notebook headless (nbclient), one at a time, and time each."""
    import nbformat
    from nbclient import NotebookClient

    from course.lessons.recap import stated_run_minutes
    from course.paths import PROJECT_ROOT, jupyter_env

    paths = notebook_paths()
    if not paths:
        return {"status": "not available", "reason": "no notebooks in lessons/ or solutions/ yet"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-nb-") as tmp:
        env = jupyter_env(state=Path(tmp) / "jupyter")
        env.update({"KVCOURSE_RESULTS": str(Path(tmp) / "results.json"), "MPLBACKEND": "Agg",
                    "PYTHONPATH": str(PROJECT_ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
        for path in ctx.progress(paths, "notebooks"):
            nb = nbformat.read(path, as_version=4)
            stated = stated_run_minutes(nb)
            client = NotebookClient(nb, timeout=900, kernel_name="python3",
                                    resources={"metadata": {"path": str(path.parent)}})
            t0 = time.perf_counter()
            try:
                client.execute(env=env)
                error = None
            except Exception as exc:  # a failing notebook is reported, with its time until the failure
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            rows.append(dict(notebook=str(path.relative_to(PROJECT_ROOT)), seconds=time.perf_counter() - t0,
                             ok=error is None, error=error, stated_min=stated))
    total = sum(r["seconds"] for r in rows)
    lessons = sum(r["seconds"] for r in rows if r["notebook"].startswith("lessons"))
    ratios = [(r["seconds"] / (60 * r["stated_min"]), r["notebook"]) for r in rows if r.get("stated_min")]
    worst = max(ratios, default=(float("nan"), ""))
    return {"status": "ok", "rows": rows, "total_s": total, "lessons_s": lessons,
            "all_ok": all(r["ok"] for r in rows), "repeats": 1,
            "worst_over_stated": worst[0], "worst_lesson": worst[1]}


# --- grading ------------------------------------------------------------------------------------------------
@bench_item("grading", title="Autograde", slow=True, text=lambda it: (
    f"{it['submissions']} submissions ({len(it['students'])} students × their assignments) regraded in "
    f"{it['seconds']:.0f} s → **{it['s_per_submission']:.1f} s per submission** (first run, with a fresh "
    f"gradebook: {it['first_run_s']:.0f} s)."),
    targets=[Target("grade_s_per_submission", "autograde seconds per submission", "<=", 10.0,
                    lambda it: (it["s_per_submission"], f"{it['submissions']} submissions"))])
def bench_grading(ctx: Context, grade_samples: int | None = None) -> dict:
    """`kvcourse grade` over a copy of the first sample submissions (adversarial ones left out)."""
    grade_samples = grade_samples or ctx.options.get("grade_samples", 6)
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


# --- widgets ------------------------------------------------------------------------------------------------
@bench_item("widgets", title="Widget redraw", columns={
    "widget": "{widget}", "callback": "{callback}", "median ms": "{median_ms:.1f}", "p90 ms": "{p90_ms:.1f}",
    "max ms": "{max_ms:.1f}", "moves": "{moves}"},
    text=lambda it: ("Not available: " + "; ".join(it["not_available"])) if it["not_available"] else "",
    targets=[Target("widget_redraw_ms", "slowest widget's median slider redraw, ms", "<=", 200.0,
                    lambda it: (lambda w: (w["median_ms"], w["widget"]))(max(it["rows"], key=lambda r: r["median_ms"])))])
def bench_widgets(ctx: Context) -> dict:
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
    return dict(widget=name, callback=callback, median_ms=summary(times_ms)["median"],
                p90_ms=times_ms[int(0.9 * (len(times_ms) - 1))], max_ms=times_ms[-1], moves=len(times_ms))


# --- targets, output ----------------------------------------------------------------------------------------
def targets() -> dict:
    """Every registered item's targets: name → (what, comparison, bound)."""
    return {t.name: (t.what, t.op, t.bound) for spec in REGISTRY.values() for t in spec.targets}


def evaluate_targets(result: dict) -> list[dict]:
    quick = result["meta"]["quick"]
    out = []
    for name, spec in REGISTRY.items():
        item = result["items"].get(name, {})
        for t in spec.targets:
            value, note = t.measure(item) if item.get("status") == "ok" else (None, "")
            met = None if value is None or quick else (value <= t.bound if t.op == "<=" else value >= t.bound)
            out.append(dict(name=t.name, what=t.what, target=f"{t.op} {t.bound:g}", value=value, met=met, note=note))
    return out


def write_results(result: dict, out_dir=None) -> tuple[Path, Path]:
    from course.paths import PROJECT_ROOT

    out = Path(out_dir) if out_dir else PROJECT_ROOT / "bench-results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["meta"]["started"].replace(":", "").replace("-", "")[:15]
    json_path, md_path = out / f"bench-{stamp}.json", out / f"bench-{stamp}.md"
    text = json.dumps(result, indent=1, default=_jsonable)
    markdown = render_markdown(result)
    for path, content in ((json_path, text), (md_path, markdown), (out / "latest.json", text),
                          (out / "latest.md", markdown)):
        _write_atomically(path, content)
    return json_path, md_path


def _write_atomically(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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

    for number, (name, spec) in enumerate(REGISTRY.items(), 1):
        item = items.get(name, {})
        lines.append(f"### {number}. {spec.title}")
        if item.get("status") != "ok":
            lines.extend([f"{item.get('status', 'skipped')}: {item.get('reason', '')}", ""])
            continue
        if spec.columns:
            table(list(spec.columns), [[cell(f, r) for f in spec.columns.values()] for r in item["rows"]])
        text = spec.text(item) if spec.text else ""
        if text:
            lines.extend([text, ""])
    lines.append("### Targets")
    table(["target", "bound", "measured", "met"],
          [[t["what"], t["target"], fmt(t["value"], ".2f") + (f" ({t['note']})" if t["note"] else ""),
            {True: "yes", False: "**no**", None: "—"}[t["met"]]] for t in result.get("targets", [])])
    return "\n".join(lines)


# --- helpers ------------------------------------------------------------------------------------------------
def _meta(device, quick, compile, sizes) -> dict:
    import torch

    from course.engine.device import cpu_name

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
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


def _loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return [float("nan")] * 3



def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _load_items() -> tuple[str, ...]:
    for module in ITEM_MODULES:
        importlib.import_module(module)
    return tuple(REGISTRY)


ITEMS = _load_items()
SLOW_ITEMS = tuple(name for name, spec in REGISTRY.items() if spec.slow)
TARGETS = targets()
