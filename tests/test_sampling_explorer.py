"""The sampling explorer's callback over a grid of settings: its numbers equal the reference sampler's on the
model's own logits, its chart shows them, its widget wires sliders and button to them."""
import itertools
import xml.etree.ElementTree as ET

import pytest
import torch

from course.engine.sampling import entropy_bits, kept_mask, nucleus_size, probabilities
from course.widgets.sampling_explorer import (PROMPTS, TOP_K_CHOICES, Prompt, SamplingExplorer, headless,
                                              sample_continuations, static_grid, svg_chart)

GRID = list(itertools.product((0.0, 0.05, 0.3, 0.7, 1.0, 1.5, 2.0), (0, 1, 3, 20, 100, 1000), (0.05, 0.3, 0.9, 1.0)))


class ByteTokenizer:
    """Enough of ChatTokenizer for the 256-token tiny model: one token per byte."""
    eos_id = 2

    def encode(self, text, add_bos=False):
        return list(text.encode())

    def chat_ids(self, user, system=None):
        return self.encode(f"<user>{user}</user><assistant>")

    def decode(self, ids, skip_special=False):
        return bytes(i for i in ids if not (skip_special and i == self.eos_id)).decode(errors="replace")

    def token_text(self, i):
        return chr(i) if 33 <= i < 127 else f"<{i}>"


@pytest.fixture
def explorer(tiny):
    prompts = {"a": Prompt("What is the capital of France?", "The capital of France is"), "b": Prompt("Hi")}
    return SamplingExplorer(tiny, ByteTokenizer(), prompts=prompts, top_n=20)


def test_logits_are_computed_once_per_prompt(explorer, monkeypatch):
    calls = []
    import course.widgets.sampling_explorer as module
    real = module.next_token_logits
    monkeypatch.setattr(module, "next_token_logits", lambda m, ids: calls.append(ids) or real(m, ids))
    for t, k, p in GRID[:30]:
        explorer.redraw(t, k, p, "a")
    explorer.redraw(1.0, 0, 1.0, "b")
    explorer.redraw(0.5, 0, 1.0, "a")
    assert len(calls) == 2


def test_cached_logits_are_the_models(explorer, tiny):
    ids = explorer.prompts["a"].ids(explorer.tokenizer)
    direct = tiny(torch.tensor([ids]), last_only=True)[0]
    torch.testing.assert_close(explorer.logits("a"), direct)


@pytest.mark.parametrize("prompt", ["a", "b"])
def test_callback_over_grid_matches_reference_sampler(explorer, prompt):
    logits = explorer.logits(prompt)
    for t, k, p in GRID:
        view = explorer.redraw(t, k, p, prompt)
        ids = view.token_ids
        assert len(ids) == 20 and len(set(ids)) == 20
        assert view.before == pytest.approx(logits.softmax(-1)[ids].tolist(), abs=1e-6)
        assert view.after == pytest.approx(probabilities(logits, t, k or None, p)[ids].tolist(), abs=1e-6)
        assert view.kept == kept_mask(logits, t, k or None, p)[ids].tolist()
        assert view.nucleus_size == int(nucleus_size(logits, t, k or None, p))
        assert view.entropy_after_bits == pytest.approx(float(entropy_bits(probabilities(logits, t, k or None, p))),
                                                        abs=1e-4)
        assert view.before == sorted(view.before, reverse=True)  # the bars are the 20 most likely, in order
        assert view.redraw_ms >= 0 and explorer.svg.startswith("<svg")


def test_greedy_and_tiny_top_p_keep_one_token(explorer):
    for t, p in [(0.0, 1.0), (1.0, 1e-4)]:
        view = explorer.redraw(t, 0, p, "a")
        assert view.nucleus_size == 1 and view.kept[0] and not any(view.kept[1:])
        assert view.after[0] == pytest.approx(1.0) and view.entropy_after_bits == pytest.approx(0.0, abs=1e-6)


def test_svg_chart_draws_every_bar_and_marks_dropped_tokens(explorer):
    view = explorer.redraw(1.2, 5, 1.0, "a")
    root = ET.fromstring(explorer.svg)  # well-formed XML, even with '<' and '&' in token labels
    ns = "{http://www.w3.org/2000/svg}"
    rects = root.findall(f"{ns}rect")
    assert len(rects) == 2 * 20 + 3  # before + after per token, 3 legend swatches
    after_bars = rects[1:40:2]
    dropped = [r.get("fill") == "#e06060" for r in after_bars]
    assert dropped == [not k for k in view.kept]
    assert sum(view.kept) == 5
    labels = [t.text for t in root.findall(f"{ns}text") if t.get("transform")]
    assert labels == view.labels


def test_svg_escapes_labels():
    from course.widgets.sampling_explorer import View

    view = View("p", 1.0, 0, 1.0, list(range(3)), ["<", "&", '"'], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2],
                [True, True, False], 2, 1.5, 1.0)
    ET.fromstring(svg_chart(view))


