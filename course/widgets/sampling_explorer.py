"""Sampling explorer: reshape the real model's next-token distribution with temperature, top-k and top-p.

    explorer = SamplingExplorer(model, tokenizer)       # logits are computed once per prompt, then cached
    view = explorer.redraw(temperature=0.7, top_k=0, top_p=0.9, prompt="factual")   # the slider callback
    explorer.show()                                     # sliders + chart + sample button (static view headless)

`redraw` is a plain function: tests drive it over a grid of settings without a front end.
It recomputes the distribution from the cached (sorted) logits with the reference sampler and renders the
bar chart as SVG; `View.redraw_ms` is the whole wait a slider move costs in the kernel. The SVG goes
straight to the browser (a matplotlib PNG render alone takes longer than the budget on a busy CPU); the
static view for a headless run is a matplotlib figure (`figure()`, `static_grid()`).
"""
from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

import torch

from course.engine.device import torch_threads
from course.engine.continuations import next_token_logits, sample_continuations  # noqa: F401  (re-exported)
from course.engine.prompts import PROMPTS, Prompt  # noqa: F401  (re-exported)
from course.engine.sampling import check_params, entropy_bits, probabilities, transform_logits
from course.measure.display import figure_png, headless, show_figure  # noqa: F401  (re-exported)


TOP_K_CHOICES = [("off", 0)] + [(str(k), k) for k in range(1, 101)]


@dataclass
class View:
    """What one redraw shows: the top-n tokens before and after the transforms, and the summary numbers."""
    prompt: str
    temperature: float
    top_k: int
    top_p: float
    token_ids: list[int]  # the n most likely tokens at temperature 1, most likely first
    labels: list[str]  # their text, as on the chart's axis
    before: list[float]  # their probabilities: plain softmax (T = 1, no filter)
    after: list[float]  # their probabilities after temperature, top-k, top-p and renormalising
    kept: list[bool]  # which of them the settings keep
    nucleus_size: int  # how many tokens of the whole vocabulary top-k / top-p keep (1 when greedy)
    entropy_before_bits: float
    entropy_after_bits: float
    redraw_ms: float = float("nan")  # in the kernel: sampler on the cached logits + SVG chart

    def summary(self) -> str:
        k = "off" if not self.top_k else self.top_k
        return (f"T={self.temperature:g}  top-k={k}  top-p={self.top_p:g}  →  nucleus: {self.nucleus_size} "
                f"token{'s' if self.nucleus_size != 1 else ''}, entropy {self.entropy_before_bits:.2f} → "
                f"{self.entropy_after_bits:.2f} bits, top token {self.labels[0]!r} "
                f"{self.before[0]:.1%} → {self.after[0]:.1%}")


@dataclass
class _Cached:
    sorted_logits: torch.Tensor  # [V] most likely first (stable: lowest id first among ties, as argmax)
    order: torch.Tensor  # [V] token id of each sorted position
    before: torch.Tensor  # [V] plain softmax, sorted
    entropy_bits: float
    labels: list[str] = field(default_factory=list)


