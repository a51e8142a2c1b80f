"""The KV-cache calculator: pick a model, context, batch, dtype and beam width; see the cache next to the weights.

    calculator_view(preset, T, B, dtype, beam)   the update, as a plain function (tests drive it)
    kv_calculator(...)                           the ipywidgets front end; headless it shows the same
                                                 numbers as text and the plot as a PNG

Every number comes from course.measure.costs, so the widget, the lesson's formula cells and the tests agree.
"""
from __future__ import annotations

import base64

import ipywidgets as widgets
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from course.engine.config import PRESETS, ModelConfig
from course.measure.display import figure_png
from course.measure.costs import (DTYPE_BYTES, LONG_CONTEXT, GiB, _positive_int, dtype_bytes, human_bytes,
                                  kv_bytes_per_token, kv_cache_bytes_for, weights_bytes)

MODELS = {**PRESETS, **LONG_CONTEXT}  # the presets, and the long-context models the lessons quote (Llama-3.1-70B)
DTYPES = {"fp32": "fp32", "fp16/bf16": "fp16", "int8": "int8", "fp8": "fp8"}  # label → course.measure.costs name
T_MAX = 131_072  # the slider's top: 128 Ki tokens
# The context slider is logarithmic: 1, 1.5, 2, 3 × powers of two from 128 to 128 Ki, so 4k and 128k are both
# a short drag away (a linear slider spends nearly all its track above 8k).
T_STEPS = sorted({int(m * 2 ** e) for e in range(7, 18) for m in (1, 1.5)} & set(range(128, T_MAX + 1)))  # whole tokens
B_MAX = 256
BEAM_MAX = 64


def _dtype_name(dtype: str, argument: str) -> str:
    """A selector label ('fp16/bf16') or a course.measure.costs dtype name ('bf16', 'float32') → 'fp32'|'fp16'|'int8'|'fp8'."""
    key = dtype.lower() if isinstance(dtype, str) else None
    if key in DTYPES:
        return DTYPES[key]
    if key in DTYPE_BYTES:
        return {4: "fp32", 2: "fp16"}.get(DTYPE_BYTES[key], key)
    raise ValueError(f"{argument} must be one of {list(DTYPES)}, got {dtype!r}")


def _preset(preset) -> ModelConfig:
    if isinstance(preset, ModelConfig):
        return preset
    if isinstance(preset, str) and preset.lower() in MODELS:
        return MODELS[preset.lower()]
    raise ValueError(f"preset must be one of {sorted(MODELS)}, got {preset!r}")


