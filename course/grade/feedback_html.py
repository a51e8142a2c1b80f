"""The feedback HTML's sanitiser: a student's markdown and outputs may carry <script> tags or onerror= handlers,
and the feedback file is opened by the instructor as well as the student.

nbconvert's HTMLExporter can sanitise (`sanitize_html`), but its `clean_html` filter keeps only a few inline tags
(bleach's defaults plus div, pre, code, span and tables), so every heading and paragraph of a markdown cell would be
shown as escaped text. This filter, which autograde/nbgrader_config.py installs under the same name, keeps what
rendered markdown uses (headings, paragraphs, lists, tables, images, links) and removes scripts, event handlers,
styles, frames and non-web links, with bleach (the library nbconvert itself uses).
"""
from __future__ import annotations

import bleach
from nbconvert.filters.markdown_mistune import markdown2html_mistune
from nbconvert.preprocessors import Preprocessor
from traitlets import Bool

TAGS = frozenset({
    "a", "abbr", "b", "blockquote", "br", "code", "dd", "del", "details", "div", "dl", "dt", "em", "h1", "h2", "h3",
    "h4", "h5", "h6", "hr", "i", "img", "kbd", "li", "ol", "p", "pre", "s", "span", "strong", "sub", "summary", "sup",
    "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul",
})
ATTRIBUTES = {
    "*": ["class", "id", "title"],
    "a": ["href", "title"],
    "img": ["src", "alt", "title", "width", "height"],
    "td": ["align", "colspan", "rowspan"],
    "th": ["align", "colspan", "rowspan"],
}
PROTOCOLS = frozenset({"http", "https", "mailto"})


def clean_html(element) -> str:
    """`element` (HTML, str or bytes) with only TAGS and ATTRIBUTES kept: anything else is shown escaped."""
    text = element.decode() if isinstance(element, bytes) else str(element)
    return bleach.clean(text, tags=TAGS, attributes=ATTRIBUTES, protocols=PROTOCOLS, strip_comments=True)


def sanitized_markdown(source: str) -> str:
    """A markdown cell's source rendered to HTML and cleaned: raw HTML is valid markdown, so the feedback template's
    own markdown2html passes it through unchanged, and nothing of the student's <script> or onerror= survives."""
    return clean_html(markdown2html_mistune(source))


class SanitizeMarkdown(Preprocessor):
    """nbgrader's feedback template renders markdown cells without nbconvert's sanitising (its own
    `markdowncell` block): this replaces each markdown cell's source with its cleaned HTML first."""

    enabled = Bool(True).tag(config=True)  # nbconvert registers preprocessors switched off unless they say so

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "markdown" and cell.source.strip():
            cell.source = sanitized_markdown(cell.source)
        return cell, resources
