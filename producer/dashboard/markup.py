"""Model output rendered as HTML, safely: the text is untrusted.

markdown-it with raw HTML off escapes every tag the model writes; images are switched
off so a page can never load anything from elsewhere, and markdown-it's own link check
drops javascript:, vbscript: and data: links.
"""

from __future__ import annotations

from markdown_it import MarkdownIt
from markupsafe import Markup, escape

_MD = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
_MD.disable("image")


def markdown(text: str) -> Markup:
    return Markup(_MD.render(text))


def plain(text: str) -> Markup:
    return Markup("<p class=plain>") + escape(text) + Markup("</p>")
