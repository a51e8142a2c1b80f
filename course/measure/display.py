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


def _env_on(name: str, on=("1", "true", "yes", "on")) -> bool:
    return os.environ.get(name, "").strip().lower() in on


def text_only() -> bool:
    """True when KVCOURSE_QUIZ=text: print plain text instead of displaying widgets."""
    return _env_on("KVCOURSE_QUIZ", on=("text",))


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
