"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2), with every tap written out.

Parameter names mirror HF's so checkpoints load by name. Each tap is an explicit line
`if NAME in taps: x = taps[NAME](x)`: a dict lookup when nobody asked, and plain code that survives
torch.compile and CUDA graphs (no module hooks). grep a hook name to find where it is tapped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlens.config import ModelConfig, UnsupportedModelError
from vlens.context import get_context
from vlens.layers.attention import Attention
from vlens.layers.linear import FusedLinear
from vlens.layers.norm import RMSNorm
from vlens.layers.rotary import Rotary, apply_rotary

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q_proj": h * d, "k_proj": kv * d, "v_proj": kv * d}, cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.norm_eps)
            self.k_norm = RMSNorm(d, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = Attention(h, kv, d, cfg.sliding_windows[layer])
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        p = f"blocks.{layer}.attn."
        self.hook_q, self.hook_k, self.hook_v, self.hook_z = p + "hook_q", p + "hook_k", p + "hook_v", p + "hook_z"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, taps: dict) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.hook_q in taps: q = taps[self.hook_q](q)  # fmt: skip
        if self.hook_k in taps: k = taps[self.hook_k](k)  # fmt: skip
        if self.hook_v in taps: v = taps[self.hook_v](v)  # fmt: skip
        z = self.attn(q, k, v)
        if self.hook_z in taps: z = taps[self.hook_z](z)  # fmt: skip
        return self.o_proj(z.flatten(1))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        parts = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
        self.gate_up_proj = FusedLinear(cfg.hidden_size, parts, cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        if cfg.hidden_act not in ACTIVATIONS:  # a KeyError from deep in model construction says nothing
            raise UnsupportedModelError(
                f"hidden_act {cfg.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.hook_post = f"blocks.{layer}.mlp.hook_post"

    def forward(self, x: torch.Tensor, taps: dict) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        h = self.act(gate) * up
        if self.hook_post in taps: h = taps[self.hook_post](h)  # fmt: skip
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg, layer)
        p = f"blocks.{layer}."
        self.hook_resid_pre, self.hook_ln1 = p + "hook_resid_pre", p + "ln1.hook_normalized"
        self.hook_attn_out, self.hook_resid_mid = p + "hook_attn_out", p + "hook_resid_mid"
        self.hook_ln2, self.hook_mlp_out = p + "ln2.hook_normalized", p + "hook_mlp_out"
        self.hook_resid_post = p + "hook_resid_post"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, taps: dict) -> torch.Tensor:
        if self.hook_resid_pre in taps: x = taps[self.hook_resid_pre](x)  # fmt: skip
        h = self.input_layernorm(x)
        if self.hook_ln1 in taps: h = taps[self.hook_ln1](h)  # fmt: skip
        a = self.self_attn(h, cos, sin, taps)
        if self.hook_attn_out in taps: a = taps[self.hook_attn_out](a)  # fmt: skip
        x = x + a
        if self.hook_resid_mid in taps: x = taps[self.hook_resid_mid](x)  # fmt: skip
        h = self.post_attention_layernorm(x)
        if self.hook_ln2 in taps: h = taps[self.hook_ln2](h)  # fmt: skip
        m = self.mlp(h, taps)
        if self.hook_mlp_out in taps: m = taps[self.hook_mlp_out](m)  # fmt: skip
        x = x + m
        if self.hook_resid_post in taps: x = taps[self.hook_resid_post](x)  # fmt: skip
        return x


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class CausalLM(nn.Module):
    """forward() runs the layers a batch needs and returns the residual stream; logits are separate,
    so callers pay for the unembedding only on the rows they sample or capture."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, device)

    def forward(self, input_ids: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Packed [T] ids -> [T, d]: every layer then the final norm when `num_layers` is None, else the
        raw residual after the first `num_layers` layers and no norm (a forward nobody reads past a layer
        stops there; a trace of the last layer's resid_post does not pay for the final norm)."""
        ctx = get_context()
        taps = ctx.taps
        x = self.model.embed_tokens(input_ids)
        if "hook_embed" in taps: x = taps["hook_embed"](x)  # fmt: skip
        cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        for layer in layers:
            x = layer(x, cos, sin, taps)
        if num_layers is not None:
            if num_layers < self.cfg.num_layers:
                # The input tap of the first layer not run lives in that layer's forward: fire it here,
                # else a trace of blocks.{num_layers}.hook_resid_pre would capture nothing.
                hook = self.model.layers[num_layers].hook_resid_pre
                if hook in taps: x = taps[hook](x)  # fmt: skip
            return x
        x = self.model.norm(x)
        if "ln_final.hook_normalized" in taps: x = taps["ln_final.hook_normalized"](x)  # fmt: skip
        return x

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(normed)
        taps = get_context().taps
        if "unembed.hook_out" in taps: logits = taps["unembed.hook_out"](logits)  # fmt: skip
        return logits
