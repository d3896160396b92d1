"""A tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with the Tuned Lens"): one
affine translator per layer input, h + W h + b, before the final norm and unembedding, so that a middle layer's
residual stream reads as the model's own next-token prediction would. Read from the files the tuned-lens package
saves (`TunedLens.save`: config.json and params.pt, `layer_translators`' state dict), the lenses it publishes
included; the logit lens's readout applies it (vlens.capture.readouts.logit_lens).

Translator i reads HF's hidden_states[i], the input of layer i: `blocks.i.hook_resid_pre`, or the output of the layer
before, `blocks.{i-1}.hook_resid_post`. The last layer's output needs none (the tuned-lens package has N
translators for N layers, the last one's output being what the model unembeds)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlens.config import ModelConfig


@dataclass
class TunedLens:
    weight: torch.Tensor  # [layers, d, d]: translator i's W (nn.Linear's layout, out x in)
    bias: torch.Tensor  # [layers, d]
    _placed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def load(cls, path: str | Path) -> TunedLens:
        """A tuned-lens directory (config.json, params.pt), as `tuned_lens.TunedLens.save` writes it."""
        path = Path(path)
        try:
            config = json.loads((path / "config.json").read_text())
            state = torch.load(path / "params.pt", map_location="cpu", weights_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"tuned_lens: {str(path)!r} is not a tuned-lens directory (config.json, params.pt): "
                             f"{e}") from None  # fmt: skip
        layers, d = config.get("num_hidden_layers"), config.get("d_model")
        if config.get("lens_type", "linear_tuned_lens") != "linear_tuned_lens":
            raise ValueError(f"tuned_lens: {str(path)!r} is a {config.get('lens_type')!r} lens; vlens reads "
                             "linear_tuned_lens")  # fmt: skip
        if not (isinstance(layers, int) and isinstance(d, int) and isinstance(state, dict)):
            raise ValueError(f"tuned_lens: {str(path)!r}: config.json needs num_hidden_layers and d_model, params.pt "
                             "a state dict")  # fmt: skip
        expected = {f"{i}.{name}": shape for i in range(layers) for name, shape in (("weight", (d, d)), ("bias", (d,)))}
        if not config.get("bias", True):
            state = {**state, **{f"{i}.bias": torch.zeros(d) for i in range(layers)}}
        bad = [key for key, shape in expected.items() if tuple(getattr(state.get(key), "shape", ())) != shape]
        if bad:
            raise ValueError(f"tuned_lens: {str(path)!r}: params.pt lacks {bad[0]} of shape {expected[bad[0]]} (a lens "
                             f"of {layers} layers of width {d}, as config.json says)")  # fmt: skip
        weight = torch.stack([state[f"{i}.weight"] for i in range(layers)]).float()
        bias = torch.stack([state[f"{i}.bias"] for i in range(layers)]).float()
        return cls(weight, bias)

    def __post_init__(self) -> None:
        layers, d = self.weight.shape[0], self.weight.shape[-1]
        if self.weight.shape != (layers, d, d) or self.bias.shape != (layers, d):
            raise ValueError(f"tuned_lens: weight {tuple(self.weight.shape)} and bias {tuple(self.bias.shape)} are not "
                             "[layers, d, d] and [layers, d]")  # fmt: skip

    def placed(self, device: torch.device, dtype: torch.dtype) -> TunedLens:
        """This lens on `device` in `dtype`, copied once per (device, dtype), not per request."""
        key = (torch.device(device), dtype)
        if key not in self._placed:
            self._placed[key] = TunedLens(self.weight.to(device, dtype), self.bias.to(device, dtype))
        return self._placed[key]

    def check(self, cfg: ModelConfig, option: str = "capture.tuned_lens") -> int:
        """This lens's number of layers, which must be the model's, as its width."""
        layers, d = self.weight.shape[0], self.weight.shape[-1]
        if (layers, d) != (cfg.num_layers, cfg.hidden_size):
            raise ValueError(f"{option}: a lens of {layers} layers of width {d}; this model has {cfg.num_layers} of "
                             f"width {cfg.hidden_size}")  # fmt: skip
        return layers

    def translators(self, taps: list[str], cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each tap's translator (W, b) by the layer input it is; None for the last layer's output (none needed)."""
        layers = self.check(cfg)
        out: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for tap in taps:
            parts = tap.split(".")
            if len(parts) != 3 or parts[0] != "blocks" or parts[2] not in ("hook_resid_pre", "hook_resid_post"):
                raise ValueError(f"capture.tuned_lens: translates a layer's input or output (blocks.L.hook_resid_pre, "
                                 f"blocks.L.hook_resid_post, hidden_states.i), not {tap}")  # fmt: skip
            index = int(parts[1]) + (parts[2] == "hook_resid_post")
            out[tap] = (self.weight[index], self.bias[index]) if index < layers else None
        return out
