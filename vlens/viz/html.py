"""One page, two homes: `vlens serve`'s /lens (which fetches its data from the server's API) and the
self-contained files and notebook cells of vlens.viz (which carry their data as an embedded payload).
Both are static/lens.html with the stylesheet and script inlined, so neither makes a request to
anywhere but the server that served it; its Content-Security-Policy says so to the browser too."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

STATIC = Path(__file__).parent / "static"
# What the page may load: nothing but its own inline script and style, and (served) calls to its server.
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"


@cache
def _asset(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def page_html(payload: dict[str, Any] | None, title: str = "vlens lens") -> str:
    """The whole page: with a payload, a static view of it; without, the server's page, which asks the
    API for its data."""
    if payload is None:
        data, csp = "", CSP + "; connect-src 'self'"
    else:
        # JSON inside <script>: no "</script>" or "<!--" may appear, so every "<" is escaped.
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
        data, csp = f'<script type="application/json" id="vlens-payload">{text}</script>', CSP
    slots = {"csp": csp, "title": html.escape(title), "payload": data}
    slots |= {"css": _asset("lens.css"), "js": _asset("lens.js")}
    # One pass, so a slot's text (a prompt, say) is never searched for slots itself.
    return re.sub(r"\{\{(\w+)\}\}", lambda m: slots[m.group(1)], _asset("lens.html"))


@dataclass
class View:
    """A view of one output: renders in Jupyter (`_repr_html_`, the page in an isolated iframe) and saves
    as one offline HTML file."""

    payload: dict[str, Any]
    title: str = "vlens lens"
    height: int = 480  # pixels of the notebook frame (the page scrolls inside it)

    def html(self) -> str:
        return page_html(self.payload, self.title)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.html(), encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        # srcdoc keeps the page's ids, style and script apart from the notebook's and from other views'.
        return (
            f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" title="{html.escape(self.title)}" '
            f'style="width: 100%; height: {self.height}px; border: 1px solid #ccc"></iframe>'
        )
