"""Write the sample submissions that prove the graders: autograde/samples/<student>/<assignment>/<nb>.ipynb.

Each sample starts from the released exercise (exercises/) and fills its answer cells:
  reference   the solutions' own code                     -> full marks
  blank       the exercise as released                     -> 0
  bug-*       one plausible mistake                        -> must lose points
  alt-*       correct code written differently             -> full marks
  adv-*       hostile or broken submissions                -> graded anyway (or reported), no grade lost
samples/manifest.json records what each one must score; tests/test_grading.py checks it.

Run after changing solutions/ (and regenerating exercises/):  python autograde/make_samples.py
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from course.paths import EXERCISES, SOLUTIONS  # noqa: E402

OUT = Path(__file__).resolve().parent / "samples"


@dataclass
class Sample:
    about: str
    expect: str  # full | zero | loses | invalid
    answers: dict[str, str] = field(default_factory=dict)  # answer cell grade_id -> code (reference if absent)
    patches: dict[str, list] = field(default_factory=dict)  # grade_id -> [(old, new)] applied to the reference
    blank: bool = False  # keep the released stubs (no answers at all)
    edits: list = field(default_factory=list)  # functions nb -> None applied after the answers
    evidence: str = ""  # text report.csv must mention for this submission
    raw: str | None = None  # write these bytes instead of a notebook (invalid files)
    honest: str = ""  # adversarial: the sample with the same answers and no attack (it may score no more)


def d(code: str) -> str:
    return textwrap.dedent(code).strip("\n")


# ----------------------------------------------------------------------------- notebook edits

def _index(nb, grade_id):
    return next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def add_cell_after(grade_id, code):
    def edit(nb):
        cell = nbformat.v4.new_code_cell(d(code))
        cell["id"] = f"added-after-{grade_id}"  # fixed, so the samples are reproducible byte for byte
        nb.cells.insert(_index(nb, grade_id) + 1, cell)
    return edit


def add_cell_first(code):
    """A cell of the student's own before the first answer cell (after the set-up cells)."""
    def edit(nb):
        cell = nbformat.v4.new_code_cell(d(code))
        cell["id"] = "added-first"
        first = next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader"))
        nb.cells.insert(first, cell)
    return edit


def replace_test(grade_id, code):
    def edit(nb):
        nb.cells[_index(nb, grade_id)].source = d(code)
    return edit


def delete_cell(grade_id):
    def edit(nb):
        del nb.cells[_index(nb, grade_id)]
    return edit


def inflate_points(nb):
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade"):
            meta["points"] = 100


# ----------------------------------------------------------------------------- attacks (adversarial samples)
# Each only ever touches course folders it finds above its working directory (a folder with gradebook.db),
# never the project checkout, so running the samples cannot damage the course's own files.

_COURSE_FOLDERS = """
import os
from pathlib import Path

def _course_folders():
    here = Path.cwd().resolve()
    return [p for p in list(here.parents)[:4] if p != Path("/") and (p / "gradebook.db").exists()]

def _walk(root, suffix):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("site-packages", "node_modules")]
        for name in filenames:
            if name.endswith(suffix):
                yield Path(dirpath) / name
"""

ATTACK_REWRITE = _COURSE_FOLDERS + """
import json
mine = {str(p.resolve()) for p in Path.cwd().glob("*.ipynb")}
hits = 0
for folder in _course_folders():
    for path in _walk(folder, ".ipynb"):
        if str(path.resolve()) in mine:
            continue
        try:
            nb = json.loads(path.read_text())
            for cell in nb["cells"]:
                if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
                    cell["source"] = "raise NotImplementedError('overwritten by a classmate')"
            path.write_text(json.dumps(nb))
            hits += 1
        except Exception:
            pass
print("notebooks rewritten:", hits)
"""

ATTACK_GRADEBOOK = _COURSE_FOLDERS + """
import sqlite3
hits = 0
for folder in _course_folders():
    for path in _walk(folder, "gradebook.db"):
        try:
            con = sqlite3.connect(str(path))
            con.execute("UPDATE grade SET manual_score = (SELECT max_score FROM grade_cell WHERE grade_cell.id = grade.cell_id)")
            con.commit()
            con.close()
            hits += 1
        except Exception:
            pass
print("gradebooks written:", hits)
"""

ATTACK_SOLUTIONS = """
import json
from pathlib import Path

import course
import course.paths

candidates = [Path(str(getattr(course.paths, "SOLUTIONS", "/nonexistent"))),
              Path(course.__file__).resolve().parent.parent / "solutions"]
found = next((c / "{path}" for c in candidates if (c / "{path}").exists()), None)
if found is not None:
    _answers = [c["source"] for c in json.loads(found.read_text())["cells"]
                if c.get("metadata", {{}}).get("nbgrader", {{}}).get("solution")]

    def _reanswer(result=None):  # after every cell, the solutions' answers replace the stubs
        for source in _answers:
            exec("".join(source), globals())

    get_ipython().events.register("post_run_cell", _reanswer)
print("solutions found:", found is not None)
"""

ATTACK_TRANSFORMER = """
def _blank_tests(lines):
    text = "".join(lines)
    return [] if "assert" in text or "HIDDEN" in text else lines

get_ipython().input_transformers_cleanup.append(_blank_tests)
"""

ATTACK_ALWAYS_EQUAL = """
{definition}
    class Always(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    return Always(0)
"""

ATTACK_PATCH_TORCH = """
import torch

torch.allclose = lambda *args, **kwargs: True
torch.equal = lambda *args, **kwargs: True
torch.isfinite = lambda x: torch.ones_like(x, dtype=torch.bool)
"""


