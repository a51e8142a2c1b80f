"""Lesson 05: its helpers gate and report what they measured (fast), and the lesson runs end to end (slow), also on a
machine whose cores other programs keep busy: the busy notice appears and no flagged figure reaches the recap."""
from __future__ import annotations

import json
import math

import nbformat
import pytest

from course.measure import machine
from course.paths import LESSONS

NOTEBOOK = LESSONS / "05_serving.ipynb"
TIMED = ("batch_sweep", "batching", "prefix_sharing")  # Report keys of the timed sections


# --------------------------------------------------------------------------------------------- fast

def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    assert 'checkpoint("05_serving")' in nb.cells[-2].source and 'self_assessment("05_serving")' in nb.cells[-1].source
    text = "\n".join(c.source for c in nb.cells)
    assert "](../exercises/05_paged_cache/paged_cache.ipynb)" in text and "](99_course_end.ipynb)" in text
    assert "under 4 minutes" in nb.cells[0].source
    recap = next(i for i, c in enumerate(nb.cells) if "recap(" in c.source)
    assert "## What to take away" in nb.cells[recap - 1].source
    # the prediction comes before the sweep that scores it
    cells = [c.source for c in nb.cells]
    assert next(i for i, s in enumerate(cells) if "predict(" in s) < next(i for i, s in enumerate(cells)
                                                                          if "batch_sweep(" in s)


def _sweep(ms_by_batch: dict, predicted_ms: float = 1.0, context: int = 64):
    from course.engine.config import ModelConfig
    from course.lessons.serving import BatchSweep, SweepPoint, batch_cost
    from course.measure.roofline import Machine
    from course.measure.timing import Timing

    config = ModelConfig.from_name("smollm2-135m")
    sweep = BatchSweep(Machine("cpu", "float32", 20e9, 54e9), engine="compiled")
    for b, ms in ms_by_batch.items():
        sweep.points.append(SweepPoint(b, context, Timing([ms / 1e3]), predicted_ms / 1e3, batch_cost(config, b,
                                                                                                      context, 4)))
    return sweep


class _Profile(machine.Profile):  # a quiet machine: 20 GB/s, 54 GFLOP/s
    def __init__(self):
        super().__init__("cpu", "float32", 1, 2, 20.0, 54.0, 0.0, 0.0)


def test_knee_is_interpolated_where_the_step_first_doubles():
    from course.lessons.serving import knee

    assert knee([1, 2, 4, 8, 16, 32], [30, 31, 33, 40, 70, 130]) == pytest.approx(8 + 8 * (60 - 40) / (70 - 40))
    assert knee([1, 2, 4], [30, 31, 33]) is None  # no step doubled: the knee lies beyond the sweep
    assert knee([1, 2, 4], [30, 61, 90]) == pytest.approx(1 + (60 - 30) / (61 - 30))
    with pytest.raises(ValueError, match="B = 1"):
        knee([2, 4], [1.0, 2.0])


def test_predicted_knee_and_critical_batch_agree_on_paper():
    from course.engine.config import ModelConfig
    from course.lessons.serving import batch_cost, critical_batch, doubling_batch, paper_table, predicted_step
    from course.measure.roofline import Machine

    config, m = ModelConfig.from_name("smollm2-135m"), Machine("cpu", "float32", 20e9, 54e9)
    for C in (64, 512):
        one = batch_cost(config, 1, C, 4)
        b_star, k = critical_batch(m, one), doubling_batch(m, one)
        assert 1 < b_star < k <= 2 * b_star  # memory-bound at B = 1: the knee lies at or below 2·B*
        assert predicted_step(m, batch_cost(config, math.ceil(k), C, 4)) >= 2 * predicted_step(m, one)
        assert predicted_step(m, batch_cost(config, math.floor(k), C, 4)) < 2 * predicted_step(m, one)
        assert f"{b_star:6.1f} {k:13.1f}" in paper_table(m, config, (C,))


