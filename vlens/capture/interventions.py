"""Per-request interventions at taps: steer (add a vector), ablate (project a direction out), patch
(replace rows with given values).

Semantics: an intervention changes the tapped value for its request's rows at the chosen positions,
before anything downstream reads it, so it also changes the KV written at those positions (and the
prefix cache keys such KV apart, see Sequence.cache_salt). Interventions at one tap apply in the
order given; a Capture at the same tap sees the value after them. Positions are those of Capture,
except that negative indices and "last" are refused: an intervention must know its rows when they
are computed, and the end of a generation is not known then.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlens.capture.positions import Positions
from vlens.capture.spec import check_heads, to_tensor


@dataclass
class Steer:
    """Add scale * vector to the tapped value at the chosen positions. With `heads` (at a per-head tap
    such as attn.hook_z), add to those heads only: a vector [d_head] for each, or [len(heads), d_head]."""

    hook: str
    vector: Any
    scale: float = 1.0
    positions: Any = "all"
    heads: Sequence[int] | None = None

    def __post_init__(self) -> None:
        self.vector = to_tensor(self.vector, "steer.vector")
        self.positions = Positions.parse(self.positions, "steer.positions").online("steer.positions")
        if not np.isfinite(self.scale):
            raise ValueError(f"steer.scale: {self.scale!r} is not finite")
        self.heads = None if self.heads is None else check_heads(self.heads, "steer.heads")


@dataclass
class Ablate:
    """Remove the component along `direction` (normalised): x - (x . d) d. With `heads` instead (the
    TransformerLens idiom, at a per-head tap such as attn.hook_z), set those heads to zero, or to
    `value` ([d_head] for each, or [len(heads), d_head]: a mean ablation)."""

    hook: str
    direction: Any = None
    positions: Any = "all"
    heads: Sequence[int] | None = None
    value: Any = None

    def __post_init__(self) -> None:
        self.positions = Positions.parse(self.positions, "ablate.positions").online("ablate.positions")
        if self.heads is not None:
            self.heads = check_heads(self.heads, "ablate.heads")
            if self.direction is not None:
                raise ValueError("ablate.direction: with heads, an ablation sets those heads (to zero or to value=)")
            self.value = None if self.value is None else to_tensor(self.value, "ablate.value")
            return
        if self.value is not None:
            raise ValueError("ablate.value: only with heads=[...]; without heads, give a direction to project out")
        if self.direction is None:
            raise ValueError("ablate.direction: required (the direction to project out), unless heads=[...]")
        d = to_tensor(self.direction, "ablate.direction")
        if d.norm() == 0:
            raise ValueError("ablate.direction: the zero vector has no direction")
        self.direction = d / d.norm()


@dataclass
class Patch:
    """Replace the tapped rows at `positions` with `values`: a single row for every selected position,
    or one row per position — for a list, in the list's order; for "prompt" or a bounded slice, in
    position order (e.g. a clean run's `activations[hook]` with its `activation_positions`). With
    `heads`, only those heads are replaced and a row is [len(heads), d_head]."""

    hook: str
    values: Any
    positions: Any = "all"
    heads: Sequence[int] | None = None

    def __post_init__(self) -> None:
        self.values = to_tensor(self.values, "patch.values")
        self.positions = Positions.parse(self.positions, "patch.positions").online("patch.positions")
        self.heads = None if self.heads is None else check_heads(self.heads, "patch.heads")


Intervention = Steer | Ablate | Patch


def fingerprint(interventions: list[Intervention]) -> str | None:
    """A digest of everything an intervention set does, salting the prefix-cache keys of its KV."""
    if not interventions:
        return None
    digest = hashlib.sha256()
    for iv in interventions:
        fields = {f.name: getattr(iv, f.name) for f in dataclasses.fields(iv)}
        tensors = {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}
        plain = {k: str(v) for k, v in fields.items() if k not in tensors}
        digest.update(repr((type(iv).__name__, sorted(plain.items()), [tuple(t.shape) for t in tensors.values()])).encode())
        for t in tensors.values():
            digest.update(t.numpy().tobytes())
    return digest.hexdigest()