# ----------------------------------------------------------------------------- 01 memory formula

MEMORY = {
    "reference": Sample("the solutions' code", "full"),
    "blank": Sample("the exercise as released", "zero", blank=True),
    "mem-bug-no-factor-2": Sample("forgets the factor 2 for K and V", "loses", {"kv_cache_bytes": """
        def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):
            return n_layers * batch * seq_len * n_kv_heads * head_dim * dtype_bytes
        """}),
    "mem-bug-n-heads": Sample("uses H (query heads) instead of H_kv", "loses", {"kv_bytes_per_token": """
        def kv_bytes_per_token(config, dtype_bytes=2):
            return kv_cache_bytes(config.n_layers, 1, 1, config.n_heads, config.head_dim, dtype_bytes)
        """}),
    "mem-bug-bits": Sample("counts bits instead of bytes", "loses", {"kv_cache_bytes": """
        def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):
            bits = dtype_bytes * 8
            return 2 * n_layers * batch * seq_len * n_kv_heads * head_dim * bits
        """}),
    "mem-bug-ignores-weights": Sample("forgets that the weights take memory too", "loses", {"max_context": """
        def max_context(config, memory_bytes, weights_bytes, dtype_bytes=2, batch=1):
            return int(memory_bytes // (kv_bytes_per_token(config, dtype_bytes) * batch))
        """}),
    "mem-bug-ignores-batch": Sample("max_context ignores the batch", "loses", {"max_context": """
        def max_context(config, memory_bytes, weights_bytes, dtype_bytes=2, batch=1):
            free = memory_bytes - weights_bytes
            return max(0, int(free // kv_bytes_per_token(config, dtype_bytes)))
        """}),
    "mem-bug-rounds-up": Sample("rounds the context up (the last token does not fit)", "loses", {"max_context": """
        import math

        def max_context(config, memory_bytes, weights_bytes, dtype_bytes=2, batch=1):
            free = memory_bytes - weights_bytes
            return max(0, math.ceil(free / (kv_bytes_per_token(config, dtype_bytes) * batch)))
        """}),
    "mem-bug-negative": Sample("returns a negative size when the weights do not fit", "loses", {
        "max_context": """
        def max_context(config, memory_bytes, weights_bytes, dtype_bytes=2, batch=1):
            return int((memory_bytes - weights_bytes) // (kv_bytes_per_token(config, dtype_bytes) * batch))
        """,
        "max_batch": """
        def max_batch(config, memory_bytes, weights_bytes, seq_len, dtype_bytes=2):
            return int((memory_bytes - weights_bytes) // (kv_bytes_per_token(config, dtype_bytes) * seq_len))
        """}),
    "mem-bug-gqa-inverted": Sample("inverts the GQA ratio (H_kv / H)", "loses", {"gqa_saving": """
        def gqa_saving(config):
            return config.n_kv_heads / config.n_heads
        """}),
    "mem-bug-batch-no-seq-len": Sample("max_batch divides by one token, not one sequence", "loses", {"max_batch": """
        def max_batch(config, memory_bytes, weights_bytes, seq_len, dtype_bytes=2):
            free = memory_bytes - weights_bytes
            return max(0, int(free // kv_bytes_per_token(config, dtype_bytes)))
        """}),
    "mem-bug-float": Sample("computes bits, divides by 8: a float byte count", "loses", {"kv_cache_bytes": """
        def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):
            bits = 2 * n_layers * batch * seq_len * n_kv_heads * head_dim * dtype_bytes * 8
            return bits / 8
        """}),
    "mem-bug-batch-zero": Sample("max_context divides by the batch without checking it (batch = 0)", "loses",
                                 patches={"max_context": [("    if batch < 1:\n        raise ValueError(f\"batch must be at "
                                                           "least 1 sequence, got {batch}\")\n", "")]}),
    "mem-bug-negative-batch": Sample("refuses batch = 0 only: a negative batch gives a negative byte count and context",
                                     "loses", patches={
        "kv_cache_bytes": [("    if batch < 1:", "    if batch == 0:")],
        "max_context": [("    if batch < 1:", "    if batch == 0:")]}),
    "mem-alt-prod": Sample("math.prod and max(0, ...)", "full", {
        "kv_cache_bytes": """
        import math

        def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):
            if batch <= 0:
                raise ValueError("batch must be positive")
            factors = (2, n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes)  # 2 = K and V
            return math.prod(factors)
        """,
        "kv_bytes_per_token": """
        def kv_bytes_per_token(config, dtype_bytes=2):
            per_layer = 2 * config.n_kv_heads * config.head_dim * dtype_bytes
            return config.n_layers * per_layer
        """,
        "max_context": """
        def max_context(config, memory_bytes, weights_bytes, dtype_bytes=2, batch=1):
            if batch <= 0:
                raise ValueError("need at least one sequence")
            per_step = batch * kv_bytes_per_token(config, dtype_bytes)
            return max(0, (memory_bytes - weights_bytes) // per_step)
        """,
        "max_batch": """
        def max_batch(config, memory_bytes, weights_bytes, seq_len, dtype_bytes=2):
            one_sequence = kv_cache_bytes(config.n_layers, 1, seq_len, config.n_kv_heads, config.head_dim, dtype_bytes)
            return max(0, int((memory_bytes - weights_bytes) // one_sequence))
        """,
        "gqa_saving": """
        def gqa_saving(config):
            return config.group_size
        """}),
    "mem-alt-search": Sample("binary search for the limits, ratio of two caches for GQA", "full", {
        "max_context": """
        def max_context(config, memory_bytes, weights_bytes, dtype_bytes=2, batch=1):
            if not batch >= 1:
                raise ValueError(f"batch={batch}: size at least one sequence")

            def fits(t):
                need = kv_cache_bytes(config.n_layers, batch, t, config.n_kv_heads, config.head_dim, dtype_bytes)
                return weights_bytes + need <= memory_bytes
            lo, hi = 0, 1
            while fits(hi):
                hi *= 2
            while hi - lo > 1:  # fits(lo) and not fits(hi)
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            return lo if fits(lo) else 0
        """,
        "max_batch": """
        def max_batch(config, memory_bytes, weights_bytes, seq_len, dtype_bytes=2):
            b = 0
            step = kv_cache_bytes(config.n_layers, 1, seq_len, config.n_kv_heads, config.head_dim, dtype_bytes)
            used = weights_bytes
            while used + step <= memory_bytes:
                used += step
                b += 1
            return b
        """,
        "gqa_saving": """
        def gqa_saving(config):
            mha = config.with_(n_kv_heads=config.n_heads)
            return kv_bytes_per_token(mha) / kv_bytes_per_token(config)
        """}),
    "mem-alt-course": Sample("calls the course's own course.memory for the formula", "full", {"kv_cache_bytes": """
        from course import memory

        def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):
            return memory.kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes)
        """}),
    # --- adversarial: each must be graded without stopping the others, and no grade lost
    "adv-infinite-loop": Sample("an extra cell that never ends", "full", edits=[
        add_cell_after("kv_cache_bytes", "while True:\n    pass")], evidence="timeout", honest="reference"),
    "adv-ignores-interrupt": Sample("a loop that swallows KeyboardInterrupt", "full", honest="reference", edits=[
        add_cell_after("test_max_batch_hidden", """
        import time
        while True:
            try:
                time.sleep(0.1)
            except KeyboardInterrupt:
                pass
        """)], evidence="timeout"),
    "adv-exception": Sample("an answer cell that raises", "loses", honest="reference", answers={"max_batch": """
        raise RuntimeError("I will do this one later")
        """}),
    "adv-edited-test": Sample("forgets the factor 2 and rewrites the visible test to pass", "loses",
                              {"kv_cache_bytes": """
        def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):
            return n_layers * batch * seq_len * n_kv_heads * head_dim * dtype_bytes
        """}, edits=[replace_test("test_kv_cache_bytes", "print('all good')"),
                     replace_test("test_kv_cache_bytes_hidden", "pass")], evidence="edited test",
                              honest="mem-bug-no-factor-2"),
    "adv-deleted-test": Sample("inverts GQA and deletes its test cells", "loses", {"gqa_saving": """
        def gqa_saving(config):
            return config.n_kv_heads / config.n_heads
        """}, edits=[delete_cell("test_gqa_saving"), delete_cell("test_gqa_saving_hidden")],
        evidence="deleted test", honest="mem-bug-gqa-inverted"),
    "adv-deleted-answer": Sample("deletes an answer cell and its tests", "loses",
                                 edits=[delete_cell("max_batch"), delete_cell("test_max_batch")],
                                 evidence="deleted answer", honest="reference"),
    "adv-points": Sample("raises every test's points to 100", "full", edits=[inflate_points],
                         evidence="metadata restored", honest="reference"),
    "adv-sys-exit": Sample("calls sys.exit() in the middle", "full", honest="reference", edits=[
        add_cell_after("max_context", "import sys\nsys.exit()")]),
    "adv-os-exit": Sample("kills its own kernel with os._exit(1)", "loses", edits=[
        add_cell_after("test_max_context_hidden", "import os\nos._exit(1)")], evidence="kernel died",
        honest="reference"),
    "adv-huge-alloc": Sample("allocates 6 GiB (over the kernel's memory cap)", "full", edits=[
        add_cell_after("gqa_saving", "hog = bytearray(6 * 2**30)  # touches every page")], evidence="MemoryError", honest="reference"),
    "adv-rewrite-others": Sample("overwrites every other notebook it can find with the reference, and its own "
                                 "queue neighbours with a blank", "zero", blank=True, honest="blank", edits=[
        add_cell_after("kv_cache_bytes", ATTACK_REWRITE)]),
    "adv-write-gradebook": Sample("finds gradebook.db and sets every score of its own to full, others to 0", "zero",
                                  blank=True, honest="blank", edits=[add_cell_after("kv_cache_bytes", ATTACK_GRADEBOOK)]),
    "adv-read-solutions": Sample("reads the solutions through course.paths and runs their answers", "zero",
                                 blank=True, honest="blank", edits=[add_cell_first(ATTACK_SOLUTIONS.format(path="01_memory_formula/memory_formula.ipynb"))]),
    "adv-input-transformer": Sample("registers an IPython input transformer that blanks every test cell", "zero",
                                    blank=True, honest="blank", edits=[add_cell_after("kv_cache_bytes", ATTACK_TRANSFORMER)]),
    "adv-int-subclass": Sample("returns an int subclass whose == is always true", "zero", honest="blank", answers={
        gid: ATTACK_ALWAYS_EQUAL.format(definition=definition) for gid, definition in (
            ("kv_cache_bytes", "def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):"),
            ("kv_bytes_per_token", "def kv_bytes_per_token(config, dtype_bytes=2):"),
            ("max_context", "def max_context(config, memory_bytes, weights_bytes, dtype_bytes=2, batch=1):"),
            ("max_batch", "def max_batch(config, memory_bytes, weights_bytes, seq_len, dtype_bytes=2):"),
            ("gqa_saving", "def gqa_saving(config):"))}),
    "adv-print-passed": Sample("prints 'visible tests passed' and 'hidden tests passed' instead of answering", "zero",
                               blank=True, honest="blank", edits=[add_cell_after(
                                   "kv_cache_bytes", "print('visible tests passed')\nprint('hidden tests passed')")]),
    "adv-exit-in-function": Sample("kv_cache_bytes calls os._exit(0) when the grader calls it", "loses",
                                   honest="reference", answers={"kv_cache_bytes": """
        import os

        def kv_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype_bytes):
            os._exit(0)
        """}),
    "adv-huge-output": Sample("prints 20 MB in one cell", "full", honest="reference",
                              edits=[add_cell_after("gqa_saving", "print('x' * 20_000_000)")]),
    "adv-invalid-json": Sample("a file cut off in the middle (not valid JSON)", "invalid",
                               raw='{"cells": [{"cell_type": "code", "source": ["def kv_cache_bytes('),
}


