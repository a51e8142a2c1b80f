"""The course-end page: it links every lesson, the review page, the exercises and real sources, runs
headless, and never mentions the source lesson the course grew from."""
import re

import nbformat
import pytest

from course.paths import LESSONS
from learner_text import notebook_text, source_sense_seeds

NOTEBOOK = LESSONS / "99_course_end.ipynb"
WRITTEN_ALONGSIDE = {"05_serving.ipynb", "review.ipynb"}  # other pages of the course, linked here by name


def _links(nb):
    return re.findall(r"\]\(([^)#\s]+)\)", "\n".join(c.source for c in nb.cells if c.cell_type == "markdown"))


def test_links_every_lesson_the_review_page_and_the_exercises():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    links = _links(nb)
    local = [l for l in links if not l.startswith("http")]
    for lesson in ("01_prefill_decode", "02_kv_cache", "03_sampling", "04_speculative_prefix", "05_serving"):
        assert f"{lesson}.ipynb" in local
    assert "review.ipynb" in local
    exercises = sorted(str(p.relative_to(LESSONS.parent)) for p in (LESSONS.parent / "exercises").glob("*/*.ipynb"))
    assert exercises and all(f"../{e}" in local for e in exercises), "every exercise is linked"
    for target in local:
        if target not in WRITTEN_ALONGSIDE or (LESSONS / target).exists():
            assert (LESSONS / target).exists(), target
    assert sum(l.startswith("https://") for l in links) >= 6  # named, linked sources
    assert source_sense_seeds(notebook_text(nb, outputs=False)) == []


@pytest.mark.slow
def test_runs_headless_and_shows_progress(run_notebook, tmp_path):
    run_notebook(NOTEBOOK, timeout=300, env={"KVCOURSE_PROGRESS": str(tmp_path / "p.sqlite")})
    out = nbformat.read(tmp_path / "99_course_end-executed.ipynb", as_version=4)
    text = notebook_text(out)
    assert "Nothing saved yet" in text and "quiz: 0/" in text
