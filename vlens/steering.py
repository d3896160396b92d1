"""Steering vectors from contrastive pairs (contrastive activation addition, as the steering-vectors library
trains them): each pair's positive and negative prompt is read at one token, and a hook's vector is an aggregate
of the differences, by default their mean.

The prompts run as one continuous batch of prefill-only requests, each capturing the one row it is read at, so
there is no padding to shift the read position and thousands of pairs cost a batched forward, not a loop. The
vector steers as `Steer` does in any request (`SteeringVector.steers`), at every position by default, as the
library's `apply` adds it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vlens.capture.interventions import Steer
from vlens.capture.names import LOGITS, is_pattern, resolve_hooks, tap_dtype
from vlens.capture.spec import Capture
from vlens.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlens.config import ModelConfig
    from vlens.llm import LLM

Aggregator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (positive [n, d], negative [n, d]) -> [d]


def mean_difference(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """The mean of the pairs' differences: contrastive activation addition's vector."""
    return (positive - negative).mean(0)


def principal_difference(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """The unit direction that explains most of the differences (uncentred: each difference is taken with its
    negation), signed to agree with them on average."""
    differences = positive - negative
    u, _, _ = torch.linalg.svd(torch.cat([differences, -differences]).T, full_matrices=False)
    direction = u[:, 0]
    return torch.sign((differences @ direction).mean()) * direction


AGGREGATORS: dict[str, Aggregator] = {"mean": mean_difference, "pca": principal_difference}


@dataclass
class SteeringVector:
    """One vector per hook (a row of the hook's shape), all of which one steer adds together."""

    vectors: dict[str, torch.Tensor]

    def steers(self, multiplier: float = 1.0, positions="all") -> list[Steer]:
        """The interventions that add `multiplier` times each hook's vector at `positions`, for any request's
        `SamplingParams(interventions=...)` (the server's: `vlens serve --steering-vector`)."""
        return [Steer(hook, vector, scale=multiplier, positions=positions) for hook, vector in self.vectors.items()]

    def fwd_hooks(self, multiplier: float = 1.0) -> list[tuple[str, Callable]]:
        """TransformerLens's form, for HookedLM (`with model.hooks(fwd_hooks=vector.fwd_hooks(4.0)):`): a hook
        function per hook that adds `multiplier` times its vector at every position, in the value's dtype."""

        def add(vector: torch.Tensor) -> Callable:
            scaled = multiplier * vector.float()  # (once, not at every call of the hook)
            return lambda value, hook: value + scaled.to(value.device, value.dtype)

        return [(hook, add(vector)) for hook, vector in self.vectors.items()]

    def scaled(self, multiplier: float) -> SteeringVector:
        """The vectors times `multiplier`: what a server steers with at the strength chosen, where a request names
        the vector as its model (`vlens serve --steering-vector`)."""
        return SteeringVector({hook: vector * multiplier for hook, vector in self.vectors.items()})

    def save(self, path: str | Path) -> None:
        """A safetensors file of the vectors, keyed by hook name (written whole, then renamed into place)."""
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        save_file({hook: vector.detach().contiguous().cpu() for hook, vector in self.vectors.items()}, str(partial))
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | Path) -> SteeringVector:
        try:
            vectors = load_file(str(Path(path).expanduser()))
        except (OSError, SafetensorError) as e:
            raise ValueError(f"steering_vector: {str(path)!r} is not a readable safetensors file ({e})") from None
        if not vectors:
            raise ValueError(f"steering_vector: {str(path)!r} holds no vector")
        return cls(vectors)

    def check(self, cfg: ModelConfig, shapes: dict[str, tuple], field: str) -> None:
        """Each hook one steerable hook of this model, each vector one of its rows (at start, not in a request)."""
        for hook, vector in self.vectors.items():
            try:
                taps = set(resolve_hooks(hook, cfg, shapes).values())
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
            if len(taps) != 1:
                raise ValueError(f"{field}: {hook!r} names {len(taps)} hooks; a vector is one hook's")
            _steerable(taps, field)
            shape = shapes[taps.pop()]
            if tuple(vector.shape) not in (shape, (math.prod(shape),)):
                raise ValueError(f"{field}: the vector at {hook} has shape {tuple(vector.shape)}, its rows {shape}")


def train_steering_vector(
    llm: LLM, pairs: Sequence[tuple[str | Sequence[int], str | Sequence[int]]],
    hooks: str | Sequence[str] = "blocks.*.hook_resid_post", read_token_index: int = -1,
    aggregator: str | Aggregator = "mean",
) -> SteeringVector:  # fmt: skip
    """A steering vector at every hook `hooks` names (names or globs, as Capture's) from (positive, negative)
    prompts (strings or token ids), each read at its token `read_token_index` (negative: from its end).
    `aggregator`: "mean" (the mean difference), "pca" (the differences' first principal direction, unit norm),
    or a function of the positive and negative rows [pairs, width] that returns a vector [width]."""
    if isinstance(aggregator, str):
        if aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator: {aggregator!r} is not one of {', '.join(AGGREGATORS)}, or a function")
        aggregator = AGGREGATORS[aggregator]
    elif not callable(aggregator):
        raise ValueError(f"aggregator: expected one of {', '.join(AGGREGATORS)} or a function, got {aggregator!r}")
    if isinstance(pairs, (str, bytes)) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise ValueError("pairs: expected a list of (positive, negative) prompts")
    if not pairs:
        raise ValueError("pairs: empty; give at least one (positive, negative) pair")
    if not isinstance(read_token_index, int) or isinstance(read_token_index, bool):
        raise ValueError(f"read_token_index: expected an int (negative counts from the end), got {read_token_index!r}")
    capture = Capture(hooks=hooks, positions=read_token_index)
    _steerable(resolve_hooks(capture.hooks, llm.config, llm.engine.shapes).values(), "hooks")
    outputs = llm.generate([prompt for pair in pairs for prompt in pair], SamplingParams(max_tokens=0, capture=capture),
                           use_tqdm=False)  # fmt: skip
    vectors = {}
    for hook in outputs[0].activations:
        rows = torch.stack([out.activations[hook][0] for out in outputs])  # [2 * pairs, *row], each pair in turn
        vector = aggregator(rows[0::2].flatten(1), rows[1::2].flatten(1))
        vectors[hook] = vector.reshape(rows.shape[1:])
    return SteeringVector(vectors)


def _steerable(taps: Iterable[str], field: str) -> None:
    """Refuses taps a steer cannot edit: the logits, attention scores and patterns, and the chosen experts' ids."""
    fixed = [t for t in taps if t == LOGITS or is_pattern(t) or tap_dtype(t, torch.float32) == torch.long]
    if fixed:
        raise ValueError(f"{field}: {fixed} cannot be steered (logits, attention scores and patterns and the chosen "
                         "experts' ids are read-only)")  # fmt: skip
