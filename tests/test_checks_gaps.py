"""The declared checks (autograde/checks) run directly on a notebook's code, without the sandbox: fast proof that
each planted bug the grader review found (2026-12-03) loses its cell, and that correct code written with another
free-list policy keeps full marks.

The sealed grader runs the same `run(ns)` in the sandbox and judges the same plain data with the same compare
functions (tests/test_grading.py grades the samples that way, slowly); here the namespace comes from exec'ing the
sample's set-up and answer cells in this process, so only the project's own samples and patches of the reference
solution run here, never a hostile submission.
"""
from __future__ import annotations

import functools
import os
import sys

import nbformat
import pytest

from course.grade.plain import decode, encode, error
from course.grade.verdicts import checks_path, judge, load_checks
from course.paths import AUTOGRADE

sys.path.insert(0, str(AUTOGRADE))
import make_samples  # noqa: E402

SAMPLES = make_samples.samples()


def Sample(about: str, expect: str, **fields) -> dict:
    """A sample as autograde/samples.yaml spells one."""
    return dict(about=about, expect=expect, **fields)


def namespace(source: bytes) -> dict:
    """Every code cell but the test cells, exec'd in order, as the grader runs them (the demos skip themselves)."""
    nb = nbformat.reads(source.decode(), as_version=4)
    ns: dict = {}
    saved = os.environ.get("NBGRADER_EXECUTION")
    os.environ["NBGRADER_EXECUTION"] = "autograde"
    try:
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and not (meta.get("grade") and not meta.get("solution")):
                exec(compile(cell.source, "<notebook>", "exec"), ns)
    finally:
        if saved is None:
            os.environ.pop("NBGRADER_EXECUTION")
        else:
            os.environ["NBGRADER_EXECUTION"] = saved
    return ns


def values(checks: dict, ns: dict) -> dict:
    out = {}
    for gid, items in checks.items():
        out[gid] = []
        for check in items:
            try:
                value = encode(check.run(ns))
            except BaseException as exc:  # what the harness records for a raising learner
                value = error(exc)
            out[gid].append(decode(value))
    return out


@functools.lru_cache(maxsize=None)
def checks_of(assignment: str, cells: tuple = ()) -> dict:
    checks = load_checks(checks_path(assignment))
    return {g: c for g, c in checks.items() if not cells or g in cells}


@functools.lru_cache(maxsize=None)
def reference(assignment: str, cells: tuple = ()) -> dict:
    return values(checks_of(assignment, cells), namespace(make_samples.build(assignment, "reference", Sample("", "full"))))


def failed_cells(assignment: str, sample: Sample, cells: tuple = ()) -> set:
    checks = checks_of(assignment, cells)
    got = values(checks, namespace(make_samples.build(assignment, "test", sample)))
    return {gid for gid, v in judge(checks, got, reference(assignment, cells)).items() if not v.passed}


def sample(assignment: str, student: str) -> dict:
    return SAMPLES[assignment][student]


# ----------------------------------------------------------------------------- bugs the review found

