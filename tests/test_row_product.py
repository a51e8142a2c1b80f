"""The batched decode kernel (course/engine/row_product.cpp): BLAS's products, inside and outside a compiled graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course.engine import row_product
from course.engine.fast import DecodeStep
from course.engine.model import tiny_model

needs_kernel = pytest.mark.skipif(not row_product.available(), reason=f"no row kernel: {row_product.why_not()}")


@needs_kernel
@pytest.mark.parametrize("d", [576, 80, 64, 48, 24, 1])  # multiples of 16 (of 32 or not: the one-row loop takes 32
# at a time) take the vector path, the others the portable one
def test_kernel_equals_blas_for_every_batch_size(d):
    g = torch.Generator().manual_seed(d)
    for N in (1, 2, 6, 17, 130):  # tiles of 6 weight rows (2 for B < 4) and the rows left over
        w = torch.randn(N, d, generator=g)
        for B in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 64):  # tiles of 4 rows, remainders, beyond 16 rows
            x = torch.randn(B, d, generator=g)
            for above in (16, 1 << 30):  # BLAS above 16 rows (Intel CPUs), the kernel at every batch (elsewhere)
                got = row_product.row_product(x, w, above)
                assert got.shape == (B, N) and got.dtype == torch.float32
                torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_kernel_equals_blas_on_the_course_models_head():
    """The tied 49152 × 576 head: many rows, split between threads."""
    w = torch.randn(49152, 576, generator=torch.Generator().manual_seed(1))
    for B in (1, 3, 8):
        x = torch.randn(B, 576)
        torch.testing.assert_close(row_product.row_product(x, w), F.linear(x, w), atol=2e-4, rtol=1e-5)


@needs_kernel
def test_kernel_reads_views_and_threads_like_blas():
    w = torch.randn(300, 128)
    x = torch.randn(128, 5).t()  # a transposed view: not contiguous
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.testing.assert_close(row_product.row_product(x, w[::2]), F.linear(x, w[::2]), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_kernel_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="x must be \\[B, d\\]"):
        row_product.row_product(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="float32"):
        row_product.row_product(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))


def _attention_inputs(B, H, G, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, H, G, D), (B + 2, H, S, D), (B + 2, H, S, D)))
    positions = torch.randint(0, S, (B,), generator=g)
    hidden = torch.where(torch.arange(S)[None] <= positions[:, None], 0.0, float("-inf"))[:, None, None, :]
    return q, k[1:B + 1], v[1:B + 1], hidden  # k and v: rows of a larger cache (views, not contiguous copies)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_kernel_equals_softmax_attention(threads):
    """decode_attention against plain_attention (softmax(q kᵀ / √D + mask) v): head sizes on the vector path (16, 64,
    128) and off it (24), one and several query heads per KV head, masks that hide most keys or none."""
    from course.engine.fast import plain_attention

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for B, H, G, S, D in ((1, 3, 3, 65, 64), (8, 3, 3, 65, 64), (3, 2, 4, 17, 24), (2, 1, 1, 1, 16),
                              (5, 2, 1, 40, 128), (4, 4, 2, 33, 32)):
            q, k, v, hidden = _attention_inputs(B, H, G, S, D, seed=B * S + D)
            got = torch.ops.kvcourse.decode_attention(q, k, v, hidden)
            assert got.shape == (B, H, G, D)
            torch.testing.assert_close(got, plain_attention(q, k, v, hidden), atol=1e-5, rtol=1e-5)
            hidden = torch.zeros_like(hidden)  # every key visible
            torch.testing.assert_close(torch.ops.kvcourse.decode_attention(q, k, v, hidden),
                                       plain_attention(q, k, v, hidden), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_attention_kernel_refuses_what_it_cannot_compute():
    q, k, v, hidden = _attention_inputs(2, 3, 3, 8, 16, seed=0)
    with pytest.raises(RuntimeError, match="q must be \\[B, H, G, D\\]"):
        torch.ops.kvcourse.decode_attention(q[:, :2], k, v, hidden)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvcourse.decode_attention(q.double(), k.double(), v.double(), hidden.double())
    with pytest.raises(RuntimeError, match="hidden must hold"):
        torch.ops.kvcourse.decode_attention(q, k, v, hidden[:1])


@needs_kernel
def test_kernel_runs_inside_a_full_graph_with_a_symbolic_batch():
    w = torch.randn(48, 32)
    f = torch.compile(lambda x: torch.ops.kvcourse.row_product(torch.relu(x), w, 3) * 2, fullgraph=True, dynamic=True)
    for B in (2, 5, 11):  # the kernel, then BLAS (above 3 rows)
        x = torch.randn(B, 32)
        torch.testing.assert_close(f(x), F.linear(torch.relu(x), w) * 2, atol=1e-4, rtol=1e-5)


def test_blas_takes_over_above_16_rows_on_intel_cpus_only_unless_told(monkeypatch):
    monkeypatch.delenv("KVCOURSE_BLAS_ABOVE", raising=False)
    monkeypatch.setattr("course.engine.device.cpu_vendor", lambda: "GenuineIntel")
    assert row_product.blas_above() == 16
    monkeypatch.setattr("course.engine.device.cpu_vendor", lambda: "AuthenticAMD")
    assert row_product.blas_above() > 64  # every decode batch on the kernel
    monkeypatch.setenv("KVCOURSE_BLAS_ABOVE", "8")
    assert row_product.blas_above() == 8
    for bad in ("many", "-1"):
        monkeypatch.setenv("KVCOURSE_BLAS_ABOVE", bad)
        with pytest.raises(ValueError, match="KVCOURSE_BLAS_ABOVE"):
            row_product.blas_above()


def test_turned_off_it_says_so_and_the_step_uses_blas(monkeypatch):
    monkeypatch.setenv("KVCOURSE_ROW_KERNEL", "0")
    assert row_product._build() == "turned off (KVCOURSE_ROW_KERNEL=0)"
    monkeypatch.setattr(row_product, "_state", {"why": "turned off (KVCOURSE_ROW_KERNEL=0)"})
    model = tiny_model(seed=1)
    assert DecodeStep(model).row_kernel is False
    assert DecodeStep(model, row_kernel=False).row_kernel is False
    with pytest.raises(RuntimeError, match="batched decode kernel is not available: turned off"):
        DecodeStep(model, row_kernel=True)


def test_only_a_compiled_float32_cpu_step_uses_it():
    model = tiny_model(seed=1)
    assert DecodeStep(model, compile=False).row_kernel is False  # the eager reference stays on F.linear
    assert DecodeStep(model.to(torch.bfloat16)).row_kernel is False
    assert DecodeStep(tiny_model(seed=1), product="blas").row_kernel is False
    assert DecodeStep(tiny_model(seed=1)).row_kernel is row_product.available()


@needs_kernel
def test_a_killed_builds_lock_does_not_hang_the_next_build(tmp_path, monkeypatch):
    """torch waits as long as the build folder's lock file exists; one left by a killed build is removed."""
    import os

    import course.engine.weights as weights

    monkeypatch.setattr(weights, "cache_dir", lambda: tmp_path)
    where = row_product.build_dir()
    where.mkdir(parents=True)
    (where / "lock").write_text("")
    old = row_product.time.time() - row_product.STALE_LOCK_S - 5
    os.utime(where / "lock", (old, old))
    calls = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: calls.append(kw))
    monkeypatch.delattr(torch.ops.kvcourse, "row_product", raising=False)
    monkeypatch.setattr(row_product, "_already_loaded", lambda: False)
    row_product._build()
    assert calls and calls[0]["build_directory"] == str(where)
    assert not (where / "lock").exists()
