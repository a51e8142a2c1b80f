"""The benchmark suite and the fast decode path: the suite runs and writes a valid result; speed is never asserted.

The smoke test runs `kvcourse bench --quick` on the random tiny model (seconds); the same suite on the course
model is a slow test. The compiled decode path (course/fast.py) must give the eager model's logits.
"""
import json
import os
import statistics
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course.cli import bench
from course.cli import main
from course.engine.fast import FastModel, GemvLinear, use_gemv_linears
from course.engine.generate import decode_one_token, generate, prefill
from course.engine.kv_cache import KVCache
from course.engine.model import tiny_model
from course.measure.costs import prefill_flops

ITEM_ROW_KEYS = {
    "decode": {"engine", "dtype", "context", "batch", "ms_per_token", "tokens_per_s", "bytes_per_step",
               "achieved_bytes_per_s", "roofline_ms", "x_roofline", "fraction_of_bandwidth", "repeats"},
    "prefill": {"dtype", "tokens", "seconds", "tokens_per_s", "flops", "achieved_flops_per_s",
                "matmul_flops_per_s", "fraction_of_matmul_flops", "repeats"},
    "transformers": {"engine", "dtype", "new_tokens", "decode_tokens_per_s", "x_transformers",
                     "greedy_tokens_agreeing", "repeats"},
    "notebooks": {"notebook", "seconds", "ok", "error"},
    "widgets": {"widget", "callback", "median_ms", "p90_ms", "max_ms", "moves"},
}
ITEM_KEYS = {
    "cache_speedup": {"prompt_tokens", "new_tokens", "uncached_s", "cached_s", "speedup"},
    "load": {"cold_s", "warm_s", "gguf_bytes", "cache_bytes"},
    "grading": {"submissions", "seconds", "s_per_submission"},
    "notebooks": {"total_s", "lessons_s", "all_ok"},
}


def _positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_schema(result: dict):
    """Structure and types of a bench result (never the figures' sizes)."""
    assert result["schema"] == bench.SCHEMA
    meta = result["meta"]
    for key in ("started", "device", "device_name", "threads", "torch", "quick", "load_average_before", "wall_s"):
        assert key in meta, key
    assert set(result["items"]) == set(bench.ITEMS)
    for name, item in result["items"].items():
        assert item["status"] in bench.STATUSES, (name, item)
        if item["status"] != "ok":
            assert item["reason"], f"{name} is {item['status']} without a reason"
            continue
        for key in ITEM_KEYS.get(name, ()):
            assert key in item, (name, key)
        if name in ITEM_ROW_KEYS:
            assert item["rows"], name
            for row in item["rows"]:
                assert ITEM_ROW_KEYS[name] <= set(row), (name, ITEM_ROW_KEYS[name] - set(row))
    dec = result["items"]["decode"]
    if dec["status"] == "ok":
        for row in dec["rows"]:
            assert all(_positive(row[k]) for k in ("ms_per_token", "bytes_per_step", "x_roofline")), row
            # the bookkeeping, not the speed: achieved bytes/s is bytes per step over the measured time
            assert row["achieved_bytes_per_s"] == pytest.approx(row["bytes_per_step"] / (row["ms_per_token"] / 1e3))
            assert row["x_roofline"] == pytest.approx(1 / row["fraction_of_bandwidth"])
    assert "memory_bandwidth_bytes_per_s" in result["hardware"]
    names = {t["name"] for t in result["targets"]}
    assert names == set(bench.TARGETS)
    for t in result["targets"]:
        assert t["met"] in (True, False, None)
        assert t["value"] is None or isinstance(t["value"], (int, float))


def _run_cli(tmp_path, *args) -> tuple[dict, str]:
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--threads", "1", "--out", str(out), *args]) == 0
    result = json.loads((out / "latest.json").read_text())
    markdown = (out / "latest.md").read_text()
    stamped = sorted(out.glob("bench-*.json"))
    assert len(stamped) == 1 and json.loads(stamped[0].read_text()) == result
    return result, markdown


