"""course/measure/{sweeps,costs,roofline,latency,threads}.py and course/lessons/prefill_decode.py on the tiny random model (fast), and lessons/01_prefill_decode.ipynb end to end (slow).

No test here asserts a speed: timings only have to exist and be positive. The cost formulas are
checked against the model itself (parameter counts, FlopCounterMode, cache buffers), the latency
model against synthetic data with a known answer, and the notebook's recorded numbers against the
relations the lesson claims.
"""
import math
import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from course.lessons import prefill_decode  # noqa: E402
from course.measure import costs, latency, roofline, sweeps, threads  # noqa: E402
from course.engine.config import ModelConfig  # noqa: E402
from course.engine.generate import decode_one_token  # noqa: E402
from course.engine.kv_cache import KVCache  # noqa: E402
from course.engine.model import Transformer, tiny_model  # noqa: E402
from course.measure.timing import Timing  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parent.parent / "lessons" / "01_prefill_decode.ipynb"
SMOL = ModelConfig.from_name("smollm2-135m")


def synthetic_sweep(phase, lengths, fn):
    return sweeps.Sweep(phase, list(lengths), [Timing([fn(n)]) for n in lengths])


# --- sizes and input checks ---------------------------------------------------------------------

def test_default_sizes_quick_and_full(monkeypatch):
    monkeypatch.delenv("KVCOURSE_FULL", raising=False)
    quick = sweeps.default_sizes()
    assert not quick.full and 256 in quick.prefill and max(quick.prefill) <= 1024 and max(quick.decode) <= 1024
    monkeypatch.setenv("KVCOURSE_FULL", "1")
    full = sweeps.default_sizes()
    assert full.full and max(full.prefill) == 2048 and max(full.decode) == 2048
    assert set(quick.prefill) <= set(full.prefill)


@pytest.mark.parametrize("lengths", [[], [0], [129], ["8"], [4.0], [True]])
def test_prefill_sweep_rejects_bad_lengths(tiny, lengths):
    with pytest.raises(ValueError, match="lengths"):
        sweeps.prefill_sweep(tiny, lengths, progress=False)


def test_decode_needs_room_for_one_more_token(tiny):
    with pytest.raises(ValueError, match=r"context.*1\.\.127"):
        sweeps.decode_sweep(tiny, [128], progress=False)
    with pytest.raises(ValueError, match="context"):
        costs.decode_cost(tiny.config, 0)


@pytest.fixture
def thread_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("KVCOURSE_THREADS", raising=False)
    return calls


def test_steady_threads_drops_to_one_thread_on_a_busy_machine(monkeypatch, thread_calls):
    monkeypatch.setattr(threads, "sample_others", lambda: 1.8)  # other programs use 1.8 of 2 cores
    note = threads.steady_threads("cpu")
    assert thread_calls == [1] and "busy" in note and "1.8 of 2 cores" in note


def test_steady_threads_keeps_one_thread_per_free_core(monkeypatch, thread_calls):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(threads, "sample_others", lambda: 0.7)  # a browser playing a video, say
    note = threads.steady_threads("cpu")
    assert thread_calls == [7] and "7 CPU threads, one per free core" in note
    monkeypatch.setattr(threads, "sample_others", lambda: 0.3)  # less than half a core: all 8 stay
    assert "8 CPU threads" in threads.steady_threads("cpu") and thread_calls == [7]


def test_steady_threads_leaves_an_idle_machine_alone(monkeypatch, thread_calls):
    monkeypatch.setattr(threads, "sample_others", lambda: 0.1)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.5, 9.0, 8.0))  # this process's own past work
    assert "2 CPU threads" in threads.steady_threads("cpu") and thread_calls == []
    assert "cuda" in threads.steady_threads("cuda") and thread_calls == []  # GPU timing: threads untouched


def test_steady_threads_falls_back_on_the_load_average_without_proc_stat(monkeypatch, thread_calls):
    monkeypatch.setattr(threads, "sample_others", lambda: None)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.5, 9.0, 8.0))
    note = threads.steady_threads("cpu")
    assert thread_calls == [1] and "load average 9.5" in note


def test_steady_threads_obeys_an_explicit_choice(monkeypatch, thread_calls):
    monkeypatch.setattr(threads, "sample_others", lambda: 1.9)
    monkeypatch.setenv("KVCOURSE_THREADS", "2")
    assert "as asked" in threads.steady_threads("cpu") and thread_calls == [2]
    with pytest.raises(ValueError, match="threads"):
        threads.steady_threads("cpu", threads=0)


