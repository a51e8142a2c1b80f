"""A CPU kernel for a batched decode step's products: y [B, N] = x [B, d] · wᵀ, each weight row read once.

    from course.engine import row_product
    if row_product.available():               # builds the C++ kernel once (a minute), then loads it
        y = torch.ops.kvcourse.row_product(x, w)

A decode step of B sequences multiplies B row vectors by every weight matrix. The weights are read once whatever B
is, so until arithmetic takes longer than reading, a step of 8 sequences should cost about what a step of 1 costs;
BLAS's matrix-matrix kernels did not deliver that for small B on the course's CPUs (row_product.cpp says how the
kernel does). The compiled decode step (course.engine.fast) calls it for batches.

It is built for this machine's CPU (-march=native) by torch.utils.cpp_extension into the course's cache folder
(course.engine.weights.cache_dir(), or $KVCOURSE_CACHE), once per CPU kind and torch version, printing one line;
the compiler's output goes to a log file, named only if the build fails. Without a C++ compiler or a vector unit
`available()` is False (`why_not()` says why) and batches use BLAS; a failed build is not tried again until its
folder is deleted. KVCOURSE_ROW_KERNEL=0 turns it off.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("row_product.cpp")
STALE_LOCK_S = 600  # a build lock this old belongs to a build that was killed
_lock = threading.Lock()
_state: dict = {}


def build_dir() -> Path:
    from course.engine.device import cpu_kind
    from course.engine.weights import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + cpu_kind().encode() + torch.__version__.encode()
                         + sys.version.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"row_product-{key}"


@contextlib.contextmanager
def _output_to(log: Path):
    """Everything this process writes to stdout and stderr (the compiler's too) goes to `log` meanwhile."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
            yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(saved[0]), os.close(saved[1])


def _build() -> str | None:
    """Load row_product.cpp's library, building it the first time; None when it loaded, else why not."""
    if os.environ.get("KVCOURSE_ROW_KERNEL", "1") == "0":
        return "turned off (KVCOURSE_ROW_KERNEL=0)"
    if not hasattr(torch.ops.kvcourse, "row_product"):  # another copy of this module may have loaded it
        from torch.utils.cpp_extension import load

        where = build_dir()
        log, failed = where / "build.log", where / "failed"
        if failed.exists():  # every process would otherwise spend its minute on the same failing build
            return failed.read_text()
        try:
            where.mkdir(parents=True, exist_ok=True)
            lock = where / "lock"  # torch waits for this file while another process builds; a killed build leaves it
            if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink(missing_ok=True)
            if not any(where.glob("*.so")):
                print("Building the course's C++ kernel for this CPU, once (about a minute)…", flush=True)
            with _output_to(log):
                import ninja  # torch's builder runs ninja, which sits next to this Python (maybe not on PATH)

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
                load(name="kvcourse_row_product", sources=[str(SOURCE)], build_directory=str(where),
                     extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],  # at::parallel_for
                     is_python_module=False, verbose=True)
        except Exception as exc:  # no compiler, no headers, a read-only cache: batches use BLAS
            why = (f"it could not be built ({type(exc).__name__}); the compiler's output is in {log} (delete "
                   f"{where} to build it again)")
            with contextlib.suppress(OSError):
                failed.write_text(why)
            return why
    if torch.ops.kvcourse.vector_width() < 4:
        return "no vector unit was found for it on this CPU, so it would not be faster than BLAS"
    return None


def available() -> bool:
    """True when torch.ops.kvcourse.row_product is loaded and vectorised for this CPU (builds it the first time)."""
    with _lock:
        if "why" not in _state:
            _state["why"] = _build()
            if _state["why"] is None:
                torch.library.register_fake("kvcourse::row_product")(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
        return _state["why"] is None


def why_not() -> str | None:
    """Why the kernel is not used (None when it is)."""
    available()
    return _state["why"]
