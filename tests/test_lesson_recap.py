"""Lesson recaps: bullets quote the values they are given (and drop a bullet whose numbers are missing),
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


def test_bullets_quote_the_values_and_skip_what_was_not_measured():
    v = {"start_prompt_tokens": 31, "start_n_tokens": 9, "start_stop_reason": "eos",
         "start_ttft_ms": 412.3, "start_itl_ms": 55.5, "start_cold_ttft_ms": 4000.0}
    r = recap_mod.recap("00_start_here", v)
    text = "\n".join(r.bullets)
    assert "31-token prompt" in text and "412 ms" in text and "55.5 ms" in text and "4000 ms" in text
    assert "9.7× the warm figure" in text  # 4000 / 412.3, computed
    assert "ran on" not in text  # start_model / start_device were not given: that bullet is left out
    warm = recap_mod.recap("00_start_here", {**v, "start_cold_ttft_ms": 420.0})
    assert "about the same as warm" in "\n".join(warm.bullets)


def test_a_verdict_follows_the_numbers():
    good = recap_mod.recap("01_prefill_decode", {"heldout_error": 0.08, "ab_A_total_s": 3, "ab_B_total_s": 90})
    bad = recap_mod.recap("01_prefill_decode", {"heldout_error": -0.43, "ab_A_total_s": 9, "ab_B_total_s": 4})
    assert "within 8%" in str(good) and "Request B is the slower" in str(good)
    assert "missed a run it never saw by -43%" in str(bad) and "Request A is the slower" in str(bad)


def test_next_links_skip_the_optional_appendix_and_missing_lessons(tmp_path):
    for name in ("02_kv_cache", "02b_kv_cache_appendix", "04_speculative_prefix"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    assert recap_mod.next_lesson("02_kv_cache", tmp_path)[0] == "04_speculative_prefix.ipynb"
    assert recap_mod.next_lesson("02b_kv_cache_appendix", tmp_path)[0] == "04_speculative_prefix.ipynb"
    assert recap_mod.next_lesson("04_speculative_prefix", tmp_path) is None
    with pytest.raises(ValueError, match="unknown lesson 'nope'"):
        recap_mod.next_lesson("nope")


def test_markdown_links_exist_on_disk():
    for lesson in recap_mod.BULLETS:
        md = recap_mod.recap(lesson, {})._repr_markdown_()
        for target in re.findall(r"\]\(([^)]+)\)", md):
            assert (LESSONS / target).exists(), (lesson, target)


@pytest.mark.parametrize("lesson", MAIN_PATH)
def test_every_lesson_ends_with_a_recap_and_a_link_onward(lesson):
    nb = nbformat.read(LESSONS / f"{lesson}.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert f'recap("{lesson}")' in code, f"{lesson}: no recap cell"
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


def test_a_lesson_can_bring_its_own_bullets():
    r = recap_mod.recap("05_serving", {}, bullets=["B = 8 ran 5.0× the tokens/s of B = 1.", None])
    assert r.bullets == ["B = 8 ran 5.0× the tokens/s of B = 1."]
    with pytest.raises(ValueError, match="pass bullets"):
        recap_mod.recap("05_serving", {})
    with pytest.raises(ValueError, match="unknown lesson 'nope'"):
        recap_mod.recap("nope", {})


def test_the_cold_start_reason_names_the_device_it_ran_on():
    v = {"start_ttft_ms": 40.0, "start_cold_ttft_ms": 900.0}
    gpu = "\n".join(recap_mod.recap("00_start_here", {**v, "start_device": "cuda:0"}).bullets)
    cpu = "\n".join(recap_mod.recap("00_start_here", {**v, "start_device": "cpu"}).bullets)
    assert "GPU's kernels" in gpu and "CPU" not in gpu
    assert "CPU's caches" in cpu and "GPU" not in cpu


def test_the_draft_bullet_names_the_depth_that_ran():
    v = {"shallow_acceptance_rate": 0.3, "shallow_speedup": 0.7}
    four = "\n".join(recap_mod.recap("04_speculative_prefix", {**v, "draft_layers": 4}).bullets)
    assert "shallow 4-layer draft" in four and "8-layer" not in four and "does not pay" in four
    assert "8-layer" not in "\n".join(recap_mod.recap("04_speculative_prefix", v).bullets)


def test_the_ab_bullet_keeps_the_digits_of_a_fast_machine():
    text = str(recap_mod.recap("01_prefill_decode", {"ab_A_total_s": 0.12, "ab_B_total_s": 3.4}))
    assert "3.40 s for B's" in text and "120 ms for A's" in text and " 0 s" not in text


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


def test_a_recap_run_before_the_lesson_says_to_run_the_lesson_first():
    """In a fresh kernel, recap('00_start_here') showed only its generic line, with no word that the lesson's
    cells had not run."""
    from course.lessons.recap import recap

    r = recap("00_start_here", values={})
    assert r.bullets[0].startswith("Nothing was measured in this kernel yet: run the lesson from the top")
    measured = recap("00_start_here", values={"ttft_ms": 123.0})
    assert not measured.bullets[0].startswith("Nothing was measured")


def test_each_recap_links_the_exercises_that_follow_its_lesson():
    """The graded quiz covers lessons 1-3, so lesson 3's recap links it after the sampler and lesson 4's links none."""
    def exercises(lesson):
        return [p.removeprefix("../exercises/") for p in recap_mod.recap(lesson, {}, bullets=[]).exercises]

    assert exercises("03_sampling") == ["03_sampler/sampler.ipynb", "04_checkpoint_quiz/checkpoint_quiz.ipynb"]
    assert exercises("04_speculative_prefix") == []
    assert exercises("02_kv_cache") == ["01_memory_formula/memory_formula.ipynb", "02_kv_cache/kv_cache.ipynb"]


def test_the_nucleus_bullet_puts_the_noun_in_the_number_it_takes():
    def bullet(factual, open_ended):
        (line,) = [b for b in recap_mod._sampling({"sampling_nucleus_p09": {"factual": factual,
                                                                          "open-ended": open_ended}}) if b]
        return line

    assert "kept 1 token after" in bullet(1, 1200) and "1,200 after the open one" in bullet(1, 1200)
    assert "kept 3 tokens after" in bullet(3, 40) and "(s)" not in bullet(3, 40) + bullet(1, 40)