def test_others_busy_reads_the_kernel_accounting(tmp_path, monkeypatch):
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"

    def reading(busy_ticks, own_s, wall):  # user nice system idle iowait irq softirq steal
        stat.write_text(f"cpu  {busy_ticks - 30} 10 10 5000 7 4 4 2 0 0\ncpu0 1 2 3\n")
        return threads.CpuClock(wall=wall, everyone=threads._everyone_cpu_s(str(stat)), own=own_s)

    a = reading(100, own_s=1.0, wall=10.0)
    b = reading(100 + 3 * hz, own_s=2.5, wall=12.0)  # everyone used 3 s of CPU in 2 s, this process 1.5 s of it
    assert threads.others_busy(a, b) == pytest.approx(0.75)
    assert threads.others_busy(b, reading(100 + 3 * hz, own_s=4.0, wall=13.0)) == 0.0  # never negative
    assert threads.others_busy(a, threads.CpuClock(wall=12.0, everyone=None, own=2.0)) is None
    stat.write_text("intr 1 2 3\n")
    assert threads._everyone_cpu_s(str(stat)) is None and threads._everyone_cpu_s(str(tmp_path / "no")) is None


@pytest.mark.alone  # it reads the machine's load: another test worker beside it would fill the cores
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_others_busy_tells_another_program_from_this_one():
    import subprocess
    import sys

    def spin():
        end = time.perf_counter() + 0.8
        while time.perf_counter() < end:
            pass

    before = threads.cpu_clock()
    spin()  # this process busy: not counted as others
    own = threads.others_busy(before, threads.cpu_clock())
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nend = time.perf_counter() + 1.2\nwhile time.perf_counter() < end: pass"])
    time.sleep(0.2)  # the child's start-up
    before = threads.cpu_clock()
    time.sleep(0.8)
    other = threads.others_busy(before, threads.cpu_clock())
    child.wait()
    if own > (os.cpu_count() or 1) - 1.4:  # other programs already fill the cores: one more spinner cannot show
        pytest.skip(f"the machine is too busy to tell ({own:.2f} cores busy with other programs)")
    assert other >= own + 0.4, (own, other)  # a spinning child is about one core more than the background


# --- sweeps on the tiny model ---------------------------------------------------------------------

def test_prefill_sweep_on_tiny(tiny):
    sweep = sweeps.prefill_sweep(tiny, [4, 16, 64], budget_s=0.05, max_repeats=3, progress=False)
    assert sweep.phase == "prefill" and sweep.lengths == [4, 16, 64]
    assert all(1 <= len(t.times) <= 3 for t in sweep.timings)
    assert all(s > 0 for s in sweep.seconds)
    assert sweep.tokens_per_s == pytest.approx([n / s for n, s in zip(sweep.lengths, sweep.seconds)])
    assert sweep.at(16) == sweep.seconds[1]
    with pytest.raises(ValueError, match="not measured"):
        sweep.at(32)
    values = sweep.values()
    assert values["prefill_lengths"] == [4, 16, 64] and values["prefill_tokens_per_s_max"] == max(sweep.tokens_per_s)


def test_decode_sweep_on_tiny(tiny):
    sweep = sweeps.decode_sweep(tiny, [1, 32, 100], budget_s=0.05, max_repeats=4, progress=False)
    assert sweep.phase == "decode" and all(s > 0 for s in sweep.seconds)
    assert all(len(t.times) >= 3 for t in sweep.timings)  # min_repeats: a median of at least three steps
    assert sweep.tokens_per_s == pytest.approx([1 / s for s in sweep.seconds])
    assert set(sweep.values()) == {"decode_contexts", "decode_ms_per_token", "decode_tokens_per_s"}


def test_the_timed_decode_step_attends_over_the_prefilled_context(tiny):
    cache, ids = sweeps.prepare_context(tiny, 10, seed=3)
    assert ids.shape == (1, 10) and cache.max_seq_len == 11
    token = torch.ones(1, 1, dtype=torch.long)
    cached = decode_one_token(tiny, token, 10, cache)
    uncached = tiny(torch.cat([ids, token], dim=1), last_only=True)
    torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=1e-5)


def test_random_prompt_is_seeded_and_in_vocabulary(tiny):
    a, b = sweeps.random_prompt(tiny, 50, seed=1), sweeps.random_prompt(tiny, 50, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, sweeps.random_prompt(tiny, 50, seed=2))
    assert a.shape == (1, 50) and 0 <= int(a.min()) and int(a.max()) < tiny.config.vocab_size


# --- costs on paper, checked against the model ------------------------------------------------------