def test_quick_suite_on_tiny_model_writes_valid_json_and_markdown(tmp_path, capsys):
    threads = torch.get_num_threads()
    result, markdown = _run_cli(tmp_path, "--model", "tiny")
    assert torch.get_num_threads() == threads  # --threads does not leak into the caller
    check_schema(result)
    items = result["items"]
    assert items["decode"]["status"] == "ok" and items["prefill"]["status"] == "ok"
    assert {r["dtype"] for r in items["decode"]["rows"]} == {"float32", "bfloat16"}
    assert [r["tokens"] for r in items["prefill"]["rows"] if r["dtype"] == "float32"] == bench.QUICK["prefill_tokens"]
    for slow in bench.SLOW_ITEMS:  # --quick never runs the slow items, and says so
        assert items[slow]["status"] == "skipped" and "quick" in items[slow]["reason"]
    assert items["load"]["status"] == "skipped"  # needs the course model
    assert all(t["met"] is None for t in result["targets"])  # quick sizes never claim a target
    assert "| engine | dtype | context | ms/token" in markdown and "### Targets" in markdown
    assert "wrote " in capsys.readouterr().out
    floor = items["decode_floor"]
    assert floor["status"] == "ok" and floor["rows"]
    for r in floor["rows"]:  # × floor: the median of each round's step ÷ that round's own probe
        assert len(r["x_floor_rounds"]) == bench.QUICK["rounds"]
        assert r["x_floor"] == pytest.approx(statistics.median(r["x_floor_rounds"]))
        assert all(x > 0 for x in r["x_floor_rounds"])
        assert len(r["ms_rounds"]) == len(r["read_rounds"]) == bench.QUICK["rounds"]  # each round's step and probe
        assert r["read_bytes_per_s"] == pytest.approx(statistics.median(r["read_rounds"]))
        assert min(r["ms_rounds"]) <= r["ms_per_step"] <= max(r["ms_rounds"])
    assert "the read probe ranged from" in floor["summary"]


@pytest.mark.slow
def test_quick_suite_on_course_model(tmp_path):
    result, markdown = _run_cli(tmp_path)
    check_schema(result)
    for name in ("decode", "prefill", "cache_speedup", "load", "widgets"):
        assert result["items"][name]["status"] in ("ok", "not available"), result["items"][name]
    assert result["items"]["load"]["warm_s"] > 0


def test_not_available_items_carry_no_number(monkeypatch):
    """A part of the course that is not there yet is reported, never given a figure."""
    monkeypatch.setattr(bench, "notebook_paths", lambda: [])
    monkeypatch.setattr(bench.util, "find_spec", lambda name: None)
    ctx = bench._Context(torch.device("cpu"), bench.QUICK, False, print, "tiny")
    for item in (bench.bench_notebooks(ctx), bench.bench_grading(ctx), bench.bench_widgets(ctx)):
        assert item["status"] in ("not available", "skipped") and item["reason"]
        assert not any(isinstance(v, float) for v in item.values())


