"""`kvcourse bench` (and `make bench`): run the items of bench.ITEMS, write JSON and Markdown to bench-results/.

    kvcourse bench                 # everything: tens of minutes on 2 CPU cores (mostly the uncached
                                   # generation, the notebooks and the first torch.compile)
    kvcourse bench --quick         # tiny sizes, slow items skipped (the smoke test)
    kvcourse bench --list          # the items, one a line
    kvcourse bench --only decode_floor --threads 1 --out DIR
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path

from bench import ITEMS
from bench.core import FULL, QUICK, STATUSES, Context, cell, fmt, load_average  # noqa: F401  (the tests read them)

SCHEMA = "kvcourse-bench/1"


def add_arguments(p):
    from course.cli.args import writable_dir

    p.add_argument("--quick", action="store_true", help="tiny sizes, slow items skipped (seconds; the smoke test)")
    p.add_argument("--list", action="store_true", help="print the items, one a line, and run nothing")
    p.add_argument("--out", type=writable_dir, default=None,  # checked before the suite runs, not after
                   help="folder for the JSON and Markdown results (default: bench-results/)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; on a busy shared machine 1 is steadier)")
    p.add_argument("--skip", action="append", default=[], choices=list(ITEMS), metavar="ITEM",
                   help=f"leave an item out (repeatable): {', '.join(ITEMS)}")
    p.add_argument("--only", action="append", default=[], choices=list(ITEMS), metavar="ITEM", help="run only these items")
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled engine (course/engine/fast.py)")
    p.add_argument("--grade-samples", type=int, default=6,
                   help="students of autograde/samples/ whose submissions are graded (default 6)")
    p.add_argument("--model", default="course", choices=("course", "tiny"),
                   help="course: SmolLM2-135M (default); tiny: a random tiny model, to test the suite itself")


def run(args) -> int:
    from course.cli.args import check_writable_dir
    from course.paths import PROJECT_ROOT

    if args.list:
        print("\n".join(f"{name:16s} {item.title}{' (slow)' if item.slow else ''}" for name, item in ITEMS.items()))
        return 0
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.grade_samples < 1:
        raise ValueError(f"--grade-samples must be >= 1, got {args.grade_samples}")
    both = sorted(set(args.only) & set(args.skip))
    if both:  # the suite would run nothing and write an empty report as a success
        raise ValueError(f"{', '.join(both)} given to both --only and --skip: drop it from one of them")
    items = [i for i in (args.only or list(ITEMS)) if i not in args.skip]
    if not items:
        raise ValueError(f"--skip leaves no item to run (items: {', '.join(ITEMS)}): skip fewer")
    check_writable_dir(args.out or PROJECT_ROOT / "bench-results")  # before the suite, never after it
    result = run_suite(items=items, quick=args.quick, device=args.device, threads=args.threads,
                       compile=not args.no_compile, grade_samples=args.grade_samples, model=args.model)
    json_path, md_path = write_results(result, args.out)
    print(render_markdown(result))
    print(f"\nwrote {json_path}\n      {md_path}")
    return 0


def run_suite(items=None, quick: bool = False, device="auto", threads: int | None = None, compile: bool = True,
              grade_samples: int = 6, model: str = "course", log=print) -> dict:
    import torch

    from course.engine.device import cpu_name, pick_device, torch_threads

    items = list(ITEMS) if items is None else list(items)
    if model not in ("course", "tiny"):
        raise ValueError(f"model must be 'course' or 'tiny', got {model!r}")
    unknown = [i for i in items if i not in ITEMS]
    if unknown:
        raise ValueError(f"unknown bench items {unknown}; choose from {list(ITEMS)}")
    if threads is None and os.cpu_count() and load_average() >= os.cpu_count():
        log(f"[bench] load average {load_average():.1f} on {os.cpu_count()} cores: multi-threaded timings will suffer "
            "from waiting on descheduled threads; --threads 1 is steadier")
    device = pick_device(device)
    sizes = QUICK if quick else FULL
    with torch_threads(threads):
        meta = {"started": _dt.datetime.now().isoformat(timespec="seconds"), "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
                "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                "python": platform.python_version(), "quick": quick, "compile": compile, "model": model,
                "sizes": dict(sizes), "load_average_before": _loadavg()}
        result = {"schema": SCHEMA, "meta": meta, "hardware": {}, "items": {}}
        ctx = Context(device, sizes, compile, log, model, options={"grade_samples": grade_samples})
        t_start = time.perf_counter()
        for name, item in ITEMS.items():
            if name not in items or (quick and item.slow):
                why = "--quick leaves out the slow items" if name in items else "not selected"
                result["items"][name] = {"status": "skipped", "reason": why}
                continue
            log(f"[bench] {name} …")
            t0 = time.perf_counter()
            try:
                out = item.run(ctx)
            except Exception as exc:  # one broken item must not hide the others' figures
                out = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc(limit=6)}
            out["wall_s"] = time.perf_counter() - t0
            result["items"][name] = out
    result["hardware"] = ctx.hardware()
    meta.update(wall_s=time.perf_counter() - t_start, load_average_after=_loadavg())
    result["targets"] = evaluate_targets(result)
    return result


def targets() -> dict:
    """Every item's targets: name → (what, comparison, bound)."""
    return {t.name: (t.what, t.op, t.bound) for item in ITEMS.values() for t in item.targets}


