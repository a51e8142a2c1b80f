"""Checks for exercise 01 (the KV-cache memory formula): one list per test cell of the notebook.

Run by course.grade.verdicts: `run` inside the sandbox on the learner's namespace, `compare` outside on
plain data. Byte counts must be an exact integer (int, a numpy integer, an integer 0-d tensor, a whole Fraction:
course.grade.verdicts.exact); a float such as 2.0 * ... fails, with a hint that names it.
"""
import functools

from course.engine.config import ModelConfig
from course.grade.verdicts import Check, close, exact, raises

GiB = 2 ** 30
llama_7b = ModelConfig.from_name("llama-2-7b")
llama_70b = ModelConfig.from_name("llama-2-70b")
gpt2 = ModelConfig.from_name("gpt2-124m")
mistral = ModelConfig.from_name("mistral-7b")
smollm = ModelConfig.from_name("smollm2-135m")
FORMULA = "hint: one K and one V per layer, per KV head, per token, per sequence; FP16 is 2 bytes (not 16 bits)"
WHOLE = "hint: return a whole number of bytes (an int, not a float)"


def call(name, *args, **kw):
    """What the learner's `name(*args, **kw)` returns."""
    return lambda ns: ns[name](*args, **kw)


kv = functools.partial(call, "kv_cache_bytes")
per_token = functools.partial(call, "kv_bytes_per_token")
ctx = functools.partial(call, "max_context")
batch = functools.partial(call, "max_batch")
gqa = functools.partial(call, "gqa_saving")


# The course's own KV byte math: left out of the sandbox (course.grade.sandbox.course_tree).
ABSENT = ["course.measure.costs"]