def test_bad_settings_and_prompt_raise(explorer):
    with pytest.raises(ValueError, match="temperature"):
        explorer.redraw(-1, 0, 1.0, "a")
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        explorer.redraw(1.0, 0, 0.0, "a")
    with pytest.raises(ValueError, match="prompt must be one of"):
        explorer.redraw(1.0, 0, 1.0, "nope")
    with pytest.raises(ValueError, match="top_n"):
        SamplingExplorer(None, None, top_n=1)


def test_widget_sliders_drive_the_callback(explorer):
    pytest.importorskip("ipywidgets")
    box = explorer.widget(prompt="a", temperature=1.0)
    c = box.controls
    assert (c["temperature"].min, c["temperature"].max) == (0.0, 2.0)
    assert (c["top_p"].min, c["top_p"].max) == (0.05, 1.0)
    assert TOP_K_CHOICES[0] == ("off", 0) and [v for _, v in TOP_K_CHOICES[1:]] == list(range(1, 101))
    assert c["prompt"].options == ("a", "b")
    c["top_k"].value = 3
    assert explorer.last.top_k == 3 and explorer.last.nucleus_size == 3
    c["temperature"].value = 0.0
    assert explorer.last.temperature == 0.0 and explorer.last.nucleus_size == 1
    c["prompt"].value = "b"
    assert explorer.last.prompt == "b"
    assert box.chart.format == "svg+xml" and box.chart.value == explorer.svg.encode()
    ET.fromstring(box.chart.value)
    assert "nucleus: 1 token," in box.status.value and "T=0 " in box.status.value


def test_sample_button_uses_current_settings_and_new_seeds(explorer):
    pytest.importorskip("ipywidgets")
    box = explorer.widget(prompt="a")
    box.controls["temperature"].value = 0.0  # greedy: every row is the argmax path
    first = box.sample()
    assert len(first) == 3 and len(set(first)) == 1
    assert "seed 0" in box.samples.value and "seed 1" not in box.samples.value
    box.controls["temperature"].value = 1.0
    box.sample()
    assert "seed 1" in box.samples.value


def test_switching_prompt_clears_the_old_prompts_samples(explorer):
    pytest.importorskip("ipywidgets")
    box = explorer.widget(prompt="a")
    box.sample()
    assert "<ol>" in box.samples.value
    box.controls["prompt"].value = "b"
    assert box.samples.value == ""
    box.sample()
    assert "<ol>" in box.samples.value


def test_sample_continuations_greedy_matches_generate(tiny):
    from course.engine.generate import generate

    tok = ByteTokenizer()
    ids = tok.chat_ids("Hello")
    texts = sample_continuations(tiny, tok, ids, n=2, max_new_tokens=6, temperature=0.0)
    g = generate(tiny, ids, 6, temperature=0.0, eos_id=tok.eos_id)
    stop = g.tokens.index(tok.eos_id) if tok.eos_id in g.tokens else len(g.tokens)
    assert texts == [tok.decode(g.tokens[:stop], skip_special=True)] * 2
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_continuations(tiny, tok, ids, n=1, max_new_tokens=0)


def test_sample_continuations_seeded(tiny):
    tok = ByteTokenizer()
    ids = tok.chat_ids("Hello")
    a = sample_continuations(tiny, tok, ids, n=3, max_new_tokens=5, temperature=1.0, seed=4)
    b = sample_continuations(tiny, tok, ids, n=3, max_new_tokens=5, temperature=1.0, seed=4)
    assert a == b


def test_static_grid_and_headless(explorer, monkeypatch):
    fig = static_grid(explorer, [(1.0, 0, 1.0, "a"), (0.5, 5, 0.9, "b"), (0.0, 0, 1.0, "a")], columns=2)
    assert len(fig.axes) == 4 and not fig.axes[3].axison
    assert "nucleus 5" in fig.axes[1].get_title()
    monkeypatch.setenv("MPLBACKEND", "Agg")
    assert headless()


@pytest.mark.slow
def test_real_model_grid(real_model, tokenizer):
    """On SmolLM2: the factual prompt is sure of Paris, the open one is flat, and the callback runs everywhere."""
    explorer = SamplingExplorer(real_model, tokenizer)
    fact, story = explorer.compute(prompt="factual"), explorer.compute(prompt="open-ended")
    assert "Paris" in fact.labels[0] and fact.before[0] > 0.5
    assert story.before[0] < 0.3 and story.entropy_before_bits > fact.entropy_before_bits + 2
    for prompt in PROMPTS:
        for t, k, p in GRID[::3]:
            view = explorer.redraw(t, k, p, prompt)
            assert 1 <= view.nucleus_size <= tokenizer.vocab_size
    assert int(nucleus_size(explorer.logits("factual"), top_p=0.9)) < int(nucleus_size(explorer.logits("open-ended"),
                                                                                        top_p=0.9))


def test_svg_chart_has_a_y_axis_title_and_keeps_the_tallest_bar_inside(explorer):
    explorer.redraw(0.3, 0, 1.0, "a")  # a sharp distribution: one bar near the top
    root = ET.fromstring(explorer.svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert "probability" in [t.text for t in root.iter(f"{ns}text")]
    legend_bottom = 8 + 12
    for rect in root.findall(f"{ns}rect")[:-3]:  # the bars, not the legend swatches
        assert float(rect.get("y")) > legend_bottom and float(rect.get("height")) >= 0