class SamplingExplorer:
    """Sliders over the real model's next-token distribution. One forward pass per prompt, ever."""

    def __init__(self, model, tokenizer, prompts: dict[str, Prompt] | None = None, top_n: int = 20):
        if top_n < 2:
            raise ValueError(f"top_n must be >= 2 bars, got {top_n}")
        self.model, self.tokenizer = model, tokenizer
        self.prompts = dict(prompts or PROMPTS)
        self.top_n = top_n
        self._cache: dict[str, _Cached] = {}
        self.svg = ""
        self.last: View | None = None
        self.seed = 0

    # -- numbers -------------------------------------------------------------------------------------------
    def logits(self, prompt: str) -> torch.Tensor:
        """The model's next-token logits [V] for a prompt name (computed once, then cached)."""
        c = self._cached(prompt)
        return torch.empty_like(c.sorted_logits).scatter_(0, c.order, c.sorted_logits)

    def _cached(self, prompt: str) -> _Cached:
        if prompt not in self.prompts:
            raise ValueError(f"prompt must be one of {sorted(self.prompts)}, got {prompt!r}")
        if prompt not in self._cache:
            logits = next_token_logits(self.model, self.prompts[prompt].ids(self.tokenizer))
            # Temperature keeps the order and top-k / top-p keep a prefix of it, so sorting once per prompt
            # is enough: every redraw works on the sorted vector.
            sorted_logits, order = torch.sort(logits, descending=True, stable=True)
            before = sorted_logits.softmax(-1)
            self._cache[prompt] = _Cached(sorted_logits, order, before, float(entropy_bits(before)),
                                          [self.tokenizer.token_text(int(i)) for i in order[: self.top_n]])
        return self._cache[prompt]

    def compute(self, temperature: float = 1.0, top_k: int | None = 0, top_p: float | None = 1.0,
                prompt: str = "factual") -> View:
        """The numbers behind one redraw (the reference sampler on the cached sorted logits), without drawing."""
        check_params(temperature, top_k, top_p)
        c = self._cached(prompt)
        with torch_threads(1):  # a few 50k-element ops: waking a second thread costs more than it saves
            if temperature == 0:  # greedy: all the mass on the top token
                after = probabilities(c.sorted_logits, 0)  # [V], sorted order
                kept = after > 0
            else:
                scaled = transform_logits(c.sorted_logits, temperature, top_k or None, top_p)  # [V], sorted
                kept = torch.isfinite(scaled)  # what top-k / top-p keep (a kept token may still round to 0)
                after = scaled.softmax(-1)
            n = self.top_n
            return View(
                prompt=prompt, temperature=float(temperature), top_k=int(top_k or 0),
                top_p=float(1.0 if top_p is None else top_p), token_ids=c.order[:n].tolist(), labels=c.labels,
                before=c.before[:n].tolist(), after=after[:n].tolist(), kept=kept[:n].tolist(),
                nucleus_size=int(kept.sum()),
                entropy_before_bits=c.entropy_bits, entropy_after_bits=float(entropy_bits(after)),
            )

    def redraw(self, temperature: float = 1.0, top_k: int | None = 0, top_p: float | None = 1.0,
               prompt: str = "factual") -> View:
        """The slider callback: compute and draw the chart (self.svg). Returns the View with redraw_ms set."""
        t0 = time.perf_counter()
        view = self.compute(temperature, top_k, top_p, prompt)
        self.svg = svg_chart(view)
        view.redraw_ms = (time.perf_counter() - t0) * 1e3
        self.last = view
        return view

    def sample_continuations(self, n: int = 3, max_new_tokens: int = 12, temperature: float = 1.0,
                             top_k: int | None = 0, top_p: float | None = 1.0, prompt: str = "factual",
                             seed: int | None = None) -> list[str]:
        """n short continuations of the prompt from the real model with these settings.

        Without a seed, each call takes the next one (0, 1, 2, ...), so pressing the button again gives
        new samples and the seed shown next to them repeats them.
        """
        if seed is None:
            seed, self.seed = self.seed, self.seed + 1
        return sample_continuations(self.model, self.tokenizer, self.prompts[prompt].ids(self.tokenizer), n,
                                    max_new_tokens, temperature=temperature, top_k=top_k or None,
                                    top_p=top_p, seed=seed)

    # -- static views --------------------------------------------------------------------------------------
    def figure(self, temperature: float = 1.0, top_k: int | None = 0, top_p: float | None = 1.0,
               prompt: str = "factual"):
        """The same chart as a matplotlib figure (for a static notebook)."""
        return static_grid(self, [(temperature, top_k, top_p, prompt)], columns=1, width=9.5)

    # -- the widget ----------------------------------------------------------------------------------------
    def widget(self, prompt: str = "factual", temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        """The ipywidgets box: prompt chooser, sliders, chart, summary line, sample button."""
        import ipywidgets as w

        style = {"description_width": "90px"}
        temp = w.FloatSlider(value=temperature, min=0.0, max=2.0, step=0.05, description="temperature",
                             style=style, readout_format=".2f")
        k_slider = w.SelectionSlider(options=TOP_K_CHOICES, value=top_k, description="top-k", style=style)
        p_slider = w.FloatSlider(value=top_p, min=0.05, max=1.0, step=0.05, description="top-p", style=style,
                                 readout_format=".2f")
        chooser = w.Dropdown(options=list(self.prompts), value=prompt, description="prompt", style=style)
        chart = w.Image(format="svg+xml")  # the browser draws the SVG; the kernel only writes it
        status = w.HTML()
        button = w.Button(description="sample 3 continuations", icon="random",
                          layout=w.Layout(width="220px"))
        samples = w.HTML()

        def on_change(_=None):
            view = self.redraw(temp.value, k_slider.value, p_slider.value, chooser.value)
            chart.value = self.svg.encode()
            status.value = (f"<code>{html.escape(view.summary())}</code> &nbsp; "
                            f"<small>redraw {view.redraw_ms:.0f} ms</small>")
            return view

        def on_sample(_=None):
            button.disabled, samples.value = True, "<i>sampling…</i>"
            try:
                seed = self.seed
                texts = self.sample_continuations(3, 12, temp.value, k_slider.value, p_slider.value,
                                                  chooser.value)
                prefix = html.escape(self.prompts[chooser.value].answer_prefix)
                shown = [html.escape(t).replace("\n", "⏎") for t in texts]  # a newline shown as ⏎
                rows = "".join(f"<li>{prefix}<b>{t}</b></li>" for t in shown)
                samples.value = f"<small>seed {seed}</small><ol>{rows}</ol>"
            finally:
                button.disabled = False
            return texts

        def on_prompt(_=None):  # samples of the old prompt would sit under the new prompt's chart
            samples.value = ""

        for control in (temp, k_slider, p_slider, chooser):
            control.observe(on_change, names="value")
        chooser.observe(on_prompt, names="value")
        button.on_click(on_sample)
        on_change()
        box = w.VBox([w.HBox([w.VBox([chooser, temp]), w.VBox([k_slider, p_slider])]), chart, status, button,
                      samples])
        # handles for driving the widget from code (tests, or a learner's cell)
        box.controls = dict(temperature=temp, top_k=k_slider, top_p=p_slider, prompt=chooser)
        box.chart, box.status, box.samples = chart, status, samples
        box.redraw, box.sample = on_change, on_sample
        return box

    def show(self, prompt: str = "factual", temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        """Display the widget; when headless, also the same view as a static figure and a printed summary."""
        from IPython.display import display

        box = self.widget(prompt, temperature, top_k, top_p)
        display(box)
        if headless():
            show_figure(self.figure(temperature, top_k, top_p, prompt))
            print(self.last.summary())
        return box


def svg_chart(view: View, width: int = 780, height: int = 290) -> str:
    """The live bar chart as an SVG string: grey = before, blue = after (kept), red sliver = dropped."""
    left, right, top, bottom = 62, 8, 34, 92  # room for the y-axis title, the legend and rotated labels
    plot_w, plot_h = width - left - right, height - top - bottom
    n = len(view.labels)
    y_max = max(max(view.before), max(view.after), 1e-9) * 1.08  # the tallest bar stays inside the frame
    slot = plot_w / n
    bar = slot * 0.4

    def y(p):
        return top + plot_h * (1 - p / y_max)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<g transform="translate(14,{top + plot_h / 2:.1f}) rotate(-90)"><text text-anchor="middle">'
             'probability</text></g>']
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):  # horizontal grid with probability labels
        p = y_max / 1.08 * frac
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(p):.1f}" y2="{y(p):.1f}" '
                     f'stroke="#e5e5e5"/><text x="{left - 4}" y="{y(p) + 4:.1f}" text-anchor="end">{p:.2f}</text>')
    for i, (label, b, a, kept) in enumerate(zip(view.labels, view.before, view.after, view.kept)):
        x0 = left + i * slot + slot / 2 - bar
        parts.append(f'<rect x="{x0:.1f}" y="{y(b):.1f}" width="{bar:.1f}" height="{y(0) - y(b):.1f}" '
                     f'fill="#bbbbbb"><title>{html.escape(label)} before: {b:.4f}</title></rect>')
        h = a if kept else y_max * 0.015
        parts.append(f'<rect x="{x0 + bar:.1f}" y="{y(h):.1f}" width="{bar:.1f}" height="{y(0) - y(h):.1f}" '
                     f'fill="{"#1f77b4" if kept else "#e06060"}"><title>{html.escape(label)} after: {a:.4f}'
                     f'</title></rect>')
        cx = left + i * slot + slot / 2
        parts.append(f'<text transform="translate({cx:.1f},{y(0) + 10:.1f}) rotate(-55)" text-anchor="end" '
                     f'fill="{"black" if kept else "#b03030"}">{html.escape(label)}</text>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#555"/>')
    legend = [("#bbbbbb", "before (T = 1, no filter)"), ("#1f77b4", "after: kept, renormalised"),
              ("#e06060", "dropped by top-k / top-p")]
    for j, (color, text) in enumerate(legend):
        lx = left + j * 210
        parts.append(f'<rect x="{lx}" y="8" width="12" height="12" fill="{color}"/>'
                     f'<text x="{lx + 16}" y="18">{text}</text>')
    parts.append("</svg>")
    return "".join(parts)


