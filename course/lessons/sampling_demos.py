"""The sampling lesson's experiments: order of composition, one knob or two, settings per task, tie gaps.

Each function returns numbers (for record()) and, where a picture helps, a matplotlib Figure built without
pyplot (display it with IPython's display or the lesson's show_figure).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from course.engine.sampling import apply_temperature, check_params, entropy_bits, top_p_filter, transform_logits
from course.engine.continuations import sample_continuations
from course.engine.prompts import Prompt
from course.measure.display import working


# -- order of composition ----------------------------------------------------------------------------------
def nucleus_by_order(logits: torch.Tensor, temperatures: list[float], top_p: float) -> dict[str, list[int]]:
    """Tokens kept at each temperature (> 0) when temperature comes before top-p (the usual order) or after.

    Temperature first: top-p cuts the reshaped distribution, so the nucleus grows with T.
    Top-p first: the nucleus is fixed by the T = 1 distribution; temperature only reshapes inside it.
    """
    check_params(top_p=top_p)
    if any(t <= 0 for t in temperatures):
        raise ValueError("temperatures must all be > 0 here (temperature 0 is greedy: a nucleus of 1)")
    t_first = [int(torch.isfinite(top_p_filter(apply_temperature(logits, t), top_p)).sum()) for t in temperatures]
    p_first = [int(torch.isfinite(apply_temperature(top_p_filter(logits, top_p), t)).sum()) for t in temperatures]
    return {"temperature then top-p": t_first, "top-p then temperature": p_first}


def entropy_grid(logits: torch.Tensor, temperatures: list[float], top_ps: list[float]) -> torch.Tensor:
    """Entropy in bits of the sampled distribution for every (temperature, top_p): [len(T), len(p)]."""
    out = torch.empty(len(temperatures), len(top_ps))
    for i, t in enumerate(temperatures):
        for j, p in enumerate(top_ps):
            out[i, j] = entropy_bits(transform_logits(logits, t, None, p).softmax(-1))
    return out


def matching_top_p(logits: torch.Tensor, temperature: float, top_ps: list[float]) -> tuple[float, float, float]:
    """The top-p (at T = 1) whose entropy comes closest to `temperature` alone: (top_p, its bits, target bits)."""
    target = float(entropy_bits(transform_logits(logits, temperature).softmax(-1)))
    bits = entropy_grid(logits, [1.0], top_ps)[0]
    j = int((bits - target).abs().argmin())
    return top_ps[j], float(bits[j]), target


def composition_figure(logits: torch.Tensor, temperatures: list[float], top_ps: list[float], top_p: float = 0.9):
    """Left: nucleus size vs temperature in both orders. Right: entropy over the (temperature, top-p) plane."""
    from matplotlib.figure import Figure

    with working(f"Filtering the {logits.shape[-1]:,} logits at {len(temperatures)} temperatures × "
                 f"{len(top_ps)} top-p values and taking each result's entropy", "a few seconds on a 2-core CPU"):
        sizes = nucleus_by_order(logits, temperatures, top_p)
        grid = entropy_grid(logits, temperatures, top_ps)
    fig = Figure(figsize=(11, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    for label, ys in sizes.items():
        ax1.plot(temperatures, ys, marker="o", ms=3, label=label)
    ax1.set_yscale("log")
    ax1.set_xlabel("temperature")
    ax1.set_ylabel(f"tokens kept (top-p = {top_p})")
    ax1.legend(frameon=False, fontsize=8)
    ax1.set_title("same settings, other order, other nucleus", fontsize=10)
    im = ax2.contourf(top_ps, temperatures, grid.numpy(), levels=12, cmap="viridis")
    lines = ax2.contour(top_ps, temperatures, grid.numpy(), levels=[1, 2, 3, 4], colors="white", linewidths=0.8)
    ax2.clabel(lines, fmt="%g bits", fontsize=7)
    fig.colorbar(im, ax=ax2, label="entropy (bits)")
    ax2.set_xlabel("top-p")
    ax2.set_ylabel("temperature")
    ax2.set_title("many (T, top-p) pairs, one entropy: two knobs, one effect", fontsize=10)
    fig.tight_layout()
    return fig


# -- settings per task -------------------------------------------------------------------------------------
CITY_QUESTION = Prompt("Which city is mentioned in this sentence? 'Last spring I flew to Tokyo to visit my aunt.' "
                       "Answer with the city name only.")


@dataclass(frozen=True)
class Task:
    name: str
    prompt: Prompt
    temperature: float
    top_p: float = 1.0
    must_contain: str | None = None  # a semantic check: the answer mentions this (case-insensitive)
    meant: str | None = None  # what the setting is meant to show ("too hot", "too cold"); the label says if it did


GUIDANCE: list[Task] = [
    Task("extraction, T = 0.1", CITY_QUESTION, 0.1, must_contain="Tokyo"),
    Task("extraction, T = 1.5", CITY_QUESTION, 1.5, must_contain="Tokyo", meant="too hot"),
    Task("assistant, T = 0.7", Prompt("How can I get better at remembering new words in a foreign language?"), 0.7),
    Task("brainstorming, T = 1.0", Prompt("Give me one unusual idea for a birthday party."), 1.0),
    Task("brainstorming, T = 0.2", Prompt("Give me one unusual idea for a birthday party."), 0.2, meant="too cold"),
]


@dataclass
class TaskResult:
    task: Task
    texts: list[str]

    @property
    def distinct(self) -> int:
        return len(set(self.texts))

    @property
    def passed(self) -> int | None:
        """How many answers pass the task's semantic check (None when it has none)."""
        if self.task.must_contain is None:
            return None
        return sum(self.task.must_contain.lower() in t.lower() for t in self.texts)

    @property
    def label(self) -> str:
        """The task's name, and whether this run showed what the setting is meant to show: too hot when some
        answers fail the check, too cold when answers repeat. Never claimed before the run."""
        meant, n = self.task.meant, len(self.texts)
        if meant is None:
            return self.task.name
        if self.passed is not None:
            shown = self.passed < n
            how = (f"{n - self.passed} of {n} miss {self.task.must_contain}" if shown
                   else f"all {n} name {self.task.must_contain} in this run")
        else:
            shown = self.distinct < n
            how = f"only {self.distinct} distinct of {n}" if shown else f"all {n} differ in this run"
        return f"{self.task.name} ({meant}: {how})" if shown else f"{self.task.name} (meant as {meant}, but {how})"


