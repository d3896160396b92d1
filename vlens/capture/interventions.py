"""Per-request interventions at taps: steer (add a vector, or an SAE latent's decoder row), ablate
(project a direction out), patch (replace rows with given values), clamp (set an SAE latent).

Semantics: an intervention changes the tapped value for its request's rows at the chosen positions,
before anything downstream reads it, so it also changes the KV written at those positions and after
them (the prefix cache keys such KV apart; the KV before its first position is keyed as without it,
see Sequence.salt_until). Interventions at one tap apply in the
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
from vlens.capture.spec import check_feature, check_heads, to_tensor
from vlens.sae.model import SAE


@dataclass
class Steer:
    """Add scale * vector to the tapped value at the chosen positions. With `heads` (at a per-head tap
    such as attn.hook_z), add to those heads only: a vector [d_head] for each, or [len(heads), d_head].
    With `sae` and `feature` instead of a vector, the vector is that latent's decoder row W_dec[feature]
    (at the hook the SAE writes: the one it reads, or a transcoder's hook_out)."""

    hook: str
    vector: Any = None
    scale: float = 1.0
    positions: Any = "all"
    heads: Sequence[int] | None = None
    sae: SAE | None = None
    feature: int | None = None

    def __post_init__(self) -> None:
        if self.sae is not None or self.feature is not None:
            _check_sae(self.sae, "steer")
            if self.vector is not None or self.heads is not None:
                raise ValueError("steer.sae: steers along W_dec[feature]; give no vector or heads with it")
            self.vector = self.sae.W_dec[check_feature(self.feature, self.sae.d_sae, "steer.feature")]
        elif self.vector is None:
            raise ValueError("steer.vector: required, unless sae= and feature= name an SAE latent to steer along")
        self.vector = to_tensor(self.vector, "steer.vector")
        self.positions = Positions.parse(self.positions, "steer.positions").online("steer.positions")
        self.scale = _number(self.scale, "steer.scale")
        if not torch.isfinite(self.vector * self.scale).all():  # (added in float32)
            raise ValueError(f"steer.scale: {self.scale!r} times the vector is not finite in float32")
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


@dataclass
class Clamp:
    """Set latent `feature` of `sae` to `value` at the chosen positions, keeping what the SAE does not
    reconstruct: x + (value − f(x)) · W_dec[feature] (scaled back through the SAE's run-time
    normalisation, if any), with f(x) the latent of the row as it reaches the tap. Standard and
    JumpReLU SAEs; a topk SAE's latent depends on all the others, so clamping one is refused. A
    transcoder's latent is read where it reads and set where it writes (`hook` names its hook_out): the
    output gains (value − f(x)) · W_dec[feature], f(x) from the row where it reads (circuit-tracer's
    feature interventions; SAELens's spliced transcoder with its error term and the latent set)."""

    hook: str
    sae: SAE
    feature: int
    value: float
    positions: Any = "all"

    def __post_init__(self) -> None:
        _check_sae(self.sae, "clamp")
        if self.sae.architecture == "topk":
            raise ValueError(
                "clamp.sae: a topk SAE's latent is nonzero only while it ranks among the top k of all d_sae, so a "
                "clamp cannot be computed from its own row; clamp standard or jumprelu SAEs, or Steer(sae=, feature=)"
            )
        check_feature(self.feature, self.sae.d_sae, "clamp.feature")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not np.isfinite(self.value):
            raise ValueError(f"clamp.value: expected a finite number, got {self.value!r}")
        self.positions = Positions.parse(self.positions, "clamp.positions").online("clamp.positions")


def _number(value: Any, field: str) -> float:
    """A finite number (a 0-d tensor or numpy scalar too; not a string or a bool)."""
    try:
        number = None if isinstance(value, (str, bytes, bool)) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not np.isfinite(number):
        raise ValueError(f"{field}: expected a finite number, got {value!r}")
    return number


def _check_sae(sae: Any, kind: str) -> None:
    if not isinstance(sae, SAE):
        raise ValueError(f"{kind}.sae: expected a vlens.SAE (SAE.load(path)), got {type(sae).__name__}")


Intervention = Steer | Ablate | Patch | Clamp


def check_interventions(interventions: Sequence[Any]) -> None:
    """ValueError naming the first item of a request's (or a harvest's) interventions that is not one."""
    for i, iv in enumerate(interventions):
        if not isinstance(iv, (Steer, Ablate, Patch, Clamp)):
            raise ValueError(
                f"interventions[{i}]: expected vlens.Steer, Ablate, Patch or Clamp, got {type(iv).__name__}"
            )


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
