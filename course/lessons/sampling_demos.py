"""The sampling lesson's experiments: order of composition, one knob or two, settings per task. Figures are built
without pyplot (show them with course.measure.display.show_figure)."""
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
    """Tokens kept at each temperature (> 0) when temperature comes before top-p (the usual order: the nucleus grows
    with T) or after it (the nucleus is fixed by the T = 1 distribution)."""
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
    ax1.set(yscale="log", xlabel="temperature", ylabel=f"tokens kept (top-p = {top_p})")
    ax1.legend(frameon=False, fontsize=8)
    ax1.set_title("same settings, other order, other nucleus", fontsize=10)
    im = ax2.contourf(top_ps, temperatures, grid.numpy(), levels=12, cmap="viridis")
    ax2.clabel(ax2.contour(top_ps, temperatures, grid.numpy(), levels=[1, 2, 3, 4], colors="white", linewidths=0.8),
               fmt="%g bits", fontsize=7)
    fig.colorbar(im, ax=ax2, label="entropy (bits)")
    ax2.set(xlabel="top-p", ylabel="temperature")
    ax2.set_title("many (T, top-p) pairs, one entropy: two knobs, one effect", fontsize=10)
    fig.tight_layout()
    return fig


# -- settings per task -------------------------------------------------------------------------------------
CITY_QUESTION = Prompt("Which city is mentioned in this sentence? 'Last spring I flew to Tokyo to visit my aunt.' "
                       "Answer with the city name only.")
PARTY = Prompt("Give me one unusual idea for a birthday party.")


@dataclass(frozen=True)
class Task:
    name: str
    prompt: Prompt
    temperature: float
    must_contain: str | None = None  # a semantic check: the answer mentions this (case-insensitive)


# Temperature 0 is greedy, so its four answers are one answer: "too cold" shown for certain, not hoped for.
GUIDANCE: list[Task] = [
    Task("extraction, T = 0", CITY_QUESTION, 0.0, must_contain="Tokyo"),
    Task("extraction, T = 1.5", CITY_QUESTION, 1.5, must_contain="Tokyo"),
    Task("assistant, T = 0.7", Prompt("How can I get better at remembering new words in a foreign language?"), 0.7),
    Task("brainstorming, T = 1.0", PARTY, 1.0),
    Task("brainstorming, T = 0", PARTY, 0.0),
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
        word = self.task.must_contain
        return None if word is None else sum(word.lower() in t.lower() for t in self.texts)

    def __str__(self) -> str:
        check = "" if self.passed is None else f", {self.passed} name {self.task.must_contain}"
        return "\n".join([f"{self.task.name}: {self.distinct} distinct of {len(self.texts)}{check}"]
                         + [f"    {t!r}" for t in self.texts])


def run_tasks(model, tokenizer, tasks: list[Task] = GUIDANCE, n: int = 4, max_new_tokens: int = 16,
              seed: int = 0) -> list[TaskResult]:
    """n sampled answers per task (each task its own seed: seed, seed + 1, ...)."""
    with working(f"Sampling {n} answers of up to {max_new_tokens} tokens for each of {len(tasks)} settings",
                 "under a minute on a 2-core CPU"):
        return [TaskResult(task, sample_continuations(model, tokenizer, task.prompt.ids(tokenizer), n, max_new_tokens,
                                                      temperature=task.temperature, seed=seed + i))
                for i, task in enumerate(tqdm(tasks, desc="settings sampled", unit="setting", leave=False))]
