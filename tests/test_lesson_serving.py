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
        # the knee is the first measured B > 1 whose step took twice the baseline, the faster of B = 1 and B = 2
        knee, base = row["knee"], min(row["ms"][:2])
        assert row["knee_baseline_ms"] == pytest.approx(base)
        i = row["batch"].index(knee)
        assert row["knee_found"] == any(ms >= 2 * base for ms in row["ms"][1:])
        assert row["ms"][i] >= 2 * base if row["knee_found"] else knee == row["batch"][-1]
        assert all(ms < 2 * base for ms in row["ms"][1:i])
        assert row["knee_ratio"] == pytest.approx(row["ms"][i] / base)
    first = sweep[min(sweep, key=int)]
    assert results["batch_speedup"] == first["speedup"] and results["batch_knee"] == first["knee"]


@pytest.mark.slow
def test_prose_follows_the_values(executed):
    results, nb, _ = executed
    out = _shown(nb)
    first = results["batch_sweep"][min(results["batch_sweep"], key=int)]
    assert f"{first['speedup']:.1f}× B = 1" in out
    c0 = min(results["batch_sweep"], key=int)
    start = out.index(f"C = {int(c0):,}: baseline ")  # its knee sentences, up to its pred/meas sentence
    knee_line = out[start:out.index("predicted ÷ measured", start)]
    assert ("; the knee, the first B at ≥ 2× it, came at B = " in knee_line) == first["knee_found"]
    if first["knee_found"]:
        from course.lessons.serving import ratio_text
        assert f"came at B = {first['knee']} ({ratio_text(first['knee_ratio'])})" in knee_line
        if first["predicted_knee_found"]:  # the two knees joined by the step that put them apart
            word = ("where predicted" if first["knee"] == first["predicted_knee"] else
                    "later because" if first["knee"] > first["predicted_knee"] else "earlier because")
            assert f"the measured knee came {word}" in knee_line
    assert ("the largest measured, cost 2× it" in knee_line) == (not first["knee_found"])
    assert "(this machine's knee) (" not in out
    run = results["batching"]
    assert f"{run['throughput_ratio']:.2f}× the throughput" in out
    assert "because its slots were busy" not in out  # the cause is the time split, printed from the run
    assert f"so it ran {run['continuous']['iterations']} iterations against {run['static']['iterations']}" in out
    assert "gain nothing from busier slots" not in out  # prompt-carrying iterations decode the running requests too
    share = run["continuous"]["prefill_s"] / (run["continuous"]["prefill_s"] + run["continuous"]["decode_s"])
    assert f"({share:.0%} of its iterations' time against" in out
    trace = [n for _, n in run["trace"]]
    n_long = sum(24 <= n <= 32 for n in trace)
    assert (f"{n_long} answers are long" if n_long > 1 else "1 answer is long" if n_long else "None of the") in out
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

def _served(occupancy: float, prefill_s: list[float], decode_s: list[float], throughput: float):
    """A stand-in ServeResult: its timeline has one prompt-carrying iteration per prefill_s, one decode-only
    iteration per decode_s (2 slots each)."""
    from types import SimpleNamespace

    steps = ([SimpleNamespace(seconds=t, slots=[(0, "prefill"), (1, "decode")]) for t in prefill_s]
             + [SimpleNamespace(seconds=t, slots=[(0, "decode"), (1, "idle")]) for t in decode_s])
    return SimpleNamespace(throughput=throughput, slot_occupancy=occupancy, ttft_p50=1.0, latency_p95=2.0,
                           timeline=steps)


def _batching(static, continuous):
    from types import SimpleNamespace

    return SimpleNamespace(static=static, continuous=continuous,
                           throughput_ratio=continuous.throughput / static.throughput,
                           identical={"static": True, "continuous": True}, differing=lambda: [])


def test_time_split_counts_prompt_carrying_iterations():
    from course.lessons.serving_runs import time_split

    split = time_split(_served(0.5, [0.3, 0.2], [0.1, 0.1, 0.3], 10.0))
    assert (split.prefill_iterations, split.decode_iterations) == (2, 3)
    assert split.prefill_s == pytest.approx(0.5) and split.decode_s == pytest.approx(0.5)
    assert split.prefill_share == pytest.approx(0.5)


def _steps(occupancy: float, throughput: float, prefill: list[tuple[float, int]], decode: list[tuple[float, int]]):
    """A stand-in ServeResult with 4 slots: per prompt-carrying iteration (seconds, running requests it also
    decoded), one prompt each; per decode-only iteration (seconds, sequences decoded)."""
    from types import SimpleNamespace

    def slots(kinds):
        return [(i, k) for i, k in enumerate(kinds)] + [(None, "idle")] * (4 - len(kinds))

    steps = ([SimpleNamespace(seconds=t, slots=slots(["prefill"] + ["decode"] * n)) for t, n in prefill]
             + [SimpleNamespace(seconds=t, slots=slots(["decode"] * n)) for t, n in decode])
    return SimpleNamespace(throughput=throughput, slot_occupancy=occupancy, ttft_p50=1.0, latency_p95=2.0,
                           timeline=steps)


