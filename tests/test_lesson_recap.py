"""Lesson recaps: numbers quote the values they are given and never a figure a physics gate flagged,
links point at files that exist, and every lesson notebook ends with a recap and a link onward."""
import re

import nbformat
import pytest

from course.lessons import recap as recap_mod
from course.paths import LESSONS

MAIN_PATH = ["00_start_here", "01_prefill_decode", "02_kv_cache", "03_sampling", "04_speculative_prefix"]


@pytest.fixture(autouse=True)
def no_results_file(monkeypatch):
    monkeypatch.delenv("KVCOURSE_RESULTS", raising=False)


def test_numbers_quote_what_was_recorded_and_never_an_unreliable_figure():
    rows = [("memory bandwidth", "profile.bandwidth_gb_s", "{:.1f} GB/s"), ("batch gain", "gain", "{:.1f}×"),
            ("decode", "decode_ms.-1", "{:.0f} ms"), ("never measured", "nope", "{}")]
    v = {"profile": {"bandwidth_gb_s": 16.94}, "gain": 15.5, "decode_ms": [30.0, 31.4], "unreliable": ["gain"]}
    r = recap_mod.recap("01_prefill_decode", rows, values=v)
    assert r.numbers == {"memory bandwidth": "16.9 GB/s", "decode": "31 ms"}
    assert "15.5" not in str(r) and "15.5" not in r._repr_markdown_()
    empty = recap_mod.recap("00_start_here", rows, values={})
    assert empty.numbers == {} and "run the lesson from the top" in str(empty)
    with pytest.raises(ValueError, match="unknown lesson 'nope'"):
        recap_mod.recap("nope")


def test_next_links_skip_the_optional_appendix_and_missing_lessons(tmp_path):
    for name in ("02_kv_cache", "02b_kv_cache_appendix", "04_speculative_prefix"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    assert recap_mod.next_lesson("02_kv_cache", tmp_path)[0] == "04_speculative_prefix.ipynb"
    assert recap_mod.next_lesson("02b_kv_cache_appendix", tmp_path)[0] == "04_speculative_prefix.ipynb"
    assert recap_mod.next_lesson("04_speculative_prefix", tmp_path) is None
    with pytest.raises(ValueError, match="unknown lesson 'nope'"):
        recap_mod.next_lesson("nope")


def test_markdown_links_exist_on_disk():
    for lesson, _, _ in recap_mod.COURSE:
        md = recap_mod.recap(lesson, values={})._repr_markdown_()
        for target in re.findall(r"\]\(([^)]+)\)", md):
            assert (LESSONS / target).exists(), (lesson, target)


@pytest.mark.parametrize("lesson", MAIN_PATH)
def test_every_lesson_ends_with_a_recap_and_a_link_onward(lesson):
    nb = nbformat.read(LESSONS / f"{lesson}.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert f'recap("{lesson}"' in code, f"{lesson}: no recap cell"
    tail = "\n".join(c.source for c in nb.cells[-6:] if c.cell_type == "markdown")
    links = re.findall(r"\]\(([^)#]+\.ipynb)\)", tail)
    assert links, f"{lesson}: the closing cells link to no notebook"
    for target in links:
        assert (LESSONS / target).exists(), (lesson, target)


def test_readme_states_the_run_time_bound_each_lesson_states():
    from course.paths import PROJECT_ROOT
    from learner_text import stated_run_minutes

    readme = (PROJECT_ROOT / "README.md").read_text()
    rows = dict(re.findall(r"\| `lessons/([0-9a-z_]+)\.ipynb`[^\n]*\| under (\d+(?:\.\d+)?) min \|", readme))
    lessons = sorted(p.stem for p in LESSONS.glob("[0-9]*.ipynb"))
    for stem in lessons:
        nb = nbformat.read(LESSONS / f"{stem}.ipynb", as_version=4)
        if stem in rows:
            assert float(rows[stem]) == stated_run_minutes(nb), stem
    assert {"00_start_here", "01_prefill_decode", "02_kv_cache", "03_sampling", "04_speculative_prefix"} <= set(rows)
    for stem in MAIN_PATH:
        assert stated_run_minutes(nbformat.read(LESSONS / f"{stem}.ipynb", as_version=4)) <= 3


def test_source_paths_the_lessons_cite_exist():
    from course.paths import PROJECT_ROOT

    cited = set()
    for path in sorted(LESSONS.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for target in re.findall(r"`((?:course|tests)/[\w/.]+\.py)`", cell.source):
                cited.add((path.name, target))
    assert cited  # the lessons do point at code
    missing = [(nb, t) for nb, t in cited if not (PROJECT_ROOT / t).exists()]
    assert not missing, missing
    shims = [(nb, t) for nb, t in cited if "real module is" in (PROJECT_ROOT / t).read_text()[:300]]
    assert not shims, f"cite the real module, not a compatibility shim: {shims}"


def test_each_recap_links_the_exercises_that_follow_its_lesson():
    """The graded quiz covers lessons 1-3, so lesson 3's recap links it after the sampler and lesson 4's links none."""
    def exercises(lesson):
        return [p.removeprefix("../exercises/") for p in recap_mod.recap(lesson, values={}).exercises]

    assert exercises("03_sampling") == ["03_sampler/sampler.ipynb", "04_checkpoint_quiz/checkpoint_quiz.ipynb"]
    assert exercises("04_speculative_prefix") == []
    assert exercises("02_kv_cache") == ["01_memory_formula/memory_formula.ipynb", "02_kv_cache/kv_cache.ipynb"]


