"""The bench's decode, batch and serving figures at commit 17d83f0 and now, side by side in one run.

    git worktree add --detach /tmp/kv-old-eb 17d83f0
    git worktree add --detach /tmp/kv-new-eb HEAD      # "new" as committed, untouched by edits in progress
    KVCOURSE_CACHE=.state/model-cache python docs/bench-runs/old_vs_new.py --old /tmp/kv-old-eb \
        --new /tmp/kv-new-eb --rounds 6 --minutes 50 --out docs/bench-runs/old-vs-new-<date>.json

Each round runs each of the four items (`kvcourse bench --only ITEM --threads 1`: decode_floor, decode_batch,
batching, serving) once from the old tree and once from this one, back to back, each in its own process with the
same sizes; which tree goes first alternates from item to item and from round to round, so the two runs of a pair
are a minute or two apart and a burst of load hits both alike. Inductor's disk cache makes every compile after the
first a load.
Reported per figure: each round's value, old and new, and the median over rounds of new ÷ old. The JSON is
rewritten after every round, and no round starts that would end past --minutes (judged by the slowest round so far).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEW = Path(__file__).resolve().parents[2]
ITEMS = ("decode_floor", "decode_batch", "batching", "serving")
SIZES = dict(rounds=3, steps_per_round=3, batch_rounds=3)  # both versions' FULL sizes, made the same and shorter
RUN = """
import sys
import torch
import course
assert course.__file__.startswith({tree!r}), ("course imported from the wrong tree", course.__file__)
torch._dynamo.config.recompile_limit = 64  # the old step shared one count over every variant (its fallback bug)
sys.argv = ["kvcourse", "bench", "--threads", "1", "--out", {out!r}] + [a for i in {items!r} for a in ("--only", i)]
import os
if os.path.exists(os.path.join({tree!r}, "bench", "core.py")):
    from bench import core as sizes
else:  # 17d83f0: `import bench` would find the editable install's (the live tree's) bench/
    from course.measure import bench as sizes
assert sizes.__file__.startswith({tree!r}), ("bench sizes from the wrong tree", sizes.__file__)
sizes.FULL.update({sizes!r})
from course.cli import main
sys.exit(main(sys.argv[1:]))
"""


def figures(result: dict) -> dict:
    """The figures the course shows, from one bench result (old or new: the same keys)."""
    items, out = result["items"], {}
    for r in items["decode_floor"].get("rows", []):
        if r.get("threads") == 1 and r.get("engine") in ("eager", "compiled") and "refused" not in r:
            out[f"decode_floor {r['engine']} ms"] = r["ms_per_step"]
            out[f"decode_floor {r['engine']} x floor"] = r["x_floor"]
    for r in items["decode_batch"].get("rows", []):
        if r.get("threads") == 1 and r.get("engine") in ("compiled", "compiled, any shape") and "refused" not in r:
            out[f"decode_batch {r['engine']} B={r['batch']} ms"] = r["ms_per_step"]
    for name, e in items["batching"].get("engines", {}).items():
        out[f"batching {name} best-batch speedup"] = e["speedup"]
    for name, e in items["serving"].get("engines", {}).items():
        out[f"serving {name} continuous/static"] = e["throughput_ratio"]
    if "compiled_over_eager" in items["serving"]:
        out["serving compiled/eager"] = items["serving"]["compiled_over_eager"]
    return out


def write(out: str, runs: dict, commits: dict) -> dict:
    """The record so far: every round's figures, and per figure the median over rounds of new ÷ old."""
    names = sorted(set.intersection(*(set(x["figures"]) for x in runs["old"] + runs["new"])))
    table = {n: {"old": [x["figures"][n] for x in runs["old"]], "new": [x["figures"][n] for x in runs["new"]],
                 "new_over_old": statistics.median(b["figures"][n] / a["figures"][n]
                                                   for a, b in zip(runs["old"], runs["new"]))} for n in names}
    Path(out).write_text(json.dumps({"commits": commits, "sizes": SIZES, "runs": runs, "table": table}, indent=1))
    return table


