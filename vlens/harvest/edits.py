"""Interventions in a harvest: the rows of an edited model — steered by a steering vector (`vlens
steering-vector`), or by any Steer, Ablate, Patch or Clamp — stored as the unedited model's would be.

They are the engine's edits, applied in every window as a request's are in a step (positions counted from
the window's start; under tensor parallelism every rank edits), and the harvest's row takers read a tap
after its edits, as a Capture does. The manifest records a digest of what they write, so a resumed run with
other edits is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vlens.capture.bind import BoundIntervention, bind_interventions
from vlens.capture.names import request_shapes
from vlens.steering import SteeringVector

if TYPE_CHECKING:
    from vlens.harvest.config import HarvestConfig
    from vlens.loader import LoadedModel


@dataclass(frozen=True)
class HarvestEdits:
    """A harvest's interventions bound to its model, the steering vector's steers last."""

    given: list[Any]  # the Steer, Ablate, Patch and Clamp objects (what a generation's requests apply)
    bound: list[BoundIntervention]
    kinds: list[str]  # each one's class name, for the manifest
    steering_vector: dict[str, Any] | None  # its file and multiplier, for the manifest

    def describe(self) -> dict[str, Any]:
        """The manifest's record: what each edit is, and a digest of the values it writes."""
        digest = hashlib.sha256()
        for iv in self.bound:
            digest.update(repr((iv.kind, iv.taps, str(iv.positions), iv.value_positions, iv.reads)).encode())
            for t in (iv.data, iv.mask, iv.encoder, iv.params):
                if t is not None:
                    digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        edits = [
            {"kind": kind, "hooks": iv.taps, "positions": str(iv.positions)} for kind, iv in zip(self.kinds, self.bound)
        ]
        return {"edits": edits, "steering_vector": self.steering_vector, "sha256": digest.hexdigest()}


def harvest_edits(config: HarvestConfig, loaded: LoadedModel) -> HarvestEdits | None:
    """The interventions a harvest's options name, checked against the model (None: it edits nothing)."""
    given, described = list(config.interventions or ()), None
    shapes = request_shapes(loaded.config)
    if config.steering_vector is not None:
        vector, path = config.steering_vector, None
        if not isinstance(vector, SteeringVector):
            path, vector = str(vector), SteeringVector.load(vector)
        vector.check(loaded.config, shapes, "steering_vector")
        multiplier = 1.0 if config.multiplier is None else config.multiplier
        given += vector.steers(multiplier)
        described = {"path": path, "multiplier": multiplier}
    if not given:
        return None
    window = config.context_size
    bound = bind_interventions(given, window, window, loaded.model, shapes)
    return HarvestEdits(given, bound, [type(iv).__name__ for iv in given], described)