def run_tasks(model, tokenizer, tasks: list[Task] = GUIDANCE, n: int = 4, max_new_tokens: int = 16,
              seed: int = 0) -> list[TaskResult]:
    """n sampled answers per task (each task its own seed: seed, seed + 1, ...)."""
    results = []
    with working(f"Sampling {n} answers of up to {max_new_tokens} tokens for each of {len(tasks)} settings",
                 "under a minute on a 2-core CPU"):
        for i, task in enumerate(tqdm(tasks, desc="settings sampled", unit="setting", leave=False)):
            texts = sample_continuations(model, tokenizer, task.prompt.ids(tokenizer), n, max_new_tokens,
                                         temperature=task.temperature, top_p=task.top_p, seed=seed + i)
            results.append(TaskResult(task, texts))
    return results


def print_tasks(results: list[TaskResult]) -> None:
    for r in results:
        check = "" if r.passed is None else f", {r.passed}/{len(r.texts)} mention {r.task.must_contain!r}"
        print(f"{r.label}: {r.distinct} distinct of {len(r.texts)}{check}")
        for t in r.texts:
            print("   ", repr(t))


def task_sentences(results: list[TaskResult]) -> list[str]:
    """What the run showed, for each pair of tasks that ask the same prompt at two temperatures: how many
    answers passed the check (checked tasks) or how many differed (the others), colder first."""
    out, seen = [], set()
    for r in results:
        same = [o for o in results if o.task.prompt == r.task.prompt]
        if len(same) != 2 or id(same[0]) in seen:
            continue
        seen.update(id(o) for o in same)
        cold, hot = sorted(same, key=lambda o: o.task.temperature)
        tc, th, n = cold.task.temperature, hot.task.temperature, len(cold.texts)
        if cold.passed is not None:
            word = cold.task.must_contain
            change = (f"heat cost {cold.passed - hot.passed} of them" if hot.passed < cold.passed else
                      "heat cost nothing in this run (a few samples are few)" if hot.passed == cold.passed else
                      "the hotter setting did better in this run (a few samples are few)")
            out.append(f"{cold.task.name.split(',')[0]}: {cold.passed} of {n} answers named {word} at T = {tc:g}, "
                       f"{hot.passed} of {len(hot.texts)} at T = {th:g}: {change}.")
        else:
            still = ("every answer still differs" if cold.distinct == n else "all answers came out the same"
                     if cold.distinct == 1 else "some answers repeat")
            out.append(f"{cold.task.name.split(',')[0]}: {hot.distinct} distinct answers of {len(hot.texts)} at "
                       f"T = {th:g}, {cold.distinct} of {n} at T = {tc:g}: at the colder setting {still}.")
    return out


def check_sentence(answers: list[str], word: str) -> str:
    """How many distinct strings the samples were and how many passed the meaning check (names `word`)."""
    n, distinct = len(answers), len(set(answers))
    passed = sum(word.lower() in a.lower() for a in answers)
    strings = ("The strings all differ" if distinct == n else "All the strings are the same this time"
               if distinct == 1 else f"The {n} strings hold {distinct} distinct answers")
    check = (f"the check holds for each of them" if passed == n else
             f"the check holds for {passed} of {n}" if passed else "the check holds for none of them")
    return f"{strings}; {check} (names {word})."


# -- how close do argmax decisions come to a tie? ----------------------------------------------------------
def gaps_figure(gaps: list[float], noise: float):
    """Histogram of top-1 minus top-2 logit gaps (log scale), with the measured noise marked."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    positive = [x for x in (*gaps, noise) if x > 0]  # a noise (or gap) of exactly 0 has no place on a log axis
    lo = min(positive) / 2 if positive else 1e-8
    bins = np.logspace(np.log10(lo), np.log10(max(max(gaps), lo) * 1.5), 40)
    ax.hist([max(g, lo) for g in gaps], bins=bins, color="#1f77b4")  # a gap of 0 lands in the first bin
    ax.set_xscale("log")
    if noise > 0:
        ax.axvline(noise, color="#d62728", ls="--", label=f"alone-vs-batched noise {noise:.1e}")
    else:
        ax.set_title("alone and batched agreed bit for bit: noise 0, not drawn on the log axis", fontsize=9)
    ax.set_xlabel("logit gap between the top two tokens at a greedy step")
    ax.set_ylabel("steps")
    if noise > 0:
        ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
