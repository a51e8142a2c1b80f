"""`kvcourse doctor`: is everything in place? Versions, device, the model file, and a bandwidth probe."""
from __future__ import annotations

import os
import platform
import sys
import time


def add_arguments(p):
    p.add_argument("--quick", action="store_true", help="skip loading the model (used by `make setup`)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")


def run(args) -> int:
    from importlib import metadata

    import torch

    from course.engine.device import pick_device
    from course.measure.timing import memory_bandwidth
    from course.engine.weights import cache_dir, cached_weights_path, check_cache, default_gguf_path

    ok = True
    print(f"python      {sys.version.split()[0]} on {platform.machine()} ({platform.system()})")
    for pkg in ("torch", "gguf", "tokenizers", "jupyterlab", "nbgrader", "ipywidgets"):
        try:
            print(f"{pkg:<11} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            print(f"{pkg:<11} MISSING — run `make setup`")
            ok = False
    device = pick_device(args.device)
    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no CUDA GPU"
    print(f"device      {device}  ({cuda}; {torch.get_num_threads()} CPU threads)")
    from course.measure.threads import THREADS_VAR, asked_threads

    try:  # every lesson's first timing cell reads it: a bad value is found here, not there
        threads, note = asked_threads()
        if threads is not None:
            print(f"threads     {note or f'{THREADS_VAR}={threads}: timing uses {threads} CPU thread(s)'}")
    except ValueError as exc:
        print(f"threads     WRONG — {exc}")
        ok = False
    from course.measure.results import FULL_VAR, full_size

    try:
        if os.environ.get(FULL_VAR, "").strip():
            print(f"full size   {FULL_VAR}={os.environ[FULL_VAR].strip()}: notebooks run "
                  + ("their full sweeps" if full_size() else "the quick default sizes"))
    except ValueError as exc:
        print(f"full size   WRONG — {exc}")
        ok = False
    try:
        path = default_gguf_path()
        print(f"model       {path} ({path.stat().st_size / 2**20:.0f} MiB)")
        cached = cached_weights_path(path)
        if not cached.exists():
            print(f"cache       {cache_dir()} (filled on first load)")
        elif args.quick:
            print(f"cache       {cached}")
        else:  # what every load does: read each cached tensor and compare its CRC-32 with the one stored
            check = check_cache(path)
            verdict = (f"verified: {check.nbytes / 1e6:.0f} MB checked in {check.seconds:.2f} s "
                       f"({check.nbytes / check.seconds / 1e9:.1f} GB/s)") if check.ok else \
                f"{check.problem}: the next load rebuilds it"
            print(f"cache       {cached} ({verdict})")
    except FileNotFoundError as exc:
        print(f"model       MISSING — {exc}")
        ok = False
    if not args.quick:
        bw = memory_bandwidth(device, nbytes=128 << 20, repeats=3)
        print(f"bandwidth   {bw.bytes_per_s / 1e9:.1f} GB/s (read {bw.read_bytes_per_s / 1e9:.1f}, copy {bw.copy_bytes_per_s / 1e9:.1f})")
        if device.type == "cpu":  # the compiled decode step's kernel (course/engine/row_product.cpp)
            from course.engine import row_product

            print("kernel      " + (f"batched decode kernel ready ({row_product.build_dir()})" if row_product.available()
                                    else f"batched decode kernel not used: {row_product.why_not()}; the compiled "
                                         "step falls back to Inductor's reduction (one sequence) and BLAS (batches)"))
        if ok:
            import course

            t0 = time.perf_counter()
            model, tok = course.load(device=device)
            print(f"load        {time.perf_counter() - t0:.1f} s  ({model.config.n_params / 1e6:.1f} M parameters)")
    print("all good" if ok else "something is missing or wrong: see above")
    return 0 if ok else 1
