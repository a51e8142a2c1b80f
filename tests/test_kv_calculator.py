"""The KV-cache calculator widget, driven through its plain update function and its ipywidgets controls."""
import base64
import itertools

import pytest

from course.measure import costs as M
from course.engine.config import PRESETS
from course.widgets.kv_calculator import DTYPES, calculator_numbers, calculator_view, figure_png, kv_calculator

GiB = 2 ** 30


@pytest.mark.parametrize("preset", sorted(PRESETS) + ["llama-3.1-70b"])  # lesson 02 times it at 32k x 4
def test_callback_over_a_grid_agrees_with_course_memory(preset):
    for T, B, dtype, beam in itertools.product([1, 4096, 131_072], [1, 8], list(DTYPES), [1, 4]):
        n = calculator_numbers(preset, T, B, dtype, beam)
        name = DTYPES[dtype]
        assert n["bytes_per_token"] == M.kv_bytes_per_token(preset, name)
        assert n["cache_bytes"] == M.kv_cache_bytes_for(preset, T, B, name, beam) == n["bytes_per_token"] * T * B * beam
        assert n["weights_bytes"] == M.weights_bytes(preset, "fp16")
        c = n["crossover_T"]  # the first context at which the cache outweighs the weights
        assert n["bytes_per_token"] * B * beam * c >= n["weights_bytes"] > n["bytes_per_token"] * B * beam * (c - 1)


def test_seed_numbers_through_the_calculator():
    assert calculator_numbers("llama-2-7b", 4096, 1)["cache_bytes"] == 2 * GiB
    assert calculator_numbers("llama-2-7b", 4096, 8)["cache_bytes"] == 16 * GiB
    assert calculator_numbers("llama-2-7b", 4096, 1, beam=4)["cache_bytes"] == 8 * GiB
    assert calculator_numbers("gpt2-124m", 1024)["cache_bytes"] == 36 * 2 ** 20
    assert calculator_numbers("llama-2-70b", 32_000, 4)["bytes_per_token"] == 327_680
    assert calculator_numbers("llama-2-7b", 4096, dtype="int8")["cache_bytes"] == GiB
    assert calculator_numbers("llama-2-7b", 4096, dtype="fp32")["cache_bytes"] == 4 * GiB
    assert calculator_numbers("llama-2-7b", 4096, dtype="fp8")["cache_bytes"] == GiB


def test_cache_dtype_moves_the_crossover_when_weights_stay_fp16():
    fp16 = calculator_numbers("llama-2-7b", 4096, dtype="fp16/bf16")["crossover_T"]
    int8 = calculator_numbers("llama-2-7b", 4096, dtype="int8")["crossover_T"]
    assert int8 == pytest.approx(2 * fp16, abs=1)
    same = calculator_numbers("llama-2-7b", 4096, dtype="int8", weights_dtype="int8")["crossover_T"]
    assert same == pytest.approx(fp16, abs=1)  # both halved: the crossing stays put


def test_view_returns_text_and_a_figure_with_the_weights_line():
    view = calculator_view("llama-2-70b", 32_000, 4)
    assert "327,680 B" in view["text"] and "39.06 GiB" in view["text"] and "41.94 GB" in view["text"]
    ax = view["figure"].axes[0]
    weights_gib = M.weights_bytes("llama-2-70b") / GiB
    assert any(list(line.get_ydata()) == [weights_gib, weights_gib] for line in ax.lines)  # horizontal weights
    crossover = view["numbers"]["crossover_T"]
    assert any(list(line.get_xdata()) == [crossover, crossover] for line in ax.lines)  # crossover marked
    assert figure_png(view["figure"]).startswith(b"\x89PNG")


@pytest.mark.parametrize("kwargs,argument", [
    (dict(T=0), "T"), (dict(T=-5), "T"), (dict(T=4096.5), "T"), (dict(B=0), "B"), (dict(B=2.5), "B"),
    (dict(beam=0), "beam"), (dict(beam=-1), "beam"), (dict(dtype="int4"), "dtype"), (dict(dtype=2), "dtype"),
    (dict(weights_dtype="fp64"), "weights_dtype"), (dict(preset="llama-9"), "preset"),
])
def test_bad_input_names_the_argument(kwargs, argument):
    args = dict(preset="llama-2-7b", T=4096, B=1, dtype="fp16/bf16", beam=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{argument} "):
        calculator_view(**args)


def test_kv_heads_that_do_not_divide_heads_are_rejected():
    with pytest.raises(ValueError, match="must divide"):
        calculator_view(PRESETS["llama-2-7b"].with_(n_kv_heads=6))


def test_widget_controls_drive_the_view():
    w = kv_calculator("llama-2-7b", T=4096, B=1)
    assert w.view["numbers"]["cache_bytes"] == 2 * GiB
    first_png = w.image.value
    w.controls["B"].value = 8
    assert w.view["numbers"]["cache_bytes"] == 16 * GiB and w.image.value != first_png
    w.controls["beam"].value = 4
    assert w.view["numbers"]["cache_bytes"] == 64 * GiB
    w.controls["dtype"].value = "int8"
    assert w.view["numbers"]["cache_bytes"] == 32 * GiB
    w.controls["preset"].value = "llama-2-70b"
    assert w.view["numbers"]["bytes_per_token"] == 163_840
    assert "16 GiB" not in w.readout.value and "llama-2-70b" in w.readout.value


def test_widget_has_a_static_fallback():
    bundle = kv_calculator("gpt2-124m", T=1024)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "36.00 MiB" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")


def test_widget_rejects_bad_start_values():
    with pytest.raises(ValueError, match="^T "):
        kv_calculator("llama-2-7b", T=0)


def test_context_slider_is_logarithmic_and_notes_contexts_beyond_the_window():
    from course.widgets.kv_calculator import T_MAX, T_STEPS, calculator_view, kv_calculator

    assert T_STEPS[0] == 128 and T_STEPS[-1] == T_MAX and 4096 in T_STEPS and 32_768 in T_STEPS
    ratios = [b / a for a, b in zip(T_STEPS, T_STEPS[1:])]
    assert max(ratios) <= 2 and min(ratios) >= 1.3  # evenly spread on a log scale
    w = kv_calculator("llama-2-7b", T=4000, B=1)  # a value off the steps is kept, not rounded away
    assert w.controls["T"].value == 4000 and w.controls["T"].description == "context T"
    assert all(c.style.description_width == "initial" for c in w.controls.values())
    assert "beyond llama-2-7b's 4,096-token context window" in calculator_view("llama-2-7b", T=8192)["text"]
    assert "context window" not in calculator_view("llama-2-7b", T=4096)["text"]


def test_every_context_the_slider_offers_is_a_whole_number_the_calculator_accepts():
    """The slider's stops are the values a learner can drag to: each must be an int the calculator takes
    (a float stop such as 24576.0 was refused with 'T must be a whole number')."""
    from course.widgets.kv_calculator import T_STEPS, calculator_numbers

    assert T_STEPS and all(type(t) is int for t in T_STEPS)
    for t in T_STEPS:
        calculator_numbers("llama-2-7b", t, 1, "fp16/bf16", 1)
