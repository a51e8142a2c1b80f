"""A CPU kernel for decode's batched products: y [B, N] = x [B, d] · wᵀ, each weight row read once.

    from course.engine import row_product
    if row_product.available():               # builds the C++ kernel once (seconds to a minute), then loads it
        y = row_product.row_product(x, w)      # torch.ops.kvcourse.row_product(x, w, blas_above) beneath

Why it exists. A decode step of B sequences multiplies B row vectors by every weight matrix. The weights
are read once whatever B is, so up to the point where arithmetic takes longer than reading, a step of
8 sequences should cost about what a step of 1 costs. BLAS (MKL in the CPU build of torch) does not
deliver that for 2 ≤ B ≤ 16 on the course's CPUs: its matrix-matrix kernels, built for large matrices,
took 1.5–2.5× the one-row time (`kvcourse bench`, decode_batch, shows BLAS and this kernel side by side).
row_product.cpp multiplies tiles of 6 weight rows by 4 rows of x from registers (AVX-512 where the CPU has
it; 2 weight rows at a time for 2 or 3 rows of x), and prefetches the rows 8 ahead into L2 so the memory stream
keeps going while it computes (one row of x: the weight rows one after another, a single stream with no software
prefetch, which an AMD EPYC read as fast as torch sums the same weights);
with several threads each claims a share of the rows still left (large first, at least 48 at the end), so
each core reads long stretches in sequence and no core waits for a slower one at the end of a product; above blas_above() rows of x (16 on Intel CPUs, none elsewhere) it hands over to BLAS. llama.cpp's CPU matrix-vector kernels work the same way.

The same library holds decode's attention for one new token per sequence, `torch.ops.kvcourse.decode_attention(q,
k, v, hidden)` (q [B, H_kv, G, D], k and v [B, H_kv, S, D], hidden the additive mask): the compiled step calls it once
per layer (course.engine.fast.kernel_attention) instead of two batched BLAS products.

The kernel is compiled for this machine's CPU (-march=native) by torch.utils.cpp_extension into the
course's cache folder (course.engine.weights.cache_dir(), or $KVCOURSE_CACHE), one build per CPU kind and
torch version. Where no C++ compiler or no AVX-512 is found, `available()` is False (it says why in
`why_not()`) and the compiled decode step uses BLAS instead. KVCOURSE_ROW_KERNEL=0 turns it off.
"""
from __future__ import annotations

import hashlib
import os
import shutil
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


def _already_loaded() -> bool:
    try:
        torch.ops.kvcourse.row_product
    except (AttributeError, RuntimeError):
        return False
    return True


def _build() -> str | None:
    """Compile (or load the earlier build of) row_product.cpp; None when it loaded, else why not."""
    if os.environ.get("KVCOURSE_ROW_KERNEL", "1") == "0":
        return "turned off (KVCOURSE_ROW_KERNEL=0)"
    if _already_loaded():
        return None  # another copy of this module loaded it already
    from torch.utils.cpp_extension import load

    where = build_dir()
    fresh = not any(where.glob("*.so"))
    if shutil.which("ninja") is None:  # the pip package's ninja sits next to this Python, which may not be on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            return "it could not be built: ninja is missing (pip install ninja)"
    try:
        where.mkdir(parents=True, exist_ok=True)
        lock = where / "lock"  # torch waits for this file while another process builds; a killed build leaves it
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        if fresh:
            print("Building the batched decode kernel for this CPU (course/engine/row_product.cpp; once; seconds to "
                  "a minute)…", file=sys.stderr, flush=True)
        load(name="kvcourse_row_product", sources=[str(SOURCE)], build_directory=str(where),
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no headers, a read-only cache: decode uses BLAS
        return f"it could not be built ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]})"
    if not torch.ops.kvcourse.row_product_vectorised():
        return "this CPU has no AVX-512, so the kernel would not be faster than BLAS"
    return None


INTEL_BLAS_ABOVE = 16  # GenuineIntel: MKL's matrix-matrix product was faster than the kernel above 16 rows of x
OTHER_BLAS_ABOVE = 1 << 30  # elsewhere the kernel at every batch (AMD EPYC: 1.6-2.3x faster than BLAS up to 64)


def blas_above() -> int:
    """Rows of x above which the kernel hands the product to BLAS. The CPU build of torch calls Intel's MKL, whose
    matrix-matrix kernels beat this one above 16 rows on the course's Intel Xeons (Sapphire Rapids) but not on
    its AMD EPYCs, where the kernel was 1.6-2.3x faster than BLAS at 8 to 64 rows, all of a step's products, at
    1 and 2 threads (MKL picks its code paths for the CPU it finds; see the oneMKL developer guide, "Instruction
    Set Specific Dispatching on Intel Architectures"). KVCOURSE_BLAS_ABOVE=n overrides. available() sets
    BLAS_ABOVE to this number, which the compiled step passes to the kernel."""
    env = os.environ.get("KVCOURSE_BLAS_ABOVE")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"KVCOURSE_BLAS_ABOVE must be a whole number of rows, got {env!r}") from None
        if n < 0:
            raise ValueError(f"KVCOURSE_BLAS_ABOVE must be 0 or more rows, got {n}")
        return n
    from course.engine.device import cpu_vendor

    return INTEL_BLAS_ABOVE if cpu_vendor() == "GenuineIntel" else OTHER_BLAS_ABOVE


BLAS_ABOVE = INTEL_BLAS_ABOVE  # set by available(); read by course.engine.fast inside the compiled graph


def _register_fake() -> None:
    @torch.library.register_fake("kvcourse::row_product")
    def _(x, w, blas_above):  # the output's shape and dtype, for torch.compile
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("kvcourse::decode_attention")
    def _(q, k, v, hidden):
        return q.new_empty(q.shape)


def available() -> bool:
    """True when torch.ops.kvcourse.row_product is loaded and vectorised for this CPU (builds it the first time)."""
    with _lock:
        if "why" not in _state:
            global BLAS_ABOVE
            BLAS_ABOVE = blas_above()  # a bad KVCOURSE_BLAS_ABOVE fails here, before anything is built
            why = _build()
            if why is None:
                _register_fake()
            _state["why"] = why
        return _state["why"] is None


def computes(t: torch.Tensor) -> bool:
    """True where the kernel can multiply by weights like `t`: float32 on the CPU, and the kernel loaded (built
    the first time); elsewhere the products go to F.linear."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and available()


def why_not() -> str | None:
    """Why the kernel is not used (None when it is)."""
    available()
    return _state["why"]


def row_product(x: torch.Tensor, w: torch.Tensor, above: int | None = None) -> torch.Tensor:
    """x [B, d] · wᵀ ([N, d]) → [B, N] with the kernel (float32 on the CPU; call available() first); BLAS above
    `above` rows of x (None: blas_above())."""
    return torch.ops.kvcourse.row_product(x, w, BLAS_ABOVE if above is None else above)