def test_bad_arguments_are_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # refused while parsing: one line, exit 2 (tests/test_cli_fuzz.py)
        main(["bench", "--quick", "--threads", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--skip", "everything"])
    with pytest.raises(ValueError, match="model"):
        bench.run_suite(items=["decode"], quick=True, model="gpt-5")


def test_prefill_flops_match_torch_flop_counter():
    """The matmul part of our FLOP count equals what torch counts for a real prefill of the tiny model."""
    model = tiny_model()
    c, T = model.config, 16
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(torch.randint(0, c.vocab_size, (1, T)), last_only=True)
    attention = 4 * c.n_layers * c.n_heads * c.head_dim * T * (T + 1) // 2  # SDPA, which the counter omits on CPU
    assert prefill_flops(c, T) - attention == counter.get_total_flops()


# --- course/fast.py ------------------------------------------------------------------------------------------
def test_gemv_linear_is_plain_linear_in_eager_mode():
    model = tiny_model()
    x = torch.randint(0, 256, (2, 7))
    before = model(x)
    use_gemv_linears(model)
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert isinstance(model.output, GemvLinear) and model.output.weight is model.tok_embeddings.weight
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def test_fast_model_routes_prefill_eager_and_decode_to_the_step_function():
    model = tiny_model()
    fast = FastModel(model, compile=False)
    calls = []
    fast._decode = lambda *a, **k: calls.append(a[0].shape) or model(*a, **k)
    assert fast.config is model.config and fast.dtype == model.dtype and fast.device == model.device
    ids = torch.randint(0, 256, (1, 9))
    cache = KVCache(model.config, 1, 20)
    prefill(fast, ids, cache)
    assert calls == []  # prefill ([1, 9]) stays eager
    decode_one_token(fast, ids[:, -1:], 9, cache)
    assert calls == [torch.Size([1, 1])]


@pytest.mark.slow
def test_compiled_decode_matches_eager_logits_and_greedy_tokens():
    eager = tiny_model(seed=3)
    fast = FastModel(tiny_model(seed=3))
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    caches = [KVCache(eager.config, 1, 40) for _ in range(2)]
    prefill(eager, ids, caches[0])
    prefill(fast, ids, caches[1])
    for pos in range(12, 20):  # several positions: the compiled step must not be stuck on the first one
        token = torch.tensor([[pos * 5 % 256]])
        a = decode_one_token(eager, token, pos, caches[0])
        b = decode_one_token(fast, token, pos, caches[1])
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert fast.compiled
    assert generate(fast, ids[0].tolist(), 16).tokens == generate(eager, ids[0].tolist(), 16).tokens


def _batch_item(eager_ms_2):
    rows = [dict(engine="eager", batch=1, ms_per_step=50.0, tokens_per_s=20.0, x_floor=1.2, x_b1_time=1.0,
                 x_b1_tokens=1.0),
            dict(engine="eager", batch=2, ms_per_step=eager_ms_2, tokens_per_s=2000 / eager_ms_2, x_floor=1.3,
                 x_b1_time=eager_ms_2 / 50, x_b1_tokens=100 / eager_ms_2)]
    prods = [dict(rows=1, ms=40.0, bytes_per_s=13e9), dict(rows=2, ms=70.0, bytes_per_s=7.5e9)]
    return {"rows": rows, "head_products": prods, "load_average": 0.5}


def test_batch_summary_explains_a_jump_and_calls_a_small_change_noise():
    from course.measure.decode_floor import batch_summary

    jump = batch_summary(_batch_item(85.0))  # the step grew 35 ms, the products 30 ms of it
    assert "+30.0 ms of the step's +35.0 ms (86%)" in jump and "noise" not in jump
    item = _batch_item(70.0)  # the step grew 20 ms, the products timed alone 30 ms: not "150 %"
    more = batch_summary(item)
    assert "+30.0 ms, more than the whole step's +20.0 ms" in more and "(150%)" not in more
    for ms in (51.0, 44.0):  # +1 ms, or faster: no jump to explain, and the sentence says so with the number
        text = batch_summary(_batch_item(ms))
        assert "within noise" in text and f"{ms - 50:+.1f} ms" in text and "of the step's" not in text


def test_batch_summary_puts_the_any_shape_step_beside_the_whole_step_graphs():
    from course.measure.decode_floor import batch_summary

    item = _batch_item(60.0)
    for engine, ms in (("compiled", (40.0, 41.0)), ("compiled, any shape", (46.5, 47.0))):
        for b, t in zip((1, 2), ms):
            item["rows"].append(dict(engine=engine, batch=b, ms_per_step=t, tokens_per_s=1000 * b / t, x_floor=t / 32,
                                     x_b1_time=t / ms[0], x_b1_tokens=b * ms[0] / t))
    text = batch_summary(item)
    assert "compiled, any shape: B=1 46.5 ms/step" in text
    assert "+6.5 ms at B=1, +6.0 ms at B=2" in text
    assert "any-shape" not in batch_summary(_batch_item(60.0))  # no such rows, no such sentence


def test_fairness_counts_other_programs_not_this_one():
    from course.measure.decode_floor import _busy_text, fairness

    fair, why = fairness(2, others=0.1, cores=2, load=2.0)  # the load average of 2 is this process's own threads
    assert fair and "0.10 of 2 cores" in why and "fair for 2" in why
    fair, why = fairness(2, others=0.9, cores=2)
    assert not fair and "NOT fair for 2" in why
    assert fairness(1, others=0.9, cores=2)[0]  # one thread still has a core to itself
    fair, why = fairness(2, others=None, cores=2, load=2.0)  # where /proc/stat is missing: the load average
    assert not fair and "load average 2.0" in why
    assert _busy_text(dict(others_cores=0.05, load_average=1.9, fair=True)) == "0.05 cores"
    assert _busy_text(dict(others_cores=None, load_average=1.9, fair=False)) == "load 1.9 (not fair)"


def test_floor_summary_says_why_eager_did_not_gain_from_a_second_thread_from_its_own_rows():
    from course.measure.decode_floor import BLAS_PRODUCTS, floor_summary

    def rows(eager1, eager2, blas1, blas2, fair=True):
        out = []
        for n, e, b in ((1, eager1, blas1), (2, eager2, blas2)):
            for engine, ms in (("eager", e), (BLAS_PRODUCTS, b)):
                out.append(dict(threads=n, engine=engine, ms_per_step=ms, floor_ms=20.0, bytes_per_step=5.4e8,
                                read_bytes_per_s=2.7e10, x_floor=ms / 20.0, fairness="fair", fair=fair or n == 1))
        return out

    text = floor_summary(rows(41.2, 41.5, 33.0, 32.6))  # BLAS itself did not speed up
    assert "is about as fast as with 1 (41.5 vs 41.2 ms)" in text and "32.6 ms with 2 threads against 33.0" in text
    assert "compiled step" not in text  # no compiled rows: nothing said of them
    both = rows(41.2, 41.5, 33.0, 32.6) + [dict(threads=n, engine="compiled", ms_per_step=ms, floor_ms=20.0,
                                                 bytes_per_step=5.4e8, read_bytes_per_s=2.7e10, x_floor=ms / 20.0,
                                                 fairness="fair", fair=True) for n, ms in ((1, 19.3), (2, 17.7))]
    assert "the compiled step, on its own kernels, did (17.7 vs 19.3 ms)." in floor_summary(both)
    text = floor_summary(rows(41.2, 40.6, 33.0, 32.6))  # 1.5 % is not a gain
    assert "is about as fast as with 1 (40.6 vs 41.2 ms)" in text and "BLAS library" in text
    assert "the rest of its step" not in text  # the products explain all of it: nothing more is said
    slower = rows(63.2, 75.3, 51.5, 55.7)  # BLAS unchanged, the rest 19.6 ms with 2 threads against 11.7 with 1
    for r, spread in zip(slower, ([60.1, 66.0], None, [61.3, 166.9], None)):
        if spread:
            r["ms_rounds"] = spread
    text = floor_summary(slower)
    assert "is slower than with 1 (75.3 vs 63.2 ms)" in text and "55.7 ms with 2 threads against 51.5" in text
    assert "the rest of its step (every operation but the products) took 19.6 ms with 2 threads against 11.7" in text
    assert "ranged from 61.3 to 166.9 ms, with 1 from 60.1 to 66.0" in text
    text = floor_summary(rows(63.2, 75.3, 51.5, 55.7))  # no rounds recorded: the rest, without their spread
    assert "took 19.6 ms with 2 threads against 11.7 with 1: with nothing to gain" in text and "ranged" not in text
    text = floor_summary(rows(41.2, 45.0, 33.0, 18.0))  # BLAS did: the step's small operations are to blame
    assert "is slower than with 1" in text and "small operations" in text and "BLAS library" not in text
    text = floor_summary(rows(41.2, 60.0, 33.0, 40.0, fair=False))
    assert "other programs held the cores" in text
    text = floor_summary(rows(41.2, 30.0, 33.0, 18.0))
    assert "is faster than with 1 (30.0 vs 41.2 ms)." in text and "BLAS library" not in text


def test_an_unsteady_read_probe_is_said_beside_the_floor_and_its_targets():
    from course.measure.decode_floor import floor_summary
    from course.measure.timing import UNSTEADY, steadiness

    steady, text = steadiness([30e9, 31e9, 29e9])
    assert steady and text == "the read probe ranged from 29.0 to 31.0 GB/s over 3 rounds"
    steady, text = steadiness([28.1e9, 55.9e9, 40e9])  # today's AMD EPYC with 2 threads
    assert not steady and text == "the read probe ranged from 28.1 to 55.9 GB/s over 3 rounds"
    assert steadiness([20e9, 20e9 * UNSTEADY])[0] and not steadiness([20e9, 20e9 * UNSTEADY * 1.01])[0]
    assert steadiness([30e9]) == (True, "")  # one round: nothing to compare

    def rows(probes):
        return [dict(threads=1, engine=e, ms_per_step=ms, floor_ms=20.0, bytes_per_step=5.4e8, read_bytes_per_s=2.7e10,
                     x_floor=ms / 20.0, fairness="fair", fair=True, others_cores=0.01, read_rounds=probes)
                for e, ms in (("eager", 60.0), ("compiled", 24.0))]

    quiet = floor_summary(rows([27e9, 28e9]))
    assert "unsteady" not in quiet and "the read probe ranged from 27.0 to 28.0 GB/s over 2 rounds." in quiet
    assert ("the read probe ranged from 20.0 to 40.0 GB/s over 2 rounds: the memory system was unsteady, so ratios to "
            "the floor are rough." in floor_summary(rows([20e9, 40e9])))
    target = next(t for t in bench.REGISTRY["decode_floor"].targets if t.name == "compiled_1t_x_floor")
    assert target.measure({"rows": rows([27e9, 28e9])}) == (1.2, "other programs 0.01 cores")
    assert target.measure({"rows": rows([20e9, 40e9])}) == (
        1.2, "other programs 0.01 cores; read probe 20.0–40.0 GB/s, unsteady")


def test_batch_summary_says_how_busy_other_programs_were():
    from course.measure.decode_floor import batch_summary

    item = _batch_item(60.0)
    busy = float(os.cpu_count() or 1)  # every core taken by other programs
    item["others_cores"] = busy
    text = batch_summary(item)
    assert f"other programs used {busy:.2f} of" in text.lower() and "timings are inflated" in text
    item["others_cores"] = 0.0
    assert "timings are inflated" not in batch_summary(item)


def test_serving_items_time_the_lessons_compiled_engine_beside_eager(one_thread):
    """batching and serving run the eager model and FastModel(model, any_shape=True) side by side; the targets
    read the compiled rows, and the compiled server's tokens are the eager server's."""
    from course.cli import bench_serving

    ctx = bench._Context(torch.device("cpu"), bench.FULL, True, print, "tiny")  # tiny model: small trace sizes
    batching = bench_serving.bench_batching(ctx)
    assert batching["primary"] == bench_serving.ANY_SHAPE and set(batching["engines"]) == {"eager",
                                                                                           bench_serving.ANY_SHAPE}
    by_engine = {e: [r for r in batching["rows"] if r["engine"] == e] for e in batching["engines"]}
    assert [r["batch"] for r in by_engine["eager"]] == [r["batch"] for r in by_engine[bench_serving.ANY_SHAPE]]
    assert "compiled, any shape: at context" in bench_serving._batching_text(batching)
    serving = bench_serving.bench_serving(ctx)
    assert serving["primary"] == bench_serving.ANY_SHAPE and serving["engines_agree"]
    for summary in serving["engines"].values():
        assert summary["outputs_identical"] and summary["throughput_ratio"] > 0
    assert serving["compiled_over_eager"] > 0
    assert f"took {serving['compiled_over_eager']:.2f}× the" in bench_serving._serving_text(serving)
    assert ctx.serving_engine("float32") is ctx.serving_engine("float32")  # one engine, compiled once
    assert ctx.serving_engine("float32").model is ctx.model("float32")


def test_roofline_is_the_longer_of_reading_and_arithmetic():
    from course.measure.decode_floor import roofline_ms

    assert roofline_ms(1e9, 1e9, 1e10, 1e11) == pytest.approx(100.0)  # reading 100 ms, arithmetic 10 ms
    assert roofline_ms(1e9, 1e11, 1e10, 1e11) == pytest.approx(1000.0)  # arithmetic 1 s


def test_batch_ceiling_finds_the_ridge_and_the_most_batching_can_give():
    from course.measure.decode_floor import batch_ceiling

    weights, kv, flops, read, peak = 500e6, 3e6, 270e6, 25e9, 100e9  # bytes, bytes/sequence, flops/token, B/s, F/s
    by_batch = {b: weights + b * kv for b in (1, 2, 4, 8, 16, 32, 64)}
    c = batch_ceiling(by_batch, flops, read, peak, b1_ms=25.0)
    # arithmetic (B × 2.7 ms) passes reading ((500 + 3B) MB ÷ 25 GB/s = 20.2 ms at B = 8) between B = 4 and 8
    assert c["ridge_batch"] == 8
    assert c["tokens_per_s"] == pytest.approx(peak / flops)  # past the ridge every batch gives the peak's rate
    assert c["gain"] == pytest.approx(peak / flops * 25.0 / 1e3)  # ÷ the measured B = 1 rate (40 tokens/s)
    slow_peak = batch_ceiling(by_batch, flops, read, 1e15, b1_ms=25.0)  # arithmetic never binds
    assert slow_peak["ridge_batch"] is None and slow_peak["batch"] == 64


def _ceiling_rows(gain_b64):
    rows = {1: dict(ms_per_step=20.0, tokens_per_s=50.0, x_b1_tokens=1.0, x_b1_time=1.0, roofline_ms=16.0),
            8: dict(ms_per_step=30.0, tokens_per_s=8000 / 30, x_b1_tokens=8 * 20 / 30, x_b1_time=1.5, roofline_ms=21.6),
            64: dict(ms_per_step=64 * 20 / gain_b64, tokens_per_s=50.0 * gain_b64, x_b1_tokens=gain_b64,
                     x_b1_time=64 / gain_b64, roofline_ms=150.0)}
    return rows


def test_ceiling_sentence_says_a_target_is_out_of_reach_only_when_the_roofline_is_below_it():
    from course.measure.decode_floor import ceiling_sentence

    c = dict(read_bytes_per_s=27e9, flops_per_s=100e9, peaks={"step's product": 100e9, "BLAS square": 80e9},
             ridge_batch=8, batch=64, tokens_per_s=370.0, gain=7.4)
    text = ceiling_sentence(c, 270e6, _ceiling_rows(6.0), 1)
    assert "100 GFLOP/s" in text and "step's product 100, BLAS square 80" in text and "from B = 8 on" in text
    assert "at most 370 tokens/s (B = 64), 7.4×" in text and "6.0× (81% of that ceiling)" in text
    assert "21.6 ms, 1.08× B = 1's measured time (measured 1.50×)" in text
    assert "out of reach with 1 thread on this machine" in text
    high = ceiling_sentence(dict(c, gain=14.0, tokens_per_s=700.0), 270e6, _ceiling_rows(11.0), 2)
    assert "out of reach" not in high and "11.0× (79% of that ceiling)" in high


def test_batch_summary_speaks_for_each_thread_count():
    from course.measure.decode_floor import batch_summary

    item = _batch_item(60.0)
    two = [dict(r, threads=2, ms_per_step=r["ms_per_step"] * 0.7) for r in item["rows"]]
    item["rows"] = [dict(r, threads=1) for r in item["rows"]] + two
    item["threads"] = [1, 2]
    item["others_cores"] = {"1": 0.05, "2": 0.9}
    text = batch_summary(item)
    assert "With 1 thread:" in text and "With 2 threads:" in text
    assert "eager: B=1 50.0 ms/step" in text and "eager: B=1 35.0 ms/step" in text
    assert "fair for 1 thread(s)" in text and "NOT fair for 2 thread(s)" in text


def test_arithmetic_peak_measures_both_products(tiny):
    from course.measure.decode_floor import arithmetic_peak

    peaks = arithmetic_peak(tiny, repeats=2)
    assert len(peaks) == 2 and "BLAS square" in peaks and all(v > 1e8 for v in peaks.values())


def test_batch_ratios_pair_each_round_so_a_drifting_machine_cancels():
    """B = 8 takes 1.4× B = 1 in every round while the machine's speed drifts from round to round (another tenant);
    within a round the two saw the same machine, so each round's ratio, and their median, is 1.4 (within the 1 %
    spread of B = 8's two samples)."""
    from course.measure.decode_floor import paired_ratio

    speed = [1.0, 1.6, 1.1, 2.0, 1.3]  # per round, 2 samples each
    b1 = [20e-3 * s for s in speed for _ in range(2)]
    b8 = [28e-3 * s * (1 + 0.01 * k) for s in speed for k in range(2)]
    assert paired_ratio(b8, b1, 2) == pytest.approx(1.407, abs=0.001)
    assert paired_ratio(b1, b1, 2) == 1.0
    b8[6] = 1.0  # one absurd sample moves its round's median, not the median over rounds
    assert paired_ratio(b8, b1, 2) == pytest.approx(1.407, abs=0.001)
    with pytest.raises(ValueError, match="whole rounds of 2"):
        paired_ratio(b8[:-1], b1[:-1], 2)
    with pytest.raises(ValueError, match="same whole rounds"):
        paired_ratio(b8, b1[:-2], 2)