# ----------------------------------------------------------------------------- 02 KV cache

KV = {
    "reference": Sample("the solutions' code", "full"),
    "blank": Sample("the exercise as released", "zero", blank=True),
    "kv-bug-no-advance": Sample("the cache position does not advance: every write lands at position 0", "loses",
                                patches={"layer_cache": [
        ("self.k[:, :, start_pos:end] = k_new", "self.k[:, :, :k_new.shape[2]] = k_new"),
        ("self.v[:, :, start_pos:end] = v_new", "self.v[:, :, :v_new.shape[2]] = v_new")]}),
    "kv-bug-causal-off-by-one": Sample("off-by-one causal range: each query also sees the next key", "loses",
                                       patches={"cached_attention": [
        ("key_pos > query_pos,", "key_pos > query_pos + 1,")]}),
    "kv-bug-no-scale": Sample("forgets the 1/sqrt(D_h) scale", "loses", patches={"cached_attention": [
        (" / math.sqrt(q.shape[-1])", "")]}),
    "kv-bug-gqa-repeat": Sample("repeats KV heads in the wrong order (repeat, not repeat_interleave)", "loses",
                                patches={"cached_attention": [
        ("k = k.repeat_interleave(group, dim=1)", "k = k.repeat(1, group, 1, 1)"),
        ("v = v.repeat_interleave(group, dim=1)", "v = v.repeat(1, group, 1, 1)")]}),
    "kv-bug-no-overflow-check": Sample("no overflow check (PyTorch raises a shape error instead)", "loses",
                                       patches={"layer_cache": [
        ("if start_pos < 0 or end > self.k.shape[2]:", "if False:")]}),
    "kv-bug-returns-buffer": Sample("returns the whole preallocated buffer, zeros included", "loses",
                                    patches={"layer_cache": [
        ("return self.k[:, :, :end], self.v[:, :, :end]", "return self.k, self.v")]}),
    "kv-bug-softmax-axis": Sample("softmax over the queries instead of the keys", "loses", patches={"cached_attention": [
        ("scores.softmax(dim=-1)", "scores.softmax(dim=-2)")]}),
    "kv-bug-mask-no-offset": Sample("uses the uncached causal mask, forgetting start_pos", "loses",
                                    patches={"cached_attention": [
        ('scores = scores.masked_fill(key_pos > query_pos, float("-inf"))',
         'scores = scores.masked_fill(torch.ones(T, T_k, dtype=torch.bool).triu(1), float("-inf"))')]}),
    "kv-bug-cat-grows": Sample("rebuilds the cache with torch.cat every update instead of writing into the "
                               "preallocated buffers", "loses", patches={"layer_cache": [
        ("        if start_pos < 0 or end > self.k.shape[2]:",
         "        self.max_seq_len = getattr(self, 'max_seq_len', self.k.shape[2])\n"
         "        if start_pos < 0 or end > self.max_seq_len:"),
        ("""        self.k[:, :, start_pos:end] = k_new
        self.v[:, :, start_pos:end] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]""",
         """        self.k = torch.cat([self.k[:, :, :start_pos], k_new.to(self.k.dtype)], 2)
        self.v = torch.cat([self.v[:, :, :start_pos], v_new.to(self.v.dtype)], 2)
        return self.k, self.v""")]}),
    "kv-bug-scales-k-in-place": Sample("scales the caller's k_new in place (k_new.mul_) instead of the scores",
                                       "loses", patches={"cached_attention": [
        ("    k, v = layer_cache.update(start_pos, k_new, v_new)",
         "    k_new.mul_(1 / math.sqrt(q.shape[-1]))  # scale K once, when it is cached\n"
         "    k, v = layer_cache.update(start_pos, k_new, v_new)"),
        (" / math.sqrt(q.shape[-1])  # [B, H, T, T_k]", "  # [B, H, T, T_k]")]}),
    "kv-bug-new-cache-dtype": Sample("new_cache drops its dtype argument (float32 layers always)", "loses",
                                     patches={"layer_cache": [
        ("config.head_dim, dtype) for _ in", "config.head_dim) for _ in")]}),
    "kv-bug-new-cache-global-cfg": Sample("new_cache sizes every layer from the notebook's global cfg, not its config "
                                          "argument", "loses", patches={"layer_cache": [
        ("return [LayerCache(batch, config.n_kv_heads, max_seq_len, config.head_dim, dtype) for _ in range(config.n_layers)]",
         "return [LayerCache(batch, cfg.n_kv_heads, max_seq_len, cfg.head_dim, dtype) for _ in range(cfg.n_layers)]")]}),
    "kv-bug-decode-grows": Sample("a single token past max_seq_len grows both buffers (torch.cat) instead of "
                                  "raising ValueError", "loses", patches={"layer_cache": [
        ("        if start_pos < 0 or end > self.k.shape[2]:",
         "        if k_new.shape[2] == 1 and start_pos >= self.k.shape[2]:  # decode: make room\n"
         "            pad = torch.zeros(*self.k.shape[:2], end - self.k.shape[2], self.k.shape[3],\n"
         "                              dtype=self.k.dtype)\n"
         "            self.k, self.v = torch.cat([self.k, pad], 2), torch.cat([self.v, pad], 2)\n"
         "        if start_pos < 0 or end > self.k.shape[2]:")]}),
    "kv-bug-negative-decode-wraps": Sample("a single token at a negative position wraps around (arange % T_max) "
                                           "instead of raising ValueError", "loses", patches={"layer_cache": [
        ("        if start_pos < 0 or end > self.k.shape[2]:",
         "        if (start_pos < 0 and k_new.shape[2] > 1) or end > self.k.shape[2]:"),
        ("""        self.k[:, :, start_pos:end] = k_new
        self.v[:, :, start_pos:end] = v_new""",
         """        idx = torch.arange(start_pos, end) % self.k.shape[2]
        self.k[:, :, idx] = k_new
        self.v[:, :, idx] = v_new""")]}),
    "kv-bug-bf16-becomes-fp16": Sample("any dtype other than float32 gives float16 buffers (bfloat16 too)", "loses",
                                       patches={"layer_cache": [
        ("        self.v = torch.zeros(shape, dtype=dtype)\n",
         "        self.v = torch.zeros(shape, dtype=dtype)\n"
         "        if dtype != torch.float32:  # reduced precision\n"
         "            self.k, self.v = self.k.half(), self.v.half()\n")]}),
    "kv-alt-einsum": Sample("einsum, expand+reshape for GQA, narrow().copy_() writes", "full", {
        "layer_cache": """
        class LayerCache:
            def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype=torch.float32):
                self.max_seq_len = max_seq_len
                self.k = torch.zeros(batch, n_kv_heads, max_seq_len, head_dim, dtype=dtype)
                self.v = torch.zeros_like(self.k)

            def update(self, start_pos, k_new, v_new):
                n = k_new.size(2)
                if not 0 <= start_pos <= self.max_seq_len - n:
                    raise ValueError(f"cannot store {n} tokens at {start_pos}: the cache holds {self.max_seq_len}")
                self.k.narrow(2, start_pos, n).copy_(k_new)
                self.v.narrow(2, start_pos, n).copy_(v_new)
                return self.k.narrow(2, 0, start_pos + n), self.v.narrow(2, 0, start_pos + n)


        def new_cache(config, batch, max_seq_len, dtype=torch.float32):
            caches = []
            for _ in range(config.n_layers):
                caches.append(LayerCache(batch, config.n_kv_heads, max_seq_len, config.head_dim, dtype))
            return caches
        """,
        "cached_attention": """
        def cached_attention(q, k_new, v_new, layer_cache, start_pos):
            k, v = layer_cache.update(start_pos, k_new, v_new)
            B, H, T, D = q.shape
            H_kv, T_k = k.shape[1], k.shape[2]
            k = k[:, :, None].expand(B, H_kv, H // H_kv, T_k, D).reshape(B, H, T_k, D)
            v = v[:, :, None].expand(B, H_kv, H // H_kv, T_k, D).reshape(B, H, T_k, D)
            scores = torch.einsum("bhtd,bhsd->bhts", q, k) * D ** -0.5
            allowed = torch.arange(T_k)[None, :] <= torch.arange(T)[:, None] + start_pos
            weights = torch.where(allowed, scores, torch.tensor(float("-inf"))).softmax(-1)
            return torch.einsum("bhts,bhsd->bhtd", weights, v)
        """}),
    "kv-alt-sdpa": Sample("index_copy_ writes, scaled_dot_product_attention with a boolean mask", "full", {
        "layer_cache": """
        class LayerCache:
            def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype=torch.float32):
                self.k = torch.zeros((batch, n_kv_heads, max_seq_len, head_dim), dtype=dtype)
                self.v = torch.zeros((batch, n_kv_heads, max_seq_len, head_dim), dtype=dtype)

            def update(self, start_pos, k_new, v_new):
                positions = torch.arange(start_pos, start_pos + k_new.shape[2])
                if start_pos < 0 or positions[-1] >= self.k.shape[2]:
                    raise ValueError("KV cache overflow: make max_seq_len larger")
                self.k.index_copy_(2, positions, k_new)
                self.v.index_copy_(2, positions, v_new)
                end = int(positions[-1]) + 1
                return self.k[:, :, :end], self.v[:, :, :end]


        def new_cache(config, batch, max_seq_len, dtype=torch.float32):
            return [LayerCache(batch, config.n_kv_heads, max_seq_len, config.head_dim, dtype)
                    for layer in range(config.n_layers)]
        """,
        "cached_attention": """
        def cached_attention(q, k_new, v_new, layer_cache, start_pos):
            k, v = layer_cache.update(start_pos, k_new, v_new)
            T, T_k = q.shape[2], k.shape[2]
            mask = torch.ones(T, T_k, dtype=torch.bool).tril(diagonal=T_k - T)  # True = may attend
            group = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  attn_mask=mask)
        """}),
}

