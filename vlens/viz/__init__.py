"""Views of what vlens reads inside a model — the logit lens, attention patterns, SAE features — as
self-contained HTML: they render in Jupyter and save as offline files, with the renderer of
`vlens serve`'s /lens page (static/lens.js)."""

from vlens.viz.html import View, page_html
from vlens.viz.page import attention, lens_page, logit_lens, sae_features

__all__ = ["View", "attention", "lens_page", "logit_lens", "page_html", "sae_features"]
