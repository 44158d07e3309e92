"""Model output rendered as HTML, safely: the text is untrusted.

markdown-it with raw HTML off escapes every tag the model writes. Links and images are
shown, never live: a link is its text followed by its address as plain text, an image is
"[image: alt]" and its address, so nothing on the page points anywhere or loads anything
(a page's text layer or a model can name any address, the cloud's metadata service
included). markdown-it's own link check still drops javascript:, vbscript: and data:
addresses to literal text. An extract item's object is shown as its JSON, escaped like
any other text: a value holding "<script>" is only characters.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping, Sequence
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import OptionsDict
from markupsafe import Markup, escape


def _address(url: str | None) -> str:
    return f' <span class="url">({escape(url)})</span>' if url else ""


def _link_open(self: RendererHTML, tokens: Sequence[Token], idx: int,
               options: OptionsDict, env: MutableMapping[str, Any]) -> str:
    return '<span class="link">'


def _link_close(self: RendererHTML, tokens: Sequence[Token], idx: int,
                options: OptionsDict, env: MutableMapping[str, Any]) -> str:
    """Closes the link's text and shows where it pointed (CommonMark links never nest,
    so the nearest link_open before is this one's). An autolink's text is its address."""
    opening = next(t for t in reversed(tokens[:idx]) if t.type == "link_open")
    href = opening.attrGet("href")
    shown = None if opening.markup == "autolink" else href
    return "</span>" + _address(str(shown) if shown is not None else None)


def _image(self: RendererHTML, tokens: Sequence[Token], idx: int,
           options: OptionsDict, env: MutableMapping[str, Any]) -> str:
    """An image as words: its alt text and its address, no <img> to load."""
    token = tokens[idx]
    alt = self.renderInlineAsText(token.children or [], options, env)
    src = token.attrGet("src")
    return (f'<span class="image">[image: {escape(alt)}]</span>'
            + _address(str(src) if src is not None else None))


_MD = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
_MD.add_render_rule("link_open", _link_open)
_MD.add_render_rule("link_close", _link_close)
_MD.add_render_rule("image", _image)


def markdown(text: str) -> Markup:
    return Markup(_MD.render(text))


def paragraph(text: str) -> Markup:
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
