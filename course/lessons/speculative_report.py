"""Lesson 04's reports: each measurement of course/lessons/speculative.py as a short text whose every
number and verdict is computed from the values it also returns for recording.

Published figures quoted, with their sources:
  Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023, arXiv:2211.17192)
      and Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling"
      (arXiv:2302.01318): 2–3× (2–2.5× for Chinchilla-70B with a 4B draft) for well-matched drafts.
  Anthropic's prompt-caching documentation: reading cached input tokens costs 10 % of the base input
      price, the "up to 90 %" discount services quote for cached prefixes.
"""
from __future__ import annotations

from dataclasses import dataclass

from course.engine.config import ModelConfig
from course.lessons.kv_lesson import wrap
from course.lessons.wording import SAME, counted, lower_by
from course.measure.costs import weights_bytes


NOISE_BAND = 0.05  # a measured speedup within 5% of 1× is not a verdict on a shared machine


def speed_verdict(speedup: float, tokens_per_pass: float, predicted: float = float("nan")) -> str:
    """'faster', 'slower', or 'within timing noise' when the timing cannot carry a verdict: within NOISE_BAND of
    1×; above the tokens per pass (every verify pass costs at least one plain step, so no run can beat its
    yield); or on the other side of 1× from the prediction built from the pass costs."""
    if abs(speedup - 1) <= NOISE_BAND or speedup > tokens_per_pass:
        return "within timing noise"
    if predicted == predicted and (speedup - 1) * (predicted - 1) < 0:
        return "within timing noise"
    return "faster" if speedup > 1 else "slower"


def _speed_clause(r: dict) -> str:
    """The speedup's verdict as a clause, with the reason when the timing cannot carry one."""
    verdict = speed_verdict(r["speedup"], r["tokens_per_pass"], r.get("predicted_speedup", float("nan")))
    if verdict != "within timing noise":
        return f"{verdict} than plain decoding"
    if r["speedup"] > r["tokens_per_pass"]:
        why = (f"more than its {r['tokens_per_pass']:.2f} tokens per pass allow, since every verify pass costs at "
               "least the work of one plain step: the plain and speculative runs saw different machine states")
    elif abs(r["speedup"] - 1) <= NOISE_BAND:
        why = f"within {NOISE_BAND:.0%} of plain decoding"
    else:
        why = (f"the pass costs measured above predict {r['predicted_speedup']:.2f}×, on the other side of 1×: the "
               "two measurements saw different machine states")
    return f"within timing noise ({why})"


PAPER_SPEEDUPS = ("Leviathan et al. (2023)", "Chen et al. (2023)", 2.0, 3.0)
CACHED_INPUT_DISCOUNT = ("Anthropic's prompt-caching docs", 0.90)


