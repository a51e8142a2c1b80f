"""The course around the engine: its notebooks run headless, grading time per submission, widget redraws.

Items whose code is not part of this checkout are reported as "not available", never given a number.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import util
from pathlib import Path

from bench.core import Item, Target, summary


# --- notebooks -------------------------------------------------------------------------------------------------
def notebook_paths() -> list[Path]:
    from course.paths import LESSONS, SOLUTIONS

    found = sorted(LESSONS.glob("*.ipynb")) + sorted(SOLUTIONS.glob("**/*.ipynb"))
    return [p for p in found if ".ipynb_checkpoints" not in p.parts]


def stated_run_minutes(nb) -> float | None:
    """The bound a lesson's first cell states ('**Run time:** under N minutes', N may be 2.5), or None."""
    import re

    source = nb.cells[0].source if nb.cells else ""
    m = re.search(r"\*\*Run time:?\*\*:?\s*under (\d+(?:\.\d+)?) minutes?", source)
    return float(m.group(1)) if m else None


def bench_notebooks(ctx) -> dict:
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
        for path in ctx.progress(paths, "notebooks"):
            nb = nbformat.read(path, as_version=4)
            client = NotebookClient(nb, timeout=900, kernel_name="python3",
                                    resources={"metadata": {"path": str(path.parent)}})
            t0 = time.perf_counter()
            try:
                client.execute(env=env)
                error = None
            except Exception as exc:  # a failing notebook is reported, with its time until the failure
                error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}"
            rows.append(dict(notebook=str(path.relative_to(PROJECT_ROOT)), seconds=time.perf_counter() - t0,
                             ok=error is None, error=error, stated_min=stated_run_minutes(nb)))
    ratios = [(r["seconds"] / (60 * r["stated_min"]), r["notebook"]) for r in rows if r.get("stated_min")]
    worst = max(ratios, default=(float("nan"), ""))
    return {"status": "ok", "rows": rows, "total_s": sum(r["seconds"] for r in rows),
            "lessons_s": sum(r["seconds"] for r in rows if r["notebook"].startswith("lessons")),
            "all_ok": all(r["ok"] for r in rows), "repeats": 1, "worst_over_stated": worst[0], "worst_lesson": worst[1]}


NOTEBOOKS = Item(bench_notebooks, "Notebooks executed headless", slow=True, columns={
    "notebook": "{notebook}", "seconds": "{seconds:.0f}",
    "stated": lambda r: f"under {r['stated_min']:g} min" if r.get("stated_min") else "—",
    "ok": lambda r: "yes" if r["ok"] else f"no — {r['error']}"},
    text=lambda it: f"Total {it['total_s']:.0f} s (lessons {it['lessons_s']:.0f} s).",
    targets=[Target("notebooks_s", "all lessons + solutions executed headless, seconds", "<=", 600.0,
                    lambda it: (it["total_s"], "" if it["all_ok"] else "some notebooks failed")),
             Target("lesson_over_stated", "slowest lesson ÷ the run time its header states", "<=", 1.0,
                    lambda it: (it["worst_over_stated"], it["worst_lesson"]))])


# --- grading ---------------------------------------------------------------------------------------------------
def _samples(limit: int, more: bool = False) -> list[dict]:
    """The first `limit` sample submissions (adversarial ones left out): manifest entries of autograde/samples/."""
    from course.paths import AUTOGRADE

    manifest = AUTOGRADE / "samples" / "manifest.json"
    if not manifest.exists():
        return []
    picked = [e for e in json.loads(manifest.read_text()) if not e["student"].startswith("adv-")
              and (more or e.get("expect") != "invalid")]
    return picked[:limit]


def bench_grading(ctx) -> dict:
    """`kvcourse grade` over a copy of the first sample students' submissions: a first run (which also generates
    the assignments into a fresh gradebook), then `--force` regrades everything: the per-class cost."""
    from course.paths import AUTOGRADE, PROJECT_ROOT

    if util.find_spec("course.grade.grader") is None:
        return {"status": "not available", "reason": "course/grade/grader.py (kvcourse grade) is not part of this checkout"}
    students = list(dict.fromkeys(e["student"] for e in _samples(10 ** 6, more=True)))[:ctx.options.get("grade_samples", 6)]
    if not students:
        return {"status": "not available", "reason": "no sample submissions in autograde/samples/"}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-grade-") as tmp:
        folder = Path(tmp) / "submitted"
        for name in students:
            shutil.copytree(AUTOGRADE / "samples" / name, folder / name)
        n_subs = len(list(folder.glob("*/**/*.ipynb")))  # one per student and assignment
        cmd = [sys.executable, "-m", "course.cli", "grade", str(folder), "--course", str(Path(tmp) / "course"),
               "--force", "--quiet"]
        for run_name in ("first", "regrade"):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=3600)
            runs[run_name] = time.perf_counter() - t0
            if proc.returncode not in (0, 1):  # 1: graded, but some submission needs a look
                return {"status": "error", "reason": f"`kvcourse grade` exited {proc.returncode}",
                        "output_tail": (proc.stdout + proc.stderr)[-2000:], "seconds": runs}
    return {"status": "ok", "students": students, "submissions": n_subs, "first_run_s": runs["first"],
            "seconds": runs["regrade"], "s_per_submission": runs["regrade"] / n_subs, "repeats": 1}


