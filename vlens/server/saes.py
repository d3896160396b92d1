"""SAEs on the server: loaded once at start from `--sae NAME=PATH[@HOOK]` and checked against the model
(so a bad file stops the server, not a request), what GET /v1/saes says of them, and SAE features in a
response as compact JSON: a few numbers per row, so no binary container is needed."""

from __future__ import annotations

from typing import Any

import torch

from vlens.capture.bind import sae_tap
from vlens.config import ModelConfig
from vlens.outputs import RequestOutput
from vlens.sae.model import SAE
from vlens.server.config import split_named_sae


def load_saes(specs: tuple[str, ...] | None, cfg: ModelConfig, shapes: dict[str, tuple]) -> dict[str, SAE]:
    """name -> SAE for each `--sae`; ValueError naming the SAE at fault."""
    saes = {}
    for spec in specs or ():
        name, path, hook = split_named_sae(spec)
        try:
            sae = SAE.load(path, hook=hook)
            sae_tap(sae, cfg, shapes, "sae")
            if sae.transcoder:
                sae_tap(sae, cfg, shapes, "sae", writes=True)
        except ValueError as e:
            raise ValueError(f"saes: {name}: {e}") from None
        saes[name] = sae
    return saes


def describe(saes: dict[str, SAE]) -> list[dict[str, Any]]:
    """The GET /v1/saes entries."""
    fields = ("hook", "hook_out", "architecture", "d_in", "d_sae", "d_out", "k", "sha256")
    return [{"name": name, **{f: getattr(sae, f) for f in fields}} for name, sae in saes.items()]


def named_sae(saes: dict[str, SAE], name: str, field: str) -> SAE:
    """The SAE a request names; ValueError listing those the server has."""
    if name not in saes:
        loaded = f"loaded: {', '.join(saes)}" if saes else "none is loaded (start the server with --sae NAME=PATH)"
        raise ValueError(f"{field}: {name!r} is not an SAE of this server; {loaded}")
    return saes[name]


def features_json(out: RequestOutput) -> dict[str, dict[str, Any]]:
    """`vlens.sae_features` of a response: per hook, the rows' positions and tokens, then `ids` and
    `values` [rows][top_k], or `values` [rows][n] of the latents named, and `errors` [rows] when asked."""
    positions = out.activation_positions.tolist()
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    result = {}
    for hook in dict.fromkeys([*out.sae_features, *out.sae_errors]):
        entry: dict[str, Any] = {"positions": positions, "token_ids": [tokens[p] for p in positions]}
        features = out.sae_features.get(hook)
        if isinstance(features, tuple):
            entry["ids"], entry["values"] = features[0].tolist(), _floats(features[1])
        elif features is not None:
            entry["values"] = _floats(features)
        if hook in out.sae_errors:
            entry["errors"] = _floats(out.sae_errors[hook])
        result[hook] = entry
    return result


def _floats(t: torch.Tensor) -> list:
    """float32 values as the shortest decimals that read back as the same float32 (JSON has only doubles)."""
    values = t.float().numpy()
    flat = [float(str(v)) for v in values.ravel()]
    if values.ndim == 1:
        return flat
    width = values.shape[1]
    return [flat[i : i + width] for i in range(0, len(flat), width)] if width else [[] for _ in range(len(values))]