def test_weights_read_are_the_model_parameters(tiny):
    assert costs.weights_read_bytes(tiny.config, 4) == 4 * sum(p.numel() for p in tiny.parameters())
    untied = Transformer(tiny.config.with_(tie_embeddings=False))
    embedding = untied.tok_embeddings.weight.numel()  # looked up one row per token, never read whole
    assert costs.weights_read_bytes(untied.config, 2) == 2 * (sum(p.numel() for p in untied.parameters()) - embedding)


def _counted_matmul_flops(model, tokens, start_pos, cache):
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(tokens, start_pos=start_pos, cache=cache, last_only=True)
    return counter.get_total_flops()


def _causal_attention_flops(config, T_new, T_keys):
    """QKᵀ and PV: 2 FLOPs per multiply-add, D_h per score, for every (query, visible key) pair."""
    visible = torch.ones(T_new, T_keys, dtype=torch.bool).tril(T_keys - T_new).sum().item()
    return 2 * 2 * config.head_dim * visible * config.n_heads * config.n_layers


def test_prefill_cost_matches_counted_flops_and_cache_bytes(tiny):
    c, T = tiny.config, 24
    cache = KVCache(c, batch=1, max_seq_len=T)
    tokens = torch.randint(0, c.vocab_size, (1, T))
    cost = costs.prefill_cost(c, T, dtype_bytes=4)
    attention = _causal_attention_flops(c, T, T)
    assert cost.flops - attention == _counted_matmul_flops(tiny, tokens, 0, cache)  # linears, head once
    assert cost.kv_bytes == cache.nbytes  # the cache holds exactly T tokens of K and V
    assert cost.intensity == pytest.approx(cost.flops / (cost.weight_bytes + cost.kv_bytes))


def test_decode_cost_matches_counted_flops_and_cache_bytes(tiny):
    c, C = tiny.config, 40
    cache, _ = sweeps.prepare_context(tiny, C)
    cost = costs.decode_cost(c, C, dtype_bytes=4)
    assert cost.flops - _causal_attention_flops(c, 1, C + 1) == _counted_matmul_flops(
        tiny, torch.ones(1, 1, dtype=torch.long), C, cache)
    assert cost.kv_bytes == cache.nbytes  # K and V of all C + 1 positions are read
    assert cost.weight_bytes == costs.weights_read_bytes(c, 4)


def test_decode_of_smollm2_reads_about_half_a_gigabyte_and_is_memory_bound():
    decode = costs.decode_cost(SMOL, 16, dtype_bytes=4)
    assert 5.3e8 < decode.weight_bytes < 5.45e8  # 134.5 M parameters × 4 bytes
    assert decode.intensity < 1  # about 2 FLOPs per 4-byte weight
    grows = [costs.decode_cost(SMOL, C, 4).bytes for C in (16, 256, 1024, 2048)]
    assert grows == sorted(grows) and grows[-1] - grows[0] == pytest.approx(2 * 30 * 3 * 64 * 4 * 2032)
    assert costs.prefill_cost(SMOL, 256, 4).intensity > 50 * decode.intensity
    assert "GFLOP" in str(decode) and "C=16" in str(decode)


# --- machine, roofline, comparison ------------------------------------------------------------------

def test_machine_roofline_time_is_the_slower_of_bytes_and_flops():
    m = roofline.Machine("cpu", "float32", bytes_per_s=10e9, flops_per_s=100e9)
    assert m.ridge == pytest.approx(10)
    low = costs.Cost("decode", 1, flops=1e9, weight_bytes=1e9, kv_bytes=0)  # 1 FLOP/B
    high = costs.Cost("prefill", 1, flops=1e12, weight_bytes=1e9, kv_bytes=0)  # 1000 FLOP/B
    assert m.seconds(low) == pytest.approx(0.1) and m.bound(low) == "memory"
    assert m.seconds(high) == pytest.approx(10.0) and m.bound(high) == "compute"


def test_compare_puts_each_point_next_to_its_roofline_prediction():
    machine = roofline.Machine("cpu", "float32", bytes_per_s=40e9, flops_per_s=100e9)
    pre = synthetic_sweep("prefill", [16, 256], lambda T: 0.01 * T)
    dec = synthetic_sweep("decode", [16, 1024], lambda C: 0.04)
    points = roofline.compare(SMOL, pre, dec, machine)
    assert [p.phase for p in points] == ["prefill", "prefill", "decode", "decode"]
    for p in points:
        cost = (costs.prefill_cost if p.phase == "prefill" else costs.decode_cost)(SMOL, p.tokens, 4)
        assert p.predicted_s == pytest.approx(machine.seconds(cost)) and p.cost == cost
        assert p.achieved_flops_per_s == pytest.approx(cost.flops / p.measured_s)
    assert [p.bound for p in points] == ["compute", "compute", "memory", "memory"]