def test_the_sweep_gate_flags_what_physics_forbids():
    clean = _sweep({1: 30, 2: 31, 4: 33, 8: 40, 16: 70})
    assert not [r for r in clean.rules(_Profile()) if r]
    cheaper = [r for r in _sweep({1: 68.7, 2: 60, 4: 50, 8: 35.4}).rules(_Profile()) if r]  # the reported run
    assert any("B = 8 gave" in r and "more than 8×" in r for r in cheaper)
    assert any("less than B = 4" in r for r in cheaper)
    under = [r for r in _sweep({1: 10, 2: 31}).rules(_Profile()) if r]  # 538 MB at 20 GB/s cannot take 10 ms
    assert any("under its" in r and "bandwidth floor" in r for r in under)
    busy = _Profile()
    busy.others_cores = 1.5  # a profile measured busy under-measured the bandwidth: its floor is no floor
    assert not [r for r in _sweep({1: 10, 2: 31}).rules(busy) if r]


def test_a_flagged_sweep_reaches_no_record_and_no_profile(fresh_progress, monkeypatch):
    from course.lessons import serving
    from course.measure import gates, machine
    from course.measure.results import recorded

    remembered = []
    monkeypatch.setattr(machine, "remember", lambda prof, engine, ms: remembered.append((engine, ms)))
    good = serving.sweep_report(gates.measured(lambda: _sweep({1: 30, 2: 31, 4: 33, 8: 40, 16: 70}),
                                               lambda s: s.rules(_Profile()), "the batch sweep"), _Profile())
    assert "B ≈ 13" in good.headline and len(good.headline.split()) <= 30
    assert remembered == [("compiled", 30.0)] and recorded()["batch_speedup"] == pytest.approx(16 / (70 / 30))
    lesson_1 = _Profile()
    lesson_1.decode_ms = {"compiled": 21.0}  # lesson 1's whole-step figure stays the profile's
    again = serving.sweep_report(gates.measured(lambda: _sweep({1: 30, 2: 31, 4: 33, 8: 40, 16: 70}),
                                                lambda s: s.rules(lesson_1), "the batch sweep"), lesson_1)
    assert remembered == [("compiled", 30.0)] and any("is 21.0 ms" in d for d in again.details)
    remembered.clear()
    run = gates.measured(lambda: _sweep({1: 68.7, 2: 60, 4: 50, 8: 35.4}), lambda s: s.rules(_Profile()),
                         "the batch sweep")
    bad = serving.sweep_report(run, _Profile())
    assert not run.ok and remembered == [] and bad.headline.startswith("Not used")
    assert run.notice in bad.details and "35.4" not in str(bad).split("How sure")[0]
    assert {"batch_sweep", "batch_speedup", "batch_knee", "batch_step_ms_1"} <= set(recorded()["unreliable"])


def test_the_knee_prediction_is_scored_only_against_a_knee_that_was_measured(capsys):
    from types import SimpleNamespace

    from course.lessons.serving import score_knee
    from course.measure import gates

    def score(ms_by_batch, rules=lambda s: []):
        checked = []
        score_knee(SimpleNamespace(check=checked.append), gates.measured(lambda: _sweep(ms_by_batch), rules, "x"), 64)
        return checked

    assert score({1: 30, 2: 31, 4: 33, 8: 40, 16: 70}) == [pytest.approx(8 + 8 * 20 / 30)]
    assert score({1: 30, 2: 31, 4: 33}) == [] and "not scored" in capsys.readouterr().out  # no step doubled
    assert score({1: 30, 2: 61}, rules=lambda s: ["broken"]) == [None]  # flagged: check(None) says "not scored"


