"""The Hugging Face side of the parity tests: every vlens tap that has an HF counterpart, read off HF's own
modules with forward hooks (the BRIEF §1 table), for one unpadded sequence.

Not a test module; imported by the parity tests. Kept apart so SmolLM2 and the tiny families are held to
the very same definition of each tap.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# Tap kinds that exist in every decoder layer and have an HF counterpart.
LAYER_KINDS = (
    "hook_resid_pre",
    "ln1.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "ln2.hook_normalized",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)


def _first(x):
    """Modules return a tensor or a tuple whose first item is the tensor; either way the tensor."""
    return x[0] if isinstance(x, (tuple, list)) else x


@torch.no_grad()
def hf_taps(hf_model, ids: list[int], layers: Iterable[int]) -> dict[str, torch.Tensor]:
    """vlens hook name -> HF's value [T, ...] for the token ids `ids` (batch of one, no padding).

    Covers hidden_states.{i}, ln_final, logits and, for each layer in `layers`, every kind in LAYER_KINDS."""
    cfg = hf_model.config
    n = cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    base = hf_model.model
    got: dict[str, torch.Tensor] = {}
    raw: dict[str, torch.Tensor] = {}  # q/k before rotary, cos/sin
    handles = []

    def on_output(module, name, store=got):
        handles.append(module.register_forward_hook(lambda m, a, o: store.__setitem__(name, _first(o)[0].clone())))

    def on_input(module, name):
        handles.append(module.register_forward_hook(lambda m, a, o: got.__setitem__(name, a[0][0].clone())))

    handles.append(
        base.rotary_emb.register_forward_hook(lambda m, a, o: raw.update(cos=o[0].clone(), sin=o[1].clone()))
    )
    for layer in layers:
        block, p = base.layers[layer], f"blocks.{layer}."
        attn = block.self_attn
        on_output(block, p + "raw_resid_post", raw)
        on_output(block.input_layernorm, p + "ln1.hook_normalized")
        on_output(attn, p + "hook_attn_out")
        on_input(block.post_attention_layernorm, p + "hook_resid_mid")
        on_output(block.post_attention_layernorm, p + "ln2.hook_normalized")
        on_output(block.mlp, p + "hook_mlp_out")
        on_input(block.mlp.down_proj, p + "mlp.hook_post")
        on_input(attn.o_proj, p + "attn.hook_z")
        # q/k after q/k norm where the model has one, else straight off the projection.
        on_output(attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj, p + "q", raw)
        on_output(attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj, p + "k", raw)
        on_output(attn.v_proj, p + "attn.hook_v")
    try:
        out = hf_model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()

    t = len(ids)
    for i, h in enumerate(out.hidden_states):
        got[f"hidden_states.{i}"] = h[0]
    got["ln_final.hook_normalized"] = out.hidden_states[n][0]
    got["unembed.hook_out"] = out.logits[0]
    cos, sin = raw["cos"], raw["sin"]  # [1, T, head_dim]
    for layer in layers:
        p = f"blocks.{layer}."
        got[p + "hook_resid_pre"] = out.hidden_states[layer][0]
        got[p + "hook_resid_post"] = raw[p + "raw_resid_post"]
        got[p + "attn.hook_z"] = got[p + "attn.hook_z"].view(t, heads, head_dim)
        got[p + "attn.hook_v"] = got[p + "attn.hook_v"].view(t, kv_heads, head_dim)
        q = raw[p + "q"].view(1, t, heads, head_dim).transpose(1, 2)
        k = raw[p + "k"].view(1, t, kv_heads, head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        got[p + "attn.hook_q"] = q[0].transpose(0, 1)
        got[p + "attn.hook_k"] = k[0].transpose(0, 1)
    return got


def layer_hooks(layers: Iterable[int]) -> list[str]:
    return [f"blocks.{layer}.{kind}" for layer in layers for kind in LAYER_KINDS]
