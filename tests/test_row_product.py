"""The batched decode kernel (course/engine/row_product.cpp): BLAS's products, inside and outside a compiled graph,
and a build that shows the learner one plain line (its compiler output in a log, named only if it fails)."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from course.engine import row_product

needs_kernel = pytest.mark.skipif(not row_product.available(), reason=f"no row kernel: {row_product.why_not()}")


@needs_kernel
@pytest.mark.parametrize("d", [576, 64, 48, 40])  # the vector's width divides them, or not (then BLAS computes)
def test_kernel_equals_blas_for_every_batch_size(d):
    gen = torch.Generator().manual_seed(d)
    w = torch.randn(83, d, generator=gen)  # 83 rows: whole register tiles and a remainder
    for B in (1, 2, 3, 4, 5, 8, 13, 16, 17, 64):  # past 16 rows (AVX2) the op hands the product to BLAS
        x = torch.randn(B, d, generator=gen)
        torch.testing.assert_close(torch.ops.kvcourse.row_product(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_reads_views_and_threads_like_blas(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(1000, 576)[::2]  # a strided view: the kernel reads a contiguous copy
        x = torch.randn(12, 1152)[:, :576]
        torch.testing.assert_close(torch.ops.kvcourse.row_product(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_kernel_refuses_what_it_cannot_compute_and_runs_in_a_graph_with_a_symbolic_batch():
    with pytest.raises(RuntimeError, match=r"x must be \[B, d\] and w \[N, d\]"):
        torch.ops.kvcourse.row_product(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        torch.ops.kvcourse.row_product(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    w = torch.randn(40, 64)
    f = torch.compile(lambda x: torch.ops.kvcourse.row_product(torch.relu(x), w) * 2, fullgraph=True, dynamic=True)
    for B in (2, 5):
        x = torch.randn(B, 64)
        torch.testing.assert_close(f(x), F.linear(torch.relu(x), w) * 2, atol=1e-4, rtol=1e-5)


def test_turned_off_it_says_so_and_the_step_uses_blas(monkeypatch):
    from course.engine.fast import DecodeStep
    from course.engine.model import tiny_model

    monkeypatch.setenv("KVCOURSE_ROW_KERNEL", "0")
    assert row_product._build() == "turned off (KVCOURSE_ROW_KERNEL=0)"
    monkeypatch.setattr(row_product, "_state", {"why": "turned off (KVCOURSE_ROW_KERNEL=0)"})
    assert not row_product.available() and "KVCOURSE_ROW_KERNEL=0" in row_product.why_not()
    assert not DecodeStep(tiny_model()).kernel
    assert not DecodeStep(tiny_model(), compile=False).kernel  # eager: nothing to hook


BUILD = ("import sys, torch; from course.engine import row_product; ok = row_product.available(); "
         "print('WHY', row_product.why_not())")


def _build_in_a_fresh_cache(tmp_path, **env):
    import os

    env = {**os.environ, "KVCOURSE_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, env=env, timeout=1200)


def test_a_failed_build_prints_one_plain_line_and_names_its_log(tmp_path):
    """A learner's first lesson builds the kernel: nothing in red (stderr), one plain line; a build that fails (here: a
    compiler that is not there) says where its output is, and decoding goes on with BLAS."""
    run = _build_in_a_fresh_cache(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    out = run.stdout.splitlines()
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert out[0].startswith("Building the course's C++ kernel for this CPU, once") and len(out) == 2
    why = out[1]
    assert "could not be built" in why and "build.log" in why
    log = why.split("output is in ")[1].split(" (delete ")[0]
    assert (tmp_path / "cache") in __import__("pathlib").Path(log).parents and open(log).read()
    again = _build_in_a_fresh_cache(tmp_path, CXX=str(tmp_path / "no-such-compiler"))  # the same cache folder
    assert again.stdout.splitlines() == [why] and again.stderr == "", "a failed build was tried again"


@pytest.mark.slow
def test_a_build_prints_one_plain_line_and_nothing_in_red_even_after_a_killed_build(tmp_path):
    import os
    import time

    where = subprocess.run([sys.executable, "-c", "from course.engine import row_product; print(row_product.build_dir())"],
                           capture_output=True, text=True, env={**os.environ, "KVCOURSE_CACHE": str(tmp_path / "cache")})
    lock = __import__("pathlib").Path(where.stdout.strip()) / "lock"  # a killed build left its lock behind
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - row_product.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    run = _build_in_a_fresh_cache(tmp_path)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("Building the course's C++ kernel") and len(lines) == 2 and lines[1].startswith("WHY")