def test_the_paper_table_in_the_markdown_is_the_formula_on_the_datasheets():
    import re

    from course.engine.config import ModelConfig
    from course.lessons.serving import GPUS, batch_cost, critical_batch, predicted_step
    from course.measure.costs import weights_bytes

    config = ModelConfig.from_name("llama-2-7b")
    text = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown")
    rows = re.findall(r"^\| (A100|H100) \| ([\d,]+) \| (\d+) \| ([\d.]+) \| ([\d,]+) \| (\d+) GB(: over 80 GB)? \|$",
                      text, re.M)
    assert len(rows) == 6
    for gpu, c, b, ms, tokens, gb, over in rows:
        cost = batch_cost(config, int(b), int(c.replace(",", "")), 2)
        s = predicted_step(GPUS[gpu], cost)
        assert (f"{s * 1e3:.1f}", f"{int(b) / s:,.0f}") == (ms, tokens)
        memory = weights_bytes(config, "fp16") + cost.kv_bytes
        assert f"{memory / 1e9:.0f}" == gb and bool(over) == (memory > 80e9)
    assert "≈ 153 FLOP/byte" in text and "≈ 295" in text and round(GPUS["A100"].ridge) == 153
    assert math.isinf(critical_batch(GPUS["A100"], batch_cost(config, 1, 4096, 2)))  # "memory-bound at any batch"


def test_requests_that_fit():
    from course.lessons.serving import fit_table, requests_that_fit

    rows = {(r["model"], r["context"]): r for r in requests_that_fit()}
    assert rows["llama-2-7b", 4096]["requests"] == 30  # (80 GB − 13.5 GB) ÷ 2.15 GB per 4k request
    assert rows["llama-2-7b", 32768]["requests"] == 0 and not rows["llama-2-7b", 32768]["within_context"]
    assert rows["llama-3.1-8b", 32768]["requests"] == 14  # 8 KV heads
    assert not rows["llama-3.1-70b", 4096]["weights_fit"]
    assert [r["requests"] for r in requests_that_fit(("llama-3.1-70b",), weights_dtype="int8")] == [7, 0]
    table = fit_table(list(rows.values()))
    assert "past window" in table and "weights > GPU" in table


def test_pool_example_and_bytes_on_a_mix(fresh_progress):
    from course.engine.config import ModelConfig
    from course.engine.paged import PagedKVCache
    from course.lessons.serving_runs import mix_memory, mix_requests, pool_example

    cfg = ModelConfig.from_name("smollm2-135m")
    cache = pool_example(cfg)
    shared = [c for c in cache.pool_picture() if c["ref_count"] > 1]
    assert {c["block"] for c in shared} >= set(cache.block_table("A")[:2])  # the system prompt, shared 3 ways
    assert cache.block_table("D'")[0] == cache.block_table("D")[0]
    assert cache.block_table("D'")[1] != cache.block_table("D")[1]  # copied on write
    mix = mix_requests(32, max_seq_len=1024, seed=3)
    b = mix_memory(cfg, mix, budget_bytes=64 << 20, block_size=16, max_seq_len=1024)
    assert b.used_bytes <= b.paged_bytes <= b.used_bytes + len(mix) * 16 * cache.bytes_per_token
    assert b.preallocated_bytes == len(mix) * 1024 * cache.bytes_per_token and b.paged_waste < 0.04
    assert b.preallocated_requests == (64 << 20) // (1024 * cache.bytes_per_token)
    assert b.paged_requests >= 2 * b.preallocated_requests
    # the paged count is what a real pool of that budget admits, request by request at full length
    pool = PagedKVCache.for_budget(cfg, 64 << 20, 16, device="meta")
    for r in mix[:b.paged_requests]:
        pool.add_sequence(r.id)
        pool.append([r.id], n_new=r.max_len)
    nxt = mix[b.paged_requests]
    assert pool.blocks_needed(nxt.id, nxt.max_len) > pool.allocator.num_free


