"""A request's text as its tokens arrive: decoded incrementally (once), stop strings found (once), and
released in pieces that add up to exactly the final text.

Text grows by what each new token adds, without re-decoding everything: a few prompt tokens seed the
window so the first generated token gets its leading space right, and text is taken only when it no
longer ends in a partial UTF-8 character (one still partial when the request ends is taken as it decodes,
U+FFFD). With stop strings, the last (longest stop - 1) characters are held back until the request ends:
they may be the start of a stop string, which the final text must not contain. A request that neither
streams nor has stop strings gets the same text in one decode at its end (`text_of`).
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5


def text_of(tokenizer: Any, prompt_token_ids: list[int], generated: list[int]) -> str:
    """The text a Detokenizer releases for `generated`, in one decode: read after the prompt's last tokens,
    as it reads them."""
    context = list(prompt_token_ids[-CONTEXT_TOKENS:])
    return _decode(tokenizer, context + generated)[len(_decode(tokenizer, context)) :]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stops: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # window start: decoded only to know where new text begins
        self.read = len(self.ids)  # tokens up to here are already in `text`
        self.text = ""
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1
        self.released = 0  # characters of `text` handed out

    def add(self, token: int) -> str | None:
        """Append a token; if the text now contains a stop string, cut the text before it and return it."""
        self.ids.append(token)
        seen, full = self._window()
        if len(full) <= len(seen) or full.endswith("\ufffd"):
            return None
        new = full[len(seen) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        if not self.stops:
            return None
        window_start = max(0, len(self.text) - len(new) - self.hold)  # where a new stop string could begin
        # The earliest one, not the first listed: the text is cut before it, so it must hold no other.
        found = [(at, stop) for stop in self.stops if (at := self.text.find(stop, window_start)) >= 0]
        if not found:
            return None
        at, stop = min(found, key=lambda f: f[0])
        self.text = self.text[:at]
        return stop

    def _window(self) -> tuple[str, str]:
        """The window's text without the tokens not yet taken, and with them."""
        window = self.ids[self.prefix :]
        return _decode(self.tokenizer, window[: self.read - self.prefix]), _decode(self.tokenizer, window)

    def release(self, final: bool) -> str:
        """The text that became safe to show since the last call (all the rest once `final`, with a trailing
        partial character as it decodes: no token will complete it)."""
        if final:
            seen, full = self._window()
            self.text += full[len(seen) :]
        upto = len(self.text) if final else len(self.text) - self.hold
        if upto <= self.released:
            return ""
        new = self.text[self.released : upto]
        self.released = upto
        return new
