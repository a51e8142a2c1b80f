"""The lessons' conceptual diagrams: each draws what its caption says, for any sensible size, and rejects
nonsense with a clear error."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle

from course.lessons import diagrams


def _rects(fig, color=None):
    from matplotlib.colors import to_rgba

    out = [p for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle)]
    return [p for p in out if color is None or p.get_facecolor() == to_rgba(color)]


def _texts(fig):
    return " ".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title])


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("T", [1, 5, 8])
def test_mask_has_a_triangle_for_prefill_and_one_row_for_decode(T):
    fig = diagrams.mask_vs_decode_row(T)
    left, right = fig.axes
    kept = [p for p in left.patches if p.get_facecolor() != (1, 1, 1, 1)]
    assert len(left.patches) == T * T and len(kept) == T * (T + 1) // 2
    assert len(right.patches) == T + 1
    assert f"{T}×{T}" in _texts(fig)


@pytest.mark.parametrize("n_prompt, n_out", [(3, 2), (6, 5)])
def test_timeline_has_one_prefill_and_one_decode_per_later_token(n_prompt, n_out):
    fig = diagrams.prefill_decode_timeline(n_prompt, n_out)
    assert len(_rects(fig, diagrams.PREFILL)) == 1
    assert len(_rects(fig, diagrams.DECODE)) == n_out - 1
    assert f"all {n_prompt} prompt tokens" in _texts(fig)


def test_cache_layout_marks_the_new_position_in_every_layer_and_head():
    fig = diagrams.cache_layout(n_layers=2, n_kv_heads=3, T=4)
    assert len(_rects(fig, diagrams.NEW)) == 2 * 2 * 3  # K and V, per layer, per head
    assert len(_rects(fig, diagrams.CACHE)) == 2 * 2 * 3 * 4
    assert "H_kv=3" in _texts(fig)


@pytest.mark.parametrize("k, accepted, emitted", [(4, 2, 3), (4, 0, 1), (3, 3, 4)])
def test_speculative_round_emits_accepted_plus_one(k, accepted, emitted):
    fig = diagrams.speculative_round(k, accepted)
    text = _texts(fig)
    assert f"{emitted} token(s)" in text
    assert text.count("kept") == accepted
    assert ("bonus" in text) == (accepted == k)


def test_sampling_pipeline_puts_temperature_before_the_filters():
    text = _texts(diagrams.sampling_pipeline())
    assert text.index("temperature") < text.index("top-k / top-p") < text.index("renormalise") < text.index("draw")


@pytest.mark.parametrize("call, message", [
    (lambda: diagrams.mask_vs_decode_row(0), "T must be a positive integer"),
    (lambda: diagrams.speculative_round(4, 5), "accepted must be between 0 and k=4"),
    (lambda: diagrams.cache_layout(n_layers=-1), "n_layers must be a positive integer"),
])
def test_bad_sizes_say_what_to_pass(call, message):
    with pytest.raises(ValueError, match=message):
        call()
