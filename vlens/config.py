"""Model description: one flat dataclass of per-architecture flags, read from a Hugging Face config.

Like litgpt, families differ by flags (biases, q/k norm, sliding windows), not by subclasses; the
model code reads only this dataclass, never the HF config object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture vlens has no model code for."""


# HF architecture name -> the flags that set it apart from plain Llama.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
}

# model_type -> architecture, for configs that carry no `architectures` list.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else HF's rope_parameters with a rope_type
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full causal attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def d_model(self) -> int:
        return self.hidden_size

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers config object (parsed by AutoConfig, never run)."""
        arch = (getattr(hf, "architectures", None) or [None])[0]
        if arch is None:  # configs saved without a model (or by hand) may lack `architectures`
            arch = MODEL_TYPES.get(getattr(hf, "model_type", None))
        if arch not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise UnsupportedModelError(
                f"architecture {arch!r} (model_type {getattr(hf, 'model_type', None)!r}) is not supported by "
                f"vlens; supported architectures: {supported}"
            )
        flags = dict(ARCHITECTURES[arch])
        if "qkv_bias" not in flags:
            bias = bool(getattr(hf, "attention_bias", False))
            flags.update(qkv_bias=bias, o_bias=bias)
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        eos = hf.eos_token_id
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            hidden_act=hf.hidden_act,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_windows=_sliding_windows(hf),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos,
            **flags,
        )


def _sliding_windows(hf: Any) -> tuple[int | None, ...]:
    """Per-layer window, following HF: Mistral windows every layer, Qwen marks layers in `layer_types`."""
    window = getattr(hf, "sliding_window", None)
    n = hf.num_hidden_layers
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * n
