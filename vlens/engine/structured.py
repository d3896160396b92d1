"""vLLM's structured outputs: a request's text held to a JSON schema, to any JSON object, to a regular expression,
to one of a list of choices, to a grammar (EBNF) or to a structural tag (free text with structured segments), by
banning, before each sample, every token that would leave it.

xgrammar does the work, as in vLLM: its compiler turns the request's structure into a grammar over the tokenizer's
tokens (cached, so requests with one schema compile it once), and a matcher per sequence keeps where its text is in
that grammar, fills a bitmask of the tokens allowed next (32 tokens a word, on the host) and takes each token the
engine keeps. The bitmask goes to the device with the step's other logit changes (vlens.engine.penalties), where it
is unpacked into a mask. Once the structure is complete only the model's end-of-sequence tokens are allowed, which
end the request. xgrammar is imported when a request first asks for a structure: an engine without such requests
never loads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import torch

from vlens.sampling_params import StructuredOutputsParams

BITS = 32  # tokens per bitmask word
# xgrammar's errors open with its C++ log line's time, file and failed check: not for the client
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class Grammars:
    """An engine's grammar compiler, over its tokenizer and vocabulary; EOS ends every structure."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]):
        try:
            import xgrammar
        except ImportError:
            raise ValueError("structured_outputs: needs xgrammar (pip install xgrammar)") from None
        self.xgrammar, self.vocab_size = xgrammar, vocab_size
        try:
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                           stop_token_ids=sorted(eos_ids))  # fmt: skip
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: xgrammar cannot read this model's tokenizer: {e}") from None
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """xgrammar's compiled grammar of `spec`; a ValueError naming the field when it is not one."""
        compiler = self.compiler
        try:
            if spec.json is not None:
                return compiler.compile_json_schema(spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
            if spec.json_object:
                return compiler.compile_builtin_json_grammar()
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                choices = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
                return compiler.compile_grammar(f"root ::= {choices}")
            if spec.grammar is not None:
                return compiler.compile_grammar(spec.grammar)
            return self._structural_tag(spec.structural_tag)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{spec.kind}: {_LOG_PREFIX.sub('', str(e).strip())}") from None

    def _structural_tag(self, tag: str | Mapping[str, Any]) -> Any:
        """vLLM's two forms: xgrammar's own structural tag, or the older list of structures (each a schema between
        a begin and an end string) with the triggers that start them, which xgrammar still compiles."""
        tag = json.loads(tag) if isinstance(tag, str) else tag
        if not isinstance(tag, Mapping) or "structures" not in tag:
            return self.compiler.compile_structural_tag(json.dumps(tag))
        try:
            items = [self.xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]  # fmt: skip
            return self.compiler.compile_structural_tag(items, tag["triggers"])
        except (KeyError, TypeError):
            raise ValueError("expected structures (a list of objects with begin, schema and end) and triggers "
                             "(a list of strings)") from None

    def matcher(self, compiled: Any, after: tuple[int, ...] | None = None) -> Grammar:
        return Grammar(self.xgrammar.GrammarMatcher(compiled), self.vocab_size, after)


class Grammar:
    """Where one sequence's text is in its structure; with `after` (a reasoning model's `</think>` tokens:
    vlens.reasoning), a structure that holds only the text after them: until they come, every token is allowed."""

    def __init__(self, matcher: Any, vocab_size: int, after: tuple[int, ...] | None = None):
        self.matcher, self.vocab_size, self.after = matcher, vocab_size, after
        self.recent: tuple[int, ...] = ()  # (while waiting: the last tokens, as many as `after` has)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of a [B, words] int32 bitmask: the tokens that may come next."""
        if self.after is None:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Take the sampled token; False when the structure is over (its EOS taken) or the token left it (a ban of
        another option that left no token of the structure's)."""
        if self.after is not None:
            self.recent = (*self.recent, token)[-len(self.after) :]
            if self.recent == self.after:
                self.after = None  # (the structure starts with the next token)
            return True
        return self.matcher.accept_token(token) and not self.matcher.is_terminated()


def bitmask_rows(batch: int, vocab_size: int) -> torch.Tensor:
    """A [batch, words] bitmask that allows every token (rows without a structure stay so)."""
    return torch.full((batch, -(-vocab_size // BITS)), -1, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, words] int32 -> [B, vocab_size] bool: token t is allowed where bit t % 32 of word t // 32 is set."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
