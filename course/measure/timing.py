"""Timing that tells the truth: warm-up, repeats, medians, and device synchronisation.

GPU work is queued asynchronously, so a CPU clock read right after a launch measures the launch,
not the work. On CUDA we time with CUDA events; elsewhere with perf_counter after synchronising.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from course.engine.device import synchronize


@dataclass
class Timing:
    """Seconds per call: the median of `times` (robust to the odd slow run on a shared machine)."""
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    def __repr__(self) -> str:
        return f"Timing(median={self.median * 1e3:.2f} ms over {len(self.times)} runs)"


class Stopwatch:
    """`with Stopwatch(device) as sw: ...` then `sw.seconds`. Synchronises the device at both ends."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seconds = float("nan")

    def __enter__(self):
        if self.device.type == "cuda":
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            synchronize(self.device)
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3  # events report milliseconds
        else:
            synchronize(self.device)
            self.seconds = time.perf_counter() - self._t0
        return False


def measure(fn: Callable[[], object], device: torch.device | str = "cpu", warmup: int = 1, repeats: int = 5) -> Timing:
    """Run fn `warmup` times untimed (caches, allocator, lazy init), then time `repeats` runs."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    result = Timing()
    for _ in range(repeats):
        with Stopwatch(device) as sw:
            fn()
        result.times.append(sw.seconds)
    return result


@dataclass
class BandwidthProbe:
    read_bytes_per_s: float  # streaming reads (a sum over a large buffer)
    copy_bytes_per_s: float  # reads + writes of a large copy, counted both ways
    nbytes: int
    huge_pages: bool = False  # the buffers asked Linux for transparent huge pages (course.engine.arena)

    @property
    def bytes_per_s(self) -> float:
        """The figure to divide bytes-read-per-step by: the better of the two probes."""
        return max(self.read_bytes_per_s, self.copy_bytes_per_s)


def memory_bandwidth(device: torch.device | str = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> BandwidthProbe:
    """This machine's memory bandwidth, with a buffer far larger than any cache (default 256 MiB).

    On the CPU the buffers ask Linux for transparent huge pages where it offers them (course.engine.arena), the
    memory the compiled decode step's weights are moved onto: a floor must be read from memory of the same kind
    as the weights, or a plain sum over the weights beats it. On the course's AMD EPYC host, 1 thread, a 1 GiB
    buffer on 4 KB pages read at 22–23 GB/s and the same buffer on huge pages at 26–30.
    """
    reader = ReadProbe(device, nbytes=nbytes, repeats=repeats)  # the read; its buffer is the copy's source
    src, (dst, huge_dst) = reader.buffer, _probe_buffer(reader.device, nbytes // 4, 0.0)
    read = reader()
    copy = measure(lambda: dst.copy_(src), reader.device, warmup=1, repeats=repeats)
    return BandwidthProbe(read_bytes_per_s=read, copy_bytes_per_s=2 * src.numel() * 4 / copy.median,
                          nbytes=src.numel() * 4, huge_pages=reader.huge_pages and huge_dst)


def _probe_buffer(device: torch.device, n: int, value: float) -> tuple[torch.Tensor, bool]:
    """n float32s, all `value` (written once, so every page is there before any timing); on the CPU on huge pages
    where Linux offers them (course.engine.arena). Returns the buffer and whether it is on huge pages."""
    if device.type == "cpu":
        from course.engine.arena import huge_page_tensor

        buffer = huge_page_tensor(n, torch.float32)
        if buffer is not None:
            return buffer.fill_(value), True
    return torch.full((n,), value, dtype=torch.float32, device=device), False


class ReadProbe:
    """memory_bandwidth's streaming-read probe with its buffer allocated once, for a caller that probes again
    between rounds: calling it returns bytes/s. Linux faulted a fresh buffer on huge pages in at 0.65–2.4 GB/s on
    the course's AMD EPYC host (1 GiB and its copy's partner: 1–3 s a probe, every time); reading an existing one
    takes a few tenths of a second. `close()` (or dropping the probe) frees it."""

    def __init__(self, device: torch.device | str = "cpu", nbytes: int = 256 << 20, repeats: int = 3):
        self.device, self.repeats = torch.device(device), repeats
        self.buffer, self.huge_pages = _probe_buffer(self.device, nbytes // 4, 1.0)

    def __call__(self) -> float:
        if self.buffer is None:
            raise RuntimeError("this ReadProbe was closed: make a new one")
        read = measure(lambda: self.buffer.sum(), self.device, warmup=1, repeats=self.repeats)
        bytes_per_s = self.buffer.numel() * 4 / read.median
        _fastest[self.device.type] = max(bytes_per_s, fastest_read(self.device))
        return bytes_per_s

    def close(self) -> None:
        self.buffer = None


_fastest: dict[str, float] = {}


def fastest_read(device: torch.device | str = "cpu") -> float:
    """The fastest read (bytes/s) a ReadProbe in this process measured on this kind of device: a floor from it
    holds at any moment (a shared host's memory read 30 GB/s, and 45 a few minutes on: tenants it cannot see)."""
    return _fastest.get(torch.device(device).type, 0.0)


def matmul_flops(device: torch.device | str = "cpu", n: int = 1024, dtype: torch.dtype = torch.float32,
                 repeats: int = 5) -> float:
    """Achieved FLOP/s of an n×n by n×n matmul (2·n³ floating-point operations)."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = measure(lambda: a @ b, device, warmup=2, repeats=repeats)
    return 2 * n ** 3 / t.median