CHECKS = {
    "test_kv_cache_bytes": [
        Check("Llama-2-7B, one token", kv(32, 1, 1, 32, 128, 2), exact, FORMULA),
        Check("Llama-2-7B, T=4096", kv(32, 1, 4096, 32, 128, 2), exact, FORMULA),
        Check("Llama-2-7B, T=4096, B=8", kv(32, 8, 4096, 32, 128, 2), exact, FORMULA),
        Check("GPT-2, T=1024", kv(12, 1, 1024, 12, 64, 2), exact, FORMULA),
    ],
    "test_kv_cache_bytes_hidden": [
        Check("SmolLM2 shape", kv(30, 1, 1, 3, 64, 2), exact, "hint: check every factor of the formula"),
        Check("70B, B=4, 32k", kv(80, 4, 32_000, 8, 128, 2), exact, "hint: check every factor of the formula"),
        Check("INT8", kv(32, 3, 1000, 8, 128, 1), exact, "hint: an INT8 cache uses 1 byte per number"),
        Check("odd shape", kv(7, 5, 333, 2, 96, 2), exact, "hint: check every factor of the formula"),
        Check("an int, exactly", kv(32, 2, 4096, 8, 128, 2), exact, WHOLE),
        Check("batch 0", kv(32, 0, 4096, 8, 128, 2), raises, "hint: batch = 0 has no cache to size: raise ValueError"),
        Check("negative batch", kv(32, -1, 4096, 8, 128, 2), raises,
              "hint: batch must be at least 1: raise ValueError for every batch below 1, not only 0"),
    ],
    "test_kv_bytes_per_token": [
        Check("Llama-2-7B", per_token(llama_7b), exact, "hint: the cache stores K and V for the KV heads"),
        Check("GPT-2", per_token(gpt2), exact, "hint: the cache stores K and V for the KV heads"),
        Check("Llama-2-70B", per_token(llama_70b), exact, "hint: use config.n_kv_heads, not n_heads"),
    ],
    "test_kv_bytes_per_token_hidden": [
        Check("Mistral", per_token(mistral), exact, "hint: use the KV heads"),
        Check("SmolLM2", per_token(smollm), exact, "hint: use the KV heads"),
        Check("SmolLM2 INT8", per_token(smollm, 1), exact, "hint: INT8 is 1 byte"),
        Check("made-up GQA", per_token(llama_7b.with_(n_layers=5, n_heads=12, n_kv_heads=4, head_dim=80), 4),
              exact, "hint: use the config's own fields and dtype_bytes"),
    ],
    "test_max_context": [
        Check("7B on 24 GiB", ctx(llama_7b, 24 * GiB, 13 * GiB), exact, "hint: subtract the weights first"),
        Check("70B does not fit", ctx(llama_70b, 80 * GiB, 130 * GiB), exact,
              "hint: when the weights alone overflow the GPU the answer is 0"),
    ],
    "test_max_context_hidden": [
        Check("batch 4", ctx(llama_70b, 160 * GiB, 130 * GiB, batch=4), exact,
              "hint: every sequence of the batch needs its own cache; and this model shares KV heads (GQA), so "
              "if test_kv_bytes_per_token_hidden fails too, fix kv_bytes_per_token first"),
        Check("INT8", ctx(llama_7b, 24 * GiB, 13 * GiB, dtype_bytes=1), exact,
              "hint: an INT8 cache fits twice the tokens"),
        Check("rounds down", ctx(llama_7b, 24 * 10**9, 13_476_839_424), exact, "hint: round down to whole tokens"),
        Check("rounds down from above a half", ctx(llama_7b, 24 * 10**9, 13 * 10**9), exact,
              "hint: round down to whole tokens (// or int(), not round()): T + 1 tokens must not fit"),
        Check("no room", ctx(gpt2, 10**6, 10**6), exact, "hint: nothing is left for the cache"),
        Check("exactly one token fits", ctx(llama_7b, 13 * GiB + 524_288, 13 * GiB), exact,
              "hint: a token that fits exactly counts (free // per_token, not <)"),
        Check("batch 0", ctx(llama_7b, 24 * GiB, 13 * GiB, batch=0), raises,
              "hint: batch = 0 has no sequence to size: raise ValueError"),
        Check("negative batch", ctx(llama_7b, 24 * GiB, 13 * GiB, batch=-1), raises,
              "hint: batch must be at least 1: raise ValueError for every batch below 1, not only 0"),
    ],
    "test_max_batch": [
        Check("70B at 32k", batch(llama_70b, 640 * GiB, 130 * GiB, 32_768), exact,
              "hint: one sequence of seq_len tokens needs kv_bytes_per_token * seq_len bytes; round down"),
    ],
    "test_max_batch_hidden": [
        Check("7B at 4096", batch(llama_7b, 80 * GiB, 13 * GiB, 4096), exact,
              "hint: divide the free bytes by one sequence's cache"),
        Check("INT8", batch(llama_7b, 80 * GiB, 13 * GiB, 4096, dtype_bytes=1), exact,
              "hint: INT8 halves each sequence's cache"),
        Check("no room", batch(llama_70b, 80 * GiB, 130 * GiB, 1024), exact, "hint: no room for any cache means 0"),
        Check("exactly three sequences fit", batch(llama_7b, 19 * GiB, 13 * GiB, 4096), exact,
              "hint: a sequence that fits exactly counts"),
        Check("an int", batch(gpt2, 10**9, 2.5e8, 1000), exact, "hint: return a whole number (int)"),
    ],
    "test_gqa_saving": [
        Check("70B", gqa(llama_70b), close(1e-9), "hint: H / H_kv; the answer is at least 1"),
        Check("7B", gqa(llama_7b), close(1e-9), "hint: Llama-2-7B uses plain multi-head attention"),
    ],
    "test_gqa_saving_hidden": [
        Check("SmolLM2", gqa(smollm), close(1e-9), "hint: H / H_kv"),
        Check("Mistral", gqa(mistral), close(1e-9), "hint: H / H_kv"),
        Check("MQA", gqa(llama_7b.with_(n_kv_heads=1)), close(1e-9), "hint: multi-query attention keeps one KV head"),
    ],
}
