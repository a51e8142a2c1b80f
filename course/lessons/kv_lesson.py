"""Lesson 02 and its appendix: each helper measures or computes, records what passed, and returns a short table.
The ideas are the notebook's Markdown; nothing here explains, it only puts numbers in their places."""
from __future__ import annotations

import math
import statistics

import numpy as np
import torch

from course.engine.kv_cache import KVCache
from course.engine.paged import BlockAllocator
from course.measure import gates, machine
from course.measure.costs import _config, _positive_int, human_bytes, kv_bytes_per_token
from course.measure.cache_speed import measure_cache_speedup
from course.measure.display import Report, verdict
from course.measure.results import record_all, record_gated

SPEED_TOLERANCE = 0.25  # two unit costs leave out attention's growth with length, and one run's noise


# ---------------------------------------------------------------------------------------- §1 the prompt's cache
@torch.inference_mode()
def prompt_cache(model, prompt_ids) -> KVCache:
    """Prefill the prompt into a cache sized for exactly its T tokens."""
    cache = KVCache(model.config, batch=1, max_seq_len=len(prompt_ids), dtype=model.dtype, device=model.device)
    model(torch.tensor([list(prompt_ids)], device=model.device), 0, cache, last_only=True)
    return cache


# ---------------------------------------------------------------------------------------- §3 the speedup
def measure_speed(model, prompt_ids, lengths, prof, tries: int = 2) -> gates.Measured:
    """Generate with and without the cache. A cached step under its bandwidth floor, or (from 32 new tokens on) a
    run that recomputes everything beating the cached one beyond noise, is measured again, then flagged."""
    floor_ms = prof.gate_floor_ms(machine.step_bytes(model.config, prof.dtype, len(prompt_ids)))

    def rules(s):
        return [gates.not_below_floor(s.unit_costs[1] * 1e3, floor_ms, "a cached decode step")] + [
            gates.not_cheaper(s.cumulative(n, True) * 1e3, s.cumulative(n, False) * 1e3,
                              f"{n} tokens with the cache", f"{n} tokens without it") for n in s.lengths if n >= 32]

    return gates.measured(lambda: measure_cache_speedup(model, prompt_ids, lengths), rules, "the cache's speedup",
                          tries)