def test_time_split_counts_the_tokens_each_kind_of_iteration_emitted():
    from course.lessons.serving_runs import time_split

    split = time_split(_steps(0.5, 1.0, [(0.3, 2), (0.2, 0)], [(0.1, 3), (0.1, 1)]))
    assert (split.decode_tokens, split.carried_decode_tokens, split.prompts) == (4, 2, 2)
    assert split.iterations == 4 and split.mean_s == pytest.approx(0.175)
    assert split.decode_rate == pytest.approx(4 / 0.2)


def test_the_gain_sentence_claims_only_what_the_iteration_arithmetic_shows():
    from course.lessons.serving_runs import batching_sentences, gain_sentence

    static = _steps(0.37, 10.0, [(0.1, 0)] * 4, [(0.1, 1)] * 20)  # 24 iterations of 100 ms: 2.4 s
    # half the iterations (2.0× fewer); its prompt-carrying ones cost 350 ms each (they decode 3 running requests)
    run = _batching(static, _steps(0.73, 14.1, [(0.35, 3)] * 2, [(0.1, 2)] * 10))
    text = gain_sentence(run)
    assert "busy in 73% of slot-iterations against 37%" in text and "12 iterations against 24" in text
    assert "20 decode tokens per second against 10" in text and "6 tokens against 0" in text
    assert "2.00× fewer iterations at 1.42× the cost each" in text and "1.70 s in all against 2.40 s" in text
    assert "the largest part, 42 ms, is costlier prompt-carrying iterations (350 ms each against 100 ms)" in text
    assert "gain nothing" not in text and "that is why" not in text and "No gain" not in text
    lines = batching_sentences(run)
    assert "1.41× the throughput" in lines[0] and "because" not in lines[0] and lines[1] == text
    # the rise per iteration from a larger share of prompt-carrying iterations instead
    slow_prompts = _steps(0.37, 10.0, [(0.2, 0)] * 4, [(0.1, 1)] * 20)
    mix = gain_sentence(_batching(slow_prompts, _steps(0.73, 12.0, [(0.2, 1)] * 6, [(0.1, 2)] * 6)))
    assert "the largest part, 33 ms, is more iterations carrying a prompt (50% of them against 17%)" in mix
    # a part larger than the whole rise is named as such, never as a part of it
    few_prompts = _steps(0.37, 10.0, [(0.4, 0)], [(0.1, 1)] * 20)
    over = gain_sentence(_batching(few_prompts, _steps(0.73, 12.0, [(0.3, 2)] * 4, [(0.1, 2)] * 8)))
    assert ("more iterations carrying a prompt (33% of them against 5%) added 86 ms per iteration, more than the "
            "whole 52 ms rise: the other parts took 33 ms back") in over and "the largest part" not in over
    # ... or from wider decode-only steps
    wide = gain_sentence(_batching(static, _steps(0.73, 12.0, [(0.1, 3)] * 2, [(0.15, 3)] * 8)))
    assert "is wider decode-only steps (150 ms each against 100 ms)" in wide
    # fewer iterations at no higher cost: no part of a rise named
    flat = gain_sentence(_batching(static, _steps(0.73, 20.0, [(0.1, 3)] * 2, [(0.1, 3)] * 8)))
    assert "2.40× fewer iterations, at no higher cost each" in flat and "largest part" not in flat
    # as many iterations, each cheaper: the gain is the cheaper iterations
    cheap = gain_sentence(_batching(static, _steps(0.5, 20.0, [(0.05, 0)] * 4, [(0.05, 1)] * 20)))
    assert "came from cheaper iterations (0.50× the cost each), not fewer" in cheap
    # neither fewer nor cheaper, yet faster: no cause claimed
    odd = gain_sentence(_batching(static, _steps(0.5, 12.0, [(0.1, 0)] * 4, [(0.1, 1)] * 20)))
    assert "Neither fewer nor cheaper" in odd and "run the cell again" in odd
    # no gain: fewer iterations, but each cost as much more
    ate = gain_sentence(_batching(static, _steps(0.73, 9.5, [(0.5, 3)] * 4, [(0.2, 2)] * 8)))
    assert ate.count("No gain in this run") == 1 and "3.00× the cost each" in ate and "The gain is" not in ate
    # no gain, no fewer iterations either: no cause claimed
    same = gain_sentence(_batching(static, _steps(0.73, 9.5, [(0.1, 0)] * 4, [(0.1, 1)] * 20)))
    assert "it ran no fewer iterations" in same and "run the cell again" in same
    # no gain although the iterations took less: the time between them ate it
    gap = gain_sentence(_batching(static, _steps(0.73, 9.5, [(0.1, 3)] * 2, [(0.1, 3)] * 8)))
    assert "No gain in this run, although its iterations took 1.00 s in all against 2.40 s" in gap
    # no timeline recorded: no cause claimed
    untimed = gain_sentence(_batching(_steps(0.37, 10.0, [], []), _steps(0.73, 12.0, [], [])))
    assert "cannot say where the time went" in untimed and "The gain" not in untimed and "No gain" not in untimed
    # within 1 % of static counts as no gain
    assert "No gain in this run" in gain_sentence(_batching(static, _steps(0.73, 10.05, [(0.35, 3)] * 2,
                                                                            [(0.1, 2)] * 10)))


