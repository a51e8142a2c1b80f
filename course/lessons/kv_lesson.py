"""Lesson 02 (and its appendix) helpers: each measurement comes back as a result object whose
``values()`` the notebook records and whose ``str()`` is the short report a learner reads, every number
and verdict in it computed from those values.

Sources the lesson quotes (named here so every figure has an owner):
  HF_KV_POST   Hugging Face, "KV Caching Explained: Optimizing Transformer Inference Efficiency":
               GPT-2 on a T4 GPU, 61 s without the cache, 11.7 s with it, 5.21×.
  VLLM_PAPER   Kwon et al., "Efficient Memory Management for Large Language Model Serving with
               PagedAttention", SOSP 2023 (arXiv:2309.06180): the paged cache behind vLLM.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import torch

from course.engine.config import ModelConfig
from course.measure import costs
from course.lessons.wording import speedup_trend, times_faster
from course.measure.results import record

HF_KV_POST = ("Hugging Face's post “KV Caching Explained”",
              "https://huggingface.co/blog/not-lain/kv-caching", 5.21)
VLLM_PAPER = ("Kwon et al., “Efficient Memory Management for Large Language Model Serving with PagedAttention” "
              "(SOSP 2023)", "https://arxiv.org/abs/2309.06180")


def wrap(line: str, width: int = 108) -> str:
    """One printed sentence, wrapped so a notebook's output needs no horizontal scrolling."""
    return textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False)


def record_all(values: dict) -> dict:
    for key, value in values.items():
        record(key, value)
    return values


# ---------------------------------------------------------------------------------------- §3 speed
@dataclass
class SpeedReport:
    lengths: list[int]
    no_cache_s: list[float]
    cache_s: list[float]
    speedups: list[float]
    work_ratios: list[float]  # tokens pushed through the model, uncached ÷ cached
    tokens_identical: bool

    def values(self) -> dict:
        return {"speed_lengths": self.lengths, "speedups": self.speedups, "speed_tokens_identical":
                self.tokens_identical, "cache_speedup": self.speedups[-1], "speed_work_ratios": self.work_ratios}

    def __str__(self) -> str:
        rows = [f"{'new tokens':>10} {'no cache':>9} {'cache':>7} {'speedup':>8} {'work ratio':>11}"]
        rows += [f"{n:>10} {a:>8.2f}s {b:>6.2f}s {s:>7.2f}× {w:>10.0f}×" for n, a, b, s, w in
                 zip(self.lengths, self.no_cache_s, self.cache_s, self.speedups, self.work_ratios)]
        name, _, quoted = HF_KV_POST
        rows += ["", wrap(f"At {self.lengths[-1]} new tokens {times_faster(self.speedups[-1], 'the cache')} here; "
                 f"the speedup {speedup_trend(self.speedups)}. {name} measured {quoted}× (GPT-2 on a T4 GPU)."),
                 f"Same greedy tokens with and without the cache: {self.tokens_identical}."]
        return "\n".join(rows)


