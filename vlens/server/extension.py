"""The `vlens` extension object of a request:
`{"capture": {...}, "return_hidden_states": bool, "interventions": [{"type": "steer", ...}, ...],
"steering": [{"name": ..., "multiplier": ...}, ...]}`. SAEs and steering vectors are named by the names the
server loaded them under (`vlens serve --sae NAME=PATH`, `--steering-vector NAME=PATH`).

Each key has one parser that turns its JSON value into SamplingParams keyword arguments, listed in
FIELDS; a new key (interventions, say) is one function and one entry there. Unknown keys are refused
by name, so a typo never means a silently ignored capture. The keys are read in FIELDS' order, and
interventions they give add up in it (a steering vector's steers after `interventions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from vlens.capture import TunedLens
from vlens.engine.lora import LoRARequest
from vlens.sae.model import SAE
from vlens.server.protocol import APIError, from_value_error, schema_error
from vlens.server.specs import CaptureSpec, InterventionSpec, SteeringSpec
from vlens.steering import SteeringVector

ENABLE_CAPTURE_HINT = (
    "activation capture is disabled on this server; the operator enables it by starting "
    "`vlens serve --enable-capture` (and may bound it with --max-capture-bytes)"
)


@dataclass(frozen=True)
class ExtensionContext:
    """What the parsers may depend on besides the value itself."""

    enable_capture: bool
    saes: dict[str, SAE] = field(default_factory=dict)  # what requests may name (vlens serve --sae)
    tuned_lens: TunedLens | None = None  # what capture.tuned_lens reads through (vlens serve --tuned-lens)
    steering_vectors: dict[str, SteeringVector] = field(default_factory=dict)  # (vlens serve --steering-vector)
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # the LoRA adapters by name (--lora-modules)


def _interventions(value: Any, ctx: ExtensionContext) -> dict[str, Any]:
    def parse(item: Any) -> list:
        return [InterventionSpec.model_validate(item).to_intervention(ctx.saes)]

    return {"interventions": _each(value, "interventions", "{type, hook, ...}", parse)}


def _steering(value: Any, ctx: ExtensionContext) -> dict[str, Any]:
    def parse(item: Any) -> list:
        return SteeringSpec.model_validate(item).to_steers(ctx.steering_vectors)

    return {"interventions": _each(value, "steering", "{name, multiplier, positions}", parse)}


def _each(value: Any, key: str, form: str, parse: Callable[[Any], list]) -> list:
    """The items of the list at vlens.`key`, each parsed into interventions; an error names its item."""
    if not isinstance(value, list):
        raise APIError(400, f"vlens.{key}: expected a list of {form} objects", param=f"vlens.{key}")
    out = []
    for i, item in enumerate(value):
        try:
            out += parse(item)
        except ValidationError as e:
            raise schema_error(e.errors(), 400, ("vlens", key, i)) from None
        except ValueError as e:
            raise APIError(400, f"vlens.{key}[{i}].{' '.join(str(e).split())}", param=f"vlens.{key}[{i}]") from None
    return out


def _require_capture(ctx: ExtensionContext, param: str) -> None:
    if not ctx.enable_capture:
        raise APIError(400, ENABLE_CAPTURE_HINT, param=param, code="capture_disabled")


def _capture(value: Any, ctx: ExtensionContext) -> dict[str, Any]:
    _require_capture(ctx, "vlens.capture")
    try:
        return {"capture": CaptureSpec.model_validate(value).to_capture(ctx.saes, ctx.tuned_lens)}
    except ValidationError as e:
        raise schema_error(e.errors(), 400, ("vlens", "capture")) from None
    except ValueError as e:
        raise from_value_error(e, prefix="vlens.") from None


def _return_hidden_states(value: Any, ctx: ExtensionContext) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise APIError(400, "vlens.return_hidden_states: expected true or false", param="vlens.return_hidden_states")
    if value:
        _require_capture(ctx, "vlens.return_hidden_states")
    return {"return_hidden_states": value}


FIELDS: dict[str, Callable[[Any, ExtensionContext], dict[str, Any]]] = {
    "capture": _capture,
    "return_hidden_states": _return_hidden_states,
    "interventions": _interventions,
    "steering": _steering,
}


def parse_extension(raw: dict[str, Any] | None, ctx: ExtensionContext) -> dict[str, Any]:
    """The `vlens` object -> SamplingParams keyword arguments; APIError naming the field at fault."""
    if not raw:
        return {}
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise APIError(
            400,
            f"vlens.{unknown[0]}: unknown field (unknown: {', '.join(unknown)}); known: {', '.join(FIELDS)}",
            param=f"vlens.{unknown[0]}",
        )
    kwargs: dict[str, Any] = {}
    for key, parse in FIELDS.items():
        if raw.get(key) is not None:
            for name, value in parse(raw[key], ctx).items():
                kwargs[name] = kwargs.get(name, []) + value if name == "interventions" else value
    return kwargs
