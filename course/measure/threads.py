"""CPU threads for timing: how busy other programs keep the cores, a steady thread count, and set one back.

    others_busy      cores' worth of CPU that programs other than this one used over a stretch of time
    steady_threads   choose PyTorch's CPU thread count for timing, and say why (lessons print the reason)
    asked_threads    the count KVCOURSE_THREADS asks for (None: unset), checked, with what happens to it

The load average is no good for the question "is someone else using my cores?": it counts this process's
own threads too, so a benchmark that has just run two threads for a minute finds a load of 2 on an empty
two-core machine. On Linux the kernel's per-CPU accounting (/proc/stat; see `man 5 proc`) says how much
CPU time every program used, and os.times() how much of it was this process; the difference is the others
(steal time, which a virtual machine's host took for other guests, counts as others too).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

BUSY_CORES = 0.5  # other programs using more than this many cores' worth of CPU: a busy machine

PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class CpuClock:
    """One reading: wall time, CPU time every program used so far (None where /proc/stat is missing), and this
    process's own CPU time (all its threads), in seconds."""
    wall: float
    everyone: float | None
    own: float


def _everyone_cpu_s(path: str = PROC_STAT) -> float | None:
    """Busy CPU seconds summed over every core since boot: user, nice, system, irq, softirq and steal."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    ticks = [int(x) for x in fields[1:]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + (ticks[7] if len(ticks) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_clock() -> CpuClock:
    t = os.times()
    return CpuClock(wall=time.perf_counter(), everyone=_everyone_cpu_s(), own=t.user + t.system)


def others_busy(before: CpuClock, after: CpuClock) -> float | None:
    """Cores' worth of CPU other programs used between two readings (0.5: half a core on average); None where
    the system's accounting cannot be read (then only the load average is left)."""
    wall = after.wall - before.wall
    if before.everyone is None or after.everyone is None or wall <= 0:
        return None
    return max(0.0, ((after.everyone - before.everyone) - (after.own - before.own)) / wall)


def sample_others(seconds: float = 0.25) -> float | None:
    """Other programs' CPU use right now, in cores, read over `seconds` while this process waits."""
    before = cpu_clock()
    time.sleep(seconds)
    return others_busy(before, cpu_clock())


def free_cores(others: float, cores: int | None = None) -> int:
    """The cores other programs using `others` cores' worth of CPU leave free, rounded (half a core left is a
    core): how many threads get a core of their own beside them (0: none)."""
    cores = cores or os.cpu_count() or 1
    return max(0, int(cores - others + 0.5))


THREADS_VAR = "KVCOURSE_THREADS"


def asked_threads(cores: int | None = None) -> tuple[int | None, str]:
    """(thread count, note) from $KVCOURSE_THREADS: (None, "") when unset or empty. A count above this machine's
    CPUs is capped to them (more threads than cores only wait on each other), and the note says so. Anything
    but a whole number >= 1 raises ValueError naming the variable and what it may be."""
    text = os.environ.get(THREADS_VAR, "").strip()
    if not text:
        return None, ""
    cores = cores or os.cpu_count() or 1
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"{THREADS_VAR} must be a whole number of CPU threads from 1 to {cores} (this machine's "
                         f"CPUs), or unset for an automatic choice; got {text!r}: fix or unset it "
                         f"(e.g. `export {THREADS_VAR}=1`, `unset {THREADS_VAR}`) and restart the kernel")
    if threads > cores:
        return cores, f"{THREADS_VAR}={threads} is more than this machine's {cores} CPUs: capped to {cores}"
    return threads, ""


def _threads(n: int) -> str:
    return f"{n} CPU thread" + ("" if n == 1 else "s")


def steady_threads(device="cpu", threads: int | None = None) -> str:
    """Choose PyTorch's CPU thread count for timing, and say why. PyTorch waits for the slowest of its threads, and
    one on a core another program keeps busy stalls every operation (timings balloon several times), so the count is
    cut to the cores other programs leave free over a quarter of a second (at least 1; where that cannot be read, a
    load average of at least the cores means 1). `threads` or KVCOURSE_THREADS overrides it, capped to the CPUs."""
    if torch.device(device).type != "cpu":
        return f"timing on {device}; CPU threads left at {torch.get_num_threads()}"
    cores = os.cpu_count() or 1
    note = ""
    if threads is None:
        threads, note = asked_threads(cores)
    elif threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    elif threads > cores:
        threads, note = cores, f"{threads} threads is more than this machine's {cores} CPUs: capped to {cores}"
    if threads is not None:
        torch.set_num_threads(threads)
        return f"{_threads(threads)}, as asked" + (f" ({note})" if note else "")
    current = torch.get_num_threads()
    others = sample_others()
    if others is not None:
        how = f"other programs use {others:.1f} of {cores} cores"
        fits = max(1, min(current, free_cores(others, cores)))  # one thread per core they leave free
    else:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        how = f"load average {load:.1f} on {cores} cores"
        fits = 1 if load >= cores else current
    if fits < current:
        torch.set_num_threads(fits)
        return (f"this machine is busy ({how}): timing with {_threads(fits)}, one per free core, since "
                f"threads waiting on each other would distort every number; expect slower but steadier timings")
    return f"{_threads(current)} ({how})"
