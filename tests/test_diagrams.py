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
    assert f"{emitted} token{'' if emitted == 1 else 's'} for one read" in text and "(s)" not in text
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


@pytest.mark.parametrize("n_heads, n_kv_heads", [(9, 3), (8, 2), (4, 4)])
def test_head_sharing_caches_only_the_kv_heads_of_each_variant(n_heads, n_kv_heads):
    fig = diagrams.kv_head_sharing(n_heads, n_kv_heads)
    # one cached box per K/V head: H for MHA, H_kv for GQA, 1 for MQA
    assert len(_rects(fig, diagrams.CACHE)) == n_heads + n_kv_heads + 1
    text = _texts(fig)
    assert f"{n_heads} K/V heads cached" in text and f"{n_kv_heads} K/V head" in text and "1 K/V head cached" in text


def test_head_sharing_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        diagrams.kv_head_sharing(9, 2)


def test_every_lesson_draws_a_diagram():
    """Each numbered lesson shows at least one conceptual picture drawn by code (lesson 05's are its block-pool
    and batch-mask pictures, in course.lessons.serving*)."""
    import nbformat

    from course.paths import LESSONS

    pictures = ("course.lessons.diagrams import", "plot_pool(", "plot_batch_mask(")
    for path in sorted(LESSONS.glob("0*.ipynb")):
        code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        assert any(p in code for p in pictures), f"{path.name} draws no diagram"
