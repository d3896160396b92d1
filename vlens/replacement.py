"""The transcoders an attribution graph reads a model through (vlens.attribution_graph), behind one interface:
per-layer transcoders (a vlens SAE with `hook_out` for each layer, SAELens's transcoder objects, circuit-tracer's
TranscoderSet) or circuit-tracer's cross-layer transcoder, whose features read one layer's input and write to the
MLP outputs of that layer and every later one.

Each layer L's transcoder reads `reads[L]` and what its features write lands in `writes[L]` (the layer's
hook_mlp_out, or on Gemma the MLP's output before its post-norm) of each layer in `targets(L)`. All of it float32
on the host, but `skip`, which the replacement model's forward calls on the device. A cross-layer transcoder's
decoders are read for the features asked for only (circuit-tracer's lazy decoders stay on disk but for those).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vlens.capture.names import layer_hooks, mlp_input
from vlens.hooked_saes import as_vlens_sae
from vlens.sae.files import from_saelens
from vlens.sae.model import SAE

if TYPE_CHECKING:
    from vlens.config import ModelConfig
    from vlens.hooked import HookedLM

class PerLayer:
    """One transcoder per layer: layer L's features write to layer L alone."""

    def __init__(self, transcoders: list[SAE]):
        self.tcs = [tc.placed("cpu", torch.float32) for tc in transcoders]
        self.reads, self.writes = [tc.hook for tc in transcoders], [tc.hook_out for tc in transcoders]
        self.d_in = [tc.d_in for tc in transcoders]
        self.d_out = [tc.d_out for tc in transcoders]
        self.d_sae = [tc.d_sae for tc in transcoders]

    def targets(self, layer: int) -> range:
        return range(layer, layer + 1)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.tcs[layer].encode(x)

    def encoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        return self.tcs[layer].W_enc[:, features].T

    def latent(self, layer: int, feature: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(encoder row [d], bias, JumpReLU threshold or None): how feature `feature` of layer `layer` is read."""
        tc = self.tcs[layer]
        if tc.architecture == "topk":
            raise ValueError(f"transcoders[{layer}]: a topk transcoder's latent depends on all the others, so it is "
                             "not set from its own row")  # fmt: skip
        return tc.W_enc[:, feature], tc.b_enc[feature], None if tc.threshold is None else tc.threshold[feature]

    def decoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """[features, targets, d]: what each feature writes to each layer it writes to."""
        return self.tcs[layer].W_dec[features][:, None]

    def constant(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """What layer `layer`'s output has beside its features' writes: b_dec, and the skip connection from `x`."""
        tc = self.tcs[layer]
        return tc.skip(tc.b_dec.expand(len(x), -1), x)

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        W_skip = self.tcs[layer].W_skip
        return None if W_skip is None else x @ W_skip.to(x.device, x.dtype).T


class CrossLayer:
    """circuit-tracer's CrossLayerTranscoder: layer L's features write W_dec[L][f, L' - L] to each layer L' >= L;
    ReLU or its JumpReLU (x * (x > threshold)); a skip connection per layer (x @ W_skip[L])."""

    def __init__(self, clt: Any, reads: list[str], writes: list[str]):
        n = clt.n_layers
        self.clt, self.reads, self.writes = clt, reads, writes
        self.W_enc = clt._get_encoder_weights().detach().float().cpu()  # [n, d_sae, d]
        self.b_enc, self.b_dec = clt.b_enc.detach().float().cpu(), clt.b_dec.detach().float().cpu()
        self.W_skip = None if clt.W_skip is None else clt.W_skip.detach().float().cpu()
        act = clt.activation_function
        self.threshold = act.threshold.detach().float().cpu() if type(act).__name__ == "JumpReLU" else None
        self.d_in = self.d_out = [clt.d_model] * n
        self.d_sae = [clt.d_transcoder] * n

    def targets(self, layer: int) -> range:
        return range(layer, len(self.reads))

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        pre = x @ self.W_enc[layer].T + self.b_enc[layer]
        return pre.relu() if self.threshold is None else pre * (pre > self.threshold[layer])

    def encoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        return self.W_enc[layer][features]

    def latent(self, layer: int, feature: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        threshold = None if self.threshold is None else self.threshold[layer].reshape(-1)[feature]  # (its [1, d_sae])
        return self.W_enc[layer][feature], self.b_enc[layer][feature], threshold

    def decoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """[features, targets, d]: what each feature writes to each layer it writes to."""
        if not len(features):  # (a lazy decoder's file is not read for nothing)
            return torch.zeros(0, len(self.targets(layer)), self.d_out[layer])
        return self.clt._get_decoder_vectors(layer, features).detach().float().cpu()

    def constant(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        out = self.b_dec[layer].expand(len(x), -1)
        return out if self.W_skip is None else out + x @ self.W_skip[layer]

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.W_skip is None else x @ self.W_skip[layer].to(x.device, x.dtype)


def replacement(model: HookedLM, transcoders: Any) -> PerLayer | CrossLayer:
    """The transcoders an attribution graph of `model` reads (see attribute), checked: one per layer (or a
    cross-layer one spanning them), each reading a hook of its layer up to the MLP's input and writing
    blocks.L.hook_mlp_out (or, before a post-norm, the MLP's own output, blocks.L.mlp.hook_out), of the widths those
    hooks have."""
    n = model.cfg.num_layers
    if hasattr(transcoders, "feature_input_hook"):  # circuit-tracer's: its hooks name every layer's
        reads = [from_saelens(f"blocks.{layer}.{transcoders.feature_input_hook}") for layer in range(n)]
        writes = [f"blocks.{layer}.{_written(model, transcoders.feature_output_hook)}" for layer in range(n)]
        if type(transcoders).__name__ == "CrossLayerTranscoder":
            if transcoders.n_layers != n:
                raise ValueError(f"transcoders: a cross-layer transcoder of {transcoders.n_layers} layers; this model "
                                 f"has {n}")  # fmt: skip
            chosen: PerLayer | CrossLayer = CrossLayer(transcoders, reads, writes)
        else:
            chosen = PerLayer([SAE.from_circuit_tracer(tc, r, w) for tc, r, w in zip(transcoders, reads, writes)])
    else:
        chosen = PerLayer(_per_layer(list(transcoders)))
    if len(chosen.reads) != n:
        raise ValueError(f"transcoders: {len(chosen.reads)} given; an attribution graph needs one per layer, {n}")
    for layer in range(n):
        where = f"transcoders[{layer}]"
        outputs = [f"blocks.{layer}.hook_mlp_out"] + [f"blocks.{layer}.mlp.hook_out"] * model.cfg.post_norms_at(layer)
        if chosen.writes[layer] not in outputs:
            raise ValueError(f"{where}: writes {chosen.writes[layer]!r}; layer {layer}'s must write "
                             f"{' or '.join(outputs)}")  # fmt: skip
        before_mlp, read = layer_hooks(model.cfg, layer), mlp_input(model.cfg, layer)
        before_mlp = before_mlp[: before_mlp.index(read) + 1]
        if chosen.reads[layer] not in {f"blocks.{layer}.{hook}" for hook in before_mlp}:
            raise ValueError(f"{where}: reads {chosen.reads[layer]!r}; layer {layer}'s must read a hook of its "
                             f"layer up to the MLP's input, blocks.{layer}.{read}")  # fmt: skip
        model._check_hook(chosen.reads[layer], chosen.d_in[layer], "hook", "d_in")
        model._check_hook(chosen.writes[layer], chosen.d_out[layer], "hook_out", "d_out")
    return chosen


def check_frozen_attention(cfg: ModelConfig, what: str) -> None:
    """Refuse to freeze the attention of a model with layers that mix tokens otherwise: a gated delta net has no
    patterns to freeze (its output is its recurrent state read by its queries, which its queries, keys, rates and
    decays make together), nor a gated short convolution (its gates multiply what it mixes); nor the latent KV cache's
    multi-head latent attention."""
    others = [layer for layer in range(cfg.num_layers) if not cfg.attends(layer)]
    if others:
        raise ValueError(f"{what}: freezes attention patterns, and {cfg.architecture}'s layers {others} are linear "
                         "attention, short convolutions or Mamba mixers, which have none; it runs on models whose "
                         "layers all attend")  # fmt: skip
    if cfg.latent_kv_cache:  # (its scores read the latents, which its values read too: no q and k to freeze)
        raise ValueError(f"{what}: freezes attention patterns through attn.hook_q and attn.hook_k, which a model "
                         "loaded with latent_kv_cache=True attends without; load it without latent_kv_cache")


def _per_layer(transcoders: Sequence[Any]) -> list[SAE]:
    tcs = [as_vlens_sae(t) for t in transcoders]
    for layer, tc in enumerate(tcs):
        if not tc.transcoder:
            raise ValueError(f"transcoders[{layer}]: an SAE (it writes where it reads); an attribution graph needs "
                             "transcoders")  # fmt: skip
    return tcs


def _written(model: HookedLM, hook: str) -> str:
    """The hook a circuit-tracer transcoder set writes (relative to a block) in vlens's names: its ReplacementMLP's
    output, `mlp.hook_out`, is what the layer adds (hook_mlp_out), but where a post-norm follows the MLP (Gemma),
    whose input vlens taps under that name. (What it reads, `mlp.hook_in`, SAELens's name too, from_saelens
    translates.)"""
    return "hook_mlp_out" if hook == "mlp.hook_out" and not model.cfg.any_post_norms else hook