def calculator_numbers(preset="llama-2-7b", T: int = 4096, B: int = 1, dtype: str = "fp16/bf16", beam: int = 1,
                       weights_dtype: str = "fp16/bf16") -> dict:
    """Every number the calculator shows (bytes unless named otherwise). Raises ValueError on bad input."""
    config = _preset(preset)
    T, B, beam = _positive_int("T", T), _positive_int("B", B), _positive_int("beam", beam)
    cache_dtype, w_dtype = _dtype_name(dtype, "dtype"), _dtype_name(weights_dtype, "weights_dtype")
    per_token = kv_bytes_per_token(config, cache_dtype)
    cache = kv_cache_bytes_for(config, T, B, cache_dtype, beam)
    weights = weights_bytes(config, w_dtype)
    rows = B * beam  # sequences whose caches are held at once
    crossover = -(-weights // (per_token * rows))  # first T at which the cache outweighs the weights
    return dict(preset=config.name, T=T, B=B, beam=beam, dtype=cache_dtype, weights_dtype=w_dtype,
                dtype_bytes=dtype_bytes(cache_dtype), bytes_per_token=per_token, cache_bytes=cache,
                weights_bytes=weights, total_bytes=cache + weights, crossover_T=crossover,
                cache_over_weights=cache / weights, n_layers=config.n_layers, n_kv_heads=config.n_kv_heads,
                head_dim=config.head_dim, max_context=config.max_seq_len)


def calculator_text(n: dict) -> str:
    beams = f" × beam {n['beam']}" if n["beam"] > 1 else ""
    return "\n".join([
        f"{n['preset']}: L={n['n_layers']}, H_kv={n['n_kv_heads']}, D_h={n['head_dim']}, cache in {n['dtype']} "
        f"({n['dtype_bytes']:g} B/value), weights in {n['weights_dtype']}",
        f"bytes per token   2·{n['n_layers']}·{n['n_kv_heads']}·{n['head_dim']}·{n['dtype_bytes']:g} = "
        f"{n['bytes_per_token']:,} B ({human_bytes(n['bytes_per_token'])})",
        f"KV cache          T={n['T']:,} × B={n['B']}{beams} → {n['cache_bytes']:,} B = {human_bytes(n['cache_bytes'])}"
        f" ({human_bytes(n['cache_bytes'], binary=False)})",
        f"weights           {human_bytes(n['weights_bytes'])} ({human_bytes(n['weights_bytes'], binary=False)})",
        f"cache / weights   {n['cache_over_weights']:.2f}×; the cache overtakes the weights at T = "
        f"{n['crossover_T']:,} tokens",
    ] + ([f"note              T = {n['T']:,} is beyond {n['preset']}'s {n['max_context']:,}-token context window: "
          "the formula still gives the bytes, but the model was not trained to attend that far"]
         if n["T"] > n["max_context"] else []))


def draw_calculator(fig: Figure, n: dict) -> Figure:
    """Cache bytes vs context T (a straight line), the weights as a horizontal line, the crossover marked."""
    fig.clear()
    ax = fig.add_subplot(1, 1, 1)
    x_max = max(n["T"] * 1.25, min(n["crossover_T"] * 1.5, 8 * T_MAX), 1024)
    per_T = n["cache_bytes"] / n["T"]  # bytes per token of context for this batch and beam width
    ax.plot([0, x_max], [0, per_T * x_max / GiB], color="tab:blue", label="KV cache")
    ax.axhline(n["weights_bytes"] / GiB, color="tab:gray", ls="--", label=f"weights ({n['weights_dtype']})")
    # The numbers go in the legend, not beside the points: a label next to a point on the line either
    # crosses the line or is clipped by the axes, depending on where the sliders put it.
    top = 1.3 * max(per_T * x_max, n["weights_bytes"]) / GiB  # headroom for the legend
    if n["crossover_T"] <= x_max:
        ax.axvline(n["crossover_T"], color="tab:red", lw=0.8, label=f"cache > weights from T = {n['crossover_T']:,}")
    ax.plot([n["T"]], [n["cache_bytes"] / GiB], "o", color="tab:blue",
            label=f"T = {n['T']:,}: {human_bytes(n['cache_bytes'])}")
    beams = f" × beam {n['beam']}" if n["beam"] > 1 else ""
    ax.set(xlabel="context T (tokens)", ylabel="GiB", xlim=(0, x_max), ylim=(0, top),
           title=f"{n['preset']}, B={n['B']}{beams}, cache in {n['dtype']}")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def calculator_view(preset="llama-2-7b", T: int = 4096, B: int = 1, dtype: str = "fp16/bf16", beam: int = 1,
                    weights_dtype: str = "fp16/bf16", fig: Figure | None = None) -> dict:
    """The widget's update as a plain function: the numbers, the text, and the figure (new or redrawn)."""
    numbers = calculator_numbers(preset, T, B, dtype, beam, weights_dtype)
    fig = draw_calculator(fig or Figure(figsize=(6.4, 3.2), dpi=90), numbers)
    return dict(numbers=numbers, text=calculator_text(numbers), figure=fig)


def kv_calculator(preset: str = "llama-2-7b", T: int = 4096, B: int = 1, dtype: str = "fp16/bf16", beam: int = 1):
    """The interactive calculator (ipywidgets). Display it as a cell's last line."""
    calculator_numbers(preset, T, B, dtype, beam)  # reject bad starting values before building anything
    style = {"description_width": "initial"}  # each label as wide as its text: nothing truncated
    controls = dict(
        preset=widgets.Dropdown(options=sorted(MODELS), value=_preset(preset).name, description="model",
                                style=style),
        T=widgets.SelectionSlider(options=sorted(set(T_STEPS) | {int(T)}), value=int(T), description="context T",
                                  style=style, continuous_update=False, layout={"width": "460px"}),
        B=widgets.IntSlider(value=B, min=1, max=B_MAX, description="batch B", style=style, continuous_update=False,
                            layout={"width": "420px"}),
        dtype=widgets.Dropdown(options=list(DTYPES), value=_label(dtype), description="cache dtype", style=style),
        beam=widgets.BoundedIntText(value=beam, min=1, max=BEAM_MAX, description="beam width", style=style,
                                    layout={"width": "180px"}),
        weights_dtype=widgets.Dropdown(options=list(DTYPES), value="fp16/bf16", description="weights dtype",
                                       style=style),
    )
    return KVCalculator(controls)


def _label(dtype: str) -> str:
    name = _dtype_name(dtype, "dtype")
    return next(label for label, value in DTYPES.items() if value == name)


class KVCalculator(widgets.VBox):
    """Controls, a text read-out and the plot (a PNG, redrawn in place on every change)."""

    def __init__(self, controls: dict):
        self.controls = controls
        self.fig = Figure(figsize=(6.4, 3.2), dpi=90)
        self.readout = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.error = widgets.HTML()
        rows = [widgets.HBox([controls["preset"], controls["dtype"], controls["weights_dtype"]]),
                widgets.HBox([controls["T"], controls["beam"]]), controls["B"]]
        super().__init__(rows + [self.error, self.readout, self.image])
        for control in controls.values():
            control.observe(self._update, names="value")
        self._update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _update(self, change=None):
        try:
            self.view = calculator_view(fig=self.fig, **self.values())
        except ValueError as e:
            self.error.value = f"<span style='color:#b00'>{e}</span>"
            return
        self.error.value = ""
        self.readout.value = f"<pre style='font-size:12px;margin:0'>{self.view['text']}</pre>"
        self.image.value = figure_png(self.view["figure"])

    def _repr_mimebundle_(self, **kwargs):
        """The widget for front ends that render it; its text and PNG for the ones that don't (headless runs)."""
        data = super()._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = self.view["text"]
        data["image/png"] = base64.b64encode(self.image.value).decode("ascii")
        return data
