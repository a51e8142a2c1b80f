"""Pick the device and dtype once; everything else takes them as arguments."""
from __future__ import annotations

import contextlib
import functools
import platform
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def pick_device(name: str | torch.device | None = None) -> torch.device:
    """'auto' (or None): CUDA if present, else Apple MPS, else CPU. Or name one: 'cpu', 'cuda', 'cuda:1', 'mps'."""
    if isinstance(name, torch.device):
        return name
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if _mps() else "cpu")
    kind, _, index = str(name).partition(":")
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {name!r}; use 'auto', 'cpu', 'cuda' (or 'cuda:N') or 'mps'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(name)!r} was asked for but this PyTorch sees no CUDA GPU; use 'cpu' or 'auto'")
    if kind == "cuda" and index.isdigit() and int(index) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"device {str(name)!r} was asked for but this machine has {count} CUDA GPU(s) (cuda:0 to "
                         f"cuda:{count - 1}); use one of those, or 'auto'")
    if kind == "mps" and not _mps():
        raise ValueError(f"device {str(name)!r} was asked for but Apple's Metal backend is not available; use 'cpu' "
                         "or 'auto'")
    return torch.device(name)


def _mps() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def pick_dtype(name: str | torch.dtype | None = None) -> torch.dtype:
    """float32 by default: on CPUs without bfloat16 units 16-bit is *slower*, and fp32 is exact enough to compare."""
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so a clock read after it measures the work and not the launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@contextlib.contextmanager
def torch_threads(n: int | None):
    """`with torch_threads(1): ...` runs the block with n PyTorch CPU threads and puts the old count back
    afterwards, even on an error. n=None leaves the count alone (so callers can pass an optional setting)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"threads must be a whole number >= 1 (or None to leave it), got {n!r}")
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield before
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def _cpuinfo_field(*names: str) -> str | None:
    """The value of the first /proc/cpuinfo line that starts with one of names (None: none, or not Linux)."""
    line = next((line for line in (_cpuinfo() or "").splitlines() if line.startswith(names)), None)
    return None if line is None else line.split(":", 1)[1].strip()


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags the first CPU advertises (x86 'flags', Arm 'Features'); None where
    /proc/cpuinfo cannot be read (not Linux)."""
    return None if _cpuinfo() is None else frozenset((_cpuinfo_field("flags", "Features") or "").split())


def cpu_kind() -> str:
    """One string that changes when the CPU does: its model name and flags (a build for one CPU may not run on
    another)."""
    return cpu_name() + "\n" + " ".join(sorted(cpu_flags() or ()))