# The review's planted bugs that are not graded samples (the full sample run is slow): patches of the reference.
EXTRA_BUGS = {
    "samp-bug-generator-seed-only": ("03_sampler", Sample("rebuilds a generator from the given one's seed on every "
                                                          "call: one generator draws the same twice", "loses",
                                                          patches={"sampler": [
        ("    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [B]",
         "    g = torch.Generator().manual_seed(generator.initial_seed()) if generator is not None else None\n"
         "    ids = torch.multinomial(flat, 1, generator=g).squeeze(-1)  # [B]")]}), "test_sampler_hidden"),
    "samp-bug-top-p-one-drops-tail": ("03_sampler", Sample("p = 1 is not special: a float32 running total reaches 1 "
                                                           "early and the tail is dropped", "loses",
                                                           patches={"top_p_filter": [
        ("    if p == 1:\n        return logits\n", "")]}), "test_filters_hidden"),
    "samp-bug-squeeze-batch-of-1": ("03_sampler", Sample("squeeze() makes [1, V] give a 0-d id", "loses",
                                                         patches={"sampler": [
        ("    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [B]\n"
         "    return ids.reshape(probs.shape[:-1])",
         "    return torch.multinomial(flat, 1, generator=generator).squeeze()")]}), "test_sampler_hidden"),
    "samp-bug-negative-top-p": ("03_sampler", Sample("top_p_filter lets p < 0 through (it checks p == 0 only)", "loses",
                                                     patches={"top_p_filter": [("if not 0 < p <= 1:",
                                                                                "if p == 0 or p > 1:")]}),
                                "test_filters_hidden"),
    "samp-bug-negative-top-k": ("03_sampler", Sample("top_k_filter lets k < 0 through (it checks k == 0 only)", "loses",
                                                     patches={"top_k_filter": [("if k < 1:", "if k == 0:")]}),
                                "test_filters_hidden"),
    "samp-bug-keeps-half-precision": ("03_sampler", Sample("softmax in the logits' own dtype (bfloat16 stays)", "loses",
                                                           patches={"sampler": [
        ("logits = apply_temperature(logits.float(), temperature)",
         "logits = apply_temperature(logits, temperature)")]}), "test_sampler_hidden"),
    "samp-bug-1d-uniform": ("03_sampler", Sample("[V] logits give a uniform random id", "loses", patches={"sampler": [
        ("    probs = sampling_probs(logits, temperature, top_k, top_p)\n    flat",
         "    if logits.dim() == 1:\n        return torch.randint(logits.shape[-1], (), generator=generator)\n"
         "    probs = sampling_probs(logits, temperature, top_k, top_p)\n    flat")]}), "test_sampler_hidden"),
    "mem-bug-round-nearest": ("01_memory_formula", Sample("max_context rounds to the nearest token, not down", "loses",
                                                          patches={"max_context": [
        ("    return int(free // (kv_bytes_per_token(config, dtype_bytes) * batch))",
         "    return round(free / (kv_bytes_per_token(config, dtype_bytes) * batch))")]}), "test_max_context_hidden"),
    "kv-bug-new-cache-dim-over-heads": ("02_kv_cache", Sample("new_cache sizes D_h as dim // n_heads, not head_dim",
                                                            "loses", patches={"layer_cache": [
        ("max_seq_len, config.head_dim, dtype)", "max_seq_len, config.dim // config.n_heads, dtype)")]}),
        "test_cache_allocates"),
    "paged-bug-pools-dim-over-heads": ("05_paged_cache", Sample("the pools' D_h is dim // n_heads, not head_dim",
                                                              "loses", patches={"paged_cache": [
        ("shape = (num_blocks, config.n_kv_heads, block_size, config.head_dim)",
         "shape = (num_blocks, config.n_kv_heads, block_size, config.dim // config.n_heads)")]}), "test_cache_hidden"),
    "paged-bug-pool-copy-per-write": ("05_paged_cache", Sample("update() writes into a new copy of the layer's pools "
                                                             "(clone), not into the pools allocated once", "loses",
                                                             patches={"paged_cache": [
        ("        for i in range(k_new.shape[2]):\n",
         "        self.k[layer], self.v[layer] = self.k[layer].clone(), self.v[layer].clone()\n"
         "        for i in range(k_new.shape[2]):\n")]}), "test_cache_hidden"),
}

