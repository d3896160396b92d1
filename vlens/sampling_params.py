"""How to sample a request (vLLM's SamplingParams), plus what it captures and changes at the taps,
whose types live in vlens.capture.

Everything is validated at construction or, for what needs the model, before the engine runs it, so
a bad request fails alone with a message naming the field and the allowed values.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlens.capture.interventions import Intervention, check_interventions
from vlens.capture.spec import Capture

NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the text is held to one of these (vlens.engine.structured)."""

    json: str | Mapping[str, Any] | None = None  # a JSON schema (as a dict, or its text)
    regex: str | None = None
    choice: Sequence[str] | None = None  # the text is one of these
    grammar: str | None = None  # EBNF, as xgrammar reads it (GBNF's dialect)
    json_object: bool | None = None  # any JSON object
    # vLLM's structural tag (xgrammar's, as a dict or its JSON text): free text in which each segment that opens with
    # a trigger is held to its own structure, e.g. a tool call's arguments to the tool's schema between its tags;
    # {"type": "structural_tag", "format": {...}}, or vLLM's older {"structures": [{"begin", "schema", "end"}, ...],
    # "triggers": [...]}
    structural_tag: str | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURES if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set one of {', '.join(STRUCTURES)}; "
                             f"got {', '.join(given) or 'none'}")  # fmt: skip
        if self.choice is not None:
            self.choice = [self.choice] if isinstance(self.choice, str) else list(self.choice)
        checks = {
            "json": isinstance(self.json, (str, Mapping)),
            "regex": isinstance(self.regex, str),
            "choice": bool(self.choice) and all(isinstance(c, str) and c for c in self.choice or ()),
            "grammar": isinstance(self.grammar, str),
            "json_object": self.json_object is True,
            "structural_tag": isinstance(self.structural_tag, (str, Mapping)),
        }
        if not checks[given[0]]:
            allowed = {"json": "a JSON schema (a dict or its text)", "choice": "a list of non-empty strings",
                       "json_object": "True", "structural_tag": "a structural tag (a dict or its JSON text)"
                       }.get(given[0], "a string")  # fmt: skip
            raise ValueError(f"structured_outputs.{given[0]}: {getattr(self, given[0])!r} is not allowed; "
                             f"expected {allowed}")  # fmt: skip

    @property
    def kind(self) -> str:
        return next(name for name in STRUCTURES if getattr(self, name) not in (None, False))


STRUCTURES = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # log-probabilities of the sampled token and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1  # samples of the prompt returned
    best_of: int | None = None  # samples drawn, the n with the highest mean log-probability returned
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated
    repetition_penalty: float = 1.0  # vLLM's: logits of prompt and generated tokens divided (> 0) or multiplied by it
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # vLLM's: no EOS or stop token is sampled, and no stop string ends it, before this many
    allowed_token_ids: Sequence[int] | None = None  # vLLM's: the only tokens that may be sampled
    bad_words: Sequence[str] | None = None  # vLLM's: words never generated, as spelt with and without a space before
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string (or stop token) that ended it
    skip_special_tokens: bool = True  # vLLM's: special tokens (EOS, chat markers) leave no text
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: a JSON schema, regex, choice or grammar
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last this many tokens are run
    capture: Capture | None = None
    return_hidden_states: bool = False  # shortcut: ln_final.hook_out (the final norm's output) at every position
    interventions: Sequence[Intervention] | None = None  # applied in order
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in NUMBERS:  # (compared below: a string would fail there with a TypeError naming no field)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name}: {value!r} is not allowed; expected a number")
        checks = [
            (_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens", "an int >= 0 (0: prefill only)"),
            (self.temperature >= 0, "temperature", ">= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (_int(self.top_k) and self.top_k >= -1, "top_k", "an int >= 0 (0 or -1 = off)"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
            (self.logprobs is None or (_int(self.logprobs) and self.logprobs >= 0), "logprobs", "None or an int >= 0"),
            (self.prompt_logprobs is None or (_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
             "prompt_logprobs", "None or an int >= 0"),
            (_int(self.n) and self.n >= 1, "n", "an int >= 1"),
            (self.seed is None or _int(self.seed), "seed", "None or an int"),
            (self.best_of is None or (_int(self.best_of) and self.best_of >= self.n), "best_of", f"None or an int >= n ({self.n})"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 = off)"),
            (_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"an int in [0, max_tokens={self.max_tokens}]"),
            (isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "a bool"),
            (isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "a bool"),
            (self.truncate_prompt_tokens is None or (_int(self.truncate_prompt_tokens)
                                                     and self.truncate_prompt_tokens >= 1),
             "truncate_prompt_tokens", "None or an int >= 1 (the prompt's last that many tokens are kept)"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "None or a vlens.StructuredOutputsParams"),
            (self.capture is None or isinstance(self.capture, Capture), "capture", "None or a vlens.Capture"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not allowed; expected {allowed}")
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            raise ValueError(f"stop: expected non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or ())
        if not all(_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: {self.stop_token_ids!r} is not allowed; expected a list of token ids "
                             "(ints >= 0)")  # fmt: skip
        self.interventions = list(self.interventions or ())
        check_interventions(self.interventions)
        if self.top_k == -1 or self.top_k >= 2**31:  # off (a cut past every vocabulary cuts nothing; packed as int64)
            self.top_k = 0
        if self.temperature < _GREEDY_BELOW:  # greedy, as in vLLM: logits / 1e-45 overflow float32
            self.temperature = 0.0
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids: {self.allowed_token_ids!r} is not allowed; expected None or a "
                                 "non-empty list of token ids (ints >= 0)")  # fmt: skip
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or ())
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words: {self.bad_words!r} is not allowed; expected a list of words (non-blank "
                             "strings)")  # fmt: skip
        if self.max_tokens == 0 and self.prompt_logprobs is None and self.capture is None and not self.return_hidden_states:
            raise ValueError("max_tokens: 0 generates nothing; it is allowed with prompt_logprobs, capture or return_hidden_states")
        samples = "n" if self.best_of is None else "best_of"  # (the field that asks for the samples)
        if self.samples > 1 and (self.capture is not None or self.return_hidden_states):
            raise ValueError(
                f"{samples}: {self.samples} samples of one request cannot share its capture; capture with n=1 (send "
                "one request per sample, each with its own seed)"
            )
        if self.samples > 1 and self.max_tokens == 0:
            raise ValueError(f"{samples}: {self.samples} samples need max_tokens >= 1; max_tokens=0 samples nothing")

    @property
    def samples(self) -> int:
        """Sequences drawn for the request: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_samples(self) -> bool:
        """Whether more samples are drawn than returned, so they are ranked by their log-probabilities."""
        return self.samples > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalises(self) -> bool:
        """Whether a penalty reads the tokens seen so far (presence, frequency, repetition)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias(bias: Mapping[int, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (ints, or their strings as JSON keys are) -> biases in [-100, 100].
    Whether the ids are in the vocabulary is checked when the engine takes the request."""
    out: dict[int, float] = {}
    for token, value in (bias or {}).items():
        try:
            t = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: key {token!r} is not a token id (an int >= 0)") from None
        if t < 0 or isinstance(token, bool):
            raise ValueError(f"logit_bias: key {token!r} is not a token id (an int >= 0)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias: the bias of token {t} is {value!r}; expected a number in [-100, 100]")
        out[t] = float(value)
    return out
