"""course/measure/bytes_line.py: random models of real shapes, the least-squares line, and a verdict that follows the
values. Nothing here asserts a speed: the timed run uses tiny shapes, eagerly, and checks only its structure."""
from __future__ import annotations

import pytest
import torch

from course.engine.config import ModelConfig
from course.measure import bytes_line as BL
from course.measure.costs import decode_cost


def _line(points_ms: list[tuple[str, float, float]], probe: float, load=(0.5, 0.5)) -> BL.BytesLine:
    """A BytesLine over (name, bytes, ms) points, fitted as the real run fits them."""
    points = [BL.Point(n, 0, b, ms) for n, b, ms in points_ms]
    fit = BL.fit_line([p.bytes_per_step for p in points], [p.ms_per_step for p in points])
    return BL.BytesLine(points, probe, [probe], fit, "cpu", "float32", 1, True, load, 1.0)


def test_fit_recovers_bandwidth_and_fixed_cost_of_an_exact_line():
    bw, fixed = 12e9, 1.5  # bytes/s, ms
    xs = [0.5e9, 1.5e9, 4.4e9]
    fit = BL.fit_line(xs, [x / bw * 1e3 + fixed for x in xs])
    assert fit.bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-9)
    assert fit.fixed_ms == pytest.approx(fixed, abs=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.predict_ms(2e9) == pytest.approx(2e9 / bw * 1e3 + fixed)


def test_fit_rejects_too_few_points():
    with pytest.raises(ValueError, match="at least 2 points"):
        BL.fit_line([1e9], [10.0])
    with pytest.raises(ValueError, match="at least 2 points"):
        BL.fit_line([1e9, 1e9], [10.0, 11.0])


def test_verdict_follows_the_values():
    on = _line([("a", 0.5e9, 0.5e9 / 10e9 * 1e3 + 2), ("b", 1.5e9, 152.0), ("c", 4.4e9, 442.0)], probe=10.5e9)
    assert on.bandwidth_bound and on.verdict().startswith("Bandwidth-bound: step time grows with bytes read at 10.0")
    assert "the read probe's 10.5 GB/s" in on.verdict() and f"(R² {on.fit.r2:.3f})" in on.verdict()
    # held against another bandwidth (the lesson's machine profile), the same line can miss it
    assert "outside ±25%" in on.verdict(20e9, "the machine profile") and "profile's 20.0 GB/s" in on.verdict(20e9,
                                                                                                           "the machine profile")
    scattered = _line([("a", 0.5e9, 300.0), ("b", 1.5e9, 100.0), ("c", 4.4e9, 500.0)], probe=10e9)
    assert not scattered.on_the_line and "off one line" in scattered.verdict()
    slow = _line([("a", 1e9, 200.0), ("b", 2e9, 400.0), ("c", 4e9, 800.0)], probe=10e9)  # 5 GB/s: half the probe
    assert slow.on_the_line and not slow.at_probe_bandwidth and "50% of the read probe's" in slow.verdict()
    for line in (on, scattered, slow):
        assert len(line.verdict().split()) <= 30  # a headline


def test_the_details_say_the_fit_its_split_and_the_probes_in_short_sentences():
    from dataclasses import replace

    on = replace(_line([("a", 1e9, 100.0), ("b", 2e9, 200.0), ("c", 4e9, 400.0)], probe=10e9), probes=[7e9, 13e9])
    details = on.details()
    assert "Fit: time = bytes ÷ 10.0 GB/s + 0.00 ms per step" in details[0]
    assert "a 100%, b 100%, c 100%" in details[1] and "(median of 2, 7.0 to 13.0)" in details[2]
    assert all(len(d.split()) <= 35 for d in details)


def test_which_cost_dominates_comes_from_the_fit():
    # a GPU-like line: 3 TB/s with a 4 ms fixed cost per step (launches); 0.27 GB (135M in bf16) vs 13.5 GB (7B)
    line = _line([(n, b, b / 3e12 * 1e3 + 4.0) for n, b in [("small", 0.27e9), ("mid", 2.2e9), ("big", 13.5e9)]],
                 probe=3e12)
    small, big = line.points[0], line.points[-1]
    assert line.dominated_by(small) == "fixed cost" and line.dominated_by(big) == "bytes"
    assert line.bytes_share(small) == pytest.approx(0.09 / 4.09, rel=1e-3)
    assert "small 2%" in line.details()[1] and "big 53%" in line.details()[1]


def test_a_negative_fixed_cost_is_printed_with_a_minus_and_called_noise():
    """A reviewed run printed 'time = bytes ÷ 23.7 GB/s + -4.15 ms', then split every step 100% bytes, 0% fixed
    cost, as if the impossible intercept meant something."""
    neg = _line([("a", 0.5e9, 0.5e9 / 10e9 * 1e3 - 4.0), ("b", 1.5e9, 146.0), ("c", 4.4e9, 436.0)], probe=10e9)
    text = str(neg)
    assert "GB/s − 4.00 ms per step" in text and "+ -" not in text
    assert "negative" in text and "noise" in text and "Share of each step" not in text
    pos = _line([("a", 0.5e9, 54.0), ("b", 1.5e9, 154.0), ("c", 4.4e9, 444.0)], probe=10e9)
    assert "GB/s + 4.00 ms per step" in str(pos) and "negative" not in str(pos)
    assert "Timed compiled, float32 on cpu, 1 thread," in str(pos)
    from dataclasses import replace
    assert ", 2 threads, " in str(replace(pos, threads=2))


def test_random_model_has_the_shape_and_ordinary_numbers():
    config = ModelConfig.from_name("tiny").with_(n_layers=3)
    model = BL.random_model(config, seed=1)
    assert sum(p.numel() for p in model.parameters()) == config.n_params
    tiny = torch.finfo(torch.float32).tiny  # anything smaller than this but not 0 is a denormal
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert not ((p.abs() < tiny) & (p != 0)).any(), name
        if name.endswith("norm.weight"):
            assert (p == 1).all()
        else:
            assert 0.015 < float(p.detach().std()) < 0.025
    logits = BL.Step(model, context=8, compile=False)()
    assert logits.shape == (1, config.vocab_size) and torch.isfinite(logits).all()


def test_read_bytes_are_the_decode_cost_of_the_context():
    c = ModelConfig.from_name("tinyllama-1.1b")
    assert BL.read_bytes(c, 64, torch.float32) == decode_cost(c, 64, 4).bytes
    assert BL.read_bytes(c, 64, torch.bfloat16) == decode_cost(c, 64, 2).bytes


def test_default_shapes_and_the_full_switch(monkeypatch):
    monkeypatch.delenv("KVCOURSE_FULL", raising=False)
    assert BL.default_shapes("cpu") == BL.CPU_SHAPES and len(BL.CPU_SHAPES) >= 3
    monkeypatch.setenv("KVCOURSE_FULL", "1")
    assert BL.default_shapes("cpu") == BL.CPU_FULL_SHAPES
    assert "llama-2-7b" in BL.default_shapes("cuda")
    for name in BL.CPU_FULL_SHAPES + BL.GPU_SHAPES:
        ModelConfig.from_name(name)  # every shape is a preset with published numbers


def test_bytes_line_runs_end_to_end_on_tiny_shapes(one_thread):
    t = ModelConfig.from_name("tiny")
    shapes = [t, t.with_(name="tiny-wide", dim=96, n_heads=6, ffn_dim=256, n_layers=3),
              t.with_(name="tiny-deep", dim=128, n_heads=8, n_kv_heads=4, ffn_dim=384, n_layers=4)]
    line = BL.bytes_line(shapes, compile=False, budget_s=0.05, probe_bytes=8 << 20, progress=False)
    assert [p.name for p in line.points] == ["tiny", "tiny-wide", "tiny-deep"]
    assert [p.bytes_per_step for p in line.points] == [BL.read_bytes(s, BL.CONTEXT, torch.float32) for s in shapes]
    assert all(p.ms_per_step > 0 and len(p.times_ms) >= 3 for p in line.points)
    assert len(line.probes) == 4 and not line.compiled  # the models took 4 rounds of turns
    apart = BL.bytes_line(shapes[:2], compile=False, budget_s=0.05, probe_bytes=8 << 20, progress=False,
                          resident_bytes=0)  # too big to hold together: built, timed and freed in turn
    assert len(apart.probes) == 3 and [p.name for p in apart.points] == ["tiny", "tiny-wide"]
    text = str(line)
    assert all(p.name in text for p in line.points) and line.verdict() in text
    assert line.values()["r2"] == line.fit.r2
    with pytest.raises(ValueError, match="at least 2 shapes"):
        BL.bytes_line([t], compile=False, progress=False)


def test_models_built_one_at_a_time_never_share_memory_with_the_probe_buffer(one_thread, monkeypatch):
    """Models too big to hold together are built one at a time so the largest fits: the read probe's buffer is
    freed before each is built. Together, one probe buffer serves every round and is freed at the end."""
    live, at_build = [], []

    class Probe(BL.ReadProbe):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            live.append(self)

    build = BL.random_model
    monkeypatch.setattr(BL, "ReadProbe", Probe)
    monkeypatch.setattr(BL, "random_model", lambda *a, **k: at_build.append(
        sum(p.buffer is not None for p in live)) or build(*a, **k))
    t = ModelConfig.from_name("tiny")
    shapes = [t, t.with_(name="tiny-wide", dim=96, n_heads=6, ffn_dim=256, n_layers=3)]
    BL.bytes_line(shapes, compile=False, budget_s=0.02, probe_bytes=8 << 20, progress=False, resident_bytes=0)
    assert at_build == [0, 0] and len(live) == 3 and all(p.buffer is None for p in live)
    live.clear(), at_build.clear()
    BL.bytes_line(shapes, compile=False, budget_s=0.02, probe_bytes=8 << 20, progress=False)
    assert len(live) == 1 and live[0].buffer is None  # one buffer for all the rounds, freed at the end


def test_a_line_that_does_not_rise_says_so_instead_of_dividing_by_infinity():
    """On a busy machine a bigger model's steps came out no slower: the slope was <= 0 and the lesson printed
    'time = bytes ÷ inf GB/s' with every model 'bound by fixed cost'."""
    line = _line([("a", 1e9, 300.0), ("b", 2e9, 200.0), ("c", 4e9, 250.0)], probe=10e9)
    assert not line.rising and not line.on_the_line and not line.bandwidth_bound
    assert "did not grow" in line.verdict() and "inf" not in str(line) and "Fit:" not in str(line)
    line.plot()


@pytest.mark.slow
def test_the_compiled_step_agrees_with_the_eager_one():
    config = ModelConfig.from_name("tiny").with_(n_layers=2)
    model = BL.random_model(config, seed=2, context=8)
    eager, step = BL.Step(model, context=8, compile=False), BL.Step(model, context=8, compile=True)
    torch.testing.assert_close(step(), eager(), atol=1e-4, rtol=1e-4)
    assert not eager.compiled and step.compiled == (step.step.fallback is None)


def test_the_models_are_held_together_only_when_half_the_free_memory_holds_them(one_thread, monkeypatch):
    """A laptop with little memory free builds, times and frees the models in turn instead of swapping."""
    import psutil

    from course.engine.config import ModelConfig

    t = ModelConfig.from_name("tiny")
    shapes = [t, t.with_(name="tiny-wide", dim=96, n_heads=6, ffn_dim=256, n_layers=3)]
    free = type("Free", (), {"available": 10_000})()  # 10 kB free: nothing fits twice over
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    line = BL.bytes_line(shapes, compile=False, budget_s=0.02, probe_bytes=8 << 20, progress=False)
    assert len(line.probes) == len(shapes) + 1, "one probe before each model and one after: built one at a time"