def worse_by(name: str, new_over_old: float) -> float:
    """How much worse new is than old, as a fraction (negative: better). Lower is better for times, × floor and
    "serving compiled/eager" (the compiled server's CPU-seconds per token ÷ the eager one's); higher is better for
    the best-batch speedups and continuous ÷ static throughput."""
    return new_over_old - 1 if name.endswith((" ms", " x floor", "compiled/eager")) else 1 - new_over_old


def markdown(record: dict) -> str:
    """The table of a record: per figure the medians over rounds, new ÷ old (median of the rounds' ratios), and
    whether new is within 5 % of old (or better)."""
    lines = ["| figure | old (median) | new (median) | new ÷ old | new worse by | within 5 % |", "|---|---|---|---|---|---|"]
    for n, v in record["table"].items():
        worse = worse_by(n, v["new_over_old"])
        lines.append(f"| {n} | {statistics.median(v['old']):.2f} | {statistics.median(v['new']):.2f} | "
                     f"{v['new_over_old']:.3f} | {worse * 100:+.1f} % | {'yes' if worse <= 0.05 else '**no**'} |")
    return "\n".join(lines) + "\n"


def bench_once(tree: str, item: str, which: str, r: int) -> dict:
    """One item's bench result from one tree, in a process of its own."""
    tree = str(Path(tree).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        code = RUN.format(out=tmp, items=(item,), sizes=SIZES, tree=tree)
        env = {**os.environ, "PYTHONPATH": tree}
        proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{which} round {r + 1} ({item}) failed:\n{proc.stderr[-3000:]}")
        return json.loads((Path(tmp) / "latest.json").read_text())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--render", help="print the Markdown table of a record (a JSON this script wrote) and stop")
    p.add_argument("--old")
    p.add_argument("--new", default=str(NEW), help="the new tree (default: the one this script is in)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--minutes", type=float, default=float("inf"), help="start no round that would end past this")
    p.add_argument("--out")
    args = p.parse_args()
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())), end="")
        return
    if not (args.old and args.out):
        p.error("--old and --out are needed for a run")
    runs = {"old": [], "new": []}
    commits = {w: subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for w, t in (("old", args.old), ("new", args.new))}
    start, slowest = time.monotonic(), 0.0
    for r in range(args.rounds):
        if r and (time.monotonic() - start + slowest) / 60 > args.minutes:
            print(f"stopping after {r} rounds: another would end past {args.minutes} min", flush=True)
            break
        round_start = time.monotonic()
        got = {"old": {"items": {}, "load": [], "wall_s": 0.0}, "new": {"items": {}, "load": [], "wall_s": 0.0}}
        for i, item in enumerate(ITEMS):
            for which in (("old", "new") if (r + i) % 2 == 0 else ("new", "old")):
                result = bench_once(args.old if which == "old" else args.new, item, which, r)
                got[which]["items"][item] = result["items"][item]  # the others are listed there as not run
                got[which]["load"].append(result["meta"]["load_average_before"][0])
                got[which]["wall_s"] += result["meta"]["wall_s"]
                print(f"round {r + 1} {item} {which}: {result['meta']['wall_s']:.0f} s, "
                      f"load {result['meta']['load_average_before'][0]:.2f}", flush=True)
        for which, g in got.items():
            runs[which].append({"figures": figures(g), "load": g["load"], "wall_s": g["wall_s"]})
            print(f"round {r + 1} {which}: {runs[which][-1]['figures']}", flush=True)
        slowest = max(slowest, time.monotonic() - round_start)
        table = write(args.out, runs, commits)
    for n, v in table.items():
        print(f"{n:55s} old {statistics.median(v['old']):8.2f}  new {statistics.median(v['new']):8.2f}  "
              f"new/old {v['new_over_old']:.3f}")


if __name__ == "__main__":
    main()