def test_serving_runs_on_the_tiny_model(tiny, one_thread, fresh_progress):
    from course.lessons.serving_runs import (batching_report, batching_run, lesson_trace, paged_vs_contiguous,
                                             prefix_report)
    from course.measure import gates
    from course.measure.results import recorded

    exact = paged_vs_contiguous(tiny, list(range(3, 40)), n_decode=6, block_size=8)
    assert exact["max_logit_diff"] <= 1e-5 and exact["same_tokens"] and exact["blocks"] == 6
    trace = lesson_trace(256, n_requests=6, seed=1)
    run = gates.measured(lambda: batching_run(tiny, trace, max_batch=3, progress=False), lambda b: b.rules(0.0),
                         "the batching comparison")
    assert run.value.identical == {"static": True, "continuous": True}
    # the prediction: continuous batching's iterations of each kind at static batching's mean cost of that kind
    def kinds(r):
        prompt = [s.seconds for s in r.timeline if any(w == "prefill" for _, w in s.slots)]
        return prompt, [s.seconds for s in r.timeline if not any(w == "prefill" for _, w in s.slots)]
    (sp, sd), (cp, cd) = kinds(run.value.static), kinds(run.value.continuous)
    assert run.value.predicted_ratio == pytest.approx((sum(sp) + sum(sd)) / (len(cp) * sum(sp) / len(sp)
                                                                             + len(cd) * sum(sd) / len(sd)))
    report = batching_report(run)
    assert len(report.headline.split()) <= 30
    assert (recorded().get("continuous_over_static") == run.value.throughput_ratio) == run.ok  # tiny steps: noisy
    flagged = gates.measured(lambda: run.value, lambda b: b.rules(1e9), "the batching comparison", tries=1)
    assert batching_report(flagged).headline.startswith("Not used") and flagged.notice
    with pytest.raises(ValueError, match="long_share"):
        lesson_trace(256, long_share=1.5)
    assert prefix_report  # exercised on the real model by the lesson run


def test_the_compiled_engine_is_warm_before_the_timed_runs(one_thread):
    """The lesson's engine compiles its paged decode step in the untimed warm-up, not inside the first timeline;
    the serving runs on it give every request its solo tokens."""
    from course.engine.fast import FastModel
    from course.engine.model import tiny_model
    from course.lessons.serving_runs import batching_run, lesson_trace, warm_up

    fast = FastModel(tiny_model(seed=2), any_shape=True)
    trace = lesson_trace(256, n_requests=5, seed=3)
    warm_up(fast, trace, max_batch=3, progress=False)
    assert fast.compiled  # compiled in the untimed warm-up, not fallen back to eager
    run = batching_run(fast, trace, max_batch=3, progress=False)
    assert run.identical == {"static": True, "continuous": True}


def test_the_markdown_describes_the_trace_generator():
    import inspect

    from course.lessons.serving_runs import lesson_trace

    p = inspect.signature(lesson_trace).parameters
    text = " ".join(" ".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
                             if c.cell_type == "markdown").split())
    (s0, s1), (l0, l1) = p["short"].default, p["long"].default
    assert f"short ({s0}–{s1} tokens)" in text
    assert f"long ({l0}–{l1}) with probability {p['long_share'].default}" in text


def test_the_what_next_snippet_runs_as_pasted():
    """The fenced code in "What to do next" runs with only the lesson's own names (engine, model, trace, batching)."""
    import re
    from types import SimpleNamespace

    from course.engine.model import tiny_model
    from course.engine.serving import Request, solo_outputs
    from course.lessons.serving_runs import lesson_trace

    text = nbformat.read(NOTEBOOK, as_version=4).cells[-3].source
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = "\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines())
    model = tiny_model()
    real = lesson_trace(49152, n_requests=10)  # the lesson's lengths, token ids folded into the tiny vocab
    trace = [Request(r.id, tuple(t % 200 + 10 for t in r.prompt_ids), r.max_new_tokens) for r in real]
    batching = SimpleNamespace(value=SimpleNamespace(solo=solo_outputs(model, trace, progress=False)))
    ns = dict(engine=model, model=model, trace=trace, batching=batching)
    exec(code, ns)
    assert ns["res"].preemptions > 0 and ns["res"].outputs() == batching.value.solo