# --- where a decode step's time goes ---------------------------------------------------------------

# --- the latency model ------------------------------------------------------------------------------

def test_nonnegative_fit_recovers_exact_coefficients():
    xs = [16, 64, 256, 1024]
    coef = latency.nonnegative_fit([[1, x, x * x] for x in xs], [0.05 + 2e-3 * x + 1e-7 * x * x for x in xs])
    assert coef == pytest.approx([0.05, 2e-3, 1e-7], rel=1e-6)


def test_nonnegative_fit_never_returns_a_negative_cost():
    xs = [16, 64, 256, 1024]
    concave = [0.1 + 3e-3 * x - 1e-6 * x * x for x in xs]  # noise can bend real data like this
    coef = latency.nonnegative_fit([[1, x, x * x] for x in xs], concave)
    assert all(c >= 0 for c in coef) and coef[1] > 0
    with pytest.raises(ValueError, match="features"):
        latency.nonnegative_fit([[1, 2]], [1.0, 2.0])


def test_latency_total_is_ttft_plus_each_decode_step():
    lm = latency.LatencyModel((0.05, 2e-3, 1e-7), (0.03, 1e-5), max_prompt=1024, max_context=1024)
    for P, n in [(10, 1), (10, 2), (100, 37), (400, 2000)]:
        steps = sum(lm.itl(P + s - 1) for s in range(1, n))  # token s+1 is decoded with P + s - 1 cached
        assert lm.total(P, n) == pytest.approx(lm.ttft(P) + steps)
    assert lm.extrapolates(4000, 50) and lm.extrapolates(400, 2000) and not lm.extrapolates(512, 32)
    with pytest.raises(ValueError, match="n_out"):
        lm.total(10, 0)


def test_fit_latency_model_recovers_a_known_machine():
    truth = latency.LatencyModel((0.02, 1e-3, 5e-8), (0.04, 2e-5), 0, 0)
    pre = synthetic_sweep("prefill", [16, 64, 256, 1024], truth.ttft)
    dec = synthetic_sweep("decode", [16, 256, 1024], truth.itl)
    fit = latency.fit_latency_model(pre, dec)
    assert fit.ttft_coef == pytest.approx(truth.ttft_coef, rel=1e-6)
    assert fit.itl_coef == pytest.approx(truth.itl_coef, rel=1e-6)
    assert (fit.max_prompt, fit.max_context) == (1024, 1024)
    with pytest.raises(ValueError, match="at least 2"):
        latency.fit_latency_model(synthetic_sweep("prefill", [16], truth.ttft), dec)


def test_checkpoint_answer_follows_the_measured_costs():
    decode_heavy = latency.LatencyModel((0.01, 2e-3, 0.0), (0.04, 1e-5), 1024, 1024)  # a CPU-like ratio
    ab = latency.checkpoint_ab(decode_heavy)
    assert ab["slower"] == "B" and ab["B"]["total_s"] > ab["A"]["total_s"]
    assert ab["A"]["extrapolated"] and ab["B"]["extrapolated"]
    assert ab["A"]["total_s"] == pytest.approx(decode_heavy.total(4000, 50))
    prefill_heavy = latency.LatencyModel((0.01, 1e-2, 1e-5), (1e-4, 0.0), 8192, 8192)  # absurdly slow prefill
    assert latency.checkpoint_ab(prefill_heavy)["slower"] == "A"
    values = latency.ab_values(ab)
    assert values["ab_slower"] == "B" and values["ab_B_total_s"] == ab["B"]["total_s"]


def test_held_out_check_runs_the_whole_loop(tiny):
    pre = sweeps.prefill_sweep(tiny, [8, 32, 64], budget_s=0.05, max_repeats=3, progress=False)
    dec = sweeps.decode_sweep(tiny, [8, 32, 64], budget_s=0.05, max_repeats=3, progress=False)
    lm = latency.fit_latency_model(pre, dec)
    ho = latency.held_out_check(tiny, lm, prompt_len=20, n_out=6, repeats=2)
    assert ho.measured_s > 0 and ho.measured_ttft_s > 0 and ho.measured_itl_s > 0
    assert ho.predicted_s == pytest.approx(lm.total(20, 6))
    assert [r[0] for r in ho.rows()] == ["time to first token", "each later token", "whole call"]
    assert math.isfinite(ho.values()["heldout_error"])
    with pytest.raises(ValueError, match="prompt_len"):
        latency.held_out_check(tiny, lm, prompt_len=120, n_out=20)


