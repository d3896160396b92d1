"""Random SAEs saved the way SAELens saves them (and Gemma Scope's params.npz), and SAELens's encoding
written out from its source (sae_lens/saes/*.py), as the oracle the SAE tests compare vlens with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

D = 576  # SmolLM2's residual width
HOOK = "blocks.5.hook_resid_post"
LAYER = 5


def random_weights(d_in: int, d_sae: int, seed: int, threshold: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = {
        "W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        "b_enc": torch.randn(d_sae, generator=g) * 0.2,
        "W_dec": torch.randn(d_sae, d_in, generator=g) / d_sae**0.5,
        "b_dec": torch.randn(d_in, generator=g) * 0.2,
    }
    if threshold:
        weights["threshold"] = torch.rand(d_sae, generator=g) * 0.5
    return weights


def save_saelens(
    path: Path, architecture: str = "standard", d_sae: int = 512, seed: int = 0, hook: str = HOOK, d_in: int = D,
    legacy: bool = False, **config,
) -> tuple[Path, dict[str, torch.Tensor], dict]:  # fmt: skip
    """A directory as SAELens 6 `save_model` writes it (cfg.json with the hook under metadata), or with
    `legacy` as SAELens 5 did (hook_name at the top level, TopK as activation_fn kwargs)."""
    path.mkdir(parents=True, exist_ok=True)
    weights = random_weights(d_in, d_sae, seed, architecture == "jumprelu")
    save_file(weights, str(path / "sae_weights.safetensors"))
    cfg = {"d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
           "normalize_activations": "none", "reshape_activations": "none", **config}  # fmt: skip
    if legacy:
        cfg.update(hook_name=hook, sae_lens_version="5.9.0")
        if architecture == "topk":
            cfg.update(activation_fn="topk", activation_fn_kwargs={"k": cfg.pop("k")})
    else:
        cfg.update(architecture=architecture, metadata={"hook_name": hook, "sae_lens_version": "6.5.0"})
    (path / "cfg.json").write_text(json.dumps(cfg))
    return path, weights, {"architecture": architecture, **cfg}


def save_gemma_scope(path: Path, d_sae: int = 256, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """params.npz as Gemma Scope ships it (lower-case w_ names, as some releases have them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = random_weights(D, d_sae, seed, threshold=True)
    arrays = {("w_" + k[2:] if k.startswith("W_") else k): v.numpy() for k, v in weights.items()}
    np.savez(path, **arrays)
    return path, weights


def saelens_encode(w: dict[str, torch.Tensor], cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """SAELens's encode, written out (process_sae_in, then each architecture's activation)."""
    norm = cfg["normalize_activations"]
    if norm == "layer_norm":
        x = x - x.mean(-1, keepdim=True)
        x = x / (x.std(-1, keepdim=True) + 1e-5)
    elif norm == "constant_norm_rescale":
        x = x * (x.shape[-1] ** 0.5 / x.norm(dim=-1, keepdim=True))
    x = x - w["b_dec"] * cfg["apply_b_dec_to_input"]
    pre = x @ w["W_enc"] + w["b_enc"]
    if cfg["architecture"] == "topk":
        k = cfg.get("k") or cfg["activation_fn_kwargs"]["k"]
        if cfg.get("rescale_acts_by_decoder_norm"):
            pre = pre * w["W_dec"].norm(dim=-1)
        values, ids = pre.topk(k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, ids, values.relu())
    acts = pre.relu()
    return acts * (pre > w["threshold"]) if cfg["architecture"] == "jumprelu" else acts


def saelens_decode(w: dict[str, torch.Tensor], cfg: dict, acts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """SAELens's decode of `acts`, with the run-time normalisation of the rows `x` they came from undone."""
    if cfg.get("rescale_acts_by_decoder_norm"):
        acts = acts * (1 / w["W_dec"].norm(dim=-1))
    out = acts @ w["W_dec"] + w["b_dec"]
    if cfg["normalize_activations"] == "layer_norm":
        mean = x.mean(-1, keepdim=True)
        return out * (x - mean).std(-1, keepdim=True) + mean
    if cfg["normalize_activations"] == "constant_norm_rescale":
        return out * (x.norm(dim=-1, keepdim=True) / x.shape[-1] ** 0.5)
    return out


def spliced_like_saelens(hooked, theirs, ours: list, saes: list, tokens: torch.Tensor, tol: float) -> None:
    """HookedLM.run_with_saes with vlens's SAEs (or transcoders) `ours` equals SAELens's HookedSAETransformer's with
    the same `saes`, with and without the error term; with it, it is the model's own forward (the error term gives
    the forward back)."""
    plain = hooked(tokens)
    with torch.no_grad():
        for use_error_term in (False, True):
            got = hooked.run_with_saes(tokens, saes=ours, use_error_term=use_error_term)
            want = theirs.run_with_saes(tokens, saes=saes, use_error_term=use_error_term)
            assert ((got - want).norm() / want.norm()).item() <= tol, use_error_term
            assert (((got - plain).norm() / plain.norm()).item() <= tol) == use_error_term
