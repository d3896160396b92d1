"""Reading an SAE from disk: SAELens's layout (cfg.json + sae_weights.safetensors, every config version
SAELens itself loads) and Gemma Scope's params.npz. The result is the keyword arguments of `SAE`,
which checks shapes and values; anything unreadable is a ValueError naming the file and the problem.

What SAELens's loader does and this matches (sae_lens/loading/pretrained_sae_loaders.py):
`sae_lens_disk_loader` + `handle_config_defaulting` — configs before 6.0 keep the hook at the top
level (`hook_name`, older `hook_point`), default to the standard architecture, mark TopK with
`activation_fn: topk` and `activation_fn_kwargs.k`, and write normalize_activations as a bool;
from 6.0 the hook is under `metadata`. A `scaling_factor` tensor of ones is dropped (any other value
is a fine-tuning factor SAELens's current SAEs refuse too); a `log_threshold` becomes exp(it)
(JumpReLUSAE.process_state_dict_for_loading). Gemma Scope (`gemma_2_sae_huggingface_loader`): the
arrays of params.npz, `w_*` renamed `W_*`, a JumpReLU SAE that does not subtract b_dec from its input;
an embedding SAE (by its folder's name) reads hook_embed, its weights rescaled by sqrt(d_in).
Transcoders (`architecture` transcoder, skip_transcoder, jumprelu_transcoder, jumprelu_skip_transcoder) write
`metadata.hook_name_out`. SAELens's HookedSAETransformer adds `blocks.L.mlp.hook_in`, the MLP's input, which
circuit-tracer's transcoders read: vlens's name for it, `blocks.L.ln2.hook_out`, is what the SAE gets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

CONFIG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
GEMMA_SCOPE = "params.npz"
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")
# SAELens's transcoder architectures, by the activation each encodes with (the skip ones have W_skip)
TRANSCODERS = {"transcoder": "standard", "skip_transcoder": "standard", "jumprelu_transcoder": "jumprelu",
               "jumprelu_skip_transcoder": "jumprelu"}  # fmt: skip
# SAELens's inference SAE normalises at run time only for these; the others are folded into saved weights.
_FOLDED_NORMS = ("none", "expected_average_only_in", "covariance_whitening")
# TransformerLens weight processing that changes what a hook reads (SAELens trains without it by default;
# fold_ln and center_unembed leave the hooks SAEs read as they are)
_TL_PROCESSING = ("center_writing_weights", "fold_value_biases", "refactor_factored_attn_matrices")
_FORMS = f"a SAELens directory ({CONFIG} + {WEIGHTS}) or a Gemma Scope {GEMMA_SCOPE}"


# SAELens's HookedSAETransformer gives every MLP a hook at its input, `blocks.L.mlp.hook_in`, which circuit-tracer's
# transcoders read: vlens's name for that value is `blocks.L.ln2.hook_out` (one name per value, so globs stay
# the size they were); SAEs that name the former read the latter.
_SAELENS_MLP_IN = re.compile(r"^(blocks\.\d+\.)mlp\.hook_in$")


def from_saelens(name: str | None) -> str | None:
    """A hook as an SAE's config names it, in vlens's names (SAELens's `mlp.hook_in` is `ln2.hook_out`)."""
    return None if name is None else _SAELENS_MLP_IN.sub(r"\1ln2.hook_out", name)


def read_sae(path: Any) -> dict[str, Any]:
    """The `SAE` keyword arguments of the SAE saved at `path`."""
    p = Path(path)
    if p.is_dir() and (p / CONFIG).exists():
        return _saelens(p)
    npz = p / GEMMA_SCOPE if p.is_dir() else p
    if npz.suffix == ".npz" and npz.is_file():
        return _gemma_scope(npz)
    what = (
        "does not exist"
        if not p.exists()
        else f"holds neither {CONFIG} nor {GEMMA_SCOPE}"
        if p.is_dir()
        else "is not an .npz file"
    )
    raise ValueError(f"sae: {str(p)!r} {what}; expected {_FORMS}")


def from_saelens_object(sae: Any) -> dict[str, Any]:
    """The `SAE` keyword arguments of a SAELens SAE in memory (its config and weights, read as its files would be)."""
    where = Path(f"<SAELens {type(sae).__name__} object>")
    fields = _tensors({k: v.detach().float().cpu() for k, v in sae.state_dict().items()}, where)
    fields.update(_config(sae.cfg.to_dict(), where, "W_skip" in fields))
    return fields


def from_circuit_tracer_object(transcoder: Any) -> dict[str, Any]:
    """The `SAE` keyword arguments of one of circuit-tracer's SingleLayerTranscoders (W_enc and W_dec [d_sae, d]; a
    ReLU or a JumpReLU), without hooks: its TranscoderSet names them per layer."""
    where = f"<circuit-tracer {type(transcoder).__name__} object>"
    act = transcoder.activation_function
    fields: dict[str, Any] = {
        "W_enc": transcoder.W_enc.detach().float().cpu().T.contiguous(),
        "b_enc": transcoder.b_enc.detach().float().cpu(),
        "W_dec": transcoder.W_dec.detach().float().cpu().contiguous(),
        "b_dec": transcoder.b_dec.detach().float().cpu(),
        "apply_b_dec_to_input": False,
        "path": where,
    }
    if transcoder.W_skip is not None:
        fields["W_skip"] = transcoder.W_skip.detach().float().cpu()
    if type(act).__name__ == "JumpReLU":
        threshold = act.threshold.detach().float().cpu().expand(fields["b_enc"].shape).clone()
        # (its x * (x > t) keeps negative values above a negative threshold; vlens's JumpReLU, ReLU first, does not)
        if (threshold < 0).any():
            raise ValueError(f"sae: {where} has negative JumpReLU thresholds, which vlens's JumpReLU does not take")
        fields.update(architecture="jumprelu", threshold=threshold)
    elif not isinstance(act, torch.nn.ReLU):
        raise ValueError(f"sae: {where}'s activation {type(act).__name__} is not supported; supported: ReLU, JumpReLU")
    return fields


def _saelens(directory: Path) -> dict[str, Any]:
    config_path, weights_path = directory / CONFIG, directory / WEIGHTS
    try:
        cfg = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"sae: {str(config_path)!r} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"sae: {str(config_path)!r} holds {type(cfg).__name__}, not a JSON object")
    if not weights_path.is_file():
        raise ValueError(f"sae: {str(directory)!r} has {CONFIG} but no {WEIGHTS}")
    try:
        with safe_open(weights_path, framework="pt") as f:
            tensors = {key: f.get_tensor(key).float() for key in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise ValueError(f"sae: {str(weights_path)!r} is not a readable safetensors file ({e})") from None
    fields = _tensors(tensors, weights_path)
    fields.update(_config(cfg, config_path, "W_skip" in fields))
    fields["path"] = str(directory)
    sizes = {"d_in": fields["W_enc"].shape[0], "d_sae": fields["W_enc"].shape[1]}
    if fields["hook_out"] is not None:
        sizes["d_out"] = fields["W_dec"].shape[-1]
    for key, size in sizes.items():
        if key in cfg and cfg[key] != size:
            raise ValueError(f"sae: {str(config_path)!r} says {key}={cfg[key]} but W_enc in {WEIGHTS} has {key}={size}")
    return fields


def _config(cfg: dict[str, Any], where: Path, skip: bool) -> dict[str, Any]:
    """The encoding fields of a SAELens config of any version (`skip`: its weights have a W_skip)."""
    metadata = cfg.get("metadata") or {}
    activation = cfg.get("activation_fn", cfg.get("activation_fn_str"))
    if activation not in (None, "relu", "topk"):  # SAELens 6 would load it as ReLU, which encodes otherwise
        raise ValueError(f"sae: activation_fn {activation!r} in {str(where)!r} is not supported; supported: relu, topk")
    # before 6.0 a TopK SAE says activation_fn topk, whatever its `architecture` (often "standard") says
    architecture = "topk" if activation == "topk" else cfg.get("architecture") or "standard"
    hook = from_saelens(metadata.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point"))
    hook_out = None
    if skip != ("skip_transcoder" in architecture):
        raise ValueError(f"sae: {str(where)!r} is a {architecture!r} " + ("with a W_skip tensor, which only skip "
                         "transcoders have" if skip else "without the W_skip tensor it needs"))  # fmt: skip
    if architecture in TRANSCODERS:  # (SAELens writes a transcoder's output where it reads when no hook_name_out)
        architecture = TRANSCODERS[architecture]
        hook_out = from_saelens(metadata.get("hook_name_out") or cfg.get("hook_name_out")) or hook
    norm = cfg.get("normalize_activations")
    norm = {None: "none", False: "none", True: "expected_average_only_in"}.get(norm, norm)
    if norm not in (*_FOLDED_NORMS, "layer_norm", "constant_norm_rescale"):
        raise ValueError(
            f"sae: normalize_activations {norm!r} in {str(where)!r} is not one SAELens defines "
            f"({', '.join(_FOLDED_NORMS)}, layer_norm, constant_norm_rescale)"
        )
    head = metadata.get("hook_head_index", cfg.get("hook_head_index", cfg.get("hook_point_head_index")))
    if head is not None:
        raise ValueError(
            f"sae: {str(where)!r} reads one attention head (hook_head_index={head}), which vlens does not support; "
            "it reads whole hooks"
        )
    model_kwargs = metadata.get("model_from_pretrained_kwargs", cfg.get("model_from_pretrained_kwargs")) or {}
    processed = [f"{key}=True" for key in _TL_PROCESSING if model_kwargs.get(key)]
    if processed:
        raise ValueError(
            f"sae: {str(where)!r} was trained on TransformerLens's processed model (model_from_pretrained_kwargs "
            f"{', '.join(processed)}), whose hooks read other values than HF's raw ones, which vlens taps (a "
            "centred residual stream, value biases folded into the output): its latents would be wrong"
        )
    k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k")) if architecture == "topk" else None
    return {
        "architecture": architecture,
        "hook": hook,
        "hook_out": hook_out,
        "k": k,
        "apply_b_dec_to_input": bool(cfg.get("apply_b_dec_to_input", True)),
        "normalize_activations": "none" if norm in _FOLDED_NORMS else norm,
        "rescale_acts_by_decoder_norm": bool(cfg.get("rescale_acts_by_decoder_norm", False)),
    }


def _tensors(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, Any]:
    """The weights, as SAELens's loader leaves them; refuses what it would not load."""
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not torch.equal(scale, torch.ones_like(scale)):
        raise ValueError(
            f"sae: {str(where)!r} has a fine-tuning scaling_factor that is not all ones; SAELens's current SAEs do not "
            "load it either"
        )
    if "log_threshold" in tensors:
        tensors["threshold"] = torch.exp(tensors.pop("log_threshold"))
    missing = [name for name in TENSORS[:4] if name not in tensors]
    unknown = sorted(set(tensors) - set(TENSORS))
    if missing or unknown:
        problem = (
            f"lacks {', '.join(missing)}"
            if missing
            else f"has tensors no SAE architecture here uses: {', '.join(unknown)}"
        )
        raise ValueError(f"sae: {str(where)!r} {problem}; expected {', '.join(TENSORS[:4])} (+ threshold for "
                         "jumprelu, W_skip for a skip transcoder)")  # fmt: skip
    return {name: tensors[name] for name in TENSORS if name in tensors}


def _gemma_scope(path: Path) -> dict[str, Any]:
    """Gemma Scope's JumpReLU SAEs: the file names no hook, so `SAE.load(..., hook=...)` must — except the
    embedding SAEs (`embedding/width_*/average_l0_*/params.npz`), which read hook_embed. Those were trained
    on the embedding table's rows, before Gemma's sqrt(d) scaling, and hook_embed is after it (as in
    TransformerLens): SAELens divides W_enc by sqrt(d_in) and multiplies W_dec by it, keyed on the folder
    name, and so does this."""
    try:
        with np.load(path) as data:
            arrays = {("W_" + key[2:] if key.startswith("w_") else key): data[key] for key in data.files}
        tensors = {key: torch.from_numpy(np.asarray(a, dtype=np.float32)) for key, a in arrays.items()}
    except (OSError, ValueError) as e:  # the conversion too: arrays of strings, or of bytes numpy has no type for
        raise ValueError(f"sae: {str(path)!r} is not a readable .npz file ({e})") from None
    fields = {
        **_tensors(tensors, path),  # SAELens's Gemma Scope loader refuses a scaling_factor the same way
        "architecture": "jumprelu",
        "apply_b_dec_to_input": False,
        "path": str(path),
    }
    if "embedding" in (folder.name for folder in path.parents[:3]):
        scale = fields["W_enc"].shape[0] ** 0.5
        fields.update(W_enc=fields["W_enc"] / scale, W_dec=fields["W_dec"] * scale, hook="hook_embed")
    return fields
