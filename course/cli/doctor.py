"""`kvcourse doctor`: is everything in place? Versions, device, the model file, and this machine's profile (the
bandwidth, FLOP/s and decode step every lesson quotes; `--profile` measures it again)."""
from __future__ import annotations

import os
import platform
import struct
import sys
import time
from pathlib import Path

# GGUF metadata value types (gguf-py's GGUFValueType) → their size in bytes; 8 = string, 9 = array
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


def gguf_problem(path: Path) -> str | None:
    """What is wrong with a model file, from its header alone (milliseconds, where gguf.GGUFReader takes seconds):
    not a GGUF file, an unknown version, a cut-off header, or fewer bytes than its tensor table says it holds (a
    truncated download). None when it looks whole. Loading it (`kvcourse doctor` without --quick) checks the rest."""
    import gguf

    from course.engine.weights import SETUP_HINT

    import stat

    redo = f"download or reinstall it ({SETUP_HINT} for the course model)"
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):  # a named pipe would block the read below until someone writes to it
        return f"{path} is not a regular file (a pipe or a device?): {redo}"
    size = st.st_size
    with open(path, "rb") as f:
        def read(fmt: str):
            data = f.read(struct.calcsize(fmt))
            if len(data) < struct.calcsize(fmt):
                raise EOFError
            return struct.unpack("<" + fmt, data)[0]

        def skip_string() -> None:
            f.seek(read("Q"), os.SEEK_CUR)

        def read_value(kind: int):
            if kind == _GGUF_STRING:
                n = read("Q")
                return f.read(n)
            if kind == _GGUF_ARRAY:
                inner, count = read("I"), read("Q")
                if inner in _GGUF_SCALAR_BYTES:
                    f.seek(_GGUF_SCALAR_BYTES[inner] * count, os.SEEK_CUR)
                else:
                    for _ in range(count):
                        read_value(inner)
                return None
            if kind not in _GGUF_SCALAR_BYTES:
                raise ValueError(f"an unknown metadata type {kind}")
            return f.read(_GGUF_SCALAR_BYTES[kind]) if kind != _GGUF_UINT32 else read("I")

        magic = f.read(4)
        if magic != b"GGUF":
            return f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')"
        try:
            version = read("I")
            if version not in (2, 3):
                return f"{path} is GGUF version {version}; the course reads versions 2 and 3: {redo}"
            n_tensors, n_kv = read("Q"), read("Q")
            alignment = 32
            for _ in range(n_kv):
                key = f.read(read("Q"))
                value = read_value(read("I"))
                if key == b"general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
                if f.tell() > size:
                    raise EOFError
            end = 0
            for _ in range(n_tensors):
                skip_string()
                dims = [read("Q") for _ in range(read("I"))]
                kind, offset = read("I"), read("Q")
                block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
                count = 1
                for d in dims:
                    count *= d
                end = max(end, offset + count // block * type_bytes)
                if f.tell() > size:
                    raise EOFError
            data_start = -(-f.tell() // alignment) * alignment
        except EOFError:
            return f"{path} is cut off inside its GGUF header ({size} bytes): {redo}"
        except ValueError as exc:  # an unknown value or tensor type: not a file any GGUF reader can use
            return f"{path} could not be read as GGUF ({exc}): {redo}"
    if data_start + end > size:
        return (f"{path} is cut off: it holds {size / 2**20:.1f} MiB but its tensors need "
                f"{(data_start + end) / 2**20:.1f} MiB: {redo}")
    return None


def cache_problem(folder: Path) -> str | None:
    """Why the weights cache folder cannot be one (a file where it or a folder above it should be), or None."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is None:
        return None
    where = "" if blocker == folder else f" (so {folder} cannot be made)"
    return f"{blocker} is a file, not a folder{where}: set KVCOURSE_CACHE to a folder (or unset it)"


def add_arguments(p):
    p.add_argument("--quick", action="store_true", help="skip loading the model (used by `make setup`)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--profile", action="store_true",
                   help="measure this machine's profile again (the bandwidth, FLOP/s and step time every lesson quotes)")


def run(args) -> int:
    from importlib import metadata

    import torch

    from course.engine.device import pick_device
    from course.engine.weights import (cache_dir, cached_weights_path, check_cache, check_model_path,
                                       default_gguf_path)

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
        path = check_model_path(default_gguf_path())  # a folder: "is a folder, not a GGUF file", as generate says
        problem = gguf_problem(path)
        if problem:
            raise ValueError(problem)
        print(f"model       {path} ({path.stat().st_size / 2**20:.0f} MiB)")
        problem = cache_problem(cache_dir())
        cached = None if problem else cached_weights_path(path)
        if problem:
            print(f"cache       WRONG — {problem}")
            ok = False
        elif not cached.exists():
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
    except ValueError as exc:
        print(f"model       WRONG — {exc}")
        ok = False
    except OSError as exc:  # e.g. not readable by you
        print(f"model       WRONG — cannot read {exc.filename or 'the model file'} ({exc.strerror or exc}): "
              "check its permissions, or set KVCOURSE_MODEL to a .gguf file you can read")
        ok = False
    if not args.quick:
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
            from course.measure import machine

            saved = machine.load(model.device, str(model.dtype).split(".")[-1])
            if args.profile or saved is None:
                print("profile     measuring this machine (about 10 s) ...", flush=True)
            print(f"profile     {machine.profile(model, refresh=args.profile)} ({machine.path()})")
    print("all good" if ok else "something is missing or wrong: see above")
    return 0 if ok else 1
