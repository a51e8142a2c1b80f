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


def _recap_cell(nb):
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and 'recap("99_course_end"' in c.source]
    return cell.source


def test_has_a_diagram_and_a_recap_that_quotes_what_the_lessons_saved(tmp_path, monkeypatch):
    """The course-end page once quoted 'B = 8 gave 15.5× the total tokens/s of B = 1', a figure no batch can reach:
    now it quotes only the numbers each lesson's recap showed, and a recap shows only figures that passed their
    physics gates."""
    from course.measure.results import recorded
    from course.teach.progress import ProgressStore

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert any("course.lessons.diagrams import" in c.source for c in nb.cells if c.cell_type == "code")
    monkeypatch.delenv("KVCOURSE_RESULTS", raising=False)
    monkeypatch.setenv("KVCOURSE_PROGRESS", str(tmp_path / "p.sqlite"))
    exec(_recap_cell(nb), {})
    assert recorded()["recap"]["numbers"] == {}  # nothing saved yet

    store = ProgressStore(tmp_path / "p.sqlite")
    store.record_measurements("01_prefill_decode", {"recap": {"numbers": {"decode step, compiled": "24.1 ms/token"}},
                                                    "unreliable": ["bytes_line"]})
    store.record_measurements("03_sampling", {"recap": {"numbers": {}}})
    store.record_measurements("05_serving", {"recap": {"numbers": {"B = 8 over B = 1": "5.0×"}}})
    exec(_recap_cell(nb), {})
    said = recorded()["recap"]["numbers"]
    assert said == {"Lesson 1, decode step, compiled": "24.1 ms/token", "Lesson 5, B = 8 over B = 1": "5.0×"}


def test_cites_the_sources_by_their_real_names_and_figures():
    text = notebook_text(nbformat.read(NOTEBOOK, as_version=4), outputs=False)
    assert "How to Scale Your Model" in text and "Austin et al." in text and "scaling book's" not in text
    assert "A100 40GB" in text and "1.5 TB/s" in text and "~2 TB/s" not in text  # FlashAttention's Figure 1
