"""The relative links of a rendered page: pointed where their targets are, and checked.

A notebook's markdown links its neighbours relative to its own folder (`../docs/glossary.md#router`,
`../exercises/01_router_and_loop.ipynb`). nbconvert copies them into the HTML as they are, so a
page written elsewhere (`make course`'s run folder, `make site`'s site) must point them anew:
`retarget_links` rewrites each relative `href`/`src` of an `<a>`, `<img>` or `<script>` through a
function of the path, keeping its `#fragment`; `broken_links` lists those of a page whose file,
or whose fragment in a local HTML page, does not exist. Script bodies are left alone: plotly.js
holds HTML-looking strings that are no links.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# an <a href="...">, <img src="..."> or <script src="...">, in the double quotes nbconvert's
# HTML always uses
LINK = re.compile(r'(<(?:a|img|script)\b[^>]*?\s(?:href|src)=")([^"]*)(")', re.IGNORECASE)
# a script's body, which may hold HTML-looking strings (plotly.js does) that are not links
SCRIPT_BODY = re.compile(r"(<script\b[^>]*>)(.*?)(</script>)", re.IGNORECASE | re.DOTALL)


def _outside_scripts(page: str, edit: Callable[[str], str]) -> str:
    """`page` with `edit` applied to everything but the bodies of its scripts."""
    pieces, last = [], 0
    for match in SCRIPT_BODY.finditer(page):
        pieces += [edit(page[last:match.start()]), edit(match.group(1)), match.group(2),
                   match.group(3)]
        last = match.end()
    return "".join(pieces + [edit(page[last:])])


def is_relative(href: str) -> bool:
    """A link to a file next to the page: no scheme (http:, data:, mailto:), not absolute, not
    only a fragment."""
    parts = urlsplit(href)
    return bool(parts.path) and not parts.scheme and not parts.netloc and \
        not parts.path.startswith("/")


def retarget_links(page: str, resolve: Callable[[str], str | None]) -> str:
    """`page` with each relative link's path replaced by `resolve(path)` (its fragment kept);
    a link `resolve` returns None for is left as it is."""
    def one(match: re.Match) -> str:
        href = match.group(2)
        if not is_relative(href):
            return match.group(0)
        path, hash_, fragment = href.partition("#")
        new = resolve(unquote(path))
        return match.group(0) if new is None else \
            f"{match.group(1)}{new}{hash_}{fragment}{match.group(3)}"
    return _outside_scripts(page, lambda text: LINK.sub(one, text))


def relative_links(page: str) -> list[str]:
    """The relative `href`/`src` values of a page's `<a>`, `<img>` and `<script>` tags, in
    order (not what a script's body holds)."""
    found: list[str] = []

    def collect(text: str) -> str:
        found.extend(m.group(2) for m in LINK.finditer(text) if is_relative(m.group(2)))
        return text
    _outside_scripts(page, collect)
    return found


class _Anchors(HTMLParser):
    """Every `id` and `<a name>` of a page: what a `#fragment` can land on."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.anchors: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value and (name == "id" or (tag == "a" and name == "name")):
                self.anchors.add(value)


def anchors(page: str) -> set[str]:
    parser = _Anchors()
    parser.feed(page)
    return parser.anchors


def broken_links(html_file: Path, _cache: dict | None = None) -> list[str]:
    """The relative links of `html_file` that lead nowhere: a missing file, or a `#fragment`
    that no `id` of the HTML page it names carries."""
    cache = {} if _cache is None else _cache
    page = html_file.read_text(encoding="utf-8")
    broken = []
    for href in relative_links(page):
        path, _, fragment = href.partition("#")
        target = (html_file.parent / unquote(path)).resolve()
        if not target.exists():
            broken.append(href)
        elif fragment and target.suffix == ".html":
            if target not in cache:
                cache[target] = anchors(target.read_text(encoding="utf-8"))
            if unquote(fragment) not in cache[target]:
                broken.append(href)
    return broken