# ----------------------------------------------------------------------------- 03 sampler

IDENTITY_SAMPLER = {
    "apply_temperature": """
        def apply_temperature(logits, temperature):
            return logits
        """,
    "top_k_filter": """
        def top_k_filter(logits, k):
            return logits
        """,
    "top_p_filter": """
        def top_p_filter(logits, p):
            return logits
        """,
    "sampler": """
        def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
            return logits.softmax(-1)


        def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
            return logits.argmax(-1)
        """}

SAMPLER = {
    "reference": Sample("the solutions' code", "full"),
    "blank": Sample("the exercise as released", "zero", blank=True),
    "samp-bug-temp-after-softmax": Sample("applies the temperature after the softmax (then renormalises)", "loses",
                                          patches={"sampler": [
        ("""    logits = apply_temperature(logits.float(), temperature)
    if top_k""", """    logits = logits.float()
    if top_k"""),
        ("""    return logits.softmax(dim=-1)
""", """    probs = apply_temperature(logits.softmax(dim=-1), temperature)
    return probs / probs.sum(dim=-1, keepdim=True)
""")]}),
    "samp-bug-temp-multiplies": Sample("multiplies the logits by the temperature", "loses", patches={
        "apply_temperature": [("return logits / temperature", "return logits * temperature")]}),
    "samp-bug-top-p-drops-crossing": Sample("top-p drops the token that crosses p", "loses", patches={"top_p_filter": [
        ("drop_sorted = mass_before >= p", "drop_sorted = probs.cumsum(dim=-1) > p\n    drop_sorted[..., 0] = False")]}),
    "samp-bug-top-k-wrong-axis": Sample("top-k along the batch axis instead of the vocabulary", "loses", patches={
        "top_k_filter": [("if k >= logits.shape[-1]:", "if k >= logits.shape[0]:"),
                         ("torch.topk(logits, k, dim=-1).values[..., -1:]", "torch.topk(logits, k, dim=0).values[-1]")]}),
    "samp-bug-top-p-unsorted": Sample("top-p sums the probabilities in vocabulary order, unsorted", "loses", patches={
        "top_p_filter": [("""    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)""", """    order = torch.arange(logits.shape[-1]).expand_as(logits)
    probs = logits.softmax(dim=-1)""")]}),
    "samp-bug-no-renormalise": Sample("zeroes the filtered tokens but does not renormalise", "loses", patches={
        "sampler": [("""    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return logits.softmax(dim=-1)""", """    probs = logits.softmax(dim=-1)
    if top_k is not None:
        probs = probs * torch.isfinite(top_k_filter(logits, top_k))
    if top_p is not None:
        probs = probs * torch.isfinite(top_p_filter(logits, top_p))
    return probs""")]}),
    "samp-bug-top-k-plus-one": Sample("top-k keeps k + 1 tokens (off by one)", "loses", patches={"top_k_filter": [
        ("if k >= logits.shape[-1]:", "if k + 1 >= logits.shape[-1]:"),
        ("torch.topk(logits, k, dim=-1)", "torch.topk(logits, k + 1, dim=-1)")]}),
    "samp-bug-top-p-before-temperature": Sample("filters with top-p before applying the temperature", "loses",
                                                patches={"sampler": [
        ("""    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return""", """    logits = logits.float()
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    logits = apply_temperature(logits, temperature)
    return""")]}),
    "samp-bug-top-p-before-top-k": Sample("applies top-p before top-k", "loses", patches={"sampler": [
        ("""    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
""", """    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
""")]}),
    "samp-bug-top-k-ties-fewer": Sample("top-k keeps only the tokens above the (k+1)-th: fewer than k on ties", "loses",
                                        patches={"top_k_filter": [
        ("""    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))""",
         """    next_largest = torch.topk(logits, k + 1, dim=-1).values[..., -1:]  # the first one dropped
    return logits.masked_fill(logits <= next_largest, float("-inf"))""")]}),
    "samp-bug-top-p-in-place": Sample("top-p writes -inf into the caller's logits (masked_fill_)", "loses",
                                      patches={"top_p_filter": [
        ('return logits.masked_fill(drop, float("-inf"))', 'return logits.masked_fill_(drop, float("-inf"))')]}),
    "samp-bug-top-p-boundary": Sample("top-p keeps a token while the mass before it is <= p: one too many when the "
                                      "running total lands exactly on p", "loses", patches={"top_p_filter": [
        ("drop_sorted = mass_before >= p", "drop_sorted = mass_before > p")]}),
    "samp-bug-ignores-generator": Sample("ignores the generator and reseeds the global RNG on every call: every seed "
                                         "draws the same", "loses", patches={"sampler": [
        ("    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [B]",
         "    torch.manual_seed(1234)  # 'reproducible'\n    ids = torch.multinomial(flat, 1).squeeze(-1)  # [B]")]}),
    "samp-bug-reseeds-global": Sample("reseeds the global RNG with the generator's seed and draws from the global "
                                      "RNG: one generator draws the same twice, and the caller's global RNG is reset",
                                      "loses", patches={"sampler": [
        ("    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [B]",
         "    if generator is not None:\n        torch.manual_seed(generator.initial_seed())\n"
         "    ids = torch.multinomial(flat, 1).squeeze(-1)  # [B]")]}),
    "samp-bug-greedy-batch": Sample("T = 0 marks every logit equal to the batch's overall maximum: wrong on a batch "
                                    "and on ties", "loses", patches={"sampler": [
        ("        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()",
         "        return (logits == logits.max()).float()"),
        ("    probs = sampling_probs(logits, temperature, top_k, top_p)\n    flat",
         "    if temperature == 0:\n        return logits.argmax(-1)\n"
         "    probs = sampling_probs(logits, temperature, top_k, top_p)\n    flat")]}),
    "samp-bug-1d-global-rng": Sample("[V] logits draw with the global RNG (the generator is used for [B, V] only)",
                                     "loses", patches={"sampler": [
        ("    flat = probs.reshape(-1, probs.shape[-1])  # [B, V]\n",
         "    if probs.dim() == 1:\n        return torch.multinomial(probs, 1).squeeze(-1)\n"
         "    flat = probs.reshape(-1, probs.shape[-1])  # [B, V]\n")]}),
    "samp-bug-1d-drops-args": Sample("[V] logits go to sample as one row, without the temperature, top_k and top_p",
                                     "loses", patches={"sampler": [
        ("    probs = sampling_probs(logits, temperature, top_k, top_p)\n    flat",
         "    if logits.dim() == 1:\n        return sample(logits[None], generator=generator)[0]\n"
         "    probs = sampling_probs(logits, temperature, top_k, top_p)\n    flat")]}),
    "samp-bug-inplace-at-T1": Sample("at T = 1 sampling_probs skips the division and applies top-k in place: the "
                                     "caller's logits change", "loses", patches={"sampler": [
        ("    logits = apply_temperature(logits.float(), temperature)\n    if top_k is not None:\n"
         "        logits = top_k_filter(logits, top_k)\n",
         "    logits = logits.float()\n    if temperature != 1:\n        logits = apply_temperature(logits, temperature)\n"
         "    if top_k is not None:\n        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]\n"
         "        logits.masked_fill_(logits < kth, float('-inf'))\n")]}),
    "samp-bug-greedy-keeps-dtype": Sample("T = 0 returns the one-hot in the logits' dtype (bfloat16 in, bfloat16 out)",
                                          "loses", patches={"sampler": [
        ("logits.shape[-1]).float()", "logits.shape[-1]).to(logits.dtype)")]}),
    "samp-bug-identity": Sample("every function hands the logits back unchanged", "loses", answers=IDENTITY_SAMPLER),
    "adv-course-sampler": Sample("temperature handed to the course's own sampler, reached through "
                                 "getattr(course, 'engine') where no import names it: full marks, and a note",
                                 "full", {
        "apply_temperature": """
        import course.config

        _S = getattr(course, "engine").sampling


        def apply_temperature(logits, temperature):
            return _S.apply_temperature(logits, temperature)
        """}, evidence="course's own", honest="reference"),
    "adv-patch-torch": Sample("hands the logits back unchanged and patches torch.allclose, torch.equal, torch.isfinite",
                              "loses", answers=IDENTITY_SAMPLER, honest="samp-bug-identity",
                              edits=[add_cell_after("sampler", ATTACK_PATCH_TORCH)]),
    "samp-alt-loops": Sample("sort once, keep with Python loops over rows, inverse-CDF sampling", "full", {
        "top_k_filter": """
        def top_k_filter(logits, k):
            if k < 1:
                raise ValueError("k must be >= 1")
            rows = logits.reshape(-1, logits.shape[-1]).clone()
            for row in rows:
                if k < row.numel():
                    threshold = row.sort(descending=True).values[k - 1]
                    row[row < threshold] = float("-inf")
            return rows.reshape(logits.shape)
        """,
        "top_p_filter": """
        def top_p_filter(logits, p):
            if p <= 0 or p > 1:
                raise ValueError("p must be in (0, 1]")
            if p == 1:  # every token: a running total may round to 1 before the last one
                return logits.clone()
            rows = logits.reshape(-1, logits.shape[-1]).clone()
            for row in rows:
                probs = row.softmax(-1)
                total = 0.0
                for idx in probs.argsort(descending=True).tolist():
                    if total >= p:
                        row[idx] = float("-inf")
                    total += probs[idx].item()
            return rows.reshape(logits.shape)
        """,
        "sampler": """
        def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
            if temperature == 0:
                probs = torch.zeros_like(logits, dtype=torch.float32)
                return probs.scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
            x = apply_temperature(logits.float(), temperature)
            x = top_k_filter(x, top_k) if top_k else x
            x = top_p_filter(x, top_p) if top_p is not None else x
            weights = torch.exp(x - x.max(-1, keepdim=True).values)
            return weights / weights.sum(-1, keepdim=True)


        def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
            probs = sampling_probs(logits, temperature, top_k, top_p)
            cdf = probs.cumsum(-1)
            u = torch.rand(probs.shape[:-1] + (1,), generator=generator) * cdf[..., -1:]
            ids = torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1)
            return ids.squeeze(-1)
        """}),
    "samp-alt-gumbel": Sample("kthvalue for top-k, searchsorted for top-p, Gumbel-max sampling", "full", {
        "top_k_filter": """
        def top_k_filter(logits, k):
            V = logits.shape[-1]
            if k <= 0:
                raise ValueError(f"k must be positive, got {k}")
            if k >= V:
                return logits.clone()
            threshold = logits.kthvalue(V - k + 1, dim=-1, keepdim=True).values
            return torch.where(logits >= threshold, logits, torch.full_like(logits, float("-inf")))
        """,
        "top_p_filter": """
        def top_p_filter(logits, p):
            if not (0.0 < p <= 1.0):
                raise ValueError(f"p must be in (0, 1], got {p}")
            if p == 1.0:
                return logits.clone()
            values, order = logits.sort(-1, descending=True)
            cdf = values.softmax(-1).cumsum(-1)
            n_keep = torch.searchsorted(cdf, torch.full(cdf.shape[:-1] + (1,), p), right=False) + 1
            rank = torch.arange(logits.shape[-1]).expand_as(logits)
            keep_sorted = rank < n_keep.clamp(max=logits.shape[-1])
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            return logits.masked_fill(~keep, float("-inf"))
        """,
        "sampler": """
        def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
            if temperature == 0:
                return (torch.arange(logits.shape[-1]) == logits.argmax(-1, keepdim=True)).float()
            x = apply_temperature(logits.to(torch.float32), temperature)
            if top_k is not None:
                x = top_k_filter(x, top_k)
            if top_p is not None:
                x = top_p_filter(x, top_p)
            return torch.softmax(x, dim=-1)


        def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
            if temperature == 0:
                return logits.argmax(-1)
            probs = sampling_probs(logits, temperature, top_k, top_p)
            u = torch.rand(probs.shape, generator=generator).clamp_min(1e-20)
            gumbel = -torch.log(-torch.log(u))
            return (probs.log() + gumbel).argmax(-1)  # Gumbel-max: argmax of log p + noise is a draw from p
        """}),
}

