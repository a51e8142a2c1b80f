"""The end of every lesson: a recap in the learner's own measured numbers, and where to go next.

``recap("02_kv_cache")`` reads what the notebook record()ed in this kernel and returns a `Recap` that shows
as Markdown: about five bullets, each an f-string over those values (a bullet whose numbers were not
measured is left out, never filled with a typed figure), then links to the next lesson that exists on
disk, the exercises that follow this lesson, and the review page. It also records what it said, so the
lesson tests can check the recap against the values it quotes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from course.lessons.wording import SAME, counted, duration, lower_by, speedup_trend
from course.measure.results import record, recorded
from course.paths import LESSONS

EXERCISES = LESSONS.parent / "exercises"

# (lesson id = notebook stem, title shown in links, exercises that follow it: paths under exercises/)
COURSE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("00_start_here", "Start here", ()),
    ("01_prefill_decode", "Lesson 1 · One call, two phases: prefill and decode", ()),
    ("02_kv_cache", "Lesson 2 · The KV cache and its byte math",
     ("01_memory_formula/memory_formula.ipynb", "02_kv_cache/kv_cache.ipynb")),
    ("02b_kv_cache_appendix", "Lesson 2, appendix · MHA/GQA/MQA, an INT8 cache, beam search", ()),
    ("03_sampling", "Lesson 3 · Sampling: temperature, top-k, top-p",
     ("03_sampler/sampler.ipynb", "04_checkpoint_quiz/checkpoint_quiz.ipynb")),  # the quiz covers lessons 1-3
    ("04_speculative_prefix", "Lesson 4 · Speculative decoding and prefix caching", ()),
    ("05_serving", "Lesson 5 · Serving many requests at once", ("05_paged_cache/paged_cache.ipynb",)),
    ("99_course_end", "The end of the course: what you can do now", ()),
)
OPTIONAL = {"02b_kv_cache_appendix"}  # not on the main path: the main path links past it
REVIEW = "review.ipynb"


@dataclass
class Recap:
    lesson: str
    bullets: list[str]
    next_lesson: tuple[str, str] | None  # (file name, title)
    exercises: list[str] = field(default_factory=list)  # paths relative to the lesson folder
    review: bool = False

    def values(self) -> dict:
        return {"lesson": self.lesson, "bullets": self.bullets, "exercises": self.exercises,
                "next": self.next_lesson[0] if self.next_lesson else None}

    def links(self) -> list[str]:
        out = []
        if self.exercises:
            names = ", ".join(f"[{Path(p).stem.replace('_', ' ')}]({p})" for p in self.exercises)
            out.append(f"**Exercise{'s' if len(self.exercises) > 1 else ''} for this lesson:** {names}")
        if self.next_lesson:
            out.append(f"**Next:** [{self.next_lesson[1]}]({self.next_lesson[0]})")
        if self.review:
            out.append(f"**Come back later:** [review the questions you found hard]({REVIEW})")
        return out

    def _repr_markdown_(self) -> str:
        lines = ["### Recap: what you measured", ""] + [f"- {b}" for b in self.bullets] + [""]
        return "\n".join(lines + [f"{link}  " for link in self.links()])

    def __repr__(self) -> str:  # text/plain, for viewers without Markdown
        return str(self)

    def __str__(self) -> str:
        return "\n".join(["Recap: what you measured"] + [f"  • {b}" for b in self.bullets] + self.links())


def _get(v: dict, key: str):
    """v[key], where key may index a list (`name.0`, `name.-1`); None when not measured."""
    name, _, index = key.partition(".")
    value = v.get(name)
    if value is None or not index:
        return value
    try:
        return value[int(index)]
    except (IndexError, TypeError, ValueError):
        return None


def _bullet(v: dict, keys: str, make: Callable[..., str]) -> str | None:
    values = [_get(v, k) for k in keys.split()]
    if any(x is None for x in values):
        return None
    try:
        return make(*values)
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def _times(a: float, b: float) -> str:
    return f"{a / b:.1f}×"


def _cold_costs(device: str | None) -> str:
    """What a first call pays once on this device (the recorded device string: 'cpu', 'cuda:0', 'mps')."""
    kind = str(device or "").split(":")[0]
    if kind == "cuda":
        return ("loading the GPU's kernels and letting its math library pick its algorithms and allocate its "
                "workspace")
    if kind == "cpu":
        return "paging the weights in from the disk cache and warming the CPU's caches"
    return "paging the weights in and loading and warming the math library's kernels"


def _start(v):
    return [
        _bullet(v, "start_prompt_tokens start_n_tokens start_stop_reason", lambda t, n, why:
                f"One call = one prefill pass over your {t}-token prompt, then one decode pass per further "
                f"token: {n} tokens, stopped on {why}."),
        _bullet(v, "start_ttft_ms start_itl_ms", lambda ttft, itl:
                f"Warm, the first token took {ttft:.0f} ms and each later one {itl:.1f} ms "
                f"({1e3 / itl:.1f} tokens/s): the first token waits for the whole prompt, "
                f"{_times(ttft, itl)} as long as a later one."),
        _bullet(v, "start_cold_ttft_ms start_ttft_ms", lambda cold, warm:
                f"The very first call after loading (cold) took {cold:.0f} ms to its first token, "
                + (f"{_times(cold, warm)} the warm figure: a cold start pays once for "
                   + _cold_costs(v.get("start_device")) + "." if cold > 1.2 * warm else
                   "about the same as warm: the weights were already in memory.")),
        _bullet(v, "start_model start_device", lambda name, device:
                f"{name} ran on {device}, from a model file on your disk: nothing was downloaded."),
        "TTFT is set by prefill and the prompt; inter-token latency by decode and memory bandwidth "
        "(lesson 1 measures why).",
    ]


def _prefill_decode(v):
    from course.lessons.prefill_decode import cache_rise_clause, step_dominance

    return [
        _bullet(v, "prefill_tokens_per_s_256 decode_tokens_per_s.0", lambda pre, dec:
                f"Prefill ran at {pre:,.0f} tokens/s on a 256-token prompt; decode produced {dec:.1f} tokens/s, "
                + (f"{pre / dec:.0f}× fewer." if pre > dec else "no fewer: this run did not show the gap.")),
        _bullet(v, "decode_ms_per_token.0 decode_contexts.0 decode_ms_per_token.-1 decode_contexts.-1 "
                "decode_floor_ms", lambda a, ca, b, cb, _:
                f"A decode step took {a:.1f} ms at {ca:,} tokens of context and {b:.1f} ms at {cb:,}: "
                f"{step_dominance(v)}; {cache_rise_clause(v, span=False)}."),
        _bullet(v, "bandwidth_gb_s decode_floor_ms decode_ms_per_token.0", lambda bw, floor, ms:
                f"Your memory streamed {bw:.1f} GB/s, so reading the weights bounds a step at {floor:.1f} ms; "
                f"eager PyTorch took {ms:.1f} ms ({ms / floor:.1f}× the floor)."),
        _bullet(v, "heldout_error", lambda err:
                f"The fitted latency model predicted a run it never saw within {abs(err):.0%}." if abs(err) <= 0.2
                else f"The fitted latency model missed a run it never saw by {err:+.0%}, so its "
                     "extrapolations carry at least that error on this machine."),
        _bullet(v, "ab_A_total_s ab_B_total_s", lambda a, b:
                f"Request {'B' if b > a else 'A'} is the slower one: {duration(b)} for B's 2,000 output tokens "
                f"against {duration(a)} for A's 4,000-token prompt." + (" Output tokens dominate." if b > a else "")),
    ]


def _kv_cache(v):
    return [
        _bullet(v, "equivalence_max_logit_diff equivalence_tokens_identical", lambda d, same:
                f"With and without the cache the logits agreed to {d:.1e} and the greedy tokens were "
                f"{'identical' if same else 'NOT identical'}."),
        _bullet(v, "speedups speed_lengths.-1", lambda s, n:
                (f"The cache made {n} new tokens {s[-1]:.1f}× faster here" if s[-1] >= 1 + SAME else
                 f"The cache did not make {n} new tokens faster here ({s[-1]:.2f}×)")
                + f"; the speedup {speedup_trend(s)}."),
        _bullet(v, "kv_bytes_per_token", lambda b:
                f"SmolLM2 stores {b:,} bytes of K and V per token in FP16: 2 · L · H_kv · D_h · 2."),
        _bullet(v, "smollm2_cache_formula_bytes smollm2_cache_measured_bytes", lambda f, m:
                f"The formula gave {f:,} bytes for the live cache and its tensors held "
                + ("exactly that." if f == m else f"{m:,}.")),
        _bullet(v, "crossover_7b crossover_70b crossover_rows", lambda a, b, rows:
                f"Llama-2-7B's FP16 cache outweighs its weights past {a:,.0f} tokens at batch 1; "
                f"Llama-2-70B's past {b:,.0f}" + _window_caveat(rows, ("llama-2-7b", "llama-2-70b"))),
        _bullet(v, "paging_preallocated_waste paging_paged_waste", lambda pre, paged:
                f"Preallocating for the longest request left {pre:.0%} of the cache empty; 16-token pages "
                f"left {paged:.1%}."),
    ]


def _window_caveat(rows, models) -> str:
    """'.' or the caveat lesson 02's crossover cell prints: a crossover past the model's context window never
    happens at batch 1."""
    past = [r for r in rows if r["model"] in models and r["crossover_b1"] > r["max_context"]]
    if not past:
        return "."
    windows = sorted({r["max_context"] for r in past})
    return (f": {'both lie' if len(past) > 1 else 'that lies'} beyond the {' and '.join(f'{w:,}' for w in windows)}"
            "-token context window, so at batch 1 the weights always dominate.")


def _kv_appendix(v):
    from course.lessons.kv_lesson import int8_grade_phrase as _int8_grade_phrase  # the report's own words

    return [
        _bullet(v, "int8_bytes_ratio", lambda r: f"An INT8 cache took {r:.2f}× the bytes of FP16."),
        _bullet(v, "int8_max_logit_diff int8_median_top2_gap int8_error_grade int8_at_risk_steps int8_n_tokens",
                lambda d, gap, grade, at_risk, n:
                f"It moved the logits by at most {d:.3f}, {d / gap:.0%} of the median top-two gap; that is "
                f"{_int8_grade_phrase(grade, len(at_risk), n)}."),
        _bullet(v, "int8_free_run_same_prefix int8_n_tokens", lambda same, n:
                f"Running free, the INT8 generation matched all {n} tokens." if same >= n else
                f"Running free, the INT8 generation first differed at token {same + 1} of {n}."),
        _bullet(v, "beam_width beam_cache_ratio", lambda w, r:
                f"Beam search with width {w} needed {r:.1f}× the cache of one sequence."),
    ]


def _sampling(v):
    return [
        _bullet(v, "sampling_factual_top_token sampling_factual_top_prob sampling_factual_entropy_bits "
                "sampling_open_entropy_bits", lambda tok, p, h1, h2:
                f"After the factual prompt the top token {tok!r} held {p:.0%} ({h1:.2f} bits); the open-ended "
                f"prompt spread to {h2:.1f} bits."),
        _bullet(v, "sampling_nucleus_p09", lambda kept:
                f"Top-p 0.9 kept {counted(kept['factual'], 'token')} after the factual prompt and "
                f"{kept['open-ended']:,} after the open one: it adapts, top-k does not."),
        _bullet(v, "sampling_redraw_ms_median sampling_redraw_ms_max", lambda med, mx:
                f"A slider redraw took {med:.1f} ms (median), {mx:.1f} ms at worst, against a 200 ms budget."),
        _bullet(v, "determinism_batch_max_abs_diff determinism_min_gap", lambda noise, gap:
                f"The same prompt alone and in a batch differed by up to {noise:.1e} in the logits; the closest "
                f"real top-two gap was {gap:.4f}."),
        _bullet(v, "determinism_near_tie_flipped", lambda flipped:
                "At a near-tie, that noise " + ("flipped greedy decoding onto another story." if flipped else
                                                "did not flip the greedy choice this time.")),
    ]


def _draft_depth(v) -> str:
    """'8-layer' from the recorded draft_layers; 'early-exit' when it was not recorded."""
    n = v.get("draft_layers")
    return f"{n}-layer" if n else "early-exit"


def _speculative(v):
    return [
        _bullet(v, "greedy_identical_all", lambda same:
                "Greedy speculative decoding reproduced plain greedy token for token with both drafts." if same
                else "Greedy speculative decoding did NOT reproduce plain greedy for every draft (a near-tie)."),
        _bullet(v, "spec_tv_distance spec_tv_noise_limit spec_within_noise spec_tv_draft",
                lambda tv, limit, within, draft:
                f"Speculative sampling landed {tv:.4f} from the target, {'within' if within else 'OUTSIDE'} the "
                f"noise of exact draws (limit {limit:.4f} = mean + 4 SD); the draft alone was {draft:.4f} away."),
        _bullet(v, "acceptance_rate spec_speedup", lambda a, s:
                f"Prompt lookup on the copy task kept {a:.0%} of its guesses: {s:.2f}× plain decoding"
                + (" (within timing noise)." if v.get("spec_speed_verdict") == "within timing noise" else ".")),
        _bullet(v, "shallow_acceptance_rate shallow_speedup", lambda a, s:
                f"The shallow {_draft_depth(v)} draft kept {a:.0%} and ran at {s:.2f}×: " + {
                    "faster": "it pays here.", "slower": "it does not pay here."}.get(
                    v.get("shallow_speed_verdict", "faster" if s > 1 else "slower"), "within timing noise.")),
        _bullet(v, "prefix_token_share prefix_prefill_saved", lambda share, saved:
                f"Prefix caching reused {share:.0%} of each prompt: {lower_by(saved, 'time to first token')}."),
    ]


BULLETS = {"00_start_here": _start, "01_prefill_decode": _prefill_decode, "02_kv_cache": _kv_cache,
           "02b_kv_cache_appendix": _kv_appendix, "03_sampling": _sampling, "04_speculative_prefix": _speculative}


def next_lesson(lesson: str, lessons_dir: Path = LESSONS) -> tuple[str, str] | None:
    """The next lesson on the main path whose notebook exists: (file name, title)."""
    ids = [c[0] for c in COURSE]
    if lesson not in ids:
        raise ValueError(f"unknown lesson {lesson!r}; expected one of {ids}")
    for lid, title, _ in COURSE[ids.index(lesson) + 1:]:
        if lid not in OPTIONAL and (lessons_dir / f"{lid}.ipynb").exists():
            return f"{lid}.ipynb", title
    return None


def recap(lesson: str, values: dict | None = None, lessons_dir: Path = LESSONS,
          bullets: list[str] | None = None) -> Recap:
    """The recap of `lesson` from `values` (default: what this kernel record()ed), recorded as 'recap'.

    A lesson without a builder in BULLETS passes its own `bullets` (f-strings over its values); the links
    onward still come from COURSE."""
    if lesson not in {c[0] for c in COURSE}:
        raise ValueError(f"unknown lesson {lesson!r}; expected one of {[c[0] for c in COURSE]}")
    if bullets is None and lesson not in BULLETS:
        raise ValueError(f"no recap bullets for lesson {lesson!r}: pass bullets=[...] (lessons with built-in "
                         f"ones: {sorted(BULLETS)})")
    v = recorded() if values is None else values
    built = bullets is None  # the lesson's own bullets were written over values it has, so they ran
    bullets = [b for b in (bullets if bullets is not None else BULLETS[lesson](v)) if b]
    if built and not v:  # a fresh kernel: this cell run before the lesson's, so no bullet can quote a measurement
        bullets.insert(0, "Nothing was measured in this kernel yet: run the lesson from the top (Run → Run All "
                          "Cells) and this recap quotes your own numbers.")
    exercises = [f"../exercises/{p}" for lid, _, ps in COURSE if lid == lesson for p in ps
                 if (lessons_dir.parent / "exercises" / p).exists()]
    r = Recap(lesson, bullets, next_lesson(lesson, lessons_dir), exercises,
              review=(lessons_dir / REVIEW).exists())
    record("recap", r.values())
    return r


def stated_run_minutes(nb) -> float | None:
    """The bound a lesson's first cell states ('**Run time:** under N minutes', N may be 2.5), or None."""
    import re

    source = nb.cells[0].source if nb.cells else ""
    m = re.search(r"\*\*Run time:?\*\*:?\s*under (\d+(?:\.\d+)?) minutes?", source)
    return float(m.group(1)) if m else None