def expected_yield(alpha: float, k: int) -> float:
    """Tokens per target pass when each draft survives with probability alpha: 1 + α + … + α^k."""
    if not 0 <= alpha <= 1 or k < 1:
        raise ValueError(f"alpha must be in [0, 1] and k >= 1, got alpha={alpha}, k={k}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class PaperExample:
    target: str
    draft: str
    draft_cost: float  # c: draft step ÷ target step, from weight bytes (both bandwidth-bound)
    alpha: float
    k: int
    verify_ratio: float = 1.0  # v_k: a (k+1)-token pass of a large bandwidth-bound model ≈ one step

    @property
    def speedup(self) -> float:
        return expected_yield(self.alpha, self.k) / (self.k * self.draft_cost + self.verify_ratio)

    def values(self) -> dict:
        return {"paper_draft_cost": self.draft_cost, "paper_speedup": self.speedup}

    def __str__(self) -> str:
        lo, hi = PAPER_SPEEDUPS[2:]
        where = "inside" if lo <= self.speedup <= hi else "outside"
        return wrap(f"{self.draft} drafting for {self.target}: a draft step reads {self.draft_cost:.3f} of the "
                f"target's weight bytes ({1 / self.draft_cost:.0f}× cheaper). With α = {self.alpha:.0%}, "
                f"k = {self.k} and "
                f"v_k ≈ {self.verify_ratio:g}: {expected_yield(self.alpha, self.k):.2f} tokens per pass ÷ "
                f"({self.k}·{self.draft_cost:.3f} + {self.verify_ratio:g}) = {self.speedup:.2f}×, {where} the "
                f"{lo:g}–{hi:g}× reported by {PAPER_SPEEDUPS[0]} and {PAPER_SPEEDUPS[1]}.")


def paper_example(target="llama-2-70b", draft="llama-2-7b", alpha: float = 0.8, k: int = 4) -> PaperExample:
    """The GPU case on paper: both models bandwidth-bound, so a step costs its weight bytes."""
    c = weights_bytes(ModelConfig.from_name(draft)) / weights_bytes(ModelConfig.from_name(target))
    return PaperExample(target, draft, c, alpha, k)


@dataclass
class SweepSummary:
    rows: list[dict]
    lookup4: dict
    shallow2: dict
    best: dict
    open_lookup4: dict

    def values(self) -> dict:
        l4, s2 = self.lookup4, self.shallow2
        return {"acceptance_rate": self.lookup4["acceptance_rate"], "spec_speedup": self.lookup4["speedup"],
                "spec_speed_verdict": speed_verdict(l4["speedup"], l4["tokens_per_pass"], l4["predicted_speedup"]),
                "shallow_speed_verdict": speed_verdict(s2["speedup"], s2["tokens_per_pass"],
                                                       s2["predicted_speedup"]),
                "tokens_per_pass": self.lookup4["tokens_per_pass"], "sweep": self.rows,
                "shallow_acceptance_rate": self.shallow2["acceptance_rate"],
                "shallow_speedup": self.shallow2["speedup"], "open_lookup_speedup": self.open_lookup4["speedup"]}

    def table(self) -> str:
        out = [f"{'prompt · draft':44s} {'k':>2s} {'kept':>5s} {'tok/pass':>8s} {'speedup':>8s} {'predicted':>9s}"]
        for r in self.rows:
            name = f"{r['prompt']} · {r['draft']}"[:44]
            out.append(f"{name:44s} {r['k']:2d} {r['acceptance_rate']:5.0%} {r['tokens_per_pass']:8.2f} "
                       f"{r['speedup']:7.2f}× {r['predicted_speedup']:8.2f}×")
        same = all(r["identical"] for r in self.rows)
        out.append("every run's output equals plain greedy decoding: " + ("yes" if same else "NO (a near-tie flipped)"))
        over = [r for r in self.rows if r["speedup"] > r["tokens_per_pass"]]
        if over:
            cases = ", ".join(f"{r['prompt']}, {r['draft']}, k={r['k']}: {r['speedup']:.2f}× > "
                              f"{r['tokens_per_pass']:.2f}" for r in over)
            out.append(wrap(f"timing noise: {counted(len(over), 'row')} ran faster than "
                            f"{'its' if len(over) == 1 else 'their'} tokens per pass allow ({cases}); a verify pass "
                            "does at least the work of one plain step, so timing noise favoured those runs"))
        return "\n".join(out)

    def __str__(self) -> str:
        l4, s2, b, o4 = self.lookup4, self.shallow2, self.best, self.open_lookup4
        return "\n".join(wrap(line) for line in [
            f"Copy task: prompt lookup at k=4 kept {l4['acceptance_rate']:.0%} of its drafts, "
            f"{l4['tokens_per_pass']:.2f} tokens per target pass, {l4['speedup']:.2f}× the plain decode speed "
            f"(predicted {l4['predicted_speedup']:.2f}×): {_speed_clause(l4)}. "
            f"Best: {b['draft']}, k={b['k']}, {b['speedup']:.2f}×.",
            f"Shallow draft at k=2: kept {s2['acceptance_rate']:.0%}, {s2['tokens_per_pass']:.2f} tokens per pass, "
            f"{s2['speedup']:.2f}× — " + {"faster": "it pays on this machine.", "slower":
                                          "it does NOT pay on this machine."}.get(
                speed_verdict(s2["speedup"], s2["tokens_per_pass"], s2["predicted_speedup"]),
                _speed_clause(s2) + "."),
            f"Open task: prompt lookup had a guess for {o4['proposal_share']:.0%} of the target passes and kept "
            f"{o4['acceptance_rate']:.0%} of its guesses: {o4['tokens_per_pass']:.2f} tokens per pass, "
            f"{o4['speedup']:.2f}× — {_speed_clause(o4)}."])


SLOWER = 1.3  # a miss this many times a plain prefill is clearly slower, even on a shared machine


def _miss_sentence(e) -> str:
    """Why the first request through the store took longer than its plain prefill, from the re-timed miss."""
    misses = [r for r in e.rows if r.reused_tokens == 0]
    m = getattr(e, "miss_check", None)
    if not misses or m is None:
        return ""
    r = misses[0]
    first = r.ttft_cached / r.ttft_plain
    fresh, warm = m.fresh_miss / m.plain, m.warm_miss / m.plain
    said = (f"The miss took {first:.1f}× its plain prefill ({r.ttft_plain * 1e3:.0f} → {r.ttft_cached * 1e3:.0f} ms). "
            f"Timed again: plain {m.plain * 1e3:.0f} ms, a first miss through a new store {m.fresh_miss * 1e3:.0f} ms "
            f"({fresh:.1f}×), a second miss through that store {m.warm_miss * 1e3:.0f} ms ({warm:.1f}×). ")
    if warm >= SLOWER:
        return said + ("Every miss pays it, not only the first: a miss prefills all its tokens into the paged pool, "
                       "where each layer's attention first gathers K and V from the blocks its block table lists, "
                       "slower here than one contiguous cache; pinning the prefix's blocks afterwards runs no model "
                       "pass.")
    if fresh >= SLOWER:
        return said + ("Only a store's first miss pays it, a one-off: a new pool's first prefill writes memory that "
                       "the operating system maps on first use; later misses cost about a plain prefill.")
    return said + ("Timed again, no miss costs much more than a plain prefill: the first one's extra time did not "
                   "repeat, so it was timing noise or a one-off, not the store's work.")


def _row(sweep, r) -> dict:
    return dict(prompt=sweep.prompt, draft=r.draft, k=r.k, acceptance_rate=r.acceptance_rate,
                agreement=r.agreement, tokens_per_pass=r.tokens_per_pass, speedup=r.speedup,
                predicted_speedup=r.predicted_speedup, identical=r.identical, proposal_share=r.proposal_share)


def summarize_sweeps(copy_sweep, open_sweep) -> SweepSummary:
    rows = [_row(sw, r) for sw in (copy_sweep, open_sweep) for r in sw.rows]
    return SweepSummary(rows, _row(copy_sweep, copy_sweep.row("prompt lookup", 4)),
                        _row(copy_sweep, copy_sweep.row("shallow", 2)), _row(copy_sweep, copy_sweep.best()),
                        _row(open_sweep, open_sweep.row("prompt lookup", 4)))


@dataclass
class PrefixSummary:
    exp: object  # speculative.PrefixExperiment

    def values(self) -> dict:
        e, s = self.exp, self.exp.store.stats
        return {"prefix_tokens": e.prefix_tokens, "prefix_identical": all(r.identical for r in e.rows),
                "prefix_ttft_plain_ms": [r.ttft_plain * 1e3 for r in e.rows],
                "prefix_ttft_cached_ms": [r.ttft_cached * 1e3 for r in e.rows],
                "prefix_token_share": e.token_share_reused, "prefix_prefill_saved": e.time_share_saved,
                "prefix_hits": s.hits, "prefix_misses": s.misses, "prefix_entry_bytes": e.entry_bytes}

    def __str__(self) -> str:
        e, s = self.exp, self.exp.store.stats
        share, saved = e.token_share_reused, e.time_share_saved
        name, discount = CACHED_INPUT_DISCOUNT
        lines = [f"{r.question[:44]:44s} {r.prompt_tokens} tokens, reused {r.reused_tokens:3d}: TTFT "
                 f"{r.ttft_plain * 1e3:5.0f} → {r.ttft_cached * 1e3:5.0f} ms, same answer: {r.identical}"
                 for r in e.rows]
        bs = getattr(e.store, "block_size", None)
        block_bytes = getattr(getattr(e.store, "pool", None), "block_bytes", None)
        hits = [r for r in e.rows if r.reused_tokens > 0]
        lines.append("")
        n_blocks = s.bytes // block_bytes if bs and block_bytes else None
        if bs and hits:
            reused = max(r.reused_tokens for r in hits)
            beyond = reused - e.prefix_tokens
            what = (f"the {e.prefix_tokens}-token system prompt and the {counted(beyond, 'token')} after it that "
                    "open the user's turn, the same in every request (the first request left those blocks cached)"
                    if beyond > 0 else f"exactly the {e.prefix_tokens}-token system prompt" if beyond == 0 else
                    f"the {e.prefix_tokens}-token system prompt up to its last full block; its last "
                    f"{counted(-beyond, 'token')} {'was' if beyond == -1 else 'were'} prefilled again")
            lines.append(wrap(f"Reuse comes in whole {bs}-token blocks: the hits reused up to {reused} tokens = "
                              f"{counted(reused // bs, 'block')}, {what}."))
            unpinned = reused // bs - n_blocks if n_blocks is not None else 0
            if unpinned > 0:
                lines.append(wrap(
                    f"The store pins only the system prompt's {counted(n_blocks, 'full block')}; the reused "
                    f"{'block' if unpinned == 1 else counted(unpinned, 'block')} past them (positions "
                    f"{n_blocks * bs}–{reused - 1}) "
                    f"{'is' if unpinned == 1 else 'are'} the first request's own, left cached in the pool after "
                    "it finished and findable until the pool hands "
                    f"{'it' if unpinned == 1 else 'them'} out again, so the bytes held below leave "
                    f"{'it' if unpinned == 1 else 'them'} out."))
        miss = _miss_sentence(e)
        if miss:
            lines.append(wrap(miss))
        held = s.bytes
        if n_blocks is not None:
            tail = e.prefix_tokens - n_blocks * bs
            pinned = (f" ({counted(n_blocks, f'full {bs}-token block')} = {n_blocks * bs} tokens of the system prompt"
                      + (f"; its last {counted(tail, 'token')} fill{'s' if tail == 1 else ''} no whole block)"
                         if tail > 0 else ")"))
            per_token = block_bytes / bs
        else:
            pinned, per_token = "", e.entry_bytes / e.prefix_tokens
        copied = (f"copying stored rows took {s.seconds_copying * 1e3:.0f} ms in total" if s.seconds_copying else
                  "nothing was copied: each hit's block table points at the stored blocks")
        lines += [wrap(f"store: {counted(s.hits, 'hit')}, {counted(s.misses, 'miss', 'misses')}, "
                       f"{held / 2**20:.1f} MiB held{pinned}; {copied}"),
                  wrap(f"On the hits, {share:.1%} of each prompt's tokens came from the store and " + (
                  f"time to first token fell by {saved:.0%}: the time saved "
                  f"{'trails' if saved < share else 'matches or beats'} the token share. " if saved >= SAME else
                  f"{lower_by(saved, 'time to first token was')}. ") +
                  f"({name} price cached input {discount:.0%} cheaper; that is the same reuse, billed.)")]
        if held:
            lines.append(wrap(
                f"The price is memory: {per_token / 1024:.0f} KiB per token in float32 (2·L·H_kv·D_h·4 bytes), "
                f"{held / 2**20:.1f} MiB for the prefix the store holds, so the {e.store.max_bytes / 2**20:.0f} MiB "
                f"store holds {e.store.max_bytes // held} such prefixes before the least recently used one is "
                "evicted."))
        return "\n".join(lines)