def evaluate_targets(result: dict) -> list[dict]:
    out = []
    for name, item in ITEMS.items():
        got = result["items"].get(name, {})
        for t in item.targets:
            value, note = t.measure(got) if got.get("status") == "ok" else (None, "")
            met = None if value is None or result["meta"]["quick"] else (value <= t.bound if t.op == "<=" else value >= t.bound)
            out.append(dict(name=t.name, what=t.what, target=f"{t.op} {t.bound:g}", value=value, met=met, note=note))
    return out


def write_results(result: dict, out_dir=None) -> tuple[Path, Path]:
    from course.paths import PROJECT_ROOT

    out = Path(out_dir) if out_dir else PROJECT_ROOT / "bench-results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["meta"]["started"].replace(":", "").replace("-", "")[:15]
    json_path, md_path = out / f"bench-{stamp}.json", out / f"bench-{stamp}.md"
    text = json.dumps(result, indent=1, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    markdown = render_markdown(result)
    for path, content in ((json_path, text), (md_path, markdown), (out / "latest.json", text), (out / "latest.md", markdown)):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:  # a temporary file in the same folder, then a rename: a reader never sees half a file
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(content)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return json_path, md_path


def render_markdown(result: dict) -> str:
    m, items, hw = result["meta"], result["items"], result["hardware"]
    lines = [f"## Benchmark — {m['device_name']} ({m['device']}, {m['threads']} threads)", "",
             f"{m['started']} · torch {m['torch']} · {'quick sizes' if m['quick'] else 'full sizes'} · load average "
             f"{m['load_average_before'][0]:.1f} → {m['load_average_after'][0]:.1f} · {m['wall_s']:.0f} s"]
    if "memory_bandwidth_bytes_per_s" in hw:
        bw = hw["memory_bandwidth_bytes_per_s"]
        lines.append(f"Memory bandwidth (probe {hw['memory_bandwidth_probe_bytes'] / 2**20:.0f} MiB): median "
                     f"{bw['median'] / 1e9:.1f} GB/s (range {bw['min'] / 1e9:.1f}–{bw['max'] / 1e9:.1f}, {bw['n']} probes).")
    for dtype, f in hw.get("matmul_flops_per_s", {}).items():
        lines.append(f"Matmul {hw['matmul_n']}² {dtype}: median {f['median'] / 1e9:.1f} GFLOP/s.")
    lines.append("")

    def table(header, rows):
        lines.extend(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)])
        lines.extend("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
        lines.append("")

    for number, (name, item) in enumerate(ITEMS.items(), 1):
        got = items.get(name, {})
        lines.append(f"### {number}. {item.title}")
        if got.get("status") != "ok":
            lines.extend([f"{got.get('status', 'skipped')}: {got.get('reason', '')}", ""])
            continue
        rows = got.get("rows", [])
        if item.columns:
            table(list(item.columns), [[cell(f, r) for f in item.columns.values()] for r in rows if "refused" not in r])
        lines.extend(f"**Refused**: {r['refused']}" for r in rows if "refused" in r)
        text = item.text(got) if item.text else ""
        if text:
            lines.extend([text, ""])
    lines.append("### Targets")
    table(["target", "bound", "measured", "met"],
          [[t["what"], t["target"], fmt(t["value"], ".2f") + (f" ({t['note']})" if t["note"] else ""),
            {True: "yes", False: "**no**", None: "—"}[t["met"]]] for t in result.get("targets", [])])
    return "\n".join(lines)


def _loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return [float("nan")] * 3


TARGETS = targets()
SLOW_ITEMS = tuple(name for name, item in ITEMS.items() if item.slow)
