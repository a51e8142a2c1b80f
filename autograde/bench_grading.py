"""Benchmark the grader: a class of N submissions (default 20), graded serially and with --jobs J.

The class is built from autograde/samples (references, planted bugs and alternatives of all four
assignments, no adversarial ones), renamed student-01 ... student-N. Prints seconds per submission and
writes bench-results/grading.json. Speed is measured here, never asserted in a test.

    python autograde/bench_grading.py [--students 20] [--jobs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from course.grade.grading import grade  # noqa: E402


def make_class(folder: Path, students: int) -> list[str]:
    manifest = json.loads((ROOT / "autograde" / "samples" / "manifest.json").read_text())
    pool = [e for e in manifest if not e["student"].startswith("adv-") and e["expect"] != "invalid"]
    pool.sort(key=lambda e: (e["student"] not in ("reference", "blank"), e["assignment"], e["student"]))
    picked = [pool[(i * 7) % len(pool)] for i in range(students)]  # a spread over assignments and kinds
    for i, entry in enumerate(picked, start=1):
        src = ROOT / "autograde" / "samples" / entry["student"] / entry["assignment"]
        shutil.copytree(src, folder / f"student-{i:02d}" / entry["assignment"])
    return [f"{e['assignment']}/{e['student']}" for e in picked]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--students", type=int, default=20)
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    results = {"students": args.students, "cpus": os.cpu_count(), "load_avg_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-") as tmp:
        folder = Path(tmp) / "class"
        results["class"] = make_class(folder, args.students)
        for jobs in sorted({1, args.jobs}):
            started = time.perf_counter()
            rows = grade(folder, Path(tmp) / f"course-{jobs}", jobs=jobs, progress=False, log=lambda *_: None)
            seconds = time.perf_counter() - started
            assert all(r.status == "graded" for r in rows), [r for r in rows if r.status != "graded"]
            results[f"jobs_{jobs}"] = {"total_s": round(seconds, 1), "per_submission_s": round(seconds / len(rows), 2),
                                       "worker_s_per_submission": round(sum(r.seconds for r in rows) / len(rows), 2)}
            print(f"jobs={jobs}: {len(rows)} submissions in {seconds:.1f} s = {seconds / len(rows):.2f} s each "
                  f"(worker time {results[f'jobs_{jobs}']['worker_s_per_submission']:.2f} s each)", flush=True)
    results["load_avg_after"] = os.getloadavg()[0]
    out = ROOT / "bench-results" / "grading.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"load average {results['load_avg_before']:.1f} -> {results['load_avg_after']:.1f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
