"""How to sample a request (vLLM's SamplingParams), plus what it captures and changes at the taps,
whose types live in vlens.capture.

Everything is validated at construction or, for what needs the model, before the engine runs it, so
a bad request fails alone with a message naming the field and the allowed values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vlens.capture.interventions import Ablate, Clamp, Intervention, Patch, Steer
from vlens.capture.spec import Capture


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
    capture: Capture | None = None
    return_hidden_states: bool = False  # shortcut: ln_final.hook_normalized at every position
    interventions: Sequence[Intervention] | None = None  # applied in order
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an int >= 1"),
            (self.temperature >= 0, "temperature", ">= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "an int >= 0 (0 or -1 = off)"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs", "None or an int >= 0"),
            (self.capture is None or isinstance(self.capture, Capture), "capture", "None or a vlens.Capture"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not allowed; expected {allowed}")
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            raise ValueError(f"stop: expected non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or ())
        self.interventions = list(self.interventions or ())
        for i, iv in enumerate(self.interventions):
            if not isinstance(iv, (Steer, Ablate, Patch, Clamp)):
                raise ValueError(f"interventions[{i}]: expected vlens.Steer, Ablate, Patch or Clamp, got {type(iv).__name__}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
