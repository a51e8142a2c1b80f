"""Row kernels side by side: every product of the course model's decode step (its weight shapes, random float32
weights, 538 MB), for B rows of x, by each kernel given and by BLAS (torch's F.linear), 1 thread.

    .venv/bin/python docs/bench-runs/row_kernels.py --out docs/bench-runs/row-kernels-<date>.json \
        rewrite=<(git show d461b32:course/engine/row_product.cpp) now=course/engine/row_product.cpp \
        17d83f0=<(git show 17d83f0:course/engine/row_product.cpp)

Each NAME=FILE is built (-O3 -march=native, as course.engine.row_product builds it) under its own op namespace and
checked against BLAS first. Then, round after round and for each B, every kernel makes one pass over all the
weights, the order rotating between rounds so a burst of load hits them alike. Reported: per kernel and B the median
and the fastest pass, in ms. 17d83f0's kernel takes a third argument (the batch above which it calls BLAS): 2**30.
"""
import argparse, json, os, platform, re, statistics, tempfile, time  # noqa: E401
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

p = argparse.ArgumentParser()
p.add_argument("kernels", nargs="+", help="NAME=FILE of a row_product.cpp")
p.add_argument("--batches", default="1,2,4,8,16,32,64")
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--out")
args = p.parse_args()
torch.set_num_threads(1)
ops, build = {}, Path(tempfile.mkdtemp(prefix="row-kernels-"))
for item in args.kernels:
    name, file = item.split("=", 1)
    src = re.sub(r"TORCH_LIBRARY(_IMPL)?\(kvcourse", lambda m: f"TORCH_LIBRARY{m.group(1) or ''}(rk_{name}",
                 Path(file).read_text())
    (build / name).mkdir()
    (build / name / "row_product.cpp").write_text(src)
    load(name=f"rk_{name}", sources=[str(build / name / "row_product.cpp")], build_directory=str(build / name),
         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False)
    op = getattr(torch.ops, f"rk_{name}").row_product
    three = "int blas_above" in src
    ops[name] = (lambda op, three: (lambda x, w: op(x, w, 1 << 30) if three else op(x, w)))(op, three)
ops["BLAS"] = torch.nn.functional.linear
H, I, V = 576, 1536, 49152  # SmolLM2-135M: hidden, MLP width, vocabulary (the tied head)
W = [torch.randn(n, d) * 0.02 for n, d in [(576, H), (192, H), (192, H), (576, H), (I, H), (I, H), (H, I)] * 30
     + [(V, H)]]
batches = [int(b) for b in args.batches.split(",")]
for B in batches:
    xs = {d: torch.randn(B, d) for d in (H, I)}
    for w in W[:7] + W[-1:]:
        for name, op in ops.items():
            assert torch.allclose(op(xs[w.shape[1]], w), xs[w.shape[1]] @ w.T, atol=1e-3, rtol=1e-3), (name, B)
load_before, start = os.getloadavg(), time.time()
times, names = {n: {B: [] for B in batches} for n in ops}, list(ops)
for r in range(args.rounds):
    for B in batches:
        xs = {d: torch.randn(B, d) for d in (H, I)}
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            for w in W:
                ops[name](xs[w.shape[1]], w)
            times[name][B].append((time.perf_counter() - t) * 1e3)
table = {n: {B: {"median_ms": statistics.median(v), "min_ms": min(v)} for B, v in t.items()} for n, t in times.items()}
print("B     " + "".join(f"{n:>20s}" for n in names))
for B in batches:
    print(f"{B:<6d}" + "".join(f"{table[n][B]['median_ms']:11.1f} ({table[n][B]['min_ms']:5.1f})" for n in names))
if args.out:
    Path(args.out).write_text(json.dumps({
        "kernels": args.kernels, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "avx512": "avx512f" in Path("/proc/cpuinfo").read_text(), "threads": 1, "rounds": args.rounds,
        "load_average_before": load_before, "load_average_after": os.getloadavg(), "wall_s": time.time() - start,
        "ms_per_pass": table}, indent=1))
