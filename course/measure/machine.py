"""The one machine profile: what this machine can do, measured once and quoted the same everywhere.

    prof = machine.profile(model)      # loads the saved profile, or measures it (about 10 s) and saves it
    prof.bandwidth_gb_s, prof.gflop_s, prof.decode_ms["eager"], prof.floor_ms(bytes_per_step)
    machine.profile(model, refresh=True)   # measure again (also: `kvcourse doctor --profile`)

Every lesson, recap and review card quotes these figures, so lesson 1's memory bandwidth is lesson 5's.
The profile is a small JSON file beside the learner's progress (course.paths.progress_path()). It is
measured again when it is older than a week, when it was taken on a busy machine over three hours ago and
the machine is quiet now, or when the device, dtype, thread count or PyTorch version differ. A file lock makes two lessons that start together share
one measurement instead of taking two.

A per-token time always says which engine gave it. "Eager" runs the model as written, one PyTorch call
per operation; "compiled" is the same step through torch.compile, which fuses those calls into a few
kernels. Both read the same bytes, so the gap between them is overhead, not memory traffic.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from course.engine.device import cpu_name
from course.engine.weights import write_atomically
from course.measure import costs, threads
from course.measure.display import Printed
from course.measure.timing import fastest_read, matmul_flops, measure, memory_bandwidth
from course.paths import progress_path

FILE_NAME = "machine.json"
STALE_AFTER_S = 7 * 24 * 3600
BUSY_KEPT_S = 3 * 3600  # a profile taken on a busy machine serves a whole sitting before it is measured again
FLOOR_SLACK = 0.9  # a step measured under 0.9 × its bandwidth floor broke physics (the probe under-measured)


@dataclass
class Profile(Printed):  # shown as its __str__
    """This machine's figures, with when and under what load they were measured."""
    device: str
    dtype: str
    threads: int
    cores: int
    bandwidth_gb_s: float  # streaming memory bandwidth: the decode floor's denominator
    gflop_s: float  # a large matmul in `dtype`
    others_cores: float | None  # cores' worth of CPU other programs used while this was measured
    measured_at: float  # seconds since the epoch
    torch_version: str = torch.__version__
    host: str = ""
    decode_ms: dict = field(default_factory=dict)  # engine ("eager", "compiled") → ms per token, SmolLM2, B = 1

    @property
    def busy(self) -> bool:
        return self.others_cores is not None and self.others_cores > threads.BUSY_CORES

    def floor_ms(self, nbytes: float) -> float:
        """The fastest a step that reads `nbytes` can be here: bytes ÷ bandwidth, in ms."""
        return nbytes / (self.bandwidth_gb_s * 1e9) * 1e3

    def gate_floor_ms(self, nbytes: float) -> float:
        """The floor a physics gate may hold a step to: bytes ÷ the fastest read seen (this profile's or a probe's
        since: timing.fastest_read), in ms; 0 from a profile measured busy, whose probe under-measured (no floor)."""
        return 0.0 if self.busy else nbytes / max(self.bandwidth_gb_s * 1e9, fastest_read(self.device)) * 1e3

    def values(self) -> dict:
        return {"profile": asdict(self)}

    def __str__(self) -> str:
        age = max(0.0, time.time() - self.measured_at)
        when = f"{age / 60:.0f} min ago" if age < 5400 else f"{age / 3600:.0f} h ago" if age < 172800 \
            else f"{age / 86400:.0f} days ago"
        decode = "; ".join(f"decode {ms:.0f} ms/token ({engine})" for engine, ms in self.decode_ms.items())
        return (f"This machine: {self.device}, {self.threads} thread{'s' * (self.threads != 1)}, "
                f"memory {self.bandwidth_gb_s:.1f} GB/s, matmul {self.gflop_s:.0f} GFLOP/s"
                f"{'; ' + decode if decode else ''} (measured {when}).")


def path() -> Path:
    """$KVCOURSE_MACHINE (one profile for several progress files: the test suite's), else beside the progress."""
    return Path(os.environ.get("KVCOURSE_MACHINE") or progress_path().parent / FILE_NAME)


def _host(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def _matches(saved: dict, device: torch.device, dtype: str) -> bool:
    asked, _ = threads.asked_threads() if device.type == "cpu" else (None, "")
    return (saved.get("device") == str(device) and saved.get("dtype") == dtype
            and asked in (None, saved.get("threads")) and saved.get("torch_version") == torch.__version__
            and saved.get("host") == _host(device) and time.time() - saved.get("measured_at", 0) < STALE_AFTER_S)


def _threads(device: torch.device) -> int:
    return torch.get_num_threads() if device.type == "cpu" else 0


def load(device="cpu", dtype="float32") -> Profile | None:
    """The saved profile for this device and dtype, if there is a fresh one."""
    try:  # a file edited by hand, or of another version, is as good as none
        saved = json.loads(path().read_text())[f"{torch.device(device)}/{dtype}"]
        return Profile(**saved) if _matches(saved, torch.device(device), dtype) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(prof: Profile) -> None:
    """Write the profile beside the progress file (atomically: a reader never sees half a file)."""
    target = path()
    try:
        data = json.loads(target.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[f"{prof.device}/{prof.dtype}"] = asdict(prof)
    write_atomically(target, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1)))