def static_grid(explorer: SamplingExplorer, settings: list[tuple[float, int, float, str]], columns: int = 2,
                width: float = 6.0):
    """One bar chart per (temperature, top_k, top_p, prompt), side by side: a matplotlib Figure.

    Built without pyplot, so nothing is displayed twice: pass it to `show_figure`.
    """
    from matplotlib.figure import Figure

    rows = (len(settings) + columns - 1) // columns
    fig = Figure(figsize=(width * columns, 3.0 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (temperature, top_k, top_p, prompt) in zip(axes.flat, settings):
        view = explorer.compute(temperature, top_k, top_p, prompt)
        x = range(len(view.labels))
        ax.bar([i - 0.2 for i in x], view.before, 0.4, color="#bbbbbb", label="before (T = 1)")
        ax.bar([i + 0.2 for i in x], [p if k else 0 for p, k in zip(view.after, view.kept)], 0.4,
               color="#1f77b4", label="after, kept")
        ax.set_xticks(list(x))
        ax.set_xticklabels(view.labels, rotation=60, ha="right", fontsize=7)
        for label, kept in zip(ax.get_xticklabels(), view.kept):
            label.set_color("black" if kept else "#b03030")
        k = "off" if not top_k else top_k
        ax.set_title(f"{prompt}: T={temperature:g}, top-k={k}, top-p={top_p:g} → nucleus {view.nucleus_size}, "
                     f"H {view.entropy_before_bits:.2f}→{view.entropy_after_bits:.2f} bits", fontsize=8)
        ax.set_ylabel("probability", fontsize=8)
        ax.set_ylim(0, max(max(view.before), max(view.after), 1e-9) * 1.12)  # no bar cut by the frame
        ax.spines[["top", "right"]].set_visible(False)
    axes.flat[0].legend(fontsize=7, frameon=False)
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    fig.tight_layout()
    return fig
