"""The course as a learner sees it: JupyterLab in headless Chromium, driven by Playwright.

One JupyterLab server and one browser serve the whole module (see conftest.py). Each test saves
screenshots of its steps under test-artifacts/e2e/. Run:  .venv/bin/python -m pytest -m browser tests/e2e
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import time

import pytest

from course.paths import EXERCISES, LESSONS, PROJECT_ROOT

pytestmark = [pytest.mark.browser, pytest.mark.timeout(2400)]

START_HERE = "lessons/00_start_here.ipynb"
LESSON_PATHS = sorted(p.relative_to(PROJECT_ROOT).as_posix() for p in LESSONS.glob("[0-9]*.ipynb")
                      if p.stem != "00_start_here")
EXERCISE_PATHS = sorted(p.relative_to(PROJECT_ROOT).as_posix() for p in EXERCISES.glob("*/*.ipynb")
                        if ".ipynb_checkpoints" not in p.parts)
BYTES = re.compile(r"\d[\d,.]*\s*(?:bytes|[KMGTP]i?B|B)\b")

# A rendered ipywidgets slider (IntSlider, FloatSlider, SelectionSlider …) whose description matches.
SLIDER = ".widget-slider"


def lesson_using(*needles: str) -> str | None:
    """The first lesson whose source mentions one of `needles` (the lessons are written by others)."""
    for path in sorted(LESSONS.glob("[0-9]*.ipynb")):
        text = path.read_text(encoding="utf-8")
        if any(n in text for n in needles):
            return path.relative_to(PROJECT_ROOT).as_posix()
    return None


SAMPLING_NEEDLES = ("sampling_explorer", "SamplingExplorer")
KV_NEEDLES = ("kv_calculator", "KVCalculator", "KvCalculator")


@pytest.fixture(scope="module")
def kept_pages():
    """Lesson pages already run in test_every_lesson_runs_clean, reused by the slider test."""
    pages: dict = {}
    yield pages
    for page in pages.values():
        if not page.is_closed():
            page.close()


def assert_clean(lab, page, state, what: str) -> None:
    errors = lab.errors(state) + lab.dom_errors(page)
    assert not errors, f"{what}: error output after Run All:\n" + "\n".join(errors)
    not_run = lab.not_run(state)
    assert not not_run, f"{what}: cells that never ran (Run All stopped early?): {not_run}"


def watch_output_js(marker: str) -> str:
    """Install a MutationObserver that records every distinct text of the output of the code cell whose
    source contains `marker` (in window.__outputStates), so no intermediate state is missed by polling."""
    return f"""() => {{
      const read = () => {{
        for (const cell of document.querySelectorAll('.jp-Notebook .jp-CodeCell')) {{
          const src = cell.querySelector('.jp-InputArea-editor');
          if (src && src.textContent.includes({marker!r})) {{
            const out = cell.querySelector('.jp-OutputArea');
            return out ? out.innerText : '';
          }}
        }}
        return '';
      }};
      const states = window.__outputStates = [];
      const note = () => {{ const t = read(); if (t && t !== states[states.length - 1]) states.push(t); }};
      new MutationObserver(note).observe(document.querySelector('.jp-Notebook'),
                                         {{subtree: true, childList: true, characterData: true}});
    }}"""


# ----------------------------------------------------------------------------------------------- 1
@pytest.mark.slow
def test_start_here_runs_and_streams_an_answer(lab):
    page = lab.open(START_HERE)
    lab.shot(page, "opened")
    # Watch the answer cell while it runs: a streamed answer shows up in pieces, not all at once.
    answer_cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea-editor", has_text="stream_answer("))
    page.evaluate(watch_output_js("stream_answer("))
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    page.wait_for_function("() => window.__outputStates.length > 0", timeout=900_000, polling=100)
    answer_cell.scroll_into_view_if_needed()
    lab.shot(page, "streaming")
    state = lab.wait_run_finished(page, timeout_s=900)
    seen: list[str] = page.evaluate("() => window.__outputStates")

    answer_cell.scroll_into_view_if_needed()
    lab.shot(page, "answer")
    answer = seen[-1].strip()  # the cell prints the streamed answer and nothing else
    assert "Paris" in answer, f"no 'Paris' in the streamed answer: {answer!r}"
    partial = [t for t in seen if t.strip() and answer.startswith(t.strip()) and len(t.strip()) < len(answer)]
    assert partial, (f"the answer appeared all at once, not streamed token by token (saw {len(seen)} states: "
                     f"{[t[:40] for t in seen]})")
    print(f"streamed answer seen in {len(partial) + 1} steps: {[t.strip()[-12:] for t in partial]}")
    assert_clean(lab, page, state, START_HERE)
    texts = " ".join(lab.output_texts(state))
    assert "first token, warm" in texts and "first token, 600-token prompt" in texts, "the TTFT reports are missing"
    assert page.locator(".jp-OutputArea-output img").count() >= 1, "the per-token timing plot is missing"
    assert page.locator(".kvcourse-quiz").count() == 1, "the checkpoint quiz widget did not render"
    page.locator(".kvcourse-quiz").scroll_into_view_if_needed()
    lab.shot(page, "checkpoint")


# ----------------------------------------------------------------------------------------------- 2
LANES = 2  # lessons running at once, each a kernel of one torch thread (as two lessons open in two tabs)


@pytest.fixture(scope="module")
def started_lessons(jupyter_server):
    """Lessons whose Run All an earlier test started in another tab, ahead of their own test: while one lesson
    runs, the next ones run beside it, so both cores stay busy (one lesson at a time left one idle)."""
    pages: dict = {}
    yield pages
    for path, page in pages.items():
        if not page.is_closed():
            page.close()
            jupyter_server.shutdown_sessions(path)


RUN_ALL_AT: dict[str, float] = {}  # lesson path -> when its Run All was clicked (time.time())
DONE_AT: dict[str, float] = {}  # lesson path -> when its run was first seen finished


def _click_run_all(page, path: str | None = None) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    if path:
        RUN_ALL_AT[path] = time.time()


def keep_lanes_full(lab, started_lessons, under_test: int = 1) -> None:
    """Start the next lessons (in order) until LANES of them run, `under_test` (the lesson a test waits on) included.
    The browser tests that time nothing (quiz, Validate, review, the self-paced lab) run first, lessons beside them."""
    for path, page in started_lessons.items():
        if path not in DONE_AT and time.time() - RUN_ALL_AT[path] > 5 and not lab.busy(lab.state(page)):
            DONE_AT[path] = time.time()
    running = under_test + sum(1 for path in started_lessons if path not in DONE_AT)
    for path in [p for p in LESSON_PATHS if p not in RUN_ALL_AT][:max(0, LANES - running)]:
        page = lab.open(path)
        _click_run_all(page, path)
        started_lessons[path] = lab.keep(page)


# What the run record()ed (course.measure.results), read from the kernel without running a cell, and the
# notebook with its outputs as JupyterLab holds it: the lesson tests check these instead of running it again.
JS_RUN_RECORD = """async () => {
  const w = window.jupyterapp.shell.currentWidget;
  const future = w.sessionContext.session.kernel.requestExecute({code: '', silent: true, store_history: false,
      user_expressions: {r: "__import__('json').dumps(__import__('course.measure.results', "
                            + "fromlist=['recorded']).recorded())"}});
  const reply = await future.done;
  const r = reply.content.user_expressions && reply.content.user_expressions.r;
  return {recorded: r && r.status === 'ok' ? r.data['text/plain'] : null, notebook: w.context.model.toJSON()};
}"""


def keep_run_for_lesson_tests(page, path: str, base) -> None:
    from learner_text import cell_times
    from notebook_runner import keep_browser_run

    kept = page.evaluate(JS_RUN_RECORD)
    assert kept["recorded"] is not None, f"{path}: the kernel did not hand over what the run recorded"
    results = json.loads(ast.literal_eval(kept["recorded"]))
    # until its last cell replied (recordTiming), not until this test looked: a lesson started ahead may have
    # finished while the one before it still ran
    replies = [replied for _, replied, _ in cell_times(kept["notebook"]["cells"])]
    end = max(replies).timestamp() if replies else time.time()
    beside = [other for other, start in RUN_ALL_AT.items()  # the lessons whose run overlapped this one
              if other != path and start < end and DONE_AT.get(other, end) > RUN_ALL_AT[path]]
    where = "JupyterLab, one torch thread" + (f", beside {' and '.join(beside)}" if beside else "")
    keep_browser_run(base, path, results, kept["notebook"], end - RUN_ALL_AT[path], where)


@pytest.mark.slow
@pytest.mark.parametrize("path", LESSON_PATHS or [pytest.param(None, marks=pytest.mark.skip("no lessons yet"))])
def test_every_lesson_runs_clean(lab, kept_pages, started_lessons, tmp_path_factory, path):
    page = started_lessons.pop(path, None)
    if page is None:
        page = lab.open(path)
        lab.shot(page, "opened")
        _click_run_all(page, path)
    else:
        lab.adopt(page)
    state = lab.wait_run_finished(page, timeout_s=1500, meanwhile=lambda: keep_lanes_full(lab, started_lessons))
    DONE_AT.setdefault(path, time.time())
    lab.shot(page, "finished")
    page.locator(".jp-Notebook .jp-Cell").last.scroll_into_view_if_needed()
    lab.shot(page, "end")
    assert_clean(lab, page, state, path)
    keep_run_for_lesson_tests(page, path, tmp_path_factory.getbasetemp())
    source = (PROJECT_ROOT / path).read_text(encoding="utf-8")
    if any(n in source for n in SAMPLING_NEEDLES + KV_NEEDLES):
        kept_pages[path] = lab.keep(page)  # the slider test uses its live widgets


# ----------------------------------------------------------------------------------------------- 3
def find_slider(page, label: re.Pattern):
    sliders = page.locator(SLIDER).filter(has=page.locator(".widget-label", has_text=label))
    sliders.first.wait_for(state="visible", timeout=60_000)
    return sliders.first


def drag_slider(page, slider, fraction: float) -> None:
    """Drag the slider's handle by `fraction` of the track's width, as a learner does with the mouse."""
    handle = slider.locator(".noUi-handle").first
    track = slider.locator(".noUi-base, .noUi-target").first
    handle.scroll_into_view_if_needed()
    hb, tb = handle.bounding_box(), track.bounding_box()
    x0, y0 = hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2
    x1 = min(max(x0 + fraction * tb["width"], tb["x"] + 1), tb["x"] + tb["width"] - 1)
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move((x0 + x1) / 2, y0, steps=5)
    page.mouse.move(x1, y0, steps=5)
    page.mouse.up()


def lesson_page(lab, kept_pages, needles, what, slider_label):
    """The lesson page with the widget live: the page test_every_lesson_runs_clean left open, or a fresh
    Run All stopped (Kernel > Interrupt) once the widget is up, so its later cells need not run."""
    path = lesson_using(*needles)
    if path is None:
        pytest.skip(f"no lesson uses the {what} yet ({' / '.join(needles)} not found in lessons/*.ipynb)")
    page = kept_pages.pop(path, None)
    if page is not None and not page.is_closed():
        lab.adopt(page)
        page.bring_to_front()
        return path, page
    page = lab.open(path)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    widget_cell = page.locator(".jp-CodeCell").filter(
        has=page.locator(SLIDER).filter(has=page.locator(".widget-label", has_text=slider_label)))
    widget_cell.first.wait_for(state="attached", timeout=1_200_000)
    page.wait_for_function("el => !el.querySelector('.jp-InputPrompt').textContent.includes('*')",
                           arg=widget_cell.first.element_handle(), timeout=600_000)
    for _ in range(3):  # stop the cells after the widget: its callbacks would queue behind them
        if (lab.state(page) or {}).get("kernel") == "idle":
            break
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Interrupt Kernel$")).click()
        page.wait_for_timeout(5000)
    lab.wait_run_finished(page, timeout_s=1500)
    return path, page


@pytest.mark.slow
def test_sampling_temperature_slider_redraws_the_chart(lab, kept_pages):
    label = re.compile(r"^\s*temperature\s*$", re.I)
    path, page = lesson_page(lab, kept_pages, SAMPLING_NEEDLES, "sampling explorer", label)
    slider = find_slider(page, label)
    box = page.locator(".widget-vbox").filter(has=slider).filter(has=page.locator(".widget-image")).last
    image = box.locator("img.widget-image, .widget-image").first
    image.scroll_into_view_if_needed()
    readout = slider.locator(".widget-readout")
    before_value, before_src = readout.inner_text(), image.get_attribute("src")
    before_png = lab.shot(image, "chart-before").read_bytes()
    lab.shot(page, "explorer-before")

    drag_slider(page, slider, -0.3 if float(before_value) > 1.0 else 0.3)
    page.wait_for_function("([el, old]) => el.getAttribute('src') !== old",
                           arg=[image.element_handle(), before_src], timeout=60_000)
    lab.wait_kernel_idle(page)
    page.wait_for_timeout(500)  # the last redraw of the drag has landed
    after_value = readout.inner_text()
    after_png = lab.shot(image, "chart-after").read_bytes()
    lab.shot(page, "explorer-after")
    assert after_value != before_value, f"the temperature readout did not move ({before_value})"
    assert after_png != before_png, "the bar chart looks the same after moving the temperature slider"
    summary = box.inner_text()
    assert f"T={float(after_value):g}" in summary, f"the summary does not show T={after_value}: {summary[:300]!r}"


@pytest.mark.slow
def test_kv_calculator_context_slider_changes_the_bytes(lab, kept_pages):
    label = re.compile(r"context|seq", re.I)
    path, page = lesson_page(lab, kept_pages, KV_NEEDLES, "KV-cache calculator", label)
    slider = find_slider(page, label)
    area = page.locator(".jp-OutputArea").filter(has=slider).first
    slider.scroll_into_view_if_needed()
    readout = slider.locator(".widget-readout")
    before_value = readout.inner_text()
    before = BYTES.findall(area.inner_text())
    assert before, f"no byte figure next to the context slider: {area.inner_text()[:300]!r}"
    lab.shot(area, "calculator-before")

    old_text = area.inner_text()
    for attempt in range(3):  # a drag that lands while the page re-lays out moves nothing: drag again
        hb, tb = slider.locator(".noUi-handle").first.bounding_box(), slider.locator(".noUi-base, .noUi-target").first.bounding_box()
        toward_right = hb["x"] + hb["width"] / 2 < tb["x"] + tb["width"] / 2
        drag_slider(page, slider, 0.25 if toward_right else -0.25)
        try:
            page.wait_for_function("([el, old]) => el.innerText !== old", arg=[area.element_handle(), old_text],
                                   timeout=20_000 if attempt < 2 else 60_000)
            break
        except Exception:
            if attempt == 2:
                raise
    lab.wait_kernel_idle(page)
    page.wait_for_timeout(500)
    after = BYTES.findall(area.inner_text())
    lab.shot(area, "calculator-after")
    after_value = readout.inner_text()
    assert after_value != before_value, "the context readout did not move"
    assert after and after != before, f"the byte figures did not change: {before} → {after}"
    # The cache's byte count is proportional to T: some figure must scale by exactly T_after / T_before.
    t0, t1 = (int(re.sub(r"\D", "", v)) for v in (before_value, after_value))
    counts = lambda figs: {int(re.sub(r"\D", "", f)) for f in figs if re.fullmatch(r"[\d,]+\s*(?:bytes|B)", f)}
    scaled = [b for b in counts(before) if any(abs(a - b * t1 / t0) <= 0.005 * a for a in counts(after))]
    assert scaled, f"no byte count scaled with the context {t0} → {t1}: {sorted(counts(before))} → {sorted(counts(after))}"


# ----------------------------------------------------------------------------------------------- 4
def test_checkpoint_quiz_answers_and_explains(lab, started_lessons):
    keep_lanes_full(lab, started_lessons, under_test=0)
    from course.teach.quiz import load_questions

    question = load_questions().for_lesson("00_start_here")[0]
    wrong = next(o for o in question.options if o.key != question.answer)
    page = lab.open(START_HERE)
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea-editor",
                                                         has_text='checkpoint("00_start_here")'))
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")  # run just this cell, as a learner coming back to the quiz would
    quiz = cell.locator(".kvcourse-quiz")
    quiz.wait_for(state="visible", timeout=120_000)
    first = quiz.locator(".kvcourse-quiz-question").first
    first.scroll_into_view_if_needed()
    lab.shot(page, "quiz")

    def pick_and_check(option):
        # the picker is letter buttons (or radio labels "A. …"): click the one for this option
        first.locator(".kvcourse-quiz-options button, .kvcourse-quiz-options label").filter(
            has_text=re.compile(rf"^\s*{option.key}(\.|\s*$)")).first.click()
        first.locator(".kvcourse-quiz-check").click()
        feedback = first.locator(".kvcourse-quiz-feedback")
        feedback.locator("b").first.wait_for(state="visible", timeout=60_000)
        return feedback

    feedback = pick_and_check(wrong)
    assert "Wrong" in feedback.inner_text() and "Try another option" in feedback.inner_text()
    lab.shot(first, "quiz-wrong")

    feedback = pick_and_check(question.correct)
    page.wait_for_function("el => el.innerText.includes('Right')", arg=feedback.element_handle(), timeout=60_000)
    text = " ".join(feedback.inner_text().split())
    lab.shot(first, "quiz-right")
    expected = " ".join(question.correct.explanation.split())
    if "{" not in expected and "[[" not in expected:  # no measured numbers: the explanation is fixed text
        assert expected[:60] in text, f"the explanation is not shown: {text[:300]!r}"
    assert "Why not the others" in text
    score = quiz.locator(".kvcourse-quiz-score")
    assert re.search(r"\b1 of \d+\b", score.inner_text()), score.inner_text()


# ----------------------------------------------------------------------------------------------- 5
@pytest.mark.parametrize("path", EXERCISE_PATHS or [pytest.param(None, marks=pytest.mark.skip("no exercises yet"))])
def test_validate_shows_failing_tests_for_a_blank_exercise(lab, started_lessons, path):
    keep_lanes_full(lab, started_lessons, under_test=0)
    # Validate saves the notebook first, so the learner's view is reproduced on a scratch copy of the
    # exercise folder (gitignored), never on the committed blank exercise.
    src = PROJECT_ROOT / path
    work = lab.scratch_copy(src.parent)
    page = lab.open((work / src.name).relative_to(PROJECT_ROOT).as_posix())
    button = page.locator(".jp-NotebookPanel-toolbar jp-button, .jp-NotebookPanel-toolbar button").filter(
        has_text=re.compile(r"^\s*Validate\s*$"))
    button.first.wait_for(state="visible", timeout=60_000)
    lab.shot(page, "exercise")
    button.first.click()
    dialog = page.locator(".jp-Dialog").filter(has_text="Validation Results")
    dialog.wait_for(state="visible", timeout=300_000)  # nbgrader runs the whole notebook in a fresh kernel
    lab.shot(page, "validate-dialog")
    message = dialog.locator("#validation-message")
    assert "validation-failed" in (message.get_attribute("class") or ""), message.inner_text()[:500]
    text = message.inner_text()
    assert "The following cell failed" in text
    # one summary line: nothing passes yet, and the first failing test is named with its hint
    assert re.search(r"\b0 of \d+ visible tests pass; first failing: test_\w+ — \S", text), text[-500:]
    dialog.locator("button", has_text="Ok").first.click()
    dialog.wait_for(state="hidden")
    shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- review
def test_review_answers_one_due_card(lab, started_lessons):
    keep_lanes_full(lab, started_lessons, under_test=0)
    from course.teach.progress import ProgressStore
    from course.teach.questions import load_questions

    card = load_questions().cards_for("00_start_here")[0]
    store = ProgressStore(lab.server.state / "progress.sqlite")  # the test server's learner
    for _ in range(4):  # missed again and again: it leads the session, whatever other tests answered
        store.record_card_rating(card.lesson, card.id, False)
    before = len(store.rows("reviews"))
    page = lab.open("lessons/review.ipynb")
    assert_clean(lab, page, lab.run_all(page, timeout_s=300), "lessons/review.ipynb")
    table = page.locator(".kvcourse-review-progress")
    assert table.count() == 1 and card.lesson in table.inner_text(), "the progress table did not render"
    lab.shot(table, "review-progress")
    widget = page.locator(".kvcourse-review")
    widget.wait_for(state="visible", timeout=120_000)
    widget.scroll_into_view_if_needed()
    status = widget.locator(".kvcourse-review-status")
    assert card.id in status.inner_text(), status.inner_text()
    lab.shot(widget, "review-card")
    widget.locator(".kvcourse-quiz-flip").click()
    widget.locator(".kvcourse-quiz-card-answer").wait_for(state="visible", timeout=60_000)
    widget.locator(".kvcourse-review-knew").click()
    page.wait_for_function("([el, id]) => !el.innerText.includes(id)", arg=[status.element_handle(), card.id],
                           timeout=60_000)
    lab.shot(widget, "review-next")
    answers = store.rows("reviews")  # answers given in review
    assert len(answers) == before + 1 and (answers[-1]["item"], answers[-1]["correct"]) == (card.id, True)


# ------------------------------------------------------------------------------ self-paced `kvcourse lab`
def reopened_widget_says_how_to_return(page, artifacts) -> None:
    """A widget saved in a notebook and reopened after its kernel stopped says in one line how to bring it back
    (not "Error displaying widget: model not found"), and running its cell brings it back."""
    import nbformat

    from course.cli.jupyter_contents import WIDGET_NOTE

    scratch = LESSONS / "_reopen_check.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        'from course.teach.quiz import checkpoint\ncheckpoint("00_start_here")')])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, scratch)
    run = "() => window.jupyterapp.commands.execute('notebook:run-all-cells')"
    try:
        page.evaluate("(p) => window.jupyterapp.commands.execute('docmanager:open', {path: p})",
                      scratch.relative_to(PROJECT_ROOT).as_posix())
        page.wait_for_function("() => { const w = window.jupyterapp.shell.currentWidget; const s = w && w.sessionContext;"
                               " return w && w.context && w.context.path.endsWith('_reopen_check.ipynb') && s &&"
                               " s.session && s.session.kernel && s.session.kernel.status === 'idle'; }",
                               timeout=240_000, polling=500)
        page.evaluate(run)
        quiz = page.locator(".jp-NotebookPanel:visible .kvcourse-quiz-question")
        quiz.first.wait_for(state="visible", timeout=180_000)
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=60_000)
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:reload')")  # the file as saved
        note = page.locator(".jp-NotebookPanel:visible .jp-OutputArea", has_text=WIDGET_NOTE)
        note.first.wait_for(state="visible", timeout=120_000)
        page.screenshot(path=str(artifacts / "reopened_widget.png"))
        text = page.locator(".jp-NotebookPanel:visible").inner_text()
        assert "model not found" not in text, "a reopened widget shows an error instead of how to bring it back"
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.changeKernel({name: 'python3'})")
        page.wait_for_function("() => { const s = window.jupyterapp.shell.currentWidget.sessionContext;"
                               " return s.session && s.session.kernel && s.session.kernel.status === 'idle'; }",
                               timeout=240_000, polling=500)
        page.evaluate(run)
        quiz.first.wait_for(state="visible", timeout=180_000)  # run again: the widget is back
    finally:
        scratch.unlink(missing_ok=True)
        (LESSONS / ".ipynb_checkpoints" / "_reopen_check-checkpoint.ipynb").unlink(missing_ok=True)

@pytest.mark.slow
def test_self_paced_lab_has_no_news_popup_no_instructor_tools_and_opens_clean(browser_context, tmp_path, lab,
                                                                              started_lessons):
    """`kvcourse lab` as `make start` runs it (its own settings, not the suite's server): no news pop-up, no nbgrader
    instructor menus or exchange errors, Validate kept, the start notebook unmodified after its kernel started,
    and the file browser at the course folder. A SIGTERM then stops the server."""
    keep_lanes_full(lab, started_lessons, under_test=0)
    import os
    import secrets
    import signal
    import socket
    import subprocess
    import sys
    import time

    from course.cli.lab import SELF_PACED_DISABLED_PLUGINS, START_NOTEBOOK

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    env = dict(os.environ, KVCOURSE_STATE=str(tmp_path / "state"), KVCOURSE_PROGRESS=str(tmp_path / "p.sqlite"),
               OMP_NUM_THREADS="1", KVCOURSE_THREADS="1")
    for var in ("MPLBACKEND", "KVCOURSE_HEADLESS", "KVCOURSE_RESULTS", "JUPYTER_TOKEN"):
        env.pop(var, None)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "course.cli", "lab", "--no-browser", "--port", str(port), "--",
                             f"--IdentityProvider.token={token}", "--ServerApp.ip=127.0.0.1",
                             "--LabApp.expose_app_in_browser=True"],
                            cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    import urllib.request

    deadline = time.monotonic() + 240
    while True:  # JupyterLab takes a while to come up on a busy machine
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                log.close()
                pytest.fail("`kvcourse lab` did not come up:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(1)
    page = browser_context.new_page()
    try:
        page.goto(f"http://127.0.0.1:{port}/lab?token={token}", wait_until="domcontentloaded", timeout=240_000)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started", timeout=240_000)
        page.locator(".jp-NotebookPanel .jp-Notebook").first.wait_for(state="visible", timeout=180_000)
        state_js = """() => { const w = window.jupyterapp.shell.currentWidget;
            const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
            return w && w.context ? {path: w.context.path, dirty: w.context.model.dirty,
                                     kernel: k ? k.status : 'none'} : null; }"""
        page.wait_for_function(f"() => {{ const s = ({state_js})(); return s && s.kernel === 'idle'; }}",
                               timeout=240_000, polling=500)
        page.wait_for_timeout(5000)  # the news question used to appear a moment after start-up
        state = page.evaluate(state_js)
        assert state["path"] == START_NOTEBOOK
        assert state["dirty"] is False, "the start notebook shows unsaved changes right after it opened"
        plugins = page.evaluate("(ids) => ids.map(id => window.jupyterapp.hasPlugin(id))",
                                list(SELF_PACED_DISABLED_PLUGINS) + ["@jupyter/nbgrader:validate-assignment"])
        assert not any(plugins[:-1]), dict(zip(SELF_PACED_DISABLED_PLUGINS, plugins))
        assert plugins[-1], "nbgrader's Validate (the self-paced way to check an exercise) should stay"
        text = page.locator("body").inner_text()
        for absent in ("official Jupyter news", "Error fetching courses", "exchange directory does not exist",
                       "Formgrader", "Course List", "Assignment List", "Create Assignment"):
            assert absent not in text, f"{absent!r} is shown in self-paced mode"
        menus = page.locator(".lm-MenuBar-itemLabel").all_inner_texts()
        assert "Nbgrader" not in menus, menus
        ARTIFACTS = PROJECT_ROOT / "test-artifacts" / "e2e"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "self_paced_lab.png"))
        listing = page.locator(".jp-DirListing-itemName").all_inner_texts()
        assert "exercises" in listing and "lessons" in listing, f"file browser is not at the course folder: {listing}"
        hidden = {"solutions", "autograde", "course", "tests"} & set(listing)
        assert not hidden, f"the learner's file browser shows the instructor's material: {hidden}"
        reopened_widget_says_how_to_return(page, ARTIFACTS)
    finally:
        page.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail("`kvcourse lab` did not stop on SIGTERM:\n" + (tmp_path / "lab.log").read_text()[-3000:])
        finally:
            log.close()
    with socket.socket() as s:  # nothing serves the port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
