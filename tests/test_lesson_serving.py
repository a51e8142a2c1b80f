"""Lesson 05 runs end to end (lesson_run), the numbers it records tell the story it prints, and its helpers behave."""
from __future__ import annotations

import math

import nbformat
import pytest

from course.paths import LESSONS

NOTEBOOK = LESSONS / "05_serving.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    from notebook_runner import lesson_run

    # One torch thread: on a shared, busy 2-core machine threads waiting on a descheduled partner distort
    # every step. The test checks behaviour, and the run time against the lesson's stated bound.
    return lesson_run(NOTEBOOK, tmp_path_factory, timeout=1200, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def results(executed):
    return executed[0]


@pytest.mark.slow
def test_runs_within_its_stated_time_with_a_recap(executed):
    from learner_text import assert_learner_output_clean, check_run_time

    results, nb, elapsed = executed
    assert_learner_output_clean(nb, results, "05_serving")
    assert results["recap"]["next"] == "99_course_end.ipynb"
    assert any("05_paged_cache" in e for e in results["recap"]["exercises"])
    bullets = " ".join(results["recap"]["bullets"])
    first = results["batch_sweep"][min(results["batch_sweep"], key=int)]
    assert f"{first['speedup']:.1f}× the total tokens/s" in bullets
    assert f"{results['continuous_over_static']:.2f}× static batching's throughput" in bullets
    check_run_time(NOTEBOOK, elapsed, nb)


def _shown(nb) -> str:
    """Everything the run showed (printed text and rendered recaps), whitespace collapsed."""
    from learner_text import flat, notebook_text

    return flat(notebook_text(nb))


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    last = nb.cells[-2].source + nb.cells[-1].source
    assert 'checkpoint("05_serving")' in last and 'self_assessment("05_serving")' in last
    text = "\n".join(c.source for c in nb.cells)
    assert "](../exercises/05_paged_cache/paged_cache.ipynb)" in text and "](99_course_end.ipynb)" in text
    assert "under 4 minutes" in nb.cells[0].source


def _two_context_sweep(ms_64: dict, ms_512: dict):
    """A sweep from timed rounds: {batch: [ms, ms, ...]} at C = 64 and C = 512."""
    from course.engine.config import ModelConfig
    from course.lessons.serving import BatchSweep, SweepPoint, batch_cost
    from course.measure.roofline import Machine
    from course.measure.timing import Timing

    config = ModelConfig.from_name("smollm2-135m")
    sweep = BatchSweep(Machine("cpu", "float32", 10e9, 50e9))
    for c, rounds in ((64, ms_64), (512, ms_512)):
        for b, ms in rounds.items():
            sweep.points.append(SweepPoint(b, c, Timing([m / 1e3 for m in ms]), 1e-3, batch_cost(config, b, c, 4)))
    return sweep


def test_context_sentence_states_the_cause_only_when_the_data_supports_it():
    from course.lessons.serving import context_sentence

    # the reported run: B = 1 faster at C = 512 (37.4 ms) than at C = 64 (52.5 ms), so 4.7x against 9.1x
    noisy = context_sentence(_two_context_sweep({1: [52.5, 50.0, 55.0], 64: [369.0, 370.0, 371.0]},
                                                {1: [37.4, 36.0, 39.0], 64: [509.0, 510.0, 511.0]}))
    assert "too noisy to compare" in noisy and "cache is read" not in noisy
    # B = 1 slower at the long context, but its rounds spread so wide the two ratios overlap
    overlap = context_sentence(_two_context_sweep({1: [20.0, 25.0, 60.0], 64: [300.0, 300.0, 300.0]},
                                                  {1: [24.0, 26.0, 70.0], 64: [400.0, 400.0, 400.0]}))
    assert "too noisy to tell the two apart" in overlap and "cache is read" not in overlap
    clear = context_sentence(_two_context_sweep({1: [25.0, 25.1, 24.9], 64: [140.0, 141.0, 142.0]},
                                                {1: [25.5, 25.4, 25.6], 64: [284.0, 283.0, 285.0]}))
    assert clear.startswith("The longer context paid less for batching") and "cache is read" in clear


@pytest.mark.slow
def test_context_sentence_matches_the_recorded_sweep(results):
    """The printed cause is there only when B = 1 was no faster at the longer context and the speedups stayed
    apart across the timed rounds."""
    sweep, text = results["batch_sweep"], results["batch_context_sentence"]
    short, long_ = sweep[min(sweep, key=int)], sweep[max(sweep, key=int)]

    def span(row):
        best = row["batch"].index(row["best_batch"])
        one, top = row["round_ms"][0], row["round_ms"][best]
        return row["best_batch"] * min(one) / max(top), row["best_batch"] * max(one) / min(top)

    (lo_a, hi_a), (lo_b, hi_b) = span(short), span(long_)
    if long_["ms"][0] < short["ms"][0]:
        assert "too noisy to compare" in text and "cache is read" not in text, text
    elif "cache is read" in text:
        assert long_["speedup"] < short["speedup"] and hi_b < lo_a, text
    else:
        assert "too noisy" in text or "gained more" in text, text
    assert f"{long_['speedup']:.1f}×" in text and f"{short['speedup']:.1f}×" in text


@pytest.mark.slow
def test_batch_sweep(results):
    sweep = results["batch_sweep"]
    assert len(sweep) >= 2  # two contexts
    for c, row in sweep.items():
        assert row["batch"][0] == 1 and len(row["batch"]) >= 5
        assert all(ms > 0 and math.isfinite(ms) for ms in row["ms"])
        # the intensity of a step grows with B: decode moves right on the roofline
        assert row["intensity"] == sorted(row["intensity"]) and row["intensity"][-1] > 5 * row["intensity"][0]
        # batching pays: the best batch makes several times the tokens/s of one sequence
        assert row["speedup"] > 3, row
        assert row["speedup"] == pytest.approx(max(row["tokens_per_s"]) / row["tokens_per_s"][0])
        # the knee is the first measured batch whose step took twice B = 1's; knee_found says whether one did
        knee = row["knee"]
        i = row["batch"].index(knee)
        assert row["knee_found"] == any(ms >= 2 * row["ms"][0] for ms in row["ms"])
        assert row["ms"][i] >= 2 * row["ms"][0] if row["knee_found"] else knee == row["batch"][-1]
        assert all(ms < 2 * row["ms"][0] for ms in row["ms"][:i])
    first = sweep[min(sweep, key=int)]
    assert results["batch_speedup"] == first["speedup"] and results["batch_knee"] == first["knee"]


@pytest.mark.slow
def test_prose_follows_the_values(executed):
    results, nb, _ = executed
    out = _shown(nb)
    first = results["batch_sweep"][min(results["batch_sweep"], key=int)]
    assert f"{first['speedup']:.1f}× B = 1" in out
    assert (f"B = {first['knee']} (this machine's knee)" in out) == first["knee_found"]
    assert (f"No step cost twice B = 1's up to B = {first['batch'][-1]}" in out) == (not first["knee_found"])
    run = results["batching"]
    assert f"{run['throughput_ratio']:.2f}× the throughput" in out
    verdict = "no worse" if run["continuous"]["latency_p95"] <= run["static"]["latency_p95"] else "worse"
    assert f"({verdict} for the slowest requests)" in out
    mix = results["mix_bytes"]
    assert f"Preallocation wasted {mix['preallocated_waste']:.0%}" in out
    assert f"Paging wasted {mix['paged_waste']:.1%}" in out
    assert f"{results['prefix_sharing']['ttft_saved']:.0%} saved" in out


@pytest.mark.slow
def test_the_cache_is_the_limit(results):
    assert results["fit_llama7b_4k"] == 30  # (80 GB − 13.5 GB) ÷ 2.15 GB per 4k request
    fit = results["budget_fit"]
    assert fit["preallocated_requests"] == fit["formula_preallocated"]
    assert fit["paged_requests"] >= 2 * max(1, fit["preallocated_requests"])
    assert 11_000 < results["crossover_tokens"] < 12_500  # 538 MB of float32 weights ÷ 45 KiB per token


@pytest.mark.slow
def test_paged_cache_is_exact_and_frugal(results):
    assert results["paged_max_logit_diff"] <= 1e-5 and results["paged_same_tokens"] is True
    mix = results["mix_bytes"]
    assert mix["paged_over_used"] <= 1.05  # the target: paged reserves at most 5 % more than it uses
    assert mix["preallocated_over_used"] >= 2
    assert mix["paged_waste"] < 0.04 < 0.6 <= mix["preallocated_waste"]


@pytest.mark.slow
def test_continuous_batching(results):
    run = results["batching"]
    assert run["identical"] == {"static": True, "continuous": True}  # every output equals its solo run
    s, c = run["static"], run["continuous"]
    assert c["iterations"] < s["iterations"] and c["occupancy"] > s["occupancy"]
    assert run["throughput_ratio"] == pytest.approx(c["throughput"] / s["throughput"])
    # the speed itself is the bench's business (`kvcourse bench --only serving`, target 1.5×): a timed threshold
    # here failed once on a busy shared machine (1.15×); the lesson's sentence follows whatever was measured
    assert c["ttft_p50"] < s["ttft_p50"]
    assert results["continuous_p95_s"] == c["latency_p95"] and results["static_p95_s"] == s["latency_p95"]


@pytest.mark.slow
def test_prefix_sharing(results):
    p = results["prefix_sharing"]
    assert p["identical"] is True
    cached = p["cached_tokens"]
    assert cached[0] == 0 and all(n == (p["prefix_tokens"] // p["block_size"]) * p["block_size"] for n in cached[1:])
    assert p["peak_bytes_shared"] > 0 and p["peak_reserved_shared"] < p["peak_reserved_unshared"]
    assert p["ttft_saved"] > 0.2


# ---------------------------------------------------------------------------------------------- helpers, fast

@pytest.mark.parametrize("ratio", [1.6, 0.9])
def test_the_throughput_sentence_claims_a_gain_only_when_one_was_measured(ratio):
    from types import SimpleNamespace

    from course.lessons.serving_runs import batching_sentences

    def result(throughput):
        return SimpleNamespace(throughput=throughput, slot_occupancy=0.5, ttft_p50=1.0, latency_p95=2.0)

    run = SimpleNamespace(static=result(10.0), continuous=result(10.0 * ratio), throughput_ratio=ratio,
                          identical={"static": True, "continuous": True}, differing=lambda: [])
    run.continuous.slot_occupancy = 0.9
    first = batching_sentences(run)[0]
    assert f"{ratio:.2f}× the throughput" in first and "busy 90% of the time against 50%" in first
    assert ("because" in first) == (ratio > 1) and ("no gain in this run" in first) == (ratio <= 1)


def test_published_gpu_numbers():
    from course.lessons.serving import GPUS, paper_summary

    assert 150 <= GPUS["A100"].ridge <= 160 and 290 <= GPUS["H100"].ridge <= 300
    text = " ".join(paper_summary("llama-2-7b", context=4096))
    assert "near B ≈ 153" in text and "near B ≈ 295" in text and "never" in text
    # with grouped-query attention (8 KV heads) and a short context the batch does turn compute-bound
    assert "never" not in " ".join(paper_summary("mistral-7b", context=128))


def test_requests_that_fit():
    from course.lessons.serving import fit_sentences, requests_that_fit

    rows = {(r["model"], r["context"]): r for r in requests_that_fit()}
    assert rows["llama-2-7b", 4096]["requests"] == 30
    # past Llama-2's 4,096-token window: not served, not counted, and said so
    assert rows["llama-2-7b", 32768]["requests"] == 0 and not rows["llama-2-7b", 32768]["within_context"]
    assert rows["llama-3.1-8b", 32768]["requests"] == 14  # (80 − 16.06 GB) ÷ 4.29 GB, 8 KV heads
    assert rows["llama-3.1-70b", 4096]["requests"] == 0 and not rows["llama-3.1-70b", 4096]["weights_fit"]
    text = fit_sentences(list(rows.values()))
    assert sum("llama-3.1-70b" in s for s in text) == 1  # said once, not once per context
    assert "llama-2-7b at C = 32,768: beyond its 4,096-token context window" in " ".join(text)
    assert not any("32,768" in s and "fit" in s for s in text if s.startswith("llama-2-7b"))
    int8 = requests_that_fit(("llama-3.1-70b",), weights_dtype="int8")
    assert [r["requests"] for r in int8] == [7, 0]
    assert "so no request fits beside" in fit_sentences(int8)[1]

def test_batch_sweep_on_the_tiny_model():
    from course.engine.model import tiny_model
    from course.lessons.serving import batch_sweep, sweep_sentences
    from course.measure.roofline import Machine

    model = tiny_model()
    machine = Machine("cpu", "float32", 10e9, 50e9)
    sweep = batch_sweep(model, machine, contexts=(8, 32), batches=(1, 2, 4), rounds=2, progress=False)
    assert sweep.contexts == [8, 32] and [p.batch for p in sweep.at(8)] == [1, 2, 4]
    assert all(p.predicted_s > 0 and p.seconds > 0 for p in sweep.points)
    text = sweep_sentences(sweep)
    assert len(text) == 5 and "predicted ÷ measured (pred/meas above) ran from" in text[1]
    assert text[-1].startswith(("The longer context", "Batching gained"))
    with pytest.raises(ValueError, match="starting at 1"):
        batch_sweep(model, machine, batches=(2, 4))
    with pytest.raises(ValueError, match="max_cache_bytes"):
        batch_sweep(model, machine, contexts=(64,), batches=(1, 4096), max_cache_bytes=1 << 20)


def test_pool_example_and_bytes_on_a_mix():
    from course.engine.config import ModelConfig
    from course.lessons.serving_runs import fit_in_budget, mix_requests, pool_example, reserved_on_mix

    cfg = ModelConfig.from_name("smollm2-135m")
    cache = pool_example(cfg)
    shared = [c for c in cache.pool_picture() if c["ref_count"] > 1]
    assert {c["block"] for c in shared} >= set(cache.block_table("A")[:2])  # the system prompt, shared 3 ways
    assert cache.block_table("D'")[0] == cache.block_table("D")[0]
    assert cache.block_table("D'")[1] != cache.block_table("D")[1]  # copied on write
    mix = mix_requests(32, max_seq_len=1024, seed=3)
    b = reserved_on_mix(cfg, mix, block_size=16, max_seq_len=1024)
    assert b.used_bytes <= b.paged_bytes <= b.used_bytes + len(mix) * 16 * cache.bytes_per_token // 1
    assert b.preallocated_bytes == len(mix) * 1024 * cache.bytes_per_token
    fit = fit_in_budget(cfg, mix, budget_bytes=64 << 20, max_seq_len=1024)
    assert fit.preallocated_requests == (64 << 20) // (1024 * cache.bytes_per_token)


def test_serving_helpers_on_the_tiny_model():
    from course.engine.model import tiny_model
    from course.lessons.serving_runs import batching_run, batching_sentences, lesson_trace, paged_vs_contiguous

    model = tiny_model()
    exact = paged_vs_contiguous(model, list(range(3, 40)), n_decode=6, block_size=8)
    assert exact["max_logit_diff"] <= 1e-5 and exact["same_tokens"] and exact["blocks"] == 6
    trace = lesson_trace(256, n_requests=6, seed=1)
    assert len({r.max_new_tokens for r in trace}) > 1
    run = batching_run(model, trace, max_batch=3, progress=False)
    assert run.identical == {"static": True, "continuous": True}
    assert len(batching_sentences(run)) == 3
    with pytest.raises(ValueError, match="long_share"):
        lesson_trace(256, long_share=1.5)


def test_the_compiled_engine_is_warm_before_the_timed_runs(one_thread):
    """The lesson's engine compiles its paged decode step in the untimed warm-up, not inside the first timeline;
    the serving runs on it give every request its solo tokens."""
    from course.engine.fast import FastModel
    from course.engine.model import tiny_model
    from course.lessons.serving_runs import batching_run, lesson_trace, warm_up

    fast = FastModel(tiny_model(seed=2), any_shape=True)
    trace = lesson_trace(256, n_requests=5, seed=3)
    warm_up(fast, trace, max_batch=3, progress=False)
    warm = {key[0][0] for key in fast.step._warm}
    assert "paged" in warm and fast.compiled
    run = batching_run(fast, trace, max_batch=3, progress=False)
    assert run.identical == {"static": True, "continuous": True}
    assert {key[0][0] for key in fast.step._warm} >= {"paged", "views"}  # solo runs: whole-cache views


@pytest.mark.slow
def test_exercise_05_demo_with_the_reference_solution():
    """Exercise 05's real-model demo (skipped while grading) runs with the solution's code and agrees."""
    import re

    import course
    from course.lessons.serving import paged_exercise_demo
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
