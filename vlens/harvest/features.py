"""SAE features in a harvest: the top-k latents of every stored row (`sae_ids` int32 and `sae_values`
[rows, top_k] in the shards, beside or instead of the dense rows), encoded on the device inside the
forward, and read back as the max-activating examples of a latent.

The encoding is the engine's SAE readout (vlens.sae.readout) run as a tap hook of the packed forward
on the rows the harvest keeps, so what a harvest stores is what `Capture(sae=, top_k=)` returns.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vlens.capture.bind import sae_tap
from vlens.capture.names import hook_shapes
from vlens.sae.model import SAE
from vlens.sae.readout import SAEReadout, read_group

if TYPE_CHECKING:
    from vlens.harvest.config import HarvestConfig
    from vlens.harvest.dataset import ActivationDataset

SAE_KEYS = ("sae_ids", "sae_values")


@dataclass(frozen=True)
class FeatureHarvest:
    """What a harvest stores of an SAE: the top_k latents per row of the tap it reads."""

    sae: SAE
    tap: str
    top_k: int

    def describe(self) -> dict[str, Any]:
        """The manifest's record of the SAE: enough to know whose latents the shards hold."""
        sae = self.sae
        return {"path": sae.path, "sha256": sae.sha256, "hook": sae.hook, "tap": self.tap, "architecture": sae.architecture,
                "d_in": sae.d_in, "d_sae": sae.d_sae, "top_k": self.top_k}  # fmt: skip

    def reader(
        self, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A tap hook for one packed batch: the top latents of its packed rows `rows`, into `ids` and
        `values` (the batch's slice of the shard tensors); the tapped value passes unchanged."""

        def read(x: torch.Tensor) -> torch.Tensor:
            readout = SAEReadout(self.sae.placed(x.device, x.dtype), self.top_k, None, False, values.dtype)
            [(top_ids, top_values)] = read_group([readout], [x.index_select(0, rows.to(x.device))])
            ids.copy_(top_ids)
            values.copy_(top_values)
            return x

        return read


def feature_harvest(config: HarvestConfig, model_config: Any) -> FeatureHarvest | None:
    """The SAE a harvest's options name, checked against the model (its hook, its width, top_k)."""
    if config.sae is None:
        return None
    if isinstance(config.sae, SAE):
        sae = config.sae if config.sae_hook is None else dataclasses.replace(config.sae, hook=config.sae_hook)
    else:
        sae = SAE.load(config.sae, hook=config.sae_hook)
    tap = sae_tap(sae, model_config, hook_shapes(model_config), "sae")
    if config.top_k > sae.d_sae:
        raise ValueError(f"top_k: {config.top_k} is more than the SAE's d_sae={sae.d_sae}")
    return FeatureHarvest(sae, tap, config.top_k)


@dataclass(frozen=True)
class FeatureExample:
    """A row where a latent fires: its value, where the row sits (its index in the dataset, its window
    and position) and the tokens around it in its window (rows left out, such as BOS, are missing)."""

    value: float
    row: int
    window: int
    position: int
    token_id: int
    context_ids: list[int]
    context_positions: list[int]


def max_activating(ds: ActivationDataset, feature: int, n: int, context: int) -> list[FeatureExample]:
    """The n rows of the harvest where `feature` is largest (ties: the earlier row), one shard mapped at a time."""
    described = ds.manifest.get("sae")
    if not described:
        raise ValueError("feature: this harvest stored no SAE latents; harvest with --sae PATH --top-k K")
    d_sae = described["d_sae"]
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < d_sae:
        raise ValueError(
            f"feature: {feature!r} is not a latent of the harvest's SAE; expected an int in 0..{d_sae - 1}"
        )
    if n < 1 or context < 0:
        raise ValueError(f"n must be >= 1 and context >= 0, got {n}, {context}")
    values, rows = torch.empty(0), torch.empty(0, dtype=torch.long)
    for s in range(len(ds.files)):
        shard = ds.mapped(s)
        local, column = (shard["sae_ids"] == feature).nonzero(as_tuple=True)
        if not len(local):
            continue
        values = torch.cat([values, shard["sae_values"][local, column].float()])
        rows = torch.cat([rows, local + ds.offsets[s]])  # ascending, so a stable sort breaks ties by row
        order = torch.sort(values, descending=True, stable=True).indices[:n]
        values, rows = values[order], rows[order]
    return [_example(ds, float(v), int(r), context) for v, r in zip(values, rows)]


def _example(ds: ActivationDataset, value: float, row: int, context: int) -> FeatureExample:
    s = bisect.bisect_right(ds.offsets, row) - 1
    shard = ds.mapped(s)
    local = row - ds.offsets[s]
    window, position = int(shard["window"][local]), int(shard["position"][local])
    near = (shard["window"] == window) & ((shard["position"] - position).abs() <= context)
    order = torch.argsort(shard["position"][near])
    return FeatureExample(
        value, row, window, position, int(shard["token_ids"][local]), shard["token_ids"][near][order].tolist(),
        shard["position"][near][order].tolist(),
    )  # fmt: skip
