"""The JSON forms of the `vlens` extension's objects (capture, interventions) and of the whole object.

They live apart from their parsing (extension.py) so that protocol.py can put them in the OpenAPI
document without importing the parsers, which import protocol.py for its errors.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from vlens.capture import Ablate, Capture, Clamp, Patch, Positions, Steer, TunedLens
from vlens.sae.model import SAE
from vlens.server.saes import named_sae
from vlens.steering import SteeringVector


class SliceSpec(BaseModel):
    """Python's slice over a sequence's rows, as JSON: {"start": 0, "stop": -1, "step": 2}."""

    model_config = ConfigDict(extra="forbid")
    start: StrictInt | None = None
    stop: StrictInt | None = None
    step: StrictInt | None = None


PositionsJSON = StrictStr | StrictInt | list[StrictInt] | SliceSpec


def _positions(value: PositionsJSON, field: str) -> Positions:
    return Positions.parse(value.model_dump() if isinstance(value, SliceSpec) else value, field)


class CaptureSpec(BaseModel):
    """JSON form of vlens.Capture: which hooks, at which positions, in which dtype, read out how."""

    model_config = ConfigDict(extra="forbid")
    hooks: StrictStr | list[StrictStr] | None = None  # required unless `sae` names an SAE (its hook is the default)
    hook: StrictStr | None = None  # the same, for one hook
    positions: PositionsJSON = "all"
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    exclude_token_ids: list[StrictInt] | None = None
    reduce: Literal["none", "mean"] = "none"
    project: list[list[float]] | None = None  # W [d, k]
    project_bias: list[float] | None = None  # b [k]
    logit_lens: StrictInt | None = None
    tuned_lens: StrictBool = False  # with logit_lens: through the server's tuned lens (vlens serve --tuned-lens)
    heads: list[StrictInt] | None = None  # at per-head taps (attn.hook_q/k/v/z, scores, patterns)
    sae: StrictStr | None = None  # the name of an SAE of this server (GET /v1/saes): its features, not rows
    top_k: StrictInt | None = None  # with sae: the k largest latents per row
    features: list[StrictInt] | None = None  # with sae: these latents per row
    sae_error: StrictBool = False  # with sae: the reconstruction error per row

    def to_capture(self, saes: dict[str, SAE], tuned_lens: TunedLens | None = None) -> Capture:
        positions = _positions(self.positions, "capture.positions")
        project = self.project if self.project_bias is None else (self.project, self.project_bias)
        if self.project is None and self.project_bias is not None:
            raise ValueError("capture.project_bias: given without capture.project")
        if self.hooks is not None and self.hook is not None:
            raise ValueError("capture.hook: give hook or hooks, not both")
        hooks = self.hooks if self.hooks is not None else self.hook
        if hooks is None and self.sae is None:
            raise ValueError("capture.hooks: required (hook names or globs), unless capture.sae names an SAE")
        sae = None if self.sae is None else named_sae(saes, self.sae, "capture.sae")
        if self.tuned_lens and tuned_lens is None:
            raise ValueError("capture.tuned_lens: this server has no tuned lens; the operator loads one with "
                             "`vlens serve --tuned-lens PATH`")  # fmt: skip
        return Capture(
            hooks=hooks,
            positions=positions,
            dtype=self.dtype,
            exclude_token_ids=self.exclude_token_ids,
            reduce=self.reduce,
            project=project,
            logit_lens=self.logit_lens,
            tuned_lens=tuned_lens if self.tuned_lens else None,
            heads=self.heads,
            sae=sae,
            top_k=self.top_k,
            features=self.features,
            sae_error=self.sae_error,
        )


class InterventionSpec(BaseModel):
    """JSON form of vlens.Steer / Ablate / Patch / Clamp: the `type` says which, the fields follow it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["steer", "ablate", "patch", "clamp"]
    hook: StrictStr
    vector: list[float] | None = None  # steer
    scale: float = 1.0  # steer
    direction: list[float] | None = None  # ablate (project a direction out)
    # ablate with heads: what the heads are set to; clamp: the latent's value
    value: float | list[float] | list[list[float]] | None = None
    values: list[float] | list[list[float]] | list[list[list[float]]] | None = None  # patch
    positions: PositionsJSON = "all"
    heads: list[StrictInt] | None = None  # at attn.hook_q/k/v/z: edit only these heads
    sae: StrictStr | None = None  # steer along, or clamp, a latent of this SAE of the server ...
    feature: StrictInt | None = None  # ... this latent

    # The fields each type reads besides type, hook and positions: another one given is a mistake, not a no-op
    FIELDS: ClassVar[dict[str, set[str]]] = {
        "steer": {"vector", "scale", "heads", "sae", "feature"}, "ablate": {"direction", "heads", "value"},
        "patch": {"values", "heads"}, "clamp": {"sae", "feature", "value"},
    }  # fmt: skip

    def to_intervention(self, saes: dict[str, SAE]) -> Steer | Ablate | Patch | Clamp:
        stray = sorted(self.model_fields_set - self.FIELDS[self.type] - {"type", "hook", "positions"})
        if stray:
            raise ValueError(f"{self.type}.{stray[0]}: not a field of a {self.type} intervention, which takes "
                             f"{', '.join(sorted(self.FIELDS[self.type]))}, positions")  # fmt: skip
        positions = _positions(self.positions, f"{self.type}.positions")
        sae = None if self.sae is None else named_sae(saes, self.sae, f"{self.type}.sae")
        if self.type == "clamp":
            if sae is None or self.feature is None or not isinstance(self.value, (int, float)):
                raise ValueError("clamp: needs sae (a name), feature (a latent) and value (a number)")
            return Clamp(self.hook, sae, self.feature, self.value, positions=positions)
        if self.type == "ablate":
            return Ablate(self.hook, self.direction, positions=positions, heads=self.heads, value=self.value)
        if self.type == "steer" and (sae is not None or self.feature is not None):
            return Steer(self.hook, self.vector, self.scale, positions, self.heads, sae=sae, feature=self.feature)
        name = "vector" if self.type == "steer" else "values"
        data = getattr(self, name)
        if data is None:
            raise ValueError(f"{self.type}.{name}: required for a {self.type} intervention")
        if self.type == "steer":
            return Steer(self.hook, data, scale=self.scale, positions=positions, heads=self.heads)
        return Patch(self.hook, data, positions=positions, heads=self.heads)


class SteeringSpec(BaseModel):
    """A steering vector of the server (`vlens serve --steering-vector NAME=PATH`), added at every hook it has."""

    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    multiplier: float = 1.0
    positions: PositionsJSON = "all"

    def to_steers(self, vectors: dict[str, SteeringVector]) -> list[Steer]:
        if self.name not in vectors:
            loaded = f"loaded: {', '.join(vectors)}" if vectors else "none is loaded (vlens serve --steering-vector)"
            raise ValueError(f"name: {self.name!r} is not a steering vector of this server; {loaded}")
        return vectors[self.name].steers(self.multiplier, _positions(self.positions, "positions"))


class ExtensionSpec(BaseModel):
    """The `vlens` object of a completion or chat request as the OpenAPI document shows it. Requests keep
    it raw and extension.py parses each key on its own (capture refused by name when disabled, errors
    as 400s under `vlens.`); tests/test_server_fuzz.py checks both list the same keys."""

    model_config = ConfigDict(extra="forbid")
    capture: CaptureSpec | None = None
    return_hidden_states: StrictBool | None = None
    interventions: list[InterventionSpec] | None = None
    steering: list[SteeringSpec] | None = None  # added after the interventions
