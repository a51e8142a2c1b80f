"""The bench item `class_grading` (bench/class_grading.py) with a class small enough for a busy 2-core machine.

    .venv/bin/python docs/bench-runs/class_grading_small.py --submissions 60

`kvcourse bench` has no option for the class size (the item reads ctx.options["class_submissions"], default 300:
hours on 2 busy cores), so this calls the item's own function with that option set, and writes its dict, the load
and the machine to docs/bench-runs/class-grading-<time>.{json,md}. Serial, 1 worker, 2 workers and 2 workers with
one killed run one after the other in the one call, as the item runs them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.class_grading import CLASS_GRADING  # noqa: E402
from bench.core import FULL, Context, cell, fmt  # noqa: E402


def markdown(record: dict) -> str:
    item, lines = record["item"], []
    lines += [f"## Class grading, {item.get('submissions')} submissions — {record['cpu']}, {record['cores']} cores", "",
              f"{record['started']} · commit {record['commit']} · load average (1 min) {record['load_before'][0]:.1f} "
              f"before, {record['load_after'][0]:.1f} after · {record['wall_s']:.0f} s · "
              "docs/bench-runs/class_grading_small.py (the bench item, class size set)", ""]
    if item.get("status") != "ok":
        return "\n".join(lines + [f"{item.get('status')}: {item.get('reason', '')}", item.get("traceback", "")])
    header = list(CLASS_GRADING.columns)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(f, r) for f in CLASS_GRADING.columns.values()) + " |" for r in item["rows"]]
    lines += ["", CLASS_GRADING.text(item), "", "| target | bound | measured | met |", "|---|---|---|---|"]
    for t in CLASS_GRADING.targets:
        value, note = t.measure(item)
        met = value <= t.bound if t.op == "<=" else value >= t.bound
        lines.append(f"| {t.what} | {t.op} {t.bound:g} | {fmt(value, '.2f')}{f' ({note})' if note else ''} | "
                     f"{'yes' if met else '**no**'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--submissions", type=int, default=60, help="class size (the item's default is 300)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-runs")
    args = p.parse_args()
    if args.submissions < 1:
        raise SystemExit(f"--submissions must be >= 1, got {args.submissions}")
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    stamp = time.strftime("%Y-%m-%dT%H%M")
    record = {"schema": "kvcourse-class-grading/1", "started": stamp, "commit": commit.stdout.strip(), "cpu": cpu,
              "cores": os.cpu_count(), "python": platform.python_version(), "load_before": list(os.getloadavg())}
    ctx = Context(torch.device("cpu"), FULL, False, lambda m: print(m, flush=True), "course",
                  options={"class_submissions": args.submissions})
    started = time.perf_counter()
    try:
        record["item"] = CLASS_GRADING.run(ctx)
    except Exception as exc:  # recorded, as `kvcourse bench` records a broken item
        record["item"] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc(limit=8)}
    record.update(wall_s=time.perf_counter() - started, load_after=list(os.getloadavg()))
    out = args.out / f"class-grading-{stamp}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    print(f"wrote {out}.json and .md")
    return 0 if record["item"].get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