def speed_report(speed) -> SpeedReport:
    T0 = speed.prompt_tokens
    work = [(n * T0 + n * (n - 1) // 2) / (T0 + n - 1) for n in speed.lengths]
    return SpeedReport(list(speed.lengths), [speed.cumulative(n, False) for n in speed.lengths],
                       [speed.cumulative(n, True) for n in speed.lengths], list(speed.speedups), work,
                       bool(speed.tokens_identical))


# ------------------------------------------------------------------------------ §5 published table
@dataclass
class PublishedTable:
    rows: list[dict]

    def values(self) -> dict:
        return {"published_table": self.rows}

    def __str__(self) -> str:
        out = [f"{'model':<14} {'T':>8} {'B':>2} {'bytes/token':>12} {'GiB':>7} {'GB':>7}  "
               f"{'= real KVCache':<15} quoted"]
        for r in self.rows:
            same = "yes" if r["measured_bytes"] == r["total_bytes"] else f"NO ({r['measured_bytes']:,})"
            out.append(f"{r['model']:<14} {r['seq_len']:>8,} {r['batch']:>2} {r['bytes_per_token']:>12,} "
                       f"{r['GiB']:>7.2f} {r['GB']:>7.2f}  {same:<15} {r['quoted']}")
        for quoted, stand_in in sorted({(r["quoted_for"], r["model"]) for r in self.rows if r.get("quoted_for")}):
            q, m = costs._config(quoted), costs._config(stand_in)
            out.append(textwrap.fill(
                f"{stand_in}: these lengths are quoted for {quoted}, whose context is {q.max_seq_len:,} tokens; "
                f"{stand_in} ({m.max_seq_len:,} tokens) has the same cache shape (L = {m.n_layers}, "
                f"H_kv = {m.n_kv_heads}, D_h = {m.head_dim}), so the same bytes.", 108, subsequent_indent="  "))
        return "\n".join(out)


def published_table(dtype="fp16") -> PublishedTable:
    """The FP16 cache sizes commonly quoted for Llama-2-7B/70B and GPT-2, recomputed from the presets and
    checked against a real KVCache of that shape (on the meta device: shapes without memory)."""
    rows = []
    for row in costs.quoted_kv_table(dtype):
        row = dict(row)
        stand_in = costs.long_context_stand_in(row["model"], row["seq_len"])
        if stand_in is not None:  # a quoted length past the model's own context: a model that has it
            assert costs.kv_bytes_per_token(stand_in, dtype) == row["bytes_per_token"]
            row["quoted_for"], row["model"] = row["model"], stand_in.name
        row["measured_bytes"] = costs.measure_kv_cache_bytes(row["model"], row["seq_len"], row["batch"], dtype)
        rows.append(row)
    return PublishedTable(rows)


# ---------------------------------------------------------------------------- §6 the live cache
@dataclass
class LiveCache:
    tokens: int
    dtype_bytes: int
    formula: int
    nbytes: int
    tensor_bytes: int

    def values(self) -> dict:
        return {"smollm2_cache_tokens": self.tokens, "smollm2_cache_dtype_bytes": self.dtype_bytes,
                "smollm2_cache_formula_bytes": self.formula, "smollm2_cache_measured_bytes": self.nbytes,
                "smollm2_cache_tensor_bytes": self.tensor_bytes}

    def __str__(self) -> str:
        equal = len({self.formula, self.nbytes, self.tensor_bytes}) == 1
        return (f"{'formula':>20}: {self.formula:,} bytes\n{'cache.nbytes':>20}: {self.nbytes:,} bytes\n"
                f"{'tensor_bytes(cache)':>20}: {self.tensor_bytes:,} bytes\n"
                f"all equal: {equal}" + ("" if equal else "  (they should be: look for a stray buffer)"))


def live_cache_check(model, prompt_ids, n_new: int = 32) -> LiveCache:
    from course.engine.generate import generate
    from course.engine.kv_cache import KVCache

    cfg, T = model.config, len(prompt_ids)
    cache = KVCache(cfg, batch=1, max_seq_len=T + n_new, dtype=model.dtype, device=model.device)
    generate(model, prompt_ids, n_new, cache=cache)
    elem = cache[0].k.element_size()
    formula = costs.kv_cache_bytes(cfg.n_layers, 1, T + n_new, cfg.n_kv_heads, cfg.head_dim, elem,
                                   n_heads=cfg.n_heads)
    return LiveCache(T + n_new, elem, formula, cache.nbytes, costs.tensor_bytes(cache))


# ----------------------------------------------------------------- when the cache outweighs the weights
@dataclass
class Crossover:
    rows: list[dict]  # model, weights_bytes, kv_bytes_per_token, crossover at B=1 and B=8

    def values(self) -> dict:
        short = {"llama-2-7b": "crossover_7b", "llama-2-70b": "crossover_70b", "smollm2-135m": "crossover_smollm2"}
        out = {short[r["model"]]: r["crossover_b1"] for r in self.rows if r["model"] in short}
        return {**out, "crossover_rows": self.rows}

    def __str__(self) -> str:
        lines = []
        for r in self.rows:
            fits = (f"beyond its {r['max_context']:,}-token context window, so at batch 1 the weights always "
                    "dominate" if r["crossover_b1"] > r["max_context"] else f"within its {r['max_context']:,}-"
                    "token context window")
            lines.append(wrap(f"{r['model']}: {r['weights_bytes'] / 1e9:.2f} GB of FP16 weights, "
                              f"{r['kv_bytes_per_token'] / 1e6:.3f} MB of cache per token → the cache is the larger "
                              f"past {r['crossover_b1']:,} tokens at batch 1 ({fits}); at batch 8 past "
                              f"{r['crossover_b8']:,}."))
        return "\n".join(lines)


def crossover(models=("smollm2-135m", "llama-2-7b", "llama-2-70b"), dtype="fp16") -> Crossover:
    rows = []
    for name in models:
        cfg = ModelConfig.from_name(name)
        rows.append(dict(model=name, weights_bytes=costs.weights_bytes(cfg, dtype),
                         kv_bytes_per_token=costs.kv_bytes_per_token(cfg, dtype),
                         crossover_b1=costs.crossover_context(cfg, 1, dtype),
                         crossover_b8=costs.crossover_context(cfg, 8, dtype), max_context=cfg.max_seq_len))
    return Crossover(rows)


# ---------------------------------------------------------------------- appendix: the INT8 cache
@dataclass
class Int8Report:
    n_tokens: int
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    greedy_agreement: float
    free_run_same_prefix: int  # tokens before the free-running INT8 output first differs
    top2_gaps: list[float] = field(repr=False)  # float cache: top-1 minus top-2 logit at each step
    per_step_max_diff: list[float] = field(repr=False)

    @property
    def at_risk_steps(self) -> list[int]:
        """Steps where the INT8 error could reorder the top two: 2 · max|Δ logit| ≥ their gap."""
        return [i for i, (g, d) in enumerate(zip(self.top2_gaps, self.per_step_max_diff)) if 2 * d >= g]

    def values(self) -> dict:
        return {"int8_max_logit_diff": self.max_abs_logit_diff, "int8_mean_logit_diff": self.mean_abs_logit_diff,
                "int8_greedy_agreement": self.greedy_agreement, "int8_free_run_same_prefix":
                self.free_run_same_prefix, "int8_n_tokens": self.n_tokens, "int8_min_top2_gap":
                min(self.top2_gaps), "int8_median_top2_gap": sorted(self.top2_gaps)[len(self.top2_gaps) // 2],
                "int8_at_risk_steps": self.at_risk_steps, "int8_error_grade": self.error_grade}

    @property
    def error_grade(self) -> str:
        """How large the error is against the margin greedy decoding needs: "small" when the largest error is
        under a tenth of the median top-two gap and under 5% of the steps are at risk; "large" when it is half
        the median gap or more, or a quarter of the steps are at risk; "moderate" in between."""
        return grade_int8_error(self.max_abs_logit_diff, sorted(self.top2_gaps)[len(self.top2_gaps) // 2],
                                len(self.at_risk_steps), self.n_tokens)

    def __str__(self) -> str:
        v = self.values()
        gap_median = v["int8_median_top2_gap"]
        lines = [f"over {self.n_tokens} steps fed the same tokens: max |Δ logit| = {self.max_abs_logit_diff:.3f}, "
                 f"mean {self.mean_abs_logit_diff:.4f}",
                 f"the gap between the top two logits (float cache): median {gap_median:.2f}, smallest "
                 f"{v['int8_min_top2_gap']:.3f}; the error was {self.max_abs_logit_diff / gap_median:.0%} of the "
                 "median gap",
                 f"steps where the error could reorder the top two (2·|Δ| ≥ gap): "
                 f"{len(self.at_risk_steps)} of {self.n_tokens}; greedy choice agreed at "
                 f"{self.greedy_agreement:.0%} of steps",
                 int8_grade_phrase(self.error_grade, len(self.at_risk_steps), self.n_tokens)]
        if self.free_run_same_prefix >= self.n_tokens:
            lines.append(f"free-running, the INT8 generation matched all {self.n_tokens} tokens")
        else:
            lines.append(f"free-running, the INT8 generation first differed at token {self.free_run_same_prefix + 1}"
                         f" of {self.n_tokens}, and followed its own path from there")
        return "\n".join(wrap(line) for line in lines)


def grade_int8_error(max_err: float, median_gap: float, at_risk: int, n_steps: int) -> str:
    """"small", "moderate" or "large": the INT8 logit error against the top-two gap (Int8Report.error_grade)."""
    share, risky = max_err / median_gap, at_risk / max(n_steps, 1)
    if share >= 0.5 or risky >= 0.25:
        return "large"
    if share < 0.1 and risky < 0.05:
        return "small"
    return "moderate"


def int8_grade_phrase(grade: str, at_risk: int, n_steps: int) -> str:
    """The grade in words with its count of at-risk steps, e.g. "a large error: 27 of 64 steps were close enough
    to flip, not only near-ties" (the lesson's report and its recap both say it this way)."""
    if at_risk == 0:
        return f"a {grade} error: none of the {n_steps} steps was close enough to flip"
    risk = f"{at_risk} of {n_steps} steps {'was' if at_risk == 1 else 'were'} close enough to flip"
    # small: error < 0.1 × median gap, so an at-risk gap is < 0.2 × median; moderate: < 0.5 × median, so < median
    scope = {"small": "all near-ties", "moderate": "all with a gap under the median",
             "large": "not only near-ties"}[grade]
    return f"a {grade} error: {risk}, {scope}"


def int8_report(model, prompt_ids, n_tokens: int = 64) -> Int8Report:
    from course.engine.kv_quant import compare_int8_cache

    q = compare_int8_cache(model, prompt_ids, n_tokens=n_tokens)
    # One teacher-forced pass over prompt + the float run's tokens gives the float logits at every step.
    ids = torch.tensor([list(prompt_ids) + q.reference_tokens[:-1]], device=model.device)
    with torch.inference_mode():
        logits = model(ids, 0, None)[0, len(prompt_ids) - 1:]  # [n_tokens, V]
    top2 = logits.float().topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    return Int8Report(q.n_tokens, q.max_abs_logit_diff, q.mean_abs_logit_diff, q.greedy_agreement,
                      q.free_run_same_prefix, gaps, list(q.per_step_max_diff))


# ---------------------------------------------------- appendix: why per-token key scales suffer (KIVI)
KIVI_PAPER = ("Liu et al., “KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache” (ICML 2024)",
              "https://arxiv.org/abs/2402.02750")


@dataclass
class ChannelReport:
    """The prompt's post-RoPE keys and values, per layer and KV head: how far the largest channel stands out, and
    the INT8 round-trip error with one scale per token (this course's cache) or one scale per channel."""
    tokens: int
    key_outlier: float  # median over layers and heads of (largest channel's max |k|) ÷ (median channel's)
    value_outlier: float
    key_err_per_token: float  # relative error ||x − x̂|| ÷ ||x||, mean over layers
    key_err_per_channel: float
    value_err_per_token: float
    value_err_per_channel: float

    def values(self) -> dict:
        return {"channel_tokens": self.tokens, "key_outlier_ratio": self.key_outlier,
                "value_outlier_ratio": self.value_outlier, "key_err_per_token": self.key_err_per_token,
                "key_err_per_channel": self.key_err_per_channel, "value_err_per_token": self.value_err_per_token,
                "value_err_per_channel": self.value_err_per_channel}

    def __str__(self) -> str:
        k_ratio = self.key_err_per_token / self.key_err_per_channel
        lines = [f"over the prompt's {self.tokens} tokens, per layer and KV head: the largest channel's max |x| is "
                 f"{self.key_outlier:.1f}× the median channel's in the keys, {self.value_outlier:.1f}× in the values "
                 "(medians over layers and heads)",
                 f"INT8 round-trip error, one scale per token (this cache): keys {self.key_err_per_token:.2%}, values "
                 f"{self.value_err_per_token:.2%}; one scale per channel: keys {self.key_err_per_channel:.2%}, values "
                 f"{self.value_err_per_channel:.2%}",
                 (f"per-channel scales cut the keys' error {k_ratio:.1f}×" if k_ratio > 1 else
                  f"per-channel scales did not cut the keys' error here ({k_ratio:.2f}×)")
                 + (f", the values' {self.value_err_per_token / self.value_err_per_channel:.1f}×"
                    if self.value_err_per_channel > 0 else "")]
        return "\n".join(wrap(line) for line in lines)


def channel_report(model, prompt_ids) -> ChannelReport:
    """Prefill the prompt into a float cache and quantize its keys and values both ways (a round trip only: the
    cache that decodes stays course.engine.kv_quant's per-token one)."""
    import statistics

    from course.engine.generate import prefill
    from course.engine.kv_cache import KVCache
    from course.engine.kv_quant import dequantize_int8, quantize_int8

    T = len(prompt_ids)
    cache = KVCache(model.config, max_seq_len=T, dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        prefill(model, torch.tensor([list(prompt_ids)], device=model.device), cache)

    def outlier(x):  # [B, H_kv, T, D_h] → one ratio per head
        channel = x.abs().amax(dim=2)  # [B, H_kv, D_h]
        return (channel.amax(-1) / channel.median(-1).values).flatten().tolist()

    def err(x, per_channel: bool):  # quantize_int8 scales the last axis: channels there for per-token scales
        y = x.transpose(-1, -2) if per_channel else x  # per channel: [B, H_kv, D_h, T], one scale per channel
        back = dequantize_int8(*quantize_int8(y))
        back = back.transpose(-1, -2) if per_channel else back
        return ((x - back).norm() / x.norm()).item()

    out = {name: [] for name in ("ko", "vo", "kt", "kc", "vt", "vc")}
    for layer in cache:
        k, v = layer.k[:, :, :T].float(), layer.v[:, :, :T].float()  # [B, H_kv, T, D_h]; keys after RoPE
        out["ko"] += outlier(k)
        out["vo"] += outlier(v)
        out["kt"].append(err(k, False)), out["kc"].append(err(k, True))
        out["vt"].append(err(v, False)), out["vc"].append(err(v, True))
    return ChannelReport(T, statistics.median(out["ko"]), statistics.median(out["vo"]),
                         *(statistics.mean(out[n]) for n in ("kt", "kc", "vt", "vc")))
