"""Model output rendered as HTML, safely: the text is untrusted.

markdown-it with raw HTML off escapes every tag the model writes; images are switched
off so a page can never load anything from elsewhere, and markdown-it's own link check
drops javascript:, vbscript: and data: links. An extract item's object is shown as its
JSON, escaped like any other text: a value holding "<script>" is only characters.
"""

from __future__ import annotations

import json
from typing import Any

from markdown_it import MarkdownIt
from markupsafe import Markup, escape

_MD = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
_MD.disable("image")


def markdown(text: str) -> Markup:
    return Markup(_MD.render(text))


def plain(text: str) -> Markup:
    return Markup("<p class=plain>") + escape(text) + Markup("</p>")


def _dumps(value: Any, indent: int | None) -> str:
    """JSON with text as UTF-8, or \\u escapes where UTF-8 cannot carry it (a lone
    surrogate would fail the whole page's encoding)."""
    seps = None if indent else (",", ":")
    out = json.dumps(value, indent=indent, separators=seps, ensure_ascii=False)
    try:
        out.encode()
    except UnicodeEncodeError:
        out = json.dumps(value, indent=indent, separators=seps)
    return out


def json_block(value: Any) -> Markup:
    """An extract item's object, pretty-printed in a <pre>, escaped."""
    return Markup("<pre class=json>") + escape(_dumps(value, 2)) + Markup("</pre>")


def compact_json(value: Any) -> str:
    """The object on one line, for the items table (autoescaped by the template)."""
    return _dumps(value, None)