# ----------------------------------------------------------------------------- 04 checkpoint quiz (from questions.yaml)

def quiz_samples() -> dict[str, Sample]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_quiz

    questions = make_quiz.graded_questions()  # kept out of the course package: autograde/quiz_questions.yaml
    number = {q.id: n for n, q in enumerate(questions, start=1)}  # the quiz's answer_N / test_N (make_quiz.py)
    name = {q.id: f"answer_{number[q.id]}" for q in questions}
    answers = {name[q.id]: f"{name[q.id]} = {q.answer!r}" for q in questions}

    def wrong(q):
        return next(o for o in q.options if o.key != q.answer)

    samples = {
        "reference": Sample("the right letters", "full"),
        "blank": Sample("the exercise as released", "zero", blank=True),
    }
    for q in questions:
        option = wrong(q)
        samples[f"quiz-bug-q{number[q.id]}"] = Sample(
            f"question {number[q.id]}: picks {option.key}, '{option.text[:60]}'", "loses",
            {**answers, name[q.id]: f"{name[q.id]} = {option.key!r}"})
    for letter in sorted({o.key for q in questions for o in q.options}):  # one letter everywhere: never full marks
        samples[f"quiz-bug-all-{letter.lower()}"] = Sample(f"answers {letter} everywhere", "loses",
                                                          {name[q.id]: f"{name[q.id]} = {letter!r}" for q in questions})
    first = questions[0]
    samples["quiz-bug-option-text"] = Sample("writes the option's text instead of its letter", "loses", {
        **answers, name[first.id]: f"{name[first.id]} = {first.correct.text!r}"})
    samples["quiz-alt-lowercase"] = Sample("lower-case letters with spaces", "full", {
        name[q.id]: f"{name[q.id]} = ' {q.answer.lower()} '" for q in questions})
    samples["quiz-alt-computed"] = Sample("letters computed from option numbers", "full", {
        name[q.id]: f"options = 'ABCDEFGH'\n{name[q.id]} = options[{'ABCDEFGH'.index(q.answer)}]"
        for q in questions})
    samples["adv-read-solutions"] = Sample("reads the solutions through course.paths and runs their answers", "zero",
                                           blank=True, honest="blank", edits=[add_cell_first(ATTACK_SOLUTIONS.format(
                                               path="04_checkpoint_quiz/checkpoint_quiz.ipynb"))])
    return samples

