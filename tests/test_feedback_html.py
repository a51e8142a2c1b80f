"""The feedback HTML carries nothing of a student's markup that runs in a browser (the instructor opens these
files too), while headings, lists, tables and code still render (course/grade/feedback_html.py)."""
import re
import shutil

import nbformat
import pytest

from course.grade.feedback_html import clean_html, sanitized_markdown
from course.paths import PROJECT_ROOT

HOSTILE = ('## My notes\n\n* a list\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n'
           'hello <script>alert("x1")</script><img src=x onerror="alert(\'x2\')"> [go](javascript:alert(3))')


def test_markdown_keeps_its_structure_and_loses_its_scripts():
    html = sanitized_markdown(HOSTILE + "\n\n```python\nif a < b: pass\n```\n\nmath $x^2$")
    for kept in ("<h2", "<li>a list</li>", "<table>", "<td>1</td>", '<div class="highlight">', "$x^2$"):
        assert kept in html, kept
    for gone in ("<script", "onerror", "javascript:"):
        assert gone not in html, gone
    assert "&lt;script&gt;" in html, "the student's text is shown, escaped, not silently dropped"


def test_outputs_are_cleaned_too():
    html = clean_html('<b>ok</b><iframe src="https://example.org"></iframe><a href="javascript:x()">l</a>'
                      '<p onclick="x()" style="color:red">p</p>')
    assert "<b>ok</b>" in html and "<iframe" not in html and "javascript:" not in html
    assert "onclick" not in html and "style" not in html and "<p>p</p>" in html


@pytest.mark.slow
def test_a_graded_notebooks_feedback_runs_no_student_script(tmp_path):
    from course.grade import grader

    if __import__("course.grade.sandbox", fromlist=["x"]).sandbox_problem():
        pytest.skip("the sealed grader needs bubblewrap: sh scripts/ensure_bwrap.sh")
    src = PROJECT_ROOT / "autograde" / "samples" / "reference" / "01_memory_formula" / "memory_formula.ipynb"
    nb = nbformat.read(str(src), as_version=4)
    md = nbformat.v4.new_markdown_cell(HOSTILE)
    code = nbformat.v4.new_code_cell("from IPython.display import HTML, display\n"
                                     "display(HTML('<b>shown</b><img src=x onerror=\"alert(4)\"><script>alert(5)</script>'))")
    md["id"], code["id"] = "added-md", "added-code"
    nb.cells[1:1] = [md, code]
    folder = tmp_path / "subs" / "xss" / "01_memory_formula"
    folder.mkdir(parents=True)
    nbformat.write(nb, str(folder / "memory_formula.ipynb"))
    (row,) = grader.grade(tmp_path / "subs", tmp_path / "course", jobs=1, progress=False, log=lambda *_: None)
    assert row.status == "graded" and row.score == row.max_score
    (page,) = (tmp_path / "course" / "feedback").rglob("*.html")
    html = page.read_text()
    assert not re.search(r"<script[^>]*>\s*alert", html), "a student's script tag survived"
    assert not re.search(r"<[a-z][^>]*\son[a-z]+\s*=", html, re.I), "an event handler attribute survived"
    assert 'href="javascript:' not in html
    assert '<h2 id="My-notes">' in html and "<td>1</td>" in html  # (outputs: the grader shows only its verdicts)
    shutil.rmtree(tmp_path / "course", ignore_errors=True)


def test_feedback_templates_are_compiled_once_per_process(monkeypatch):
    """nbconvert builds a new Jinja environment for every feedback page; the templates are compiled once."""
    import jinja2
    from nbconvert import HTMLExporter

    from course.grade.nbgrader_api import templates_compiled_once

    templates_compiled_once()
    compiled, compile_ = [], jinja2.Environment.compile
    monkeypatch.setattr(jinja2.Environment, "compile", lambda env, *a, **k: compiled.append(a) or compile_(env, *a, **k))
    HTMLExporter().environment.get_template("index.html.j2")
    first = len(compiled)  # 0 when an earlier test of this process compiled them already
    page = HTMLExporter().environment.get_template("index.html.j2")
    assert len(compiled) == first and page.render  # the second environment got them compiled
