"""Predict, then measure: a number box and a "Lock in" button before a measurement, one scored line after it.

    p = predict("01_prefill_decode", "decode_ms", "ms per decode token, from the bytes and this machine's GB/s")
    ...                     # the measurement runs
    p.check(measured_ms)    # "You predicted 20 ms; measured 25.3 ms: off by 21 %, within ±30 %: well predicted."

This is the Predict-Observe-Explain routine (White and Gunstone, "Probing Understanding", 1992). A prediction is right
when |predicted - measured| <= tolerance * |measured| (course.teach.progress.is_within). Each check is saved to
progress; a missed prediction comes back in review as a "predict again" card (course/teach/review.py).
"""
from __future__ import annotations

import html
import math

from course.measure.display import text_only
from course.teach.progress import ProgressFileError, ProgressStore, default_store, is_within

NOT_SCORED = "Not scored: this figure was unreliable on a busy machine."
NO_PREDICTION = "No prediction locked in: type one in the box above, press Lock in, then run this cell again."


def as_number(value, name: str = "prediction") -> float:
    """A finite float from a number (numpy, a 0-d tensor) or a numeric string; ValueError saying what is wrong."""
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, e.g. 20 or 0.5, got {value!r}")
    return number


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def verdict(predicted: float, measured: float, unit: str, tolerance: float, in_review: bool = False) -> str:
    """One line: predicted against measured, how far off, and the verdict against ±tolerance."""
    off = abs(predicted - measured) / abs(measured) if measured else (0.0 if predicted == measured else math.inf)
    line = (f"You predicted {_fmt(predicted)} {unit}; measured {_fmt(measured)} {unit}: "
            f"{f'off by {off:.0%}'.replace('%', ' %') if math.isfinite(off) else 'off'}, ")
    if is_within(predicted, measured, tolerance):
        return line + f"within ±{tolerance:.0%}".replace("%", " %") + (
            ": well predicted, so it leaves review." if in_review else ": well predicted.")
    return line + f"outside ±{tolerance:.0%}".replace("%", " %") + (
        ": it stays in review." if in_review else ": it comes back in review.")


class Prediction:
    """A prediction to make before a measurement. ``value`` is what was locked in (None until then); setting it
    locks it in, as the button does. ``check(measured)`` scores it."""

    def __init__(self, lesson: str, key: str, prompt: str, unit: str = "ms", tolerance: float = 0.3, *,
                 store: ProgressStore | None = None, on_lock=None):
        for name, text in (("lesson", lesson), ("key", key), ("prompt", prompt)):
            if not (isinstance(text, str) and text.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {text!r}")
        if not (as_number(tolerance, "tolerance") > 0):
            raise ValueError(f"tolerance must be > 0 (0.3 means ±30 %), got {tolerance!r}")
        self.lesson, self.key, self.prompt, self.unit, self.tolerance = lesson, key, prompt, str(unit), float(tolerance)
        self.store, self.on_lock = store, on_lock
        self._value: float | None = None
        self._widget = self._shown = None

    @property
    def value(self) -> float | None:
        return self._value

    @value.setter
    def value(self, value) -> None:
        self._value = as_number(value)
        if self._widget is not None:
            self._box.value, self._box.disabled, self._button.disabled = self._value, True, True
            self._status.value = f"Locked in: {html.escape(_fmt(self._value))} {html.escape(self.unit)}."
        if self.on_lock is not None:
            self.on_lock(self._value)

    def widget(self):
        """The labelled number box, the Lock in button and a status line (ipywidgets), made once."""
        if self._widget is None:
            import ipywidgets as w

            self._box = w.FloatText(value=0.0, layout=w.Layout(width="10em"))
            self._button = w.Button(description="Lock in", button_style="primary", icon="lock")
            self._button.on_click(lambda _b: self._lock_in())
            self._status = w.HTML("")
            label = w.HTML(f"<b>Predict:</b> {html.escape(self.prompt)} <i>(scored within "
                           f"±{self.tolerance:.0%})</i>".replace("%", " %"))
            self._widget = w.VBox([label, w.HBox([self._box, w.Label(self.unit), self._button]), self._status])
            self._widget.add_class("kvcourse-predict")
        return self._widget

    def _lock_in(self) -> None:
        try:
            self.value = self._box.value
        except ValueError as exc:
            self._status.value = html.escape(str(exc))

    def check(self, measured) -> bool | None:
        """Print one line scoring the prediction against `measured` and save it; None (nothing saved) when the
        figure was unreliable (measured=None) or no prediction was locked in."""
        measured = None if measured is None else as_number(measured, "measured")
        if measured is None or self._value is None:
            print(NOT_SCORED if measured is None else NO_PREDICTION)
            return None
        line = verdict(self._value, measured, self.unit, self.tolerance)
        try:
            correct = (self.store or default_store()).record_prediction(
                self.lesson, self.key, self.prompt, self._value, measured, self.tolerance, self.unit)
        except ProgressFileError as exc:
            correct, line = is_within(self._value, measured, self.tolerance), f"{line}\nNot saved: {exc}"
        if self._widget is not None:
            self._status.value = html.escape(line)
        print(line)
        return correct

    def text(self) -> str:
        return (f"Predict: {self.prompt} ({self.unit}; scored within ±{self.tolerance:.0%}). Without widgets, set it "
                "in code: p.value = <your number>, where p is what predict() returned.").replace("%", " %")

    __repr__ = text

    def _ipython_display_(self) -> None:
        if self._shown:  # predict() displayed it; the cell's value would show it a second time
            return
        from IPython.display import display

        self._shown = True
        display({**self.widget()._repr_mimebundle_(), "text/plain": self.text()}, raw=True)


def predict(lesson: str, key: str, prompt: str, unit: str = "ms", tolerance: float = 0.3, *,
            store: ProgressStore | None = None) -> Prediction:
    """Show a number box and a "Lock in" button for a prediction; p.check(measured) scores it after the measurement."""
    p = Prediction(lesson, key, prompt, unit, tolerance, store=store)
    if text_only():
        print(p.text())
        p._shown = True
    else:
        from IPython.display import display

        display(p)
    return p
