"""Incremental detokenisation: text grows by what each new token adds, without re-decoding everything.

A few prompt tokens seed the window so the first generated token gets its leading space right, and
text is released only when it no longer ends in a partial UTF-8 character.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # window start: decoded only to know where new text begins
        self.read = len(self.ids)  # tokens up to here are already in `text`
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.ids.append(token)
        seen = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if len(full) <= len(seen) or full.endswith("\ufffd"):
            return ""
        new = full[len(seen) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new