# graded samples (autograde/samples) for the rest: assignment, the one cell each must lose
SAMPLE_BUGS = {
    "mem-bug-negative-batch": ("01_memory_formula", {"test_kv_cache_bytes_hidden", "test_max_context_hidden"}),
    "kv-bug-new-cache-global-cfg": ("02_kv_cache", {"test_cache_allocates"}),
    "samp-bug-reseeds-global": ("03_sampler", {"test_sampler_hidden"}),
    "samp-bug-greedy-batch": ("03_sampler", {"test_sampler_hidden"}),
    "paged-bug-global-cfg": ("05_paged_cache", {"test_cache_hidden"}),
    "paged-bug-rewind-stale": ("05_paged_cache", {"test_cache_hidden"}),
    "samp-bug-1d-global-rng": ("03_sampler", {"test_sampler_hidden"}),
    "samp-bug-inplace-at-T1": ("03_sampler", {"test_sampler_hidden"}),
    "samp-bug-greedy-keeps-dtype": ("03_sampler", {"test_sampler_hidden"}),
    "paged-bug-free-keeps-length": ("05_paged_cache", {"test_cache_hidden"}),
    "paged-bug-share-free": ("05_paged_cache", {"test_cache_hidden"}),
    "samp-bug-1d-drops-args": ("03_sampler", {"test_sampler_hidden"}),
    # the second review's planted bugs (2026-12-04): a one-token write past the end or at -1, bfloat16 lost, fork
    # copying the partly filled block in the notebook's 2 layers only
    "kv-bug-decode-grows": ("02_kv_cache", {"test_cache_hidden"}),
    "kv-bug-negative-decode-wraps": ("02_kv_cache", {"test_cache_hidden"}),
    "kv-bug-bf16-becomes-fp16": ("02_kv_cache", {"test_cache_hidden"}),
    "paged-bug-fork-global-layers": ("05_paged_cache", {"test_fork_hidden"}),
    # its model cells too (the old checks ran the model through the notebook's SequenceView: they passed)
    "paged-bug-own-view": ("05_paged_cache", {"test_cache_blocks", "test_cache_gather", "test_cache_hidden",
                                              "test_fork_hidden", "test_model_logits", "test_greedy_32",
                                              "test_model_hidden"}),
    # boundaries no check looked at before (2026-12): k = V - 1, T near 0
    "samp-bug-top-k-v-minus-1": ("03_sampler", {"test_filters_hidden"}),
    "samp-bug-exp-overflow": ("03_sampler", {"test_sampler_hidden"}),
}


@pytest.mark.parametrize("name", list(EXTRA_BUGS))
def test_review_bug_loses_its_cell(name):
    assignment, bug, cell = EXTRA_BUGS[name]
    assert failed_cells(assignment, bug, (cell,)) == {cell}


@pytest.mark.slow  # every sample is also graded sealed in tests/test_grading.py
@pytest.mark.parametrize("name", list(SAMPLE_BUGS))
def test_review_bug_sample_loses_exactly_its_cells(name):
    """The sample loses the cells the review named and no other (the rest of its code is the reference's)."""
    assignment, cells = SAMPLE_BUGS[name]
    assert failed_cells(assignment, sample(assignment, name)) == cells


# ----------------------------------------------------------------------------- correct code keeps full marks

@pytest.mark.slow  # every expect-full sample is graded again in tests/test_grading.py
@pytest.mark.parametrize("name", ["paged-alt-pop-highest-first", "paged-alt-random-policy-runs", "paged-alt-heap-index",
                                  "paged-alt-fifo-loops"])
def test_any_free_list_policy_gets_full_marks(name):
    """Which block id the free list hands out is left open: highest first, random, lowest first, FIFO all pass."""
    assert failed_cells("05_paged_cache", sample("05_paged_cache", name)) == set()


@pytest.mark.slow  # every expect-full sample is graded again in tests/test_grading.py
@pytest.mark.parametrize("assignment, name", [
    (assignment, name) for assignment in ("02_kv_cache", "05_paged_cache")
    for name, s in SAMPLES[assignment].items() if s["expect"] == "full"])
def test_cache_samples_expected_full_keep_full_marks(assignment, name):
    """The reference and every `expect full` sample of exercises 02 and 05 pass every check, the new ones too."""
    assert failed_cells(assignment, sample(assignment, name)) == set()


