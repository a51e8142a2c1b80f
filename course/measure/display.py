"""How the course shows things outside a live widget: figures as PNG bytes, and the two switches for runs without one.

    figure_png    a matplotlib Figure as PNG bytes (drawn with Agg, no pyplot, no display needed)
    show_figure   display a Figure as a PNG: the same in JupyterLab, a headless run and a saved notebook
    text_only     KVCOURSE_QUIZ=text: print plain text instead of displaying widgets (terminals, editors)
    headless      no widget front end is expected (tests, KVCOURSE_HEADLESS=1, no kernel): show static views
    working       one line saying what a slow step builds before it starts, and its time when it ends

The two switches differ on purpose: a headless run still displays a quiz widget (its MIME bundle carries a
text/plain fallback that the run keeps), while text_only prints the text and displays nothing.
"""
from __future__ import annotations

import io
import os
import time
from contextlib import contextmanager


def figure_png(fig, dpi: float | None = None) -> bytes:
    """PNG bytes of a matplotlib Figure, at `dpi` (default: the figure's own)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi if dpi is not None else "figure")
    return buf.getvalue()


def show_figure(fig, dpi: int = 90) -> None:
    """Display a matplotlib Figure as a PNG: the same in JupyterLab, in a headless run and in a saved notebook."""
    from IPython.display import Image, display

    display(Image(data=figure_png(fig, dpi)))


def text_only() -> bool:
    """True when KVCOURSE_QUIZ=text: print plain text instead of displaying widgets."""
    return os.environ.get("KVCOURSE_QUIZ", "").strip().lower() == "text"


def headless() -> bool:
    """True when no widget front end is expected: tests (MPLBACKEND=Agg), KVCOURSE_HEADLESS=1, or no kernel."""
    if os.environ.get("KVCOURSE_HEADLESS", "0") not in ("", "0"):
        return True
    if os.environ.get("MPLBACKEND", "").lower() == "agg":
        return True
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return True
    return shell is None or not hasattr(shell, "kernel")


class Printed:
    """A result object that shows as its __str__ when it is a notebook cell's last line (IPython's pretty printer)."""

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


@contextmanager
def working(what: str, expect: str = ""):
    """Say what a slow step is building before it starts, and how long it took when it ends.

    A printed line shows in every front end, even one where a progress-bar widget does not render. `expect`
    is a rough bound for the learner ("under a minute on a 2-core CPU"), never a measured number.
    """
    print(f"{what}{f' ({expect})' if expect else ''} …", flush=True)
    t0 = time.perf_counter()
    yield
    print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)


HEADLINE_WORDS = 30  # a headline a learner reads in one glance


def verdict(predicted: float, measured: float, tolerance: float) -> tuple[bool, str]:
    """(within tolerance?, the words): how far `measured` landed from `predicted`, against ±tolerance."""
    off = measured / predicted - 1
    if abs(off) <= tolerance:
        return True, f"within ±{tolerance:.0%} of the prediction"
    return False, f"{abs(off):.0%} {'above' if off > 0 else 'below'} the prediction, outside ±{tolerance:.0%}"


class Report(Printed):
    """Predicted against measured, ONE headline, and the details folded under "How sure is this?".

    rows: (what, predicted, measured, unit); a None predicted or measured shows as "—" (not measured, or
    unreliable on a busy machine). The headline is the verdict a learner reads; the details are for the
    curious (scatter, probes, caveats), one short sentence each."""

    def __init__(self, rows, headline: str, details=(), title: str = "", key: str = ""):
        if len(headline.split()) > HEADLINE_WORDS:
            raise ValueError(f"a headline has at most {HEADLINE_WORDS} words; this has {len(headline.split())}: "
                             f"{headline!r}")
        self.rows, self.headline, self.details, self.title = list(rows), headline, [d for d in details if d], title
        if key:  # the lesson tests find every timed section's headline under "headlines"
            from course.measure.results import record, recorded

            record("headlines", {**recorded().get("headlines", {}), key: headline})

    @staticmethod
    def _cell(x, unit: str = "") -> str:
        if x is None:
            return "—"
        if isinstance(x, str):
            return x
        text = f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
        return f"{text} {unit}".strip()

    def __str__(self) -> str:
        width = max([len(r[0]) for r in self.rows] + [4])
        lines = [self.title] if self.title else []
        if self.rows:
            lines.append(f"{'':{width}}  {'predicted':>12}  {'measured':>12}")
            lines += [f"{w:{width}}  {self._cell(p, u):>12}  {self._cell(m, u):>12}" for w, p, m, u in self.rows]
        lines.append(self.headline)
        if self.details:
            lines.append("How sure is this?")
            lines += [f"  · {d}" for d in self.details]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from html import escape

        head = f"<b>{escape(self.title)}</b>" if self.title else ""
        table = ""
        if self.rows:
            body = "".join(f"<tr><td style='text-align:left'>{escape(w)}</td><td>{escape(self._cell(p, u))}</td>"
                           f"<td>{escape(self._cell(m, u))}</td></tr>" for w, p, m, u in self.rows)
            table = (f"<table><thead><tr><th></th><th>predicted</th><th>measured</th></tr></thead>"
                     f"<tbody>{body}</tbody></table>")
        details = ""
        if self.details:
            items = "".join(f"<li>{escape(d)}</li>" for d in self.details)
            details = f"<details><summary>How sure is this?</summary><ul>{items}</ul></details>"
        return f"<div class='kvcourse-report'>{head}{table}<p><b>{escape(self.headline)}</b></p>{details}</div>"