def test_trace_sentence_counts_the_long_answers_of_the_trace():
    from types import SimpleNamespace

    from course.lessons.serving_runs import lesson_trace, trace_sentence

    def trace(answers):
        return [SimpleNamespace(max_new_tokens=n) for n in answers]

    assert "2 answers are long (24–32 tokens) and 8 short (2–6), of 10" in trace_sentence(
        trace([5, 32, 4, 4, 3, 4, 25, 4, 6, 6]))
    assert trace_sentence(trace([3, 30, 4])).startswith("1 answer is long")
    assert trace_sentence(trace([3, 4])).startswith("None of the 2 answers is long")
    real = lesson_trace(256, n_requests=12, seed=4)
    n_long = sum(r.max_new_tokens >= 24 for r in real)
    assert f"{n_long} answers are long" in trace_sentence(real) or n_long < 2


def test_the_markdown_describes_the_trace_generator():
    """Cell 26 states lesson_trace's ranges and long-answer probability: they must be its defaults."""
    import inspect

    from course.lessons.serving_runs import lesson_trace

    p = inspect.signature(lesson_trace).parameters
    text = " ".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown")
    (s0, s1), (l0, l1) = p["short"].default, p["long"].default
    assert f"short ({s0}–{s1} tokens" in text and f"long ({l0}–{l1})" in text
    assert f"long with probability {p['long_share'].default}" in text
    assert "about a third" not in text


def test_the_what_next_snippet_runs_as_pasted():
    """The fenced code in "What to do next" runs with only the lesson's own names (engine, model, trace, run)."""
    import re
    from types import SimpleNamespace

    from course.engine.model import tiny_model
    from course.engine.serving import Request, solo_outputs
    from course.lessons.serving_runs import lesson_trace

    text = nbformat.read(NOTEBOOK, as_version=4).cells[-3].source
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = "\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines())
    model = tiny_model()
    real = lesson_trace(49152, n_requests=10, seed=0)  # the lesson's lengths, token ids folded into the tiny vocab
    trace = [Request(r.id, tuple(t % 200 + 10 for t in r.prompt_ids), r.max_new_tokens) for r in real]
    run = SimpleNamespace(solo=solo_outputs(model, trace, progress=False))
    ns = dict(engine=model, model=model, trace=trace, run=run)
    exec(code, ns)
    assert ns["res"].preemptions > 0 and ns["res"].outputs() == run.solo


def test_knee_uses_the_faster_of_b1_and_b2_as_its_baseline():
    from course.lessons.serving import find_knee, ratio_text

    batches = [1, 2, 4, 8, 16, 32, 64]
    clean = find_knee(batches, [33.5, 35.4, 38.6, 40.8, 66.9, 133.3, 260.0])
    assert clean.batch == 32 and clean.baseline_s == 33.5 and clean.below[0] == 16
    assert ratio_text(clean.below[1]) == "1.99×"  # 66.9 / 33.5 = 1.997: just short, and it must read so
    # a noisy, slow B = 1 (42.7 against B = 2's 34.8) would put the knee at 16 only if B = 16 doubles B = 2
    noisy = find_knee(batches, [42.7, 34.8, 42.7, 53.2, 105.0, 183.8, 373.5])
    assert noisy.baseline_s == 34.8 and noisy.batch == 16 and noisy.ratio == pytest.approx(105.0 / 34.8)
    # with B = 1 as the baseline, 80 ms would not double 42.7; against B = 2's 34.8 it does
    assert find_knee(batches, [42.7, 34.8, 40.0, 45.0, 80.0, 170.0, 340.0]).batch == 16
    # a B = 1 twice as slow as B = 2 is noise, never the knee
    assert find_knee([1, 2, 4], [90.0, 40.0, 50.0]).batch is None
    flat = find_knee([1, 2, 4, 8], [10.0, 10.5, 12.0, 19.0])
    assert not flat.found and flat.last_batch == 8 and flat.ratio == pytest.approx(1.9)
    with pytest.raises(ValueError, match="B = 1"):
        find_knee([2, 4], [1.0, 2.0])


