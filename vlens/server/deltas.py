"""Text of a streaming request, released piece by piece as its tokens arrive.

With stop strings, the last (longest stop - 1) characters are held back: they may turn out to be the
start of a stop string, which the final text must not contain. Whatever was released is therefore
always a prefix of the final text, so the deltas add up to exactly what a non-streamed request gets.
"""

from __future__ import annotations

from typing import Any

from vlens.engine.detokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.hold = max(map(len, stops), default=1) - 1
        self.tokens = 0  # generated tokens fed to the detokenizer
        self.released = 0  # characters of detok.text sent to the client

    def _feed(self, generated: list[int]) -> None:
        for token in generated[self.tokens :]:
            self.detok.add(token)
        self.tokens = len(generated)

    def advance(self, generated: list[int]) -> str:
        """Feed the tokens generated since the last call; return the text that is now safe to send."""
        self._feed(generated)
        upto = len(self.detok.text) - self.hold
        if upto <= self.released:
            return ""
        new = self.detok.text[self.released : upto]
        self.released = upto
        return new

    def finish(self, generated: list[int], stop_reason: int | str | None) -> str:
        """The rest of the text once the sequence ended, cut before the stop string that ended it."""
        self._feed(generated)
        text = self.detok.text
        if isinstance(stop_reason, str):
            text = text[: text.find(stop_reason)] if stop_reason in text else text
        rest = text[self.released :]
        self.released = len(text)
        return rest
