"""Benchmark: grade a class of N submissions (default 40) of one assignment, serially and with --jobs J.

The class goes through nbgrader's real exchange: the assignment is released, N students (student-01 ...)
each submit one of the assignment's sample notebooks (references, planted bugs, differently written
correct code; adversarial ones only with --adversarial, whose timeouts would dominate), and the
instructor collects. The collected class is then graded twice from scratch, in two class folders, with
`kvcourse classroom grade` (course/grading.py): once with one worker, once with J. Writes
bench-results/classroom-grading.json. Speed is measured here, never asserted in a test.

    .venv/bin/python autograde/classroom/bench_class.py [--students 40] [--jobs 2] [--assignment 01_memory_formula]
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from course.grade import classroom, grading  # noqa: E402


def submit(student: str, assignment: str, notebook: Path, home: Path, exchange: Path) -> None:
    """What a student's Assignment List does: nbgrader fetch_assignment, then (after the work) submit."""
    from nbgrader.auth import Authenticator
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.exchange import ExchangeFactory
    from traitlets.config import Config

    home.mkdir(parents=True)
    cfg = Config()
    cfg.CourseDirectory.course_id = classroom.COURSE_ID
    cfg.CourseDirectory.student_id = student  # as jupyter-config/student/nbgrader_config.py sets it
    cfg.CourseDirectory.assignment_id = assignment
    cfg.CourseDirectory.root = str(home)
    cfg.Exchange.root = str(exchange)
    cfg.Exchange.cache = str(home / ".nbgrader_cache")
    cfg.Exchange.assignment_dir = str(home)
    factory = ExchangeFactory(config=cfg)
    for step in (factory.FetchAssignment, factory.Submit):
        if step is factory.Submit:
            shutil.copyfile(notebook, home / assignment / notebook.name)
        step(coursedir=CourseDirectory(config=cfg), authenticator=Authenticator(config=cfg), config=cfg,
             log_level="ERROR").start()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--students", type=int, default=40)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--assignment", default="01_memory_formula", choices=sorted(grading.assignments()))
    p.add_argument("--adversarial", action="store_true", help="include the adversarial samples")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "classroom-grading.json")
    args = p.parse_args()
    if args.students < 1 or args.jobs < 1:
        p.error("--students and --jobs must be at least 1")

    manifest = json.loads((ROOT / "autograde" / "samples" / "manifest.json").read_text())
    pool = [e for e in manifest if e["assignment"] == args.assignment and e["expect"] != "invalid"
            and (args.adversarial or not e["student"].startswith("adv-"))]
    picked = [pool[i % len(pool)] for i in range(args.students)]
    result = {"students": args.students, "assignment": args.assignment, "cpus": os.cpu_count(),
              "samples": sorted({e["student"] for e in picked}), "load_avg_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="kvcourse-class-bench-") as tmp:
        tmp = Path(tmp)
        exchange = classroom.make_exchange(tmp / "exchange")
        first = tmp / "class-jobs-1"
        started = time.perf_counter()
        classroom.release(args.assignment, first, exchange)
        for i, entry in enumerate(picked, start=1):
            nb = ROOT / "autograde" / "samples" / entry["student"] / args.assignment / f"{entry['notebook']}.ipynb"
            submit(f"student-{i:02d}", args.assignment, nb, tmp / "homes" / f"student-{i:02d}", exchange)
        collected = classroom.collect(args.assignment, first, exchange)
        assert len(collected.students) == args.students, collected
        result["release_submit_collect_s"] = round(time.perf_counter() - started, 1)

        scores = {}
        for jobs in sorted({1, args.jobs}):
            course = tmp / f"class-jobs-{jobs}"
            if course != first:
                shutil.copytree(first / classroom.INBOX, course / classroom.INBOX)
            print(f"grading {args.students} submissions with --jobs {jobs} ...", flush=True)
            t = time.perf_counter()
            rows = classroom.grade(args.assignment, course, exchange, jobs=jobs, progress=False, log=lambda *_: None)
            seconds = time.perf_counter() - t
            bad = [r for r in rows if r.status != "graded"]
            assert not bad, bad
            scores[jobs] = {r.student: r.score for r in rows}
            result[f"jobs_{jobs}"] = {"total_s": round(seconds, 1), "per_submission_s": round(seconds / len(rows), 2)}
            print(f"  {seconds:.1f} s = {seconds / len(rows):.2f} s per submission", flush=True)
        assert len({json.dumps(s, sort_keys=True) for s in scores.values()}) == 1, "serial and parallel scores differ"
        result["same_scores_serial_and_parallel"] = True
        if args.jobs != 1:
            result["speedup"] = round(result["jobs_1"]["total_s"] / result[f"jobs_{args.jobs}"]["total_s"], 2)
    result["load_avg_after"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
