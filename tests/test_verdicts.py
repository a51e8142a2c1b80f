"""Verdicts the lessons print are computed from the numbers: raised roofs, the held-out fit, bf16 advice,
the A/B answer under a failed fit, the published datacenter example, the paper speculative example."""
import pytest

from course.measure import latency, profile, roofline
from course.measure.published import datacenter_example


def _cmp(prefill_flops_s, decode_bytes, decode_s):
    return roofline.Comparison([
        dict(phase="prefill", tokens=256, bytes=5e8, measured_s=0.1, achieved_flops_per_s=prefill_flops_s),
        dict(phase="decode", tokens=16, bytes=decode_bytes, measured_s=decode_s, achieved_flops_per_s=1e9)])


def test_best_roofs_raise_only_what_a_point_beat():
    probe = roofline.Machine("cpu", "float32", 10e9, 50e9)
    raised = roofline.best_roofs(probe, _cmp(80e9, 5e8, 0.1))  # prefill beat the matmul probe, decode did not
    assert raised.flops_per_s == 80e9 and raised.flops_source == "prefill at T=256"
    assert raised.bytes_per_s == 10e9 and raised.bandwidth_source == "probe"
    assert "matmul roof raised to 80.0 GFLOP/s" in str(raised) and "memory roof: the probe's 10.0" in str(raised)
    same = roofline.best_roofs(probe, _cmp(20e9, 5e8, 0.1))
    assert (same.flops_per_s, same.bytes_per_s) == (50e9, 10e9)


def _held_out(predicted, measured, load=None):
    return latency.HeldOut(100, 50, measured, 0.3, 0.1, predicted, 0.2, 0.09, load, 2)


def test_held_out_verdict_says_whether_the_fit_holds_and_why():
    assert "the fit holds" in str(_held_out(10.5, 10.0))
    busy = str(_held_out(5.7, 10.0, load=9.5))
    assert "does NOT hold" in busy and "-43%" in busy and "load average 9.5 on 2 cores" in busy
    assert "load average" not in str(_held_out(5.7, 10.0, load=0.5))


def test_held_out_verdict_blames_other_programs_only_when_they_took_a_core():
    def held(others, load, threads=2):
        return latency.HeldOut(100, 50, 10.0, 0.3, 0.1, 5.7, 0.2, 0.09, load, 2, others, threads)

    own = str(held(0.05, load=2.4))  # a load of 2.4 that this process's own two threads made
    assert "does NOT hold" in own and "busy" not in own and "load average" not in own
    busy = str(held(1.6, load=3.5))
    assert "busy (other programs used 1.6 of its 2 cores)" in busy
    assert "busy" not in str(held(0.9, load=2.0, threads=1))  # one thread still had a core to itself


def test_ab_answer_widens_its_claim_when_the_fit_failed():
    ab = {"A": dict(ttft_s=2, decode_s=1, total_s=3, prompt_tokens=4000, output_tokens=50, extrapolated=True),
          "B": dict(ttft_s=0.2, decode_s=99.8, total_s=100, prompt_tokens=400, output_tokens=2000, extrapolated=True),
          "slower": "B"}
    lm = latency.LatencyModel((0.05, 1e-3, 1e-7), (0.05, 1e-6), max_prompt=512, max_context=512)
    robust = latency.explain_ab(ab, lm, _held_out(5.7, 10.0))
    assert "B stays slower even if each prediction is off by that much" in robust
    close = dict(ab, A=dict(ab["A"], total_s=80))
    assert "too close to call" in latency.explain_ab(close, lm, _held_out(5.7, 10.0))
    assert "off by" not in latency.explain_ab(ab, lm, _held_out(10.1, 10.0))


@pytest.mark.parametrize("ratio, words", [(0.65, "bfloat16 decoded faster"), (1.6, "bfloat16 was slower"),
                                          (1.0, "within 5 %")])