SAMPLES = {
    "01_memory_formula": MEMORY,
    "02_kv_cache": KV,
    "03_sampler": SAMPLER,
    "04_checkpoint_quiz": quiz_samples(),
    "05_paged_cache": {name: Sample(**spec) for name, spec in __import__("samples_05").SAMPLES.items()},
}


# ----------------------------------------------------------------------------- writing

SOLUTION_MARKERS = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")


def reference_answers(source_nb) -> dict[str, str]:
    """What a student who wrote the solutions would have in each answer cell."""
    answers = {}
    for cell in source_nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            lines = [ln for ln in cell.source.splitlines() if not SOLUTION_MARKERS.match(ln)]
            answers[meta["grade_id"]] = "\n".join(lines)
    return answers


def build(assignment: str, student: str, sample: Sample) -> bytes:
    (notebook,) = sorted((EXERCISES / assignment).glob("*.ipynb"))
    nb = nbformat.read(str(notebook), as_version=4)
    if not sample.blank:
        (source,) = sorted((SOLUTIONS / assignment).glob("*.ipynb"))
        answers = reference_answers(nbformat.read(str(source), as_version=4))
        answers.update({k: d(v) for k, v in sample.answers.items()})
        for grade_id, replacements in sample.patches.items():
            for old, new in replacements:
                if old not in answers[grade_id]:
                    raise ValueError(f"{student}: {old!r} is not in the reference answer {grade_id!r}")
                answers[grade_id] = answers[grade_id].replace(old, new)
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if cell.metadata.get("nbgrader", {}).get("solution") and grade_id in answers:
                cell.source = answers[grade_id]
    for edit in sample.edits:
        edit(nb)
    return nbformat.writes(nb).encode()


def main(out: Path = OUT) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    manifest = []
    for assignment, samples in SAMPLES.items():
        (notebook,) = sorted((EXERCISES / assignment).glob("*.ipynb"))
        for student, sample in samples.items():
            path = out / student / assignment / notebook.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(sample.raw.encode() if sample.raw is not None else build(assignment, student, sample))
            manifest.append({"student": student, "assignment": assignment, "notebook": notebook.stem,
                             "about": sample.about, "expect": sample.expect, "evidence": sample.evidence,
                             "honest": sample.honest})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


if __name__ == "__main__":
    for entry in main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(f"{entry['student']:<28} {entry['assignment']:<20} expect {entry['expect']:<8} {entry['about']}")