@pytest.mark.parametrize("assignment, name", [("03_sampler", "samp-alt-gumbel"), ("03_sampler", "samp-alt-loops"),
                                              ("01_memory_formula", "mem-alt-numpy"),
                                              ("01_memory_formula", "mem-alt-fraction")])
def test_right_answers_keep_full_marks_whatever_carries_them(assignment, name):
    """Other algorithms, and numbers in numpy integers, 0-d tensors or exact Fractions, lose nothing."""
    assert failed_cells(assignment, sample(assignment, name)) == set()


# Correct code written differently (patches of the reference): it keeps every cell.
CORRECT_VARIANTS = {
    "samp-alt-int32-ids": ("03_sampler", Sample("returns the ids as int32 (the notebook does not fix their dtype)",
                                                "full", patches={"sampler": [
        ("    return ids.reshape(probs.shape[:-1])", "    return ids.reshape(probs.shape[:-1]).to(torch.int32)")]}),
        "test_sampler_hidden"),
    # the model calls layer 0 first: blocks taken there only serve every layer (the notebook: "only the first call
    # should take blocks")
    "paged-alt-blocks-at-layer-0": ("05_paged_cache", Sample("takes blocks only in layer 0's update", "full",
                                                             patches={"paged_cache": [
        ("while len(table) * self.block_size < end:", "while layer == 0 and len(table) * self.block_size < end:")]}),
        None),
}


@pytest.mark.parametrize("name", list(CORRECT_VARIANTS))
def test_correct_variant_keeps_its_cells(name):
    """Every cell, or the one named."""
    assignment, variant, cell = CORRECT_VARIANTS[name]
    assert failed_cells(assignment, variant, (cell,) if cell else ()) == set()


def test_the_model_checks_use_their_own_copy_of_the_given_sequence_view():
    """The model checks of exercise 05 run the learner's PagedKVCache through the checks module's SequenceView and
    _LayerView, the given cell's code exactly (the notebook's copy is editable: a learner's may keep its own cache)."""
    import ast
    import importlib.util

    def classes(source: str) -> dict:
        return {node.name: ast.dump(node) for node in ast.parse(source).body
                if isinstance(node, ast.ClassDef) and node.name in ("SequenceView", "_LayerView")}

    source = make_samples.build("05_paged_cache", "reference", Sample("", "full"))
    nb = nbformat.reads(source.decode(), as_version=4)
    given = next(c.source for c in nb.cells if c.cell_type == "code" and "class SequenceView" in c.source)
    checks = checks_path("05_paged_cache")
    assert classes(checks.read_text()) == classes(given) and len(classes(given)) == 2
    spec = importlib.util.spec_from_file_location("checks_05", checks)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model_checks = [c for gid in ("test_model_logits", "test_greedy_32", "test_model_hidden")
                    for c in module.CHECKS[gid]]
    ns = namespace(source)
    ns["SequenceView"] = ns["_LayerView"] = None  # the notebook's own view is never called
    for check in model_checks:
        check.run(ns)


# ----------------------------------------------------------------------------- no check a constant can satisfy

@pytest.mark.parametrize("assignment", ["01_memory_formula", "02_kv_cache", "03_sampler", "05_paged_cache"])
def test_no_check_returns_a_flag(assignment):
    """A check whose value holds a True/False the check computed (`a != b`, `x in table`, a tuple of flags) can be
    forged by a submission that hands back the constant; checks return the learner's raw values (ids, counts,
    tensors, messages) and a compare function judges them outside."""
    def has_flag(value) -> bool:
        if isinstance(value, (list, tuple)):
            return any(has_flag(v) for v in value)
        if isinstance(value, dict):
            return any(has_flag(v) for v in value.values())
        return type(value) is bool

    ref = reference(assignment)
    flagged = [(gid, k) for gid, items in ref.items() for k, v in enumerate(items) if has_flag(v)]
    assert not flagged, f"checks whose value holds a flag: {flagged}"
