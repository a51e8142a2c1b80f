"""Class simulation (item `class_grading`): a class graded serially, on 1 and on 2 Dask workers over TCP.

The class: 300 submissions (ctx.options["class_submissions"]) drawn in turn from the notebooks that
autograde/make_samples.py writes (autograde/samples/: correct, buggy and hostile ones of all five assignments),
each handed in by its own student (student-000, ...), so each sample is handed in by several students.
adv-infinite-loop and adv-ignores-interrupt are left out: they only wait for the cell timeout.

Four runs one after the other, each into a fresh course folder seeded with the same reference values (a cache),
so each does the same work (sandbox, verdicts, gradebook merge, feedback):
  serial                 `kvcourse grade`: one sandbox at a time, in this process
  1 worker, 2 workers    a LocalCluster of that many worker processes, reached at its tcp:// address on loopback
  2 workers, one killed  a worker holding a submission is SIGKILLed when half the class is merged
Per run: wall seconds, submissions per minute (and per worker), seconds per 100 submissions, the seconds per
submission the grader's own process spends merging (gradebook, feedback: the one part no worker can take, so 60
over it is the most submissions per minute any number of workers can give), whether grades.csv and report.csv
(its seconds column apart) are byte-identical to the serial run's, and how many submissions were merged more than
once (none may be). Slow: on 2 busy cores, hours for 300.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.core import Item, Target, load_average

WAIT_FOR_TIMEOUT = {"adv-infinite-loop", "adv-ignores-interrupt"}
RUNS = (("serial", 0, False), ("1 worker", 1, False), ("2 workers", 2, False), ("2 workers, one killed", 2, True))


def make_class(folder: Path, n: int) -> Counter:
    """N submissions of the samples, in turn, one student each; returns how many of each assignment."""
    from course.paths import AUTOGRADE

    samples = AUTOGRADE / "samples"
    pool = [e for e in json.loads((samples / "manifest.json").read_text())
            if e["student"] not in WAIT_FOR_TIMEOUT and e["expect"] != "invalid"]
    picked = [pool[i % len(pool)] for i in range(n)]
    for i, e in enumerate(picked):
        shutil.copytree(samples / e["student"] / e["assignment"], folder / f"student-{i:03d}" / e["assignment"])
    return Counter(e["assignment"] for e in picked)


def _report(course: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(course / "report.csv"))]


def _grade(folder: Path, course: Path, workers: int, kill: bool) -> dict:
    """One run; `kill`: SIGKILL a worker that holds a submission once half of them are merged."""
    from distributed import Client, LocalCluster

    from course.grade import grader

    total, merged, killed, merging = len(list(folder.glob("*/*/*.ipynb"))), Counter(), [], [0.0]
    merge, local, client = grader._merge, None, None

    def counted(sub, *args, **kwargs):
        merged[sub.key] += 1
        if kill and not killed and 2 * sum(merged.values()) >= total:
            busy = [w for w, keys in client.processing().items() if keys]
            if busy:
                os.kill(client.run(os.getpid)[busy[0]], signal.SIGKILL)
                killed.append(busy[0])
        started = time.perf_counter()
        try:
            return merge(sub, *args, **kwargs)
        finally:
            merging[0] += time.perf_counter() - started

    grader._merge = counted
    try:
        if workers:
            local = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                                 local_directory=str(course.parent / "dask"))
            client = Client(local)
        started = time.perf_counter()
        rows = grader.grade(folder, course, cluster=local.scheduler_address if local else None, progress=False,
                            log=lambda *_: None)
        seconds = time.perf_counter() - started
    finally:
        grader._merge = merge
        if local is not None:
            client.close()
            local.close()
    n = len(rows)
    return {"workers": max(workers, 1), "submissions": n, "seconds": seconds, "per_minute": 60 * n / seconds,
            "per_minute_per_worker": 60 * n / seconds / max(workers, 1), "s_per_100": 100 * seconds / n,
            "merge_s": merging[0] / max(1, sum(merged.values())),  # the grader's own part: gradebook, feedback
            "statuses": dict(Counter(r.status for r in rows)), "worker_killed": bool(killed),
            "merged_twice": sorted(k for k, v in merged.items() if v > 1)}


def bench_class_grading(ctx) -> dict:
    from course.grade import sandbox

    problem = sandbox.sandbox_problem()
    if problem:
        return {"status": "not available", "reason": problem}
    n = ctx.options.get("class_submissions", 300)
    out = {"status": "ok", "submissions": n, "load_avg_before": load_average(), "rows": [], "repeats": 1,
           "left_out": sorted(WAIT_FOR_TIMEOUT)}
    with tempfile.TemporaryDirectory(prefix="kvcourse-class-") as tmp:
        tmp = Path(tmp)
        out["assignments"] = dict(make_class(tmp / "class", n))
        serial = tmp / "run-0" / "course"
        for i, (name, workers, kill) in enumerate(RUNS):
            course = tmp / f"run-{i}" / "course"
            if i:  # the reference values the serial run computed: a cache, the same for every run
                shutil.copytree(serial / "work" / "reference", course / "work" / "reference")
            ctx.log(f"[class_grading] {name}: {n} submissions ...")
            row = {"run": name, **_grade(tmp / "class", course, workers, kill)}
            row["same_grades_csv"] = (course / "grades.csv").read_bytes() == (serial / "grades.csv").read_bytes()
            row["same_report_csv"] = _report(course) == _report(serial)
            out["rows"].append(row)
            ctx.log(f"[class_grading] {name}: {row['seconds']:.0f} s, {row['per_minute_per_worker']:.2f} per minute "
                    "per worker")
    one, two = out["rows"][1], out["rows"][2]
    out["ratio_2_over_1"] = two["per_minute"] / one["per_minute"]
    out["load_avg_after"] = load_average()
    return out


COLUMNS = {"run": "{run}", "seconds": "{seconds:.0f}", "per minute": "{per_minute:.2f}",
           "per minute per worker": "{per_minute_per_worker:.2f}", "s per 100": "{s_per_100:.0f}",
           "grades.csv = serial": "{same_grades_csv}", "report.csv = serial": "{same_report_csv}",
           "merge s (this process)": "{merge_s:.2f}", "merged twice": lambda r: len(r["merged_twice"])}
CLASS_GRADING = Item(bench_class_grading, "Class simulation: serial, 1 and 2 Dask workers over TCP", slow=True,
    columns=COLUMNS,
    text=lambda it: (f"{it['submissions']} submissions ({it['assignments']}); 2 workers ÷ 1 worker throughput "
                     f"**{it['ratio_2_over_1']:.2f}×**; load average {it['load_avg_before']:.1f} before, "
                     f"{it['load_avg_after']:.1f} after."),
    targets=[Target("class_runs_unlike_serial", "runs whose grades.csv or report.csv differ from serial", "<=", 0,
                    lambda it: (sum(not (r["same_grades_csv"] and r["same_report_csv"]) for r in it["rows"]), "")),
             Target("class_merged_twice", "submissions merged more than once", "<=", 0,
                    lambda it: (sum(len(r["merged_twice"]) for r in it["rows"]), "one worker killed halfway")),
             Target("class_ratio_2_over_1", "grading throughput, 2 workers ÷ 1", ">=", 1.5,
                    lambda it: (it["ratio_2_over_1"], "on a shared machine: see the load average"))])
