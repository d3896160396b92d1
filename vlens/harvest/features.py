"""SAE features in a harvest: the top-k latents of every stored row (`sae_ids` int32 and `sae_values`
[rows, top_k] in the shards, beside or instead of the dense rows), encoded on the device inside the
forward. Reading them back (the max-activating examples of a latent) is `dataset`'s.

The encoding is the engine's SAE readout (vlens.sae.readout) run as a tap hook of the packed forward
on the rows the harvest keeps, so what a harvest stores is what `Capture(sae=, top_k=)` returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vlens.capture.bind import sae_tap
from vlens.capture.names import request_shapes
from vlens.sae.model import SAE
from vlens.sae.readout import SAEReadout, read_group

if TYPE_CHECKING:
    from vlens.harvest.config import HarvestConfig

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

    def encode(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The top latents of `rows` (on the device, in the model's dtype): ids int32 and values in `dtype`."""
        readout = SAEReadout(self.sae.placed(rows.device, rows.dtype), self.top_k, None, False, dtype)
        [(ids, values)] = read_group([readout], [rows])
        return ids, values


def feature_harvest(config: HarvestConfig, model_config: Any) -> FeatureHarvest | None:
    """The SAE a harvest's options name, checked against the model (its hook, its width, top_k)."""
    if config.sae is None:
        return None
    if isinstance(config.sae, SAE):
        sae = config.sae if config.sae_hook is None else dataclasses.replace(config.sae, hook=config.sae_hook)
    else:
        sae = SAE.load(config.sae, hook=config.sae_hook)
    tap = sae_tap(sae, model_config, request_shapes(model_config), "sae")
    if config.top_k > sae.d_sae:
        raise ValueError(f"top_k: {config.top_k} is more than the SAE's d_sae={sae.d_sae}")
    return FeatureHarvest(sae, tap, config.top_k)
