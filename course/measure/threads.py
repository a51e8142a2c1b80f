"""CPU threads for timing: pick a steady count on a busy machine, and set one for a block and put it back.

    steady_threads   choose PyTorch's CPU thread count for timing, and say why (lessons print the reason)
"""
from __future__ import annotations

import os

import torch


def steady_threads(device="cpu", threads: int | None = None) -> str:
    """Choose PyTorch's CPU thread count for timing, and say why.

    PyTorch splits each operation across its threads and waits for the slowest. When other programs
    already keep every core busy (load average >= cores), a descheduled thread stalls every operation,
    and timings balloon by several times; one thread is then far steadier. `threads` (or the
    environment variable KVCOURSE_THREADS) overrides the choice.
    """
    if torch.device(device).type != "cpu":
        return f"timing on {device}; CPU threads left at {torch.get_num_threads()}"
    if threads is None and os.environ.get("KVCOURSE_THREADS"):
        threads = int(os.environ["KVCOURSE_THREADS"])
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
        return f"{threads} CPU thread(s), as asked (load average {load:.1f} on {cores} cores)"
    if load >= cores and torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        return (f"this machine is busy (load average {load:.1f} on {cores} cores): timing with 1 CPU thread, "
                f"since threads waiting on each other would distort every number; expect slower but steadier timings")
    return f"{torch.get_num_threads()} CPU threads (load average {load:.1f} on {cores} cores)"
