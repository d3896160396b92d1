"""Clamping an SAE latent inside the forward: x + s(x)·(v − f(x))·W_dec[f], which sets latent f of
the row to v and keeps everything else, the SAE's reconstruction error included (s(x) is what the
SAE's run-time normalisation multiplies a decoded row by: 1, the row's std, or ‖x‖/√d_in). A
transcoder's latent is read at one tap and written at another: y + s(x)·(v − f(x))·W_dec[f], with x the
row where it reads and y where it writes, the coefficient computed at the first (`clamp_coefficient`).

A tap evaluates f(x) for each clamped row with fixed shapes: the encoder column W_enc[:, f] is stored
beside W_dec[f] in the runtime's vector table when the request arrives, and four numbers per row
(`clamp_rows`) say the rest — so no per-step host work and nothing of size d_sae inside the forward.
A topk SAE's latent depends on where pre_f ranks among all d_sae pre-activations, which would need
the whole encoder inside every clamped tap; Clamp refuses topk SAEs (see interventions.Clamp).
"""

from __future__ import annotations

import torch

from vlens.sae.model import LAYER_NORM_EPS, SAE

NORM_CODES = {"none": 0.0, "layer_norm": 1.0, "constant_norm_rescale": 2.0}
PARAMS = 4  # per clamp row: bias, floor, value, normalisation code


def clamp_rows(sae: SAE, feature: int, value: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_dec[f] [1, d_in], W_enc[:, f] [1, d_in], params [1, PARAMS]) for clamping latent f to `value`.

    pre_f = norm_in(x)·W_enc[:, f] + bias, with bias = b_enc[f] − b_dec·W_enc[:, f] when the SAE
    subtracts b_dec from its input; f(x) = pre_f where pre_f > floor, else 0, with floor = 0 (ReLU) or
    max(threshold[f], 0) (JumpReLU: relu(pre)·(pre > θ) is exactly that)."""
    column = sae.W_enc[:, feature]
    bias = sae.b_enc[feature].double()
    if sae.apply_b_dec_to_input:
        bias = bias - sae.b_dec.double() @ column.double()
    floor = max(float(sae.threshold[feature]), 0.0) if sae.architecture == "jumprelu" else 0.0
    params = torch.tensor([[float(bias), floor, float(value), NORM_CODES[sae.normalize_activations]]])
    return sae.W_dec[feature][None].clone(), column[None].clone(), params


def clamped(x: torch.Tensor, decoder: torch.Tensor, encoder: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Rows x [E, d] with their latent set (see the module doc); each row brings its own SAE's rows."""
    return x + clamp_coefficient(x, encoder, params)[:, None] * decoder


def clamp_coefficient(x: torch.Tensor, encoder: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """s(x)·(v − f(x)) [E] of rows x [E, d_in]: what the latent's decoder row is added times."""
    bias, floor, value, code = params.unbind(1)
    dot = (x * encoder).sum(1)
    mean, std, norm = x.mean(1), x.std(1), x.norm(dim=1)
    root = x.shape[1] ** 0.5
    layer_norm, rescale = code == NORM_CODES["layer_norm"], code == NORM_CODES["constant_norm_rescale"]
    projected = torch.where(
        layer_norm,
        (dot - mean * encoder.sum(1)) / (std + LAYER_NORM_EPS),
        torch.where(rescale, dot * (root / norm), dot),
    )
    pre = projected + bias
    latent = torch.where(pre > floor, pre, torch.zeros_like(pre))
    scale = torch.where(layer_norm, std, torch.where(rescale, norm / root, torch.ones_like(norm)))
    return scale * (value - latent)
