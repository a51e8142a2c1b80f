"""course.measure.timing and course.engine.device.synchronize: the clock waits for the device, medians, probes.

The CUDA path is exercised without a GPU: torch.cuda.Event and torch.cuda.synchronize are replaced
by fakes that record what was asked of them.
"""
import math
import time

import pytest
import torch

import course.engine.device
import course.measure.timing as timing
from course.measure.timing import Stopwatch, Timing, matmul_flops, measure, memory_bandwidth


class FakeEvent:
    """Stands in for torch.cuda.Event; elapsed_time hands out preset milliseconds in turn."""
    log: list = []
    elapsed_ms: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "Stopwatch must create timing events"
        self.recorded = self.synchronized = False

    def record(self, stream=None):
        self.recorded = True
        FakeEvent.log.append("record")

    def synchronize(self):
        self.synchronized = True
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end):
        assert self.recorded and end.recorded and end.synchronized, "read the clock only after the end event is done"
        return FakeEvent.elapsed_ms.pop(0)


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.log, FakeEvent.elapsed_ms = [], []
    synced = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    return synced


def test_stopwatch_cuda_uses_events_and_waits_for_the_end_event(fake_cuda):
    FakeEvent.elapsed_ms = [250.0]
    with Stopwatch("cuda") as sw:
        assert FakeEvent.log == ["record"]  # start recorded on the stream before the work
    assert FakeEvent.log == ["record", "record", "synchronize"]
    assert sw.seconds == pytest.approx(0.25)  # events report milliseconds


def test_measure_on_cuda_takes_the_median_of_event_times(fake_cuda):
    calls = []
    FakeEvent.elapsed_ms = [30.0, 10.0, 20.0, 1000.0, 40.0]
    t = measure(lambda: calls.append(1), "cuda", warmup=2, repeats=5)
    assert len(calls) == 7  # 2 warm-up + 5 timed
    assert t.times == pytest.approx([0.03, 0.01, 0.02, 1.0, 0.04])
    assert t.median == pytest.approx(0.03)  # the one slow outlier does not move it
    assert t.best == pytest.approx(0.01)
    assert FakeEvent.log.count("synchronize") == 5


def test_device_synchronize_calls_cuda_synchronize(fake_cuda):
    course.engine.device.synchronize("cuda")
    course.engine.device.synchronize(torch.device("cuda:0"))
    course.engine.device.synchronize("cpu")  # nothing to wait for on the CPU
    assert [str(d) for d in fake_cuda] == ["cuda", "cuda:0"]


def test_stopwatch_cpu_synchronizes_at_both_ends(monkeypatch):
    seen = []
    monkeypatch.setattr(timing, "synchronize", lambda device: seen.append(torch.device(device).type))
    with Stopwatch("cpu") as sw:
        time.sleep(0.01)
    assert seen == ["cpu", "cpu"]
    assert sw.seconds >= 0.009  # sleep guarantees at least this much wall time


def test_stopwatch_measures_elapsed_wall_time():
    with Stopwatch() as sw:
        time.sleep(0.02)
    assert 0.019 <= sw.seconds < 5
    assert math.isnan(Stopwatch().seconds)  # no number until something was measured


def test_measure_counts_warmup_and_repeats_and_times_each_call():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.005)

    t = measure(fn, warmup=3, repeats=4)
    assert len(calls) == 7 and len(t.times) == 4
    assert all(s >= 0.0045 for s in t.times)
    assert min(t.times) <= t.median <= max(t.times)


def test_timing_median_and_repr():
    t = Timing([0.003, 0.001, 0.002, 0.010])
    assert t.median == pytest.approx(0.0025)
    assert t.best == pytest.approx(0.001)
    assert "2.50 ms" in repr(t) and "4 runs" in repr(t)


def test_measure_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats"):
        measure(lambda: None, repeats=0)


def test_memory_bandwidth_probe_is_positive_and_uses_the_better_figure():
    probe = memory_bandwidth("cpu", nbytes=8 << 20, repeats=2)
    assert probe.nbytes == 8 << 20
    assert probe.read_bytes_per_s > 0 and probe.copy_bytes_per_s > 0
    assert probe.bytes_per_s == max(probe.read_bytes_per_s, probe.copy_bytes_per_s)
    assert probe.bytes_per_s < 1e14  # a finite, physical number (100 TB/s is beyond any machine)


def test_the_cpu_probe_reads_huge_pages_where_linux_offers_them_as_the_weights_do(monkeypatch):
    from course.engine import arena

    asked = []
    real = arena.huge_page_tensor

    def spy(numel, dtype):
        t = real(numel, dtype)
        asked.append(t is not None)
        return t

    monkeypatch.setattr(arena, "huge_page_tensor", spy)
    probe = memory_bandwidth("cpu", nbytes=8 << 20, repeats=2)
    assert len(asked) == 2 and probe.huge_pages == (all(asked) and arena.huge_pages_offered())
    assert 0 < probe.read_bytes_per_s < 1e14 and probe.nbytes == 8 << 20
    monkeypatch.setattr(arena, "huge_page_tensor", lambda numel, dtype: None)  # not offered: plain memory
    plain = memory_bandwidth("cpu", nbytes=8 << 20, repeats=2)
    assert not plain.huge_pages and 0 < plain.read_bytes_per_s < 1e14


def test_a_read_probe_allocates_its_buffer_once_and_reads_it_at_every_call(monkeypatch):
    from course.engine import arena
    from course.measure.timing import ReadProbe

    asked = []
    real = arena.huge_page_tensor
    monkeypatch.setattr(arena, "huge_page_tensor", lambda numel, dtype: asked.append(numel) or real(numel, dtype))
    probe = ReadProbe("cpu", nbytes=8 << 20, repeats=2)
    where = probe.buffer.data_ptr()
    reads = [probe() for _ in range(3)]
    assert asked == [2 << 20] and probe.buffer.data_ptr() == where  # one buffer of 8 MiB, never a second
    assert probe.huge_pages == arena.huge_pages_offered() and torch.all(probe.buffer == 1.0)
    assert all(0 < r < 1e14 for r in reads)
    probe.close()
    with pytest.raises(RuntimeError, match="closed"):
        probe()
    monkeypatch.setattr(arena, "huge_page_tensor", lambda numel, dtype: None)  # not offered: plain memory
    plain = ReadProbe("cpu", nbytes=8 << 20, repeats=2)
    assert not plain.huge_pages and 0 < plain() < 1e14


def test_matmul_flops_probe_is_positive_and_finite():
    flops = matmul_flops("cpu", n=128, repeats=2)
    assert 0 < flops < 1e16