def test_predicted_knee_and_critical_batch_agree_on_paper():
    from course.engine.config import ModelConfig
    from course.lessons.serving import (batch_cost, critical_batch_sentence, predicted_critical_batch,
                                        predicted_doubling_batch, predicted_step)
    from course.measure.roofline import Machine

    config, m = ModelConfig.from_name("smollm2-135m"), Machine("cpu", "float32", 20e9, 54e9)
    for C in (64, 512):
        b_star, knee = predicted_critical_batch(m, config, C, 4), predicted_doubling_batch(m, config, C, 4)
        assert 1 < b_star < knee <= 2 * b_star  # memory-bound at B = 1: the knee lies at or below 2·B*
        one = predicted_step(m, batch_cost(config, 1, C, 4))
        at = predicted_step(m, batch_cost(config, math.ceil(knee), C, 4))
        below = predicted_step(m, batch_cost(config, math.floor(knee), C, 4))
        assert at >= 2 * one > below
        text = critical_batch_sentence(m, config, C, 4)
        assert f"B* ≈ {b_star:.1f}" in text and f"(the knee) at B ≈ {knee:.1f}" in text
        # each context prints its own FLOPs
        assert f"F = {batch_cost(config, 1, C, 4).flops / 1e9:.3f} GFLOP" in text
    from course.lessons.serving import GPUS

    assert "no critical batch" in critical_batch_sentence(GPUS["A100"].machine(), ModelConfig.from_name("llama-2-7b"),
                                                          4096, 2)


def test_knee_sentence_reports_measured_and_predicted_by_one_rule():
    sweep = _two_context_sweep({1: [42.7], 2: [34.8], 4: [42.7], 8: [53.2], 16: [105.0]},
                               {1: [50.0], 2: [51.0], 4: [55.0], 8: [60.0], 16: [70.0]})
    for p, pred in zip(sweep.at(64), (21.0, 21.5, 22.0, 32.0, 64.0)):
        p.predicted_s = pred / 1e3
    text = sweep.knee_sentence(64)
    assert "C = 64: baseline 35 ms (the faster of B = 1 and B = 2); the knee, the first B at ≥ 2× it" in text
    assert "came at B = 16 (3.01×); B = 8 had reached 1.52×" in text
    assert "The prediction, by the same rule: B = 16" in text and "critical batch B* ≈" in text
    assert ") (" not in text
    none = sweep.knee_sentence(512)
    assert "no B up to 16, the largest measured, cost 2× it" in none and "the knee lies beyond it" in none
    assert "puts it beyond B = 16 too" in none  # predicted 1 ms at every B in the stand-in sweep


def test_recap_names_the_knee_once_per_context():
    from types import SimpleNamespace

    from course.lessons.serving_runs import recap_bullets

    values = {"64": dict(best_batch=64, speedup=8.3, knee=32, knee_found=True, batch=[1, 64]),
              "512": dict(best_batch=32, speedup=7.4, knee=64, knee_found=False, batch=[1, 64])}
    served = SimpleNamespace(latency_p95=1.0)
    run = SimpleNamespace(continuous=served, static=served, throughput_ratio=1.1, identical={"s": True})
    prefix = SimpleNamespace(ttft_saved=0.5, shared=SimpleNamespace(peak_bytes_shared=0))
    fit = SimpleNamespace(budget_bytes=1 << 28, paged_requests=7, preallocated_requests=2, max_seq_len=2048)
    mix = SimpleNamespace(paged_bytes=101, used_bytes=100, paged_waste=0.01, preallocated_bytes=300,
                          preallocated_waste=0.66)
    first = recap_bullets(values, fit, mix, run, prefix)[0]
    assert "at C = 64, B = 64 gave 8.3× the total tokens/s of B = 1 and the knee" in first
    assert "came at B = 32; at C = 512, B = 32 gave 7.4×" in first
    assert "no step reached the knee up to B = 64." in first and first.count("one-sequence baseline") == 1
    assert "), C = 512" not in first


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
    assert len(text) == 7 and "predicted ÷ measured (pred/meas above) ran from" in text[2]
    assert text[1].startswith("C = 8: baseline ")
    assert ("; the knee, the first B at ≥ 2× it" in text[1]) != ("the largest measured, cost 2× it" in text[1])
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
    assert len(batching_sentences(run)) == 4
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
