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

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlens.capture.positions import Positions
from vlens.capture.spec import to_tensor


@dataclass
class Steer:
    """Add scale * vector to the tapped value at the chosen positions."""

    hook: str
    vector: Any
    scale: float = 1.0
    positions: Any = "all"

    def __post_init__(self) -> None:
        self.vector = to_tensor(self.vector, "steer.vector")
        self.positions = Positions.parse(self.positions, "steer.positions").online("steer.positions")
        if not np.isfinite(self.scale):
            raise ValueError(f"steer.scale: {self.scale!r} is not finite")


@dataclass
class Ablate:
    """Remove the component along `direction` (normalised): x - (x . d) d."""

    hook: str
    direction: Any
    positions: Any = "all"

    def __post_init__(self) -> None:
        d = to_tensor(self.direction, "ablate.direction")
        norm = d.norm()
        if norm == 0:
            raise ValueError("ablate.direction: the zero vector has no direction")
        self.direction = d / norm
        self.positions = Positions.parse(self.positions, "ablate.positions").online("ablate.positions")


@dataclass
class Patch:
    """Replace the tapped rows at `positions` with `values`: a single row for every selected position,
    or one row per position — for a list, in the list's order; for "prompt" or a bounded slice, in
    position order (e.g. a clean run's `activations[hook]` with its `activation_positions`)."""

    hook: str
    values: Any
    positions: Any = "all"

    def __post_init__(self) -> None:
        self.values = to_tensor(self.values, "patch.values")
        self.positions = Positions.parse(self.positions, "patch.positions").online("patch.positions")


Intervention = Steer | Ablate | Patch


def fingerprint(interventions: list[Intervention]) -> str | None:
    """A digest of everything an intervention set does, salting the prefix-cache keys of its KV."""
    if not interventions:
        return None
    digest = hashlib.sha256()
    for iv in interventions:
        tensor = iv.vector * iv.scale if isinstance(iv, Steer) else iv.direction if isinstance(iv, Ablate) else iv.values
        digest.update(repr((type(iv).__name__, iv.hook, str(iv.positions), tuple(tensor.shape))).encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()