GRADING = Item(bench_grading, "Autograde", slow=True, text=lambda it: (
    f"{it['submissions']} submissions ({len(it['students'])} students × their assignments) regraded in "
    f"{it['seconds']:.0f} s → **{it['s_per_submission']:.1f} s per submission** (first run, with a fresh "
    f"gradebook: {it['first_run_s']:.0f} s)."),
    targets=[Target("grade_s_per_submission", "autograde seconds per submission", "<=", 10.0,
                    lambda it: (it["s_per_submission"], f"{it['submissions']} submissions"))])


def bench_grading_sealed(ctx) -> dict:
    """Grading time per submission sealed (bubblewrap) and unsealed: the same submissions graded into two fresh
    course folders; after a first run each (gradebook, reference values), regraded with --force in alternation."""
    from course.grade import grader, sandbox
    from course.paths import AUTOGRADE

    problem = sandbox.sandbox_problem()
    if problem:
        return {"status": "not available", "reason": problem}
    picked, rounds = _samples(ctx.options.get("grade_samples", 4)), 1 if ctx.quick else 3
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-sealed-") as tmp:
        folder = Path(tmp) / "class"
        for i, e in enumerate(picked):
            shutil.copytree(AUTOGRADE / "samples" / e["student"] / e["assignment"],
                            folder / f"s{i:02d}-{e['student']}" / e["assignment"])
        times = {"sealed": [], "unsealed": []}
        for mode in times:
            grader.grade(folder, Path(tmp) / mode, progress=False, log=lambda *_: None, unsandboxed=mode == "unsealed")
        for _ in range(rounds):
            for mode in times:
                t0 = time.perf_counter()
                graded = grader.grade(folder, Path(tmp) / mode, force=True, progress=False, log=lambda *_: None,
                                      unsandboxed=mode == "unsealed")
                times[mode].append((time.perf_counter() - t0) / len(graded))
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    return {"status": "ok", "submissions": len(picked), "ratio": med["sealed"] / med["unsealed"], "repeats": rounds,
            "rows": [{"mode": m, "median_s": med[m], "rounds_s": times[m]} for m in times]}


GRADING_SEALED = Item(bench_grading_sealed, "Autograde: sealed vs unsealed", slow=True, columns={
    "mode": "{mode}", "s per submission (median of rounds)": "{median_s:.2f}",
    "rounds (s per submission)": lambda r: ", ".join(f"{x:.2f}" for x in r["rounds_s"])},
    text=lambda it: f"{it['submissions']} submissions: sealed / unsealed = **{it['ratio']:.2f}×** per submission.",
    targets=[Target("grade_sealed_ratio", "sealed ÷ unsealed grading time per submission", "<=", 1.3,
                    lambda it: (it["ratio"], f"{it['submissions']} submissions"))])


# --- widgets ---------------------------------------------------------------------------------------------------
def bench_widgets(ctx) -> dict:
    """Median and worst slider-redraw latency of the sampling explorer and the KV-cache calculator."""
    rows, missing = [], []
    moves = ctx.sizes["widget_moves"]
    if not ctx.real:
        missing.append("sampling explorer (needs the course model; --model tiny was given)")
    elif util.find_spec("course.widgets.sampling_explorer") is not None:
        from course.widgets.sampling_explorer import SamplingExplorer

        explorer = SamplingExplorer(ctx.model("float32"), ctx.tokenizer)
        settings = [(0.2 + 1.6 * i / max(1, moves - 1), [0, 5, 40][i % 3], [1.0, 0.9, 0.5][i % 3], "factual")
                    for i in range(moves)]
        explorer.redraw(*settings[0])  # computes the prompt's logits once, as the widget does on open
        rows.append(_widget_row("sampling_explorer", "SamplingExplorer.redraw",
                                [explorer.redraw(*s).redraw_ms for s in settings]))
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


WIDGETS = Item(bench_widgets, "Widget redraw", columns={
    "widget": "{widget}", "callback": "{callback}", "median ms": "{median_ms:.1f}", "p90 ms": "{p90_ms:.1f}",
    "max ms": "{max_ms:.1f}", "moves": "{moves}"},
    text=lambda it: ("Not available: " + "; ".join(it["not_available"])) if it["not_available"] else "",
    targets=[Target("widget_redraw_ms", "slowest widget's median slider redraw, ms", "<=", 200.0,
                    lambda it: (lambda w: (w["median_ms"], w["widget"]))(max(it["rows"], key=lambda r: r["median_ms"])))])
