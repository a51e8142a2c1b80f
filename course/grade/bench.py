"""`kvcourse bench` item: grading time per submission, sealed (bubblewrap) vs unsealed, side by side.

The same submissions (the first non-adversarial samples of autograde/samples) are graded into two fresh
course folders, one sealed and one --unsandboxed; after a first run each (which also builds the gradebook
and the reference values), the two are regraded with --force in alternation, so both see the same load.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from course.measure.bench import Context, Target, bench_item


@bench_item("grading_sealed", title="Autograde: sealed vs unsealed", slow=True, columns={
    "mode": "{mode}", "s per submission (median of rounds)": "{median_s:.2f}",
    "rounds (s per submission)": lambda r: ", ".join(f"{x:.2f}" for x in r["rounds_s"])},
    text=lambda it: (f"{it['submissions']} submissions, {len(it['rows'][0]['rounds_s'])} alternating rounds each: "
                     f"sealed / unsealed = **{it['ratio']:.2f}×** per submission"
                     + ("" if it["sandbox"] == "" else f" (sealed runs unavailable: {it['sandbox']})") + "."),
    targets=[Target("grade_sealed_ratio", "sealed ÷ unsealed grading time per submission", "<=", 1.3,
                    lambda it: (it["ratio"], f"{it['submissions']} submissions"))])
def bench_grading_sealed(ctx: Context, students: int | None = None, rounds: int | None = None) -> dict:
    from course.grade import grader, sandbox
    from course.paths import AUTOGRADE

    students = students or ctx.options.get("grade_samples", 4)
    rounds = rounds or (1 if ctx.quick else 3)
    problem = sandbox.sandbox_problem()
    if problem:
        return {"status": "not available", "reason": problem}
    samples = AUTOGRADE / "samples"
    manifest = json.loads((samples / "manifest.json").read_text())
    picked = [e for e in manifest if not e["student"].startswith("adv-") and e["expect"] != "invalid"][:students]
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-sealed-") as tmp:
        folder = Path(tmp) / "class"
        for i, e in enumerate(picked):
            shutil.copytree(samples / e["student"] / e["assignment"], folder / f"s{i:02d}-{e['student']}" / e["assignment"])
        times = {"sealed": [], "unsealed": []}
        for mode in times:  # first runs: gradebook, release, reference values
            grader.grade(folder, Path(tmp) / mode, progress=False, log=lambda *_: None, unsandboxed=mode == "unsealed")
        for _ in range(rounds):
            for mode in times:
                t0 = time.perf_counter()
                rows = grader.grade(folder, Path(tmp) / mode, force=True, progress=False, log=lambda *_: None,
                                    unsandboxed=mode == "unsealed")
                times[mode].append((time.perf_counter() - t0) / len(rows))
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    return {"status": "ok", "submissions": len(picked), "sandbox": problem, "ratio": med["sealed"] / med["unsealed"],
            "rows": [{"mode": m, "median_s": med[m], "rounds_s": times[m]} for m in times], "repeats": rounds}
