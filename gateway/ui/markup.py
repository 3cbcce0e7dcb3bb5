"""Message text as HTML: markdown rendered by markdown-it-py, then sanitised by nh3 (ammonia).

Two layers, so that neither alone has to be right: markdown-it runs with ``html`` off (raw HTML
in a message is escaped and shows as text) and refuses ``javascript:``/``vbscript:``/``file:``
links; nh3 then keeps only an allow-list of tags and attributes, only http/https/mailto URLs and
no ``on*`` attributes, ``style`` or scripts whatever reached it. Images become links (the admin
page never loads a URL a model or a user wrote). Very long texts skip the markdown step and show
as escaped plain text.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import nh3
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markupsafe import Markup, escape

# past this many characters a text is shown as plain text (markdown's cost grows with it, and
# a dump that long is rarely markdown)
MARKDOWN_LIMIT = 50_000
# texts up to this long are cached once rendered: a session whose requests repeat their history
# (every restart of the context) shows the same messages many times
CACHE_TEXT = 8_000

TAGS = {"p", "br", "hr", "em", "strong", "del", "s", "code", "pre", "blockquote", "ul", "ol", "li",
        "h1", "h2", "h3", "h4", "h5", "h6", "a", "table", "thead", "tbody", "tr", "th", "td"}
ATTRIBUTES = {"a": {"href", "title"}, "ol": {"start"}, "th": {"align"}, "td": {"align"}}
URL_SCHEMES = {"http", "https", "mailto"}


def _image(self: Any, tokens: list[Any], idx: int, options: Any, env: Any) -> str:
    token = tokens[idx]
    alt = self.renderInlineAsText(token.children or [], options, env) or "image"
    return f'<a href="{escapeHtml(token.attrGet("src") or "")}">[image: {escapeHtml(alt)}]</a>'


def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "breaks": True, "linkify": False})
    md.enable(["table", "strikethrough"])
    md.add_render_rule("image", _image)
    return md


_md = _parser()


def sanitize(html: str) -> str:
    """*html* with only the allow-listed tags, attributes and URL schemes left."""
    return nh3.clean(html, tags=TAGS, attributes=ATTRIBUTES, url_schemes=URL_SCHEMES,
                     link_rel="noopener noreferrer nofollow", strip_comments=True)


def markdown(text: str | None) -> Markup:
    """*text* rendered as sanitised HTML in a ``<div class="text md">``; as escaped plain text
    in a ``<div class="text plain">`` when it is longer than :data:`MARKDOWN_LIMIT`."""
    if not text:
        return Markup("")
    if len(text) > MARKDOWN_LIMIT:
        return plain(text)
    return Markup(_cached(text) if len(text) <= CACHE_TEXT else _render(text))


def _render(text: str) -> str:
    return f'<div class="text md">{sanitize(_md.render(text))}</div>'


_cached = lru_cache(maxsize=4096)(_render)  # at most ~40 MB of HTML


def plain(text: str | None) -> Markup:
    """*text* escaped, its line breaks kept (a tool result, a reasoning trace)."""
    if not text:
        return Markup("")
    return Markup('<div class="text plain">') + escape(text) + Markup("</div>")
