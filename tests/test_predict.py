"""The prediction widget (course/teach/predict.py): lock a number in, score it against the measurement in one line,
save it; nothing scored or saved for an unreliable figure or a missing prediction; a miss comes back in review."""
from __future__ import annotations

import pytest

from course.teach.predict import NO_PREDICTION, NOT_SCORED, Prediction, predict, verdict
from course.teach.review import due_items


@pytest.fixture(autouse=True)
def text_mode(fresh_progress, monkeypatch):
    monkeypatch.setenv("KVCOURSE_QUIZ", "text")  # printed, as a run without widgets shows it


def _line(capsys) -> str:
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and len(out.split()) <= 30, out
    return out


def test_a_prediction_within_tolerance_is_well_predicted_and_saved(store, capsys):
    p = predict("01_prefill_decode", "decode_ms", "ms per decode token", unit="ms", tolerance=0.3, store=store)
    assert "ms per decode token" in capsys.readouterr().out and p.value is None
    p.value = 20
    assert p.check(25.3) is True
    assert _line(capsys) == "You predicted 20 ms; measured 25.3 ms: off by 21 %, within ±30 %: well predicted."
    (row,) = store.rows("predictions")
    assert (row["key"], row["predicted"], row["measured"], row["tolerance"], row["correct"]) == (
        "decode_ms", 20, 25.3, 0.3, True)
    assert due_items(store) == []


def test_a_missed_prediction_comes_back_in_review(store, capsys):
    import numpy as np
    import torch

    p = predict("05_serving", "knee_batch", "the batch where the step stops being flat", unit="requests",
                tolerance=0.25, store=store)
    capsys.readouterr()
    p.value = np.float32(8)
    assert p.check(torch.tensor(16.0)) is False  # a 0-d tensor is a number
    assert _line(capsys).endswith("off by 50 %, outside ±25 %: it comes back in review.")
    (item,) = due_items(store)
    assert (item.kind, item.id, item.prediction["prompt"]) == ("prediction", "05_serving/knee_batch",
                                                               "the batch where the step stops being flat")


@pytest.mark.parametrize("value, measured, says", [(20.0, None, NOT_SCORED), (None, 25.0, NO_PREDICTION)])
def test_nothing_is_scored_or_saved_without_a_figure_or_a_prediction(store, capsys, value, measured, says):
    p = predict("01_prefill_decode", "decode_ms", "ms per decode token", store=store)
    capsys.readouterr()
    if value is not None:
        p.value = value
    assert p.check(measured) is None
    assert _line(capsys) == says and store.rows("predictions") == []


def test_the_tolerance_is_inclusive_and_stated():
    assert "within ±30 %" in verdict(13.0, 10.0, "ms", 0.3)  # |13 - 10| = 0.3 × 10
    assert "outside ±30 %" in verdict(13.01, 10.0, "ms", 0.3)
    in_review = verdict(1_000, 1_050, "tokens/s", 0.1, in_review=True)
    assert "within ±10 %: well predicted, so it leaves review." in in_review
    assert "1,000 tokens/s" in verdict(1_000, 1_050, "tokens/s", 0.1)


@pytest.mark.parametrize("make, match", [
    (lambda: Prediction("01", "k", "p", tolerance=0), "tolerance must be > 0"),
    (lambda: Prediction("01", "", "p"), "key must be a non-empty string"),
    (lambda: setattr(Prediction("01", "k", "p"), "value", "lots"), "prediction must be a finite number"),
    (lambda: setattr(Prediction("01", "k", "p"), "value", float("inf")), "prediction must be a finite number"),
    (lambda: Prediction("01", "k", "p").check("x"), "measured must be a finite number"),
])
def test_bad_values_say_what_is_wrong(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_widget_locks_a_number_in(store, capsys, monkeypatch):
    shown = []
    monkeypatch.setenv("KVCOURSE_QUIZ", "")
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.append((objs, kw)))
    p = predict("02_kv_cache", "kv_mb", "MB of KV cache per token", unit="MB", store=store)
    assert shown == [((p,), {})]  # one display; the widget is made then
    p._ipython_display_()
    p._ipython_display_()  # the cell's value after predict() already showed it: not shown twice
    ((bundle,), kw), = shown[1:]
    assert kw == {"raw": True} and "application/vnd.jupyter.widget-view+json" in bundle
    assert "MB of KV cache per token" in bundle["text/plain"] and "p.value" in bundle["text/plain"]
    w = p.widget()
    assert "kvcourse-predict" in w._dom_classes
    p._box.value = 0.33
    p._button.click()  # what Lock in does
    assert p.value == 0.33 and p._box.disabled and "Locked in: 0.33 MB" in p._status.value
    p.check(0.31)
    assert "well predicted" in p._status.value and store.rows("predictions")[0]["correct"] is True