def test_bf16_advice_follows_the_measured_ratio_and_names_the_hardware(ratio, words):
    side = profile.DtypeComparison(16, ("float32", "bfloat16"), (0.1, 0.1 * ratio), (0.08, 0.08 * ratio),
                                   (5.4e8, 2.7e8), True, "cpu", ("amx_bf16", "avx512_bf16"))
    assert words in side.advice and "this CPU advertises amx_bf16, avx512_bf16" in side.advice
    none = profile.DtypeComparison(16, ("float32", "bfloat16"), (0.1, 0.16), (0.08, 0.1), (5.4e8, 2.7e8), False,
                                   "cpu", ())
    assert "no bfloat16 instructions" in str(none)


def test_datacenter_example_is_computed_from_published_specs():
    dc = datacenter_example("llama-2-7b", "a100")
    assert dc.weight_bytes == pytest.approx(13.5e9, rel=0.01)
    assert dc.floor_s * 1e3 == pytest.approx(dc.weight_bytes / 2.039e12 * 1e3)
    assert 150 < dc.gpu.ridge < 156 and "FlashAttention" in str(dc)
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'"):
        datacenter_example(gpu="tpu")


def test_paper_speculative_example_lands_in_the_reported_range():
    from course.lessons.speculative_report import expected_yield, paper_example

    ex = paper_example()
    assert ex.draft_cost == pytest.approx(7 / 70, rel=0.05)
    assert expected_yield(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert 2 <= ex.speedup <= 3 and "inside the 2–3×" in str(ex)
    assert "outside" in str(paper_example(alpha=0.3))


def _tasks(cold_texts, hot_texts, word=None):
    from course.engine.prompts import Prompt
    from course.lessons.sampling_demos import Task, TaskResult

    q = Prompt("Which city?")
    return [TaskResult(Task("extraction, T = 0.1", q, 0.1, must_contain=word), cold_texts),
            TaskResult(Task("extraction, T = 1.5 (too hot)", q, 1.5, must_contain=word), hot_texts)]


def test_task_sentences_report_what_the_samples_did():
    from course.lessons.sampling_demos import task_sentences

    lost = task_sentences(_tasks(["Tokyo"] * 4, ["Tokyo", "x", "y", "z"], "Tokyo"))[0]
    assert "4 of 4 answers named Tokyo at T = 0.1, 1 of 4 at T = 1.5: heat cost 3 of them" in lost
    assert "cost nothing in this run" in task_sentences(_tasks(["Tokyo"] * 4, ["tokyo!"] * 4, "Tokyo"))[0]
    assert "every answer still differs" in task_sentences(_tasks(list("abcd"), list("abcd")))[0]
    assert "all answers came out the same" in task_sentences(_tasks(["a"] * 4, list("abcd")))[0]


def test_check_sentence_counts_distinct_strings_and_passes():
    from course.lessons.sampling_demos import check_sentence

    assert check_sentence([" Paris.", " Paris!", " It is Paris"], "Paris") == \
        "The strings all differ; the check holds for each of them (names Paris)."
    same = check_sentence([" Paris."] * 3, "Paris")
    assert same.startswith("All the strings are the same this time")
    assert "the check holds for 1 of 3" in check_sentence([" Paris.", " Lyon.", " Rome."], "Paris")


def test_flip_sentence_and_the_near_tie_follow_the_numbers():
    from course.lessons.determinism import NearTie, flip_sentence

    assert "agreed bit for bit (noise 0)" in flip_sentence([0.5, 1.0], 0.0, 0.0)
    assert "1 of 3 greedy steps had a top-two gap within the noise" in flip_sentence([1e-6, 0.5, 1.0], 1e-5, 1e-4)
    far = flip_sentence([0.5, 1.0], 1e-5, 1e-4)
    assert "None of the 2 greedy steps came within the noise" in far and "is unlikely" in far
    tie = NearTie(1, 2, "a", "b", 0.1, 1e-7, -1e-7, 1, 2, " x", " y")
    assert "two stories" in tie.verdict()
    same = NearTie(1, 2, "a", "b", 0.1, 0.0, 0.0, 1, 1, " x", " x")
    assert "two stories" not in same.verdict() and "one story" in same.verdict()


def test_thread_comparison_is_skipped_off_the_cpu_and_says_so():
    import types

    import torch

    from course.lessons.determinism import compare_threads, threads_summary

    assert compare_threads(types.SimpleNamespace(device=torch.device("cuda")), [1, 2]) is None
    assert "not compared on cuda" in threads_summary(None, "cuda")


def test_gaps_figure_draws_a_noise_of_zero():
    from course.lessons.sampling_demos import gaps_figure

    fig = gaps_figure([0.01, 0.5, 2.0], 0.0)  # log10(0) raised before
    assert "noise 0" in fig.axes[0].get_title()
    assert gaps_figure([0.01, 0.5], 1e-6).axes[0].get_legend() is not None


def test_speculative_cost_sentences_follow_the_ratios_and_the_device():
    from course.engine.model import tiny_model
    from course.lessons.speculative import Costs, cost_sentences, draft_weight_share

    model = tiny_model()
    dear = cost_sentences(Costs(1e-3, {1: 1.6e-3, 4: 2e-3}, {1: 0.8e-3}), model, 1)
    assert dear[0].startswith("A pass over k + 1 = 5 tokens cost 2.00× one step on this CPU: not free.")
    assert "the draft is not cheap here" in dear[1] and "(1 block + the" in dear[1]
    assert f"predict {draft_weight_share(model, 1):.2f}" in dear[1]
    free = cost_sentences(Costs(1e-3, {4: 1.05e-3}, {1: 0.2e-3}), model, 1)
    assert "close to free" in free[0] and "not free" not in free[0] and "cheap enough" in free[1]


def test_rounding_verdict_scales_with_the_dtype_and_the_values():
    import torch

    from course.measure.cache_speed import Equivalence, rounding_verdict

    assert rounding_verdict(0.0, 10.0, torch.float32) == "bit for bit identical"
    small = rounding_verdict(2e-6, 10.0, torch.float32)  # one float32 rounding at 10 is ~1.2e-6
    assert small.startswith("float32 rounding") and "MORE" not in small
    assert rounding_verdict(0.05, 10.0, torch.float32).startswith("MORE than float32 rounding explains")
    assert rounding_verdict(0.05, 10.0, torch.bfloat16).startswith("bfloat16 rounding")  # eps 7.8e-3
    assert "MORE" in rounding_verdict(2e-6, 1e-3, torch.float32)  # the same |Δ| is large next to tiny values
    eq = Equivalence(24, 3e-6, True, dtype=torch.float32, logit_scale=20.0)
    assert "float32 rounding" in eq.sentence() and "greedy tokens identical" in eq.sentence()
    assert "NOT identical" in Equivalence(24, 0.5, False, logit_scale=20.0).sentence()


def test_layer0_walkthrough_reads_its_differences_as_rounding():
    from course.engine.model import tiny_model
    from course.lessons.attention_by_hand import layer0_walkthrough

    walk = layer0_walkthrough(tiny_model(), list(range(1, 12)))
    assert walk.scale > 0 and walk.dtype is not None
    text = walk.agreement()
    assert "MORE" not in text and text.count("rounding") + text.count("identical") >= 2


def test_signed_wordings_never_call_a_loss_a_saving():
    from course.lessons.wording import duration, lower_by, speedup_trend, times_faster

    assert lower_by(0.42, "TTFT") == "TTFT 42% lower"
    assert lower_by(-0.05, "TTFT") == "TTFT 5% higher, no saving in this run"
    assert "about the same" in lower_by(0.0, "TTFT") and "lower" not in lower_by(0.0, "TTFT")
    assert times_faster(2.5, "the cache") == "the cache is 2.50× faster"
    assert "SLOWER" in times_faster(0.8, "the cache") and "faster" not in times_faster(0.8, "the cache")
    assert speedup_trend([1, 2, 3]) == "kept growing with length"
    assert speedup_trend([3, 2, 1]) == "did NOT grow with length here"
    assert (duration(2.345), duration(0.0123), duration(0.0043), duration(0.00027)) == \
        ("2.35 s", "12 ms", "4.3 ms", "0.27 ms")


def test_cache_speed_report_and_recap_follow_the_sign_and_trend():
    from course.lessons import recap as recap_mod
    from course.lessons.kv_lesson import SpeedReport

    slow = str(SpeedReport([16, 64], [1.0, 2.0], [1.1, 2.5], [0.91, 0.8], [5.0, 20.0], True))
    assert "the cache is SLOWER" in slow and "faster" not in slow and "did NOT grow" in slow
    assert "the cache is 3.00× faster" in str(SpeedReport([16, 64], [2, 6], [1, 2], [2.0, 3.0], [5, 20], True))
    bullets = "\n".join(recap_mod.recap("02_kv_cache", {"speedups": [0.9, 0.8], "speed_lengths": [16, 64]}).bullets)
    assert "did not make 64 new tokens faster" in bullets and "did NOT grow" in bullets
    grew = "\n".join(recap_mod.recap("02_kv_cache", {"speedups": [1.5, 4.0], "speed_lengths": [16, 64]}).bullets)
    assert "4.0× faster here; the speedup kept growing" in grew


def test_prefix_sentences_say_higher_when_ttft_rose():
    import types

    from course.lessons import recap as recap_mod
    from course.lessons.serving_runs import PrefixRun
    from course.lessons.speculative_report import PrefixSummary

    def served(ttft, cached):
        return types.SimpleNamespace(ttft_p50=ttft, peak_bytes_reserved=2 << 20, peak_bytes_shared=1 << 20,
                                     completions=[types.SimpleNamespace(cached_tokens=c) for c in cached],
                                     outputs=lambda: [[1, 2]])

    worse = " ".join(PrefixRun(served(0.0105, [0, 16]), served(0.0100, [0, 0]), 20, 16).sentences())
    assert "with sharing 5% higher, no saving in this run" in worse and "saved" not in worse
    assert "10 ms" in worse and "0.01 s" not in worse  # a fast machine's TTFT keeps its digits
    better = " ".join(PrefixRun(served(0.5, [0, 16]), served(1.0, [0, 0]), 20, 16).sentences())
    assert "50% saved" in better
    rose = "\n".join(recap_mod.recap("04_speculative_prefix", {"prefix_token_share": 0.9,
                                                               "prefix_prefill_saved": -0.1}).bullets)
    assert "time to first token 10% higher, no saving" in rose and "cut" not in rose
    row = types.SimpleNamespace(question="q?", prompt_tokens=100, reused_tokens=90, ttft_plain=0.1,
                                ttft_cached=0.11, identical=True)
    store = types.SimpleNamespace(stats=types.SimpleNamespace(hits=1, misses=1, bytes=1 << 20, seconds_copying=0),
                                  max_bytes=64 << 20)
    exp = types.SimpleNamespace(rows=[row], token_share_reused=0.9, time_share_saved=-0.1, prefix_tokens=90,
                                entry_bytes=1 << 20, store=store)
    text = " ".join(str(PrefixSummary(exp)).split())  # unwrapped
    assert "time to first token was 10% higher, no saving" in text and "fell by" not in text


@pytest.mark.parametrize("ratio, words", [(1.03, "within 5 %"), (0.97, "within 5 %"), (1.2, "SLOWER"),
                                          (0.8, "faster, but by less"), (0.5, "faster by about what the bytes")])
def test_bf16_verdict_never_calls_a_slower_step_faster(ratio, words):
    side = profile.DtypeComparison(16, ("float32", "bfloat16"), (0.1, 0.1 * ratio), (0.08, 0.08), (5.4e8, 2.7e8),
                                   True, "cpu", ("avx512_bf16",))
    assert words in side.verdict
    if ratio > 1:
        assert "faster" not in side.verdict


def _sweep(ms_by_batch, predicted_ms_by_batch, context=64):
    from course.engine.config import ModelConfig
    from course.lessons.serving import BatchSweep, SweepPoint, batch_cost
    from course.measure.timing import Timing

    config = ModelConfig.from_name("smollm2-135m")
    sweep = BatchSweep(roofline.Machine("cpu", "float32", 10e9, 50e9))
    for (b, ms), pred in zip(ms_by_batch.items(), predicted_ms_by_batch):
        sweep.points.append(SweepPoint(b, context, Timing([ms / 1e3]), pred / 1e3, batch_cost(config, b, context, 4)))
    return sweep


def test_batch_sweep_says_when_no_step_doubled():
    from course.lessons.serving import sweep_sentences

    flat = _sweep({1: 10.0, 4: 12.0, 16: 15.0, 64: 19.0}, [10, 10.5, 11, 14])
    text = " ".join(sweep_sentences(flat))
    assert not flat.knee_found(64) and "the knee, the first B" not in text
    assert "C = 64: baseline 10 ms (B = 1); no B up to 64, the largest measured, cost 2× it (1.90× there)" in text
    assert "puts it beyond B = 64" in text and "the measured knee came" not in text
    assert flat.values()["64"]["knee_found"] is False
    bent = " ".join(sweep_sentences(_sweep({1: 10.0, 4: 12.0, 16: 25.0, 64: 90.0}, [10, 11, 21, 80])))
    assert "the knee, the first B at ≥ 2× it, came at B = 16 (2.50×); B = 4 had reached 1.20×." in bent
    assert "The prediction, by the same rule: B = 16" in bent and "the measured knee came where predicted" in bent


def test_knee_sentence_joins_a_later_or_earlier_knee_to_the_step_that_decided_it():
    from course.lessons.serving import sweep_sentences

    batches = (1, 2, 4, 8, 16)
    later = " ".join(sweep_sentences(_sweep(dict(zip(batches, [10.0, 10, 12, 15, 25])), [10, 10, 14, 21, 40])))
    assert "came at B = 16 (2.50×)" in later and "The prediction, by the same rule: B = 8" in later
    assert ("the measured knee came later because the measured step grew less than the predicted one: at B = 8 it "
            "cost 1.50× its baseline against 2.10× on paper (pred/meas 1.40)") in later
    earlier = " ".join(sweep_sentences(_sweep(dict(zip(batches, [10.0, 10, 12, 21, 40])), [10, 10, 12, 15, 25])))
    assert "came at B = 8 (2.10×)" in earlier and "The prediction, by the same rule: B = 16" in earlier
    assert "came earlier because the measured step grew more" in earlier and "(pred/meas 0.71)" in earlier
    assert "later" not in earlier
    # a context of four digits carries its thousands separator in every sentence
    long_ = sweep_sentences(_sweep(dict(zip(batches, [10.0, 10, 12, 15, 25])), [10, 10, 14, 21, 40], context=1024))
    assert all(line.startswith("C = 1,024:") for line in long_) and "C = 1024" not in " ".join(long_)


def test_crossover_example_reaches_the_crossover():
    from course.lessons.serving import crossover_sentence

    text = crossover_sentence({"kv_bytes_per_token": 30 * 1024, "weight_bytes": 540 * 2**20, "crossover_tokens": 11_500})
    assert "(e.g. 23 requests of 512 tokens)" in text  # 22 × 512 = 11,264 would stay below 11,500
    assert "(e.g. 2 requests" in crossover_sentence({"kv_bytes_per_token": 1, "weight_bytes": 1, "crossover_tokens": 1024})


def test_batching_sentences_show_fast_latencies_in_ms():
    import types

    from course.lessons.serving_runs import batching_sentences

    def served(ttft, p95, tps, busy):
        return types.SimpleNamespace(ttft_p50=ttft, latency_p95=p95, throughput=tps, slot_occupancy=busy,
                                     timeline=[])

    run = types.SimpleNamespace(static=served(0.021, 0.09, 900.0, 0.6), continuous=served(0.004, 0.08, 1100.0, 0.9),
                                throughput_ratio=1100 / 900, identical={0: True}, differing=lambda: [])
    text = " ".join(batching_sentences(run))
    assert "median: 4.0 ms against 21 ms; latency p95: 80 ms against 90 ms (no worse" in text
    assert "0.0 s" not in text