def eager_decode_ms(model, context: int = 16, repeats: int = 9) -> float:
    """Median ms of one eager decode step of `model` (batch 1) with `context` tokens cached."""
    from course.engine.generate import decode_one_token, prefill
    from course.engine.kv_cache import KVCache

    cache = KVCache(model.config, max_seq_len=context + 1, dtype=model.dtype, device=model.device)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefill(model, ids.to(model.device), cache)
        token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
        return measure(lambda: decode_one_token(model, token, context, cache), model.device,
                       warmup=2, repeats=repeats).median * 1e3


def measure_profile(model=None, device="cpu", dtype="float32", tries: int = 3) -> Profile:
    """Measure bandwidth, FLOP/s and (with a model) one eager decode step, re-measuring (up to `tries` times)
    while the step comes out faster than its bandwidth floor allows: a probe that under-measured."""
    device = torch.device(device if model is None else model.device)
    torch_dtype = getattr(torch, dtype) if model is None else model.dtype
    dtype = str(torch_dtype).split(".")[-1]
    for attempt in range(tries):
        before = threads.cpu_clock()
        bw = memory_bandwidth(device).bytes_per_s
        flops = matmul_flops(device, n=1024 if device.type == "cpu" else 4096, dtype=torch_dtype)
        decode = {} if model is None else {"eager": eager_decode_ms(model)}
        others = threads.others_busy(before, threads.cpu_clock()) if device.type == "cpu" else None
        prof = Profile(str(device), dtype, _threads(device), os.cpu_count() or 1, bw / 1e9, flops / 1e9, others,
                       time.time(), host=_host(device), decode_ms=decode)
        if model is None or decode["eager"] >= FLOOR_SLACK * prof.floor_ms(step_bytes(model.config, dtype)):
            return prof
    prof.others_cores = max(prof.others_cores or 0.0, threads.BUSY_CORES + 0.01)  # marked busy: measured again when quiet
    return prof


def step_bytes(config, dtype: str = "float32", context: int = 16) -> float:
    """Bytes one decode step of batch 1 reads: every weight once, plus the cache of `context` tokens."""
    return costs.decode_cost(config, context, costs.dtype_bytes(getattr(torch, dtype))).bytes


def profile(model=None, device="cpu", dtype="float32", refresh: bool = False) -> Profile:
    """The machine profile: the saved one when it is fresh, else measured now and saved (one process at a time).

    The thread count is part of the profile: the first measurement chooses it (one thread per core other
    programs leave free, or $KVCOURSE_THREADS), and every later lesson times with the same count."""
    from filelock import FileLock

    device = torch.device(device if model is None else model.device)
    dtype = dtype if model is None else str(model.dtype).split(".")[-1]
    path().parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path()) + ".lock", timeout=300):
        prof = None if refresh else load(device, dtype)
        # a profile taken on a busy machine is kept for a sitting (every lesson quotes the same figures), then
        # measured again at the first quiet moment
        quiet_now = (prof is not None and prof.busy and time.time() - prof.measured_at > BUSY_KEPT_S
                     and (threads.sample_others() or 0.0) <= threads.BUSY_CORES)
        if prof is not None and not quiet_now and (model is None or "eager" in prof.decode_ms):
            if device.type == "cpu":
                torch.set_num_threads(prof.threads)
            return prof
        threads.steady_threads(device)  # one thread per free core, or $KVCOURSE_THREADS
        prof = measure_profile(model, device, dtype)
        save(prof)
    return prof


def remember(prof: Profile, engine: str, ms: float) -> Profile:
    """Keep a per-token time another engine measured (e.g. "compiled", timed in lesson 5) in the profile
    (only a figure that passed its physics gate belongs here)."""
    from course.measure.results import record

    prof.decode_ms[engine] = float(ms)
    save(prof)
    record("profile", asdict(prof))
    return prof


def setup(model, refresh: bool = False) -> Profile:
    """A lesson's first cell: say once if the machine is busy, then load (or measure) the profile and show it."""
    from course.measure.gates import busy_notice

    note = busy_notice()
    if note:
        print(note)
    prof = profile(model, refresh=refresh)
    from course.measure.results import record

    record("profile", asdict(prof))  # every lesson records the figures it quotes; the tests compare them
    print(prof)
    return prof