def speed_report(run: gates.Measured, prof) -> Report:
    s = run.value
    predicted = s.predicted_speedups
    record_all({"speed_lengths": s.lengths, "speed_prompt_tokens": s.prompt_tokens, "speed_predicted": predicted,
                "speed_tokens_identical": s.tokens_identical})
    record_gated("speedups", run, s.speedups)
    record_gated("cache_speedup", run, s.speedups[-1])
    rows = [(f"{n} new tokens", run.shown(p), run.shown(m), "×") for n, p, m in zip(s.lengths, predicted, s.speedups)]
    if not run.ok:
        print(run.notice)
        return Report(rows, run.headline(""), key="cache_speed")
    n, T0, (P, C) = s.lengths[-1], s.prompt_tokens, s.unit_costs
    work = (n * T0 + n * (n - 1) // 2) / (T0 + n - 1)  # tokens pushed through the model, uncached ÷ cached
    _, words = verdict(predicted[-1], s.speedups[-1], SPEED_TOLERANCE)
    return Report(rows, f"At {n} new tokens the cache was {s.speedups[-1]:.1f}× faster: {words}.", [
        f"Unit costs of this run: prefill of the {T0}-token prompt {P * 1e3:.0f} ms, a cached step {C * 1e3:.0f} ms.",
        f"The machine profile's eager decode step: {prof.decode_ms['eager']:.0f} ms.",
        f"{n} tokens took {s.cumulative(n, False):.1f} s without the cache and {s.cumulative(n, True):.1f} s with it.",
        f"Tokens pushed through the model, uncached ÷ cached: {work:.0f}×. Every pass also reads all the weights.",
        f"Greedy tokens identical with and without the cache: {'yes' if s.tokens_identical else 'NO'}."],
        title="Speedup from the cache, uncached ÷ cached time", key="cache_speed")


# -------------------------------------------------- §5-§6 the quoted cache sizes, the cache against the weights
def published_text(rows: list[dict]) -> str:
    out = [f"{'model':<15}{'T':>9}{'B':>3}{'bytes/token':>13}{'GiB':>8}{'GB':>8}  {'= KVCache':<10}quoted"]
    for r in rows:
        same = "yes" if r["measured_bytes"] == r["total_bytes"] else "NO"
        out.append(f"{r['model'] + ('*' if 'quoted_for' in r else ''):<15}{r['seq_len']:>9,}{r['batch']:>3}"
                   f"{r['bytes_per_token']:>13,}{r['GiB']:>8.2f}{r['GB']:>8.2f}  {same:<10}{r['quoted']}")
    for quoted, shown in sorted({(r["quoted_for"], r["model"]) for r in rows if "quoted_for" in r}):
        q, m = _config(quoted), _config(shown)
        out.append(f"* quoted for {quoted}, whose window is {q.max_seq_len:,} tokens; shown for {shown}: the same "
                   f"cache shape, a {m.max_seq_len:,}-token window.")
    return "\n".join(out)


def crossover_text(rows: list[dict]) -> str:
    batches = list(rows[0]["crossover"])
    out = [f"{'':15}{'weights':>10}{'cache/token':>13}" + "".join(f"{f'B = {b}':>11}" for b in batches)
           + f"{'window':>10}"]
    for r in rows:
        cells = "".join(f"{f'{t:,}' + ('*' if t > r['window'] else ' '):>11}" for t in r["crossover"].values())
        out.append(f"{r['model']:<15}{r['weights_bytes'] / 1e9:>7.2f} GB{r['kv_bytes_per_token'] / 1e6:>10.3f} MB"
                   f"{cells}{r['window']:>10,}")
    return "\n".join(out + ["* past the model's context window: at that batch its weights always stay larger."])


# ------------------------------------------- §7 preallocation (N · max_seq_len tokens) vs paging (blocks as needed)
def sample_request_lengths(n_requests: int = 64, max_seq_len: int = 4096, seed: int = 0,
                           prompt_median: int = 400, output_median: int = 250) -> np.ndarray:
    """Total tokens (prompt + output) of n chat requests: two log-normals (many short, a long tail), capped."""
    n, cap = _positive_int("n_requests", n_requests), _positive_int("max_seq_len", max_seq_len)
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(math.log(_positive_int("prompt_median", prompt_median)), 1.0, n)
    outputs = rng.lognormal(math.log(_positive_int("output_median", output_median)), 0.8, n)
    return np.clip(np.round(prompts + outputs), 1, cap).astype(int)


def blocks_needed(length: int, block_size: int = 16) -> int:
    """Blocks a sequence of `length` tokens occupies: ceil(length / block_size)."""
    return -(-_positive_int("length", length) // _positive_int("block_size", block_size))


def simulate_paging(config="smollm2-135m", n_requests: int = 64, max_seq_len: int = 4096, block_size: int = 16,
                    dtype="fp16", seed: int = 0, lengths=None) -> dict:
    """Reserve cache for a batch of requests both ways (the paged side takes its blocks from the engine's allocator):
    the bytes used and reserved, and the share of each reservation left empty."""
    max_seq_len, block_size = _positive_int("max_seq_len", max_seq_len), _positive_int("block_size", block_size)
    lengths = np.asarray(sample_request_lengths(n_requests, max_seq_len, seed) if lengths is None else lengths, int)
    if lengths.size == 0 or lengths.min() < 1 or lengths.max() > max_seq_len:
        raise ValueError(f"lengths must be between 1 and max_seq_len={max_seq_len} tokens")
    per_token = kv_bytes_per_token(_config(config), dtype)
    pool = BlockAllocator(sum(blocks_needed(int(n), block_size) for n in lengths), block_size)
    tables = [[pool.allocate() for _ in range(blocks_needed(int(n), block_size))] for n in lengths]  # block tables
    used, preallocated = int(lengths.sum()) * per_token, len(lengths) * max_seq_len * per_token
    paged = (pool.num_blocks - pool.num_free) * block_size * per_token
    return {"paging_lengths": [int(n) for n in lengths], "paging_blocks": [len(t) for t in tables],
            "paging_max_seq_len": max_seq_len, "paging_block_size": block_size, "paging_used_bytes": used,
            "paging_preallocated_bytes": preallocated, "paging_paged_bytes": paged,
            "paging_preallocated_waste": 1 - used / preallocated, "paging_paged_waste": 1 - used / paged,
            "paging_saving": preallocated / paged}


def paging_text(v: dict) -> str:
    return (f"{len(v['paging_lengths'])} requests, {sum(v['paging_lengths']):,} tokens, "
            f"{human_bytes(v['paging_used_bytes'])} of keys and values.\n"
            f"Preallocated: {human_bytes(v['paging_preallocated_bytes'])} reserved, "
            f"{v['paging_preallocated_waste']:.0%} empty. Paged: {human_bytes(v['paging_paged_bytes'])}, "
            f"{v['paging_paged_waste']:.1%} empty.")


def plot_paging(v: dict):
    """Per request, the reserved-but-empty token slots under each scheme (log scale), sorted by length."""
    import matplotlib.pyplot as plt

    order = np.argsort(v["paging_lengths"])
    lengths, blocks = np.array(v["paging_lengths"])[order], np.array(v["paging_blocks"])[order]
    x, top, size = np.arange(len(lengths)), v["paging_max_seq_len"], v["paging_block_size"]
    fig, ax = plt.subplots(figsize=(11, 3.4))
    ax.bar(x - 0.2, top - lengths, width=0.4, color="#e06666",
           label=f"preallocated to max_seq_len = {top:,}: {v['paging_preallocated_waste']:.0%} empty")
    ax.bar(x + 0.2, np.maximum(blocks * size - lengths, 0.5), width=0.4, color="tab:blue",
           label=f"paged, {size}-token blocks: {v['paging_paged_waste']:.1%} empty (0 drawn as 0.5)")
    ax.set(xlabel="request (sorted by length)", ylabel="empty token slots (log)", yscale="log",
           ylim=(0.3, top * 40), title="Reserved but never used, per request")
    ax.legend(loc="upper center", fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------- appendix: the INT8 cache
def grade_int8_error(max_err: float, median_gap: float, at_risk: int, n_steps: int) -> str:
    """"small" when the largest error is under a tenth of the median top-two gap and under 5 % of the steps are
    at risk; "large" from half the median gap or a quarter of the steps; "moderate" in between."""
    share, risky = max_err / median_gap, at_risk / max(n_steps, 1)
    if share >= 0.5 or risky >= 0.25:
        return "large"
    return "small" if share < 0.1 and risky < 0.05 else "moderate"


@torch.inference_mode()
def int8_report(model, prompt_ids, n_tokens: int = 64) -> dict:
    """The INT8 cache against the float one, fed the same tokens, and each step's margin: the top-two gap."""
    from course.engine.kv_quant import compare_int8_cache

    q = compare_int8_cache(model, prompt_ids, n_tokens=n_tokens)
    ids = torch.tensor([list(prompt_ids) + q.reference_tokens[:-1]], device=model.device)
    top2 = model(ids)[0, len(prompt_ids) - 1:].float().topk(2, dim=-1).values  # [n_tokens, 2], one float pass
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    at_risk = [i for i, (g, d) in enumerate(zip(gaps, q.per_step_max_diff)) if 2 * d >= g]
    median_gap = statistics.median(gaps)
    return record_all({
        "int8_n_tokens": q.n_tokens, "int8_max_logit_diff": q.max_abs_logit_diff,
        "int8_mean_logit_diff": q.mean_abs_logit_diff, "int8_greedy_agreement": q.greedy_agreement,
        "int8_free_run_same_prefix": q.free_run_same_prefix, "int8_min_top2_gap": min(gaps),
        "int8_median_top2_gap": median_gap, "int8_at_risk_steps": at_risk, "int8_top2_gaps": gaps,
        "int8_per_step_max_diff": q.per_step_max_diff,
        "int8_error_grade": grade_int8_error(q.max_abs_logit_diff, median_gap, len(at_risk), q.n_tokens)})


def int8_text(v: dict) -> str:
    n, same = v["int8_n_tokens"], v["int8_free_run_same_prefix"]
    rows = [("largest |Δ logit|", f"{v['int8_max_logit_diff']:.3f}"),
            ("median top-two gap", f"{v['int8_median_top2_gap']:.3f}"),
            ("steps at risk (2·|Δ| ≥ gap)", f"{len(v['int8_at_risk_steps'])} of {n}"),
            ("greedy choice agreed", f"{v['int8_greedy_agreement']:.0%}"),
            ("free run matched the float run", f"{'all' if same >= n else 'the first'} {min(same, n)} tokens")]
    return "\n".join([f"INT8 against the float cache, {n} greedy steps fed the same tokens:"]
                     + [f"  {what:<33}{value}" for what, value in rows]
                     + [f"Grade: a {v['int8_error_grade']} error against the margin greedy decoding needs."])


@torch.inference_mode()
def channel_report(model, prompt_ids) -> dict:
    """The prompt's keys (after RoPE) and values: how far the largest channel stands out (per layer and KV head), and
    the INT8 round-trip error with one scale per token (this course's cache) or one per channel (KIVI's keys)."""
    from course.engine.kv_quant import dequantize_int8, quantize_int8

    cache, T = prompt_cache(model, prompt_ids), len(prompt_ids)
    k, v = (torch.stack([getattr(layer, n)[:, :, :T] for layer in cache]).float() for n in "kv")  # [L, B, H_kv, T, D_h]

    def outlier(x):  # median over layers and heads of: the largest channel's max |x| ÷ the median channel's
        channel = x.abs().amax(dim=-2)  # [L, B, H_kv, D_h]
        return (channel.amax(-1) / channel.median(-1).values).median().item()

    def err(x, per_channel: bool):  # quantize_int8 scales the last axis: put the tokens there for per-channel scales
        y = x.transpose(-1, -2) if per_channel else x
        return ((y - dequantize_int8(*quantize_int8(y))).norm() / y.norm()).item()

    return record_all({"channel_tokens": T, "key_outlier_ratio": outlier(k), "value_outlier_ratio": outlier(v),
                       "key_err_per_token": err(k, False), "key_err_per_channel": err(k, True),
                       "value_err_per_token": err(v, False), "value_err_per_channel": err(v, True)})


def channel_text(v: dict) -> str:
    return "\n".join([f"{'':8}{'largest ÷ median channel':>26}{'error, scale per token':>25}{'per channel':>14}"] + [
        f"{name:8}{v[f'{x}_outlier_ratio']:>25.1f}×{v[f'{x}_err_per_token']:>25.2%}{v[f'{x}_err_per_channel']:>14.2%}"
        for name, x in (("keys", "key"), ("values", "value"))])