# --- one call, streamed, and the plots ----------------------------------------------------------------

class LetterTokenizer:
    """A stand-in tokenizer for the tiny model: token i reads as one letter."""
    eos_id = None

    def chat_ids(self, text, system=None):
        return [ord(ch) % 256 for ch in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(65 + i % 26) for i in ids)

    def token_text(self, i):
        return self.decode([i])


def test_stream_call_writes_exactly_what_it_generates(tiny):
    written = []
    gen = prefill_decode.stream_call(tiny, LetterTokenizer(), "hello", max_new_tokens=7, write=written.append)
    assert gen.prompt_ids == [ord(c) for c in "hello"] and len(gen.tokens) == 7
    assert "".join(written) == LetterTokenizer().decode(gen.tokens)
    lat = prefill_decode.token_latencies(gen)
    assert lat[0] == gen.time_to_first_token and len(lat) == 7 and all(s >= 0 for s in lat)
    assert gen.stop_reason == "length"


def test_plots_draw_every_measured_point(tiny):
    gen = prefill_decode.stream_call(tiny, LetterTokenizer(), "hi", max_new_tokens=5, write=lambda s: None)
    fig = prefill_decode.plot_token_timeline(gen, LetterTokenizer())
    assert len(fig.axes[0].patches) == 5  # one bar per token
    pre = synthetic_sweep("prefill", [16, 64, 256], lambda T: 1e-3 * T)
    dec = synthetic_sweep("decode", [16, 256], lambda C: 0.04 + 1e-5 * C)
    fig2 = sweeps.plot_sweeps(pre, dec)
    assert len(fig2.axes) == 2
    machine = roofline.Machine("cpu", "float32", 40e9, 100e9)
    points = roofline.compare(SMOL, pre, dec, machine)
    fig3 = roofline.plot_roofline(machine, points)
    assert sum(len(c.get_offsets()) for c in fig3.axes[0].collections) == len(points)
    fig4 = latency.plot_latency_fit(pre, dec, latency.fit_latency_model(pre, dec))
    assert len(fig4.axes) == 2
    plt.close("all")


# --- the lesson, end to end ---------------------------------------------------------------------------

# The lesson notebook's own run and prose checks live in tests/test_lesson_prefill_decode.py.


def test_one_output_token_has_one_price_in_prompt_tokens():
    pre = synthetic_sweep("prefill", [16, 64, 256], lambda T: 0.05 + 1e-3 * T)
    dec = synthetic_sweep("decode", [16, 256], lambda C: 0.04 + 1e-5 * C)
    lm = latency.fit_latency_model(pre, dec)
    ab = latency.checkpoint_ab(lm)
    values = latency.ab_values(ab)
    x = ab["exchange"]
    assert values["output_token_in_prompt_tokens"] == pytest.approx(x["per_output_token_s"] / x["per_prompt_token_s"])
    assert x["per_output_token_s"] == pytest.approx(lm.itl(x["context"]))


def test_latency_plot_keeps_the_held_out_star_in_view():
    pre = synthetic_sweep("prefill", [16, 64, 256], lambda T: 1e-3 * T)
    dec = synthetic_sweep("decode", [16, 256], lambda C: 0.05 + 1e-6 * C)
    lm = latency.fit_latency_model(pre, dec)
    ho = latency.HeldOut(512, 32, measured_s=3.0, measured_ttft_s=0.5, measured_itl_s=0.0685, predicted_s=2.0,
                         predicted_ttft_s=0.5, predicted_itl_s=0.05)
    fig = latency.plot_latency_fit(pre, dec, lm, ho)
    assert fig.axes[1].get_ylim()[1] > 68.5 and fig.axes[1].get_ylim()[0] == 0
    plt.close("all")


def test_a_flat_prefill_fit_prices_no_prompt_token_and_does_not_crash():
    pre = synthetic_sweep("prefill", [16, 64, 256], lambda T: 3.0)  # a busy machine: no growth with T
    dec = synthetic_sweep("decode", [16, 256], lambda C: 0.05 + 1e-6 * C)
    lm = latency.fit_latency_model(pre, dec)
    ab = latency.checkpoint_ab(lm)
    values = latency.ab_values(ab)
    assert values["output_token_in_prompt_tokens"] is None


def test_one_thread_is_counted_in_the_singular(monkeypatch):
    from course.measure import threads

    monkeypatch.setattr(threads.torch, "set_num_threads", lambda n: None)
    assert threads.steady_threads("cpu", threads=1).startswith("1 CPU thread, as asked")
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    assert threads.steady_threads("cpu", threads=2).startswith("2 CPU threads, as asked")
