"""One query's attention inside the compiled decode step (course/engine/fast.py), three ways side by side in one process.

    .venv/bin/python docs/bench-runs/attention.py --out docs/bench-runs/attention-<date>.json

    sdpa     F.scaled_dot_product_attention as the model calls it (Inductor lowers it to ATen's flash-attention CPU
             kernel), the step before this record
    sums     the attention written as sums Inductor fuses (_Products with attend=True: the step as shipped)
    kernel   17d83f0's C++ decode-attention kernel (cut out of that commit's row_product.cpp, built under its own op
             namespace), for comparison: what a kernel of our own would add on top of the sums

The course model, float32, 1 thread, context 64: the whole-step graph at B = 1 and B = 8, and the any-shape step
(one compiled block per layer: lesson 05's server) at B = 8. Every variant compiles first and its logits are checked
against sdpa's; then they take turns, round after round, the order reversed every other round. Reported: each
variant's median ms and the median over rounds of its time ÷ sdpa's in the same round.
"""
import argparse, json, os, platform, re, statistics, subprocess, tempfile, time  # noqa: E401
from pathlib import Path

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--out")
args = p.parse_args()
torch.set_num_threads(1)

old = subprocess.run(["git", "show", "17d83f0:course/engine/row_product.cpp"], capture_output=True, text=True,
                     check=True).stdout
head = "\n".join(line for line in old.splitlines()[:40] if line.startswith(("#include", "#if", "#define", "#endif")))
body = old[old.index("// q . k over D numbers"):old.index("bool vectorised()")]
build = Path(tempfile.mkdtemp(prefix="attention-"))
(build / "att.cpp").write_text(head + "\n#include <ATen/Parallel.h>\n#include <ATen/cpu/vec/vec.h>\n#include <cmath>\n"
                               "#include <limits>\n#include <vector>\n" + body +
                               'TORCH_LIBRARY(kvatt, m) { m.def("decode_attention(Tensor q, Tensor k, Tensor v, '
                               'Tensor hidden) -> Tensor"); }\nTORCH_LIBRARY_IMPL(kvatt, CPU, m) '
                               '{ m.impl("decode_attention", &decode_attention); }\n')
from torch.utils.cpp_extension import load  # noqa: E402

load(name="kvatt", sources=[str(build / "att.cpp")], build_directory=str(build),
     extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False)
torch.library.register_fake("kvatt::decode_attention")(lambda q, k, v, hidden: q.new_empty(q.shape))

from pieces import rounds  # noqa: E402  (docs/bench-runs/pieces.py, beside this script)

from course.engine import fast  # noqa: E402
from course.engine.fast import DecodeStep  # noqa: E402
from course.engine.kv_cache import KVCache  # noqa: E402
from course.engine.weights import load_model  # noqa: E402


class WithKernel(fast._Products):
    """_Products whose third flag "kernel" sends one query's attention to 17d83f0's kernel instead of the sums."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and self.attend == "kernel" and torch.compiler.is_compiling():
            q, k, v = args[:3]
            mask = kwargs["attn_mask"]
            B, H, _, D = q.shape
            hidden = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
            return torch.ops.kvatt.decode_attention(q.reshape(B, k.shape[1], H // k.shape[1], D), k, v,
                                                    hidden).view(B, H, 1, D)
        return super().__torch_function__(func, types, args, kwargs)


fast._Products = WithKernel
model, T = load_model(dtype="float32"), 64


def make(attend, B: int, any_shape: bool):
    step = DecodeStep(model, any_shape=any_shape)
    step.hooks = step.hooks[:2] + (attend,)
    torch.manual_seed(B)
    cache = KVCache(model.config, batch=B, max_seq_len=T + 1, dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (B, T)), start_pos=0, cache=cache)
    token = torch.randint(0, 1000, (B, 1))
    return step, lambda: step(token, T, cache)


calls, checks = {}, {}
for B, any_shape in ((1, False), (8, False), (8, True)):
    ref = None
    for name, attend in (("sdpa", False), ("sums", True), ("kernel", "kernel")):
        t0 = time.perf_counter()
        step, call = make(attend, B, any_shape)
        out = call()
        assert step.compiled, step.fallback
        key = f"{'any-shape ' if any_shape else ''}B={B} {name}"
        ref = out if ref is None else ref
        checks[key] = (out - ref).abs().max().item()
        print(f"{key}: compiled in {time.perf_counter() - t0:.0f} s, max |logit - sdpa's| {checks[key]:.2e}", flush=True)
        calls[key] = call
with torch.inference_mode():
    times, _ = rounds(calls, args.rounds, 15)  # pieces.py's rounds: the variants take turns, order reversed every other
rows = []
for key, ts in times.items():
    base = times[key.rsplit(" ", 1)[0] + " sdpa"]
    rows.append(dict(variant=key, ms=statistics.median(ts) * 1e3, rounds_ms=[t * 1e3 for t in ts],
                     x_sdpa=statistics.median(a / b for a, b in zip(ts, base)), max_logit_diff=checks[key]))
    print(f"{key:24s} {rows[-1]['ms']:6.2f} ms  ÷ sdpa {rows[-1]['x_sdpa']:.3f}")
if args.out:
    Path(args.out).write_text(json.dumps(dict(
        cpu=platform.processor() or re.sub(r".*model name\s*:\s*", "", next(
            (ln for ln in open("/proc/cpuinfo") if "model name" in ln), "")).strip(),
        avx512="avx512f" in open("/proc/cpuinfo").read(), torch=torch.__version__, threads=1, context=T,
        rounds=args.rounds, load_after=os.getloadavg()[0], rows=rows), indent=1))