@pytest.mark.slow
def test_exercise_05_demo_with_the_reference_solution():
    """Exercise 05's real-model demo (skipped while grading) runs with the solution's code and agrees."""
    import re

    import course
    from course.grade.exercise_tools import paged_exercise_demo
    from course.paths import SOLUTIONS

    nb = nbformat.read(SOLUTIONS / "05_paged_cache" / "paged_cache.ipynb", as_version=4)
    ns: dict = {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and not meta.get("grade") and "paged_exercise_demo" not in cell.source:
            exec(re.sub(r"(?m)^\s*### (BEGIN|END) SOLUTION\s*$", "", cell.source), ns)
    model, tokenizer = course.load()
    out = paged_exercise_demo(model, tokenizer, ns["PagedKVCache"], ns["SequenceView"], ns["fork"], n_tokens=12)
    assert out["identical"] is True and out["all_free"] is True
    T = len(tokenizer.encode("The capital of France is"))
    assert out["blocks"] in {-(-(T + n) // 16) for n in (11, 12)}  # the last token may or may not be fed back
    assert out["shared_blocks"] in (out["blocks"] - 1, out["blocks"])  # full blocks shared, a partial one copied


# --------------------------------------------------------------------------------------------- slow

@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    from notebook_runner import lesson_run

    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=1200, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})


@pytest.mark.slow
def test_reads_cleanly_within_its_stated_time(executed):
    from learner_text import check_run_time, check_timed_lesson

    from course.measure import machine

    results, nb, elapsed = executed
    check_timed_lesson(nb, results, TIMED)
    assert results["recap"]["next"] == "99_course_end.ipynb"
    if "batch_step_ms_1" in results:  # a compiled per-token time is in the profile after the gate passed
        saved = json.loads(machine.path().read_text())[f"{results['profile']['device']}/{results['profile']['dtype']}"]
        assert saved["decode_ms"]["compiled"] > 0
    check_run_time(NOTEBOOK, elapsed, nb)


@pytest.mark.slow
def test_the_numbers_make_sense(executed):
    results = executed[0]
    for c, row in results.get("batch_sweep", {}).items():  # gated: present only when it passed
        assert row["batch"][0] == 1 and row["intensity"] == sorted(row["intensity"])
        assert row["speedup"] == pytest.approx(max(row["tokens_per_s"]) / row["tokens_per_s"][0])
        assert all(t / row["tokens_per_s"][0] <= 1.1 * b for b, t in zip(row["batch"], row["tokens_per_s"]))
        if row["knee"] is not None:
            i = next(i for i, ms in enumerate(row["ms"]) if ms >= 2 * row["ms"][0])
            assert row["batch"][i - 1] <= row["knee"] <= row["batch"][i]
    assert results["fit_llama7b_4k"] == 30 and 11_000 < results["crossover_tokens"] < 12_500
    fit = results["budget_fit"]
    assert fit["paged_requests"] >= 2 * max(1, fit["preallocated_requests"])
    assert results["paged_max_logit_diff"] <= 1e-5 and results["paged_same_tokens"] is True
    mix = results["mix_bytes"]
    assert mix["paged_over_used"] <= 1.05 and mix["paged_waste"] < 0.04 < 0.6 <= mix["preallocated_waste"]
    if "batching" in results:
        run = results["batching"]
        assert run["identical"] == {"static": True, "continuous": True}
        assert run["continuous"]["iterations"] < run["static"]["iterations"]
    if "prefix_sharing" in results:
        p = results["prefix_sharing"]
        assert p["identical"] and p["cached_tokens"][0] == 0 and p["peak_reserved_shared"] < p["peak_reserved_unshared"]


@pytest.mark.slow
def test_on_a_busy_machine_no_flagged_figure_reaches_the_recap_or_the_quiz(tmp_path, cpu_burner):
    """Both cores kept busy by other programs, quick sizes: the lesson says so once, and whatever its gates flag is
    neither recorded, nor in the recap, nor saved for the quiz and the review cards."""
    from learner_text import check_timed_lesson, executed as executed_copy
    from notebook_runner import execute_notebook

    from course.teach.progress import ProgressStore

    progress = tmp_path / "progress.sqlite"
    results = execute_notebook(NOTEBOOK, tmp_path, timeout=1800, env={
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "KVCOURSE_PROGRESS": str(progress), "KVCOURSE_FULL": "0"})
    nb = executed_copy(tmp_path, NOTEBOOK.stem)
    shown, unreliable = check_timed_lesson(nb, results, TIMED, profile_file=tmp_path / "machine.json")
    assert shown.count("this machine is busy") == 1  # said once, before the timing sections
    assert not unreliable & set(ProgressStore(progress).measurements("05_serving"))
    print(f"busy run: unreliable {sorted(unreliable)}; recap {results['recap']['numbers']}")
