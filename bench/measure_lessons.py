"""What one learner costs: each lesson's peak memory (RSS) and CPU-seconds, measured by running it headless once.

    .venv/bin/python bench/measure_lessons.py [NOTEBOOK ...]   (default: every lessons/*.ipynb)

Each notebook runs as a learner's Run All (`jupyter nbconvert --to notebook --execute`) in a child process
reaped with os.wait4, whose rusage covers the child and every process it reaped (the kernel): CPU-seconds
are user + system time of the whole run, peak RSS is the largest single process's (the kernel's). All
lessons share one fresh temporary home (progress file, Jupyter's folders, the course's cache), as one new
learner going through the course in order would. An empty notebook is measured first: the Jupyter machinery
alone. CPU-seconds hardly change with the machine's load; wall time does, so the load is recorded.
Writes docs/bench-runs/capacity-lessons-<time>.json after each lesson ("complete" once all ran); the capacity plan
in autograde/classroom/README.md quotes it, and tests/test_k8s.py checks values.yaml's resources against it.
"""
import json, os, platform, subprocess, sys, tempfile, time  # noqa: E401
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course.paths import jupyter_env  # noqa: E402


def run(notebook: Path, home: Path, timeout_s: int) -> dict:
    """Run one notebook headless; its status, CPU-seconds, peak RSS and wall time."""
    env = jupyter_env(state=home / "jupyter")
    env.update(KVCOURSE_PROGRESS=str(home / "progress") + "/", KVCOURSE_CACHE=str(home / "cache"),
               MPLBACKEND="Agg", HOME=str(home), PYTHONPATH=str(ROOT))  # the kernel imports this tree's course
    cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(notebook),
           "--output-dir", str(home / "out"), f"--ExecutePreprocessor.timeout={timeout_s}"]
    load, start = os.getloadavg()[0], time.monotonic()
    with open(home / "log.txt", "w+") as log:
        child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=notebook.parent)
        _, status, usage = os.wait4(child.pid, 0)
        log.seek(0)
        tail = log.read()[-600:]
    code = os.waitstatus_to_exitcode(status)
    return {"notebook": notebook.name, "ok": code == 0, "exit": code, "wall_s": round(time.monotonic() - start, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
            **({} if code == 0 else {"error_tail": tail})}


def main(argv: list[str]) -> int:
    notebooks = [Path(a).resolve() for a in argv] or sorted((ROOT / "lessons").glob("*.ipynb"))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    stamp = time.strftime("%Y-%m-%dT%H%M")
    out = ROOT / "docs" / "bench-runs" / f"capacity-lessons-{stamp}.json"
    record = {"schema": "kvcourse-capacity-lessons/1", "started": stamp, "commit": commit.stdout.strip(), "cpu": cpu,
              "cores": os.cpu_count(), "python": platform.python_version(), "complete": False, "lessons": []}
    with tempfile.TemporaryDirectory(prefix="kvcourse-measure-") as tmp:
        home = Path(tmp)
        empty = home / "empty.ipynb"
        empty.write_text(json.dumps({"cells": [], "metadata": {"kernelspec": {"name": "python3", "language": "python",
                         "display_name": "Python 3"}}, "nbformat": 4, "nbformat_minor": 5}))
        record["empty_notebook"] = run(empty, home, 600)
        for nb in notebooks:  # the file is rewritten after each lesson: a sweep stopped midway keeps what it measured
            record["lessons"].append(run(nb, home, 3600))
            record["complete"] = nb == notebooks[-1]
            out.write_text(json.dumps(record, indent=1) + "\n")
            print(json.dumps(record["lessons"][-1]), flush=True)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if all(r["ok"] for r in [record["empty_notebook"], *record["lessons"]]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
