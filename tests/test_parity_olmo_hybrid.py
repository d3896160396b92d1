"""OLMo Hybrid (AI2) against HF on tiny random checkpoints: OLMo 3's attention layers (post-norms alone, q/k norms over
the whole projection, rotary in float32) among gated delta nets in Llama's pre-norm layer (q, k, v, the gate, beta's
and the decay's projections stored apart, the convolution's q, k and v channels too; beta in [0, 2] where
linear_allow_neg_eigval), the layers' hooks and norms each their kind's; every tap, packed against alone (sequences
past one 64-token chunk), greedy generation through the paged cache and the state slots, bfloat16 bit for bit.

The checkpoints are stored as the releases are: transformers 5 saves the three convolutions as three equal thirds of
their concatenation (which it reads back the same), the releases as q's, k's and v's channels; `as_released` splits
them so where the values are wider than the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    check_feature_matters,
    load_pair,
)
from safetensors.torch import load_file, save_file
from transformers import OlmoHybridConfig

from vlens.capture.names import layer_hooks

HYBRID = dict(num_key_value_heads=4, pad_token_id=0, eos_token_id=1, linear_num_key_heads=2, linear_num_value_heads=2,
              linear_key_head_dim=8, linear_value_head_dim=16,
              layer_types=["linear_attention", "full_attention", "linear_attention"])  # fmt: skip
CONFIGS = {
    "olmo_hybrid": lambda: OlmoHybridConfig(**COMMON, **HYBRID),
    "olmo_hybrid_positive_beta": lambda: OlmoHybridConfig(**COMMON, **HYBRID, linear_allow_neg_eigval=False,
                                                          tie_word_embeddings=True),  # fmt: skip
}
# (values as wide as the keys: transformers' thirds are the releases' channels, for the checks that save their own)
SQUARE = lambda: OlmoHybridConfig(**COMMON, **HYBRID | dict(linear_value_head_dim=8))  # noqa: E731


def as_released(path: str, config) -> str:
    """The checkpoint at `path` with each layer's q, k and v convolutions cut as the releases cut them."""
    file = Path(path) / "model.safetensors"
    weights = load_file(file)
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    sizes = [keys, keys, config.linear_num_value_heads * config.linear_value_head_dim]
    for q in [k for k in weights if k.endswith("q_conv1d.weight")]:
        names = [q.replace("q_conv1d", f"{part}_conv1d") for part in "qkv"]
        for name, part in zip(names, torch.cat([weights[n] for n in names]).split(sizes)):
            weights[name] = part.contiguous()
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    config = CONFIGS[request.param]()
    path = as_released(build(config, tmp_path_factory.mktemp(request.param), request.param), config)
    return request.param, path, *load_pair(path)


class TestParity(TapParity, GenerationParity):
    generation_lengths = (70, 9, 3)  # (one prompt past a chunk)
    generation_hooks = ("blocks.0.linear_attn.hook_beta", "blocks.1.attn.hook_z", "blocks.1.ln1.hook_scale")


def test_config_and_each_layers_hooks(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "olmo_hybrid" and cfg.linear_layers == (True, False, True)
    assert cfg.post_norm_layers == (False, True, False) and cfg.qk_norm == "projection" and cfg.rope_float32
    assert cfg.linear_beta_scale == (1.0 if name == "olmo_hybrid_positive_beta" else 2.0)
    linear, attention = layer_hooks(cfg, 0), layer_hooks(cfg, 1)
    assert "ln1.hook_scale" in linear and "linear_attn.hook_beta" in linear and "attn.hook_out" not in linear
    assert {"attn.hook_out", "ln1.hook_scale", "mlp.hook_out"} <= set(attention) and "ln1.hook_out" not in attention


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(SQUARE(), tmp_path)


def test_negative_eigenvalues_are_reached(tmp_path):
    """HF without beta's doubling differs: the sequences reach the delta rule's second half of beta."""
    check_feature_matters(SQUARE(), tmp_path, linear_allow_neg_eigval=False)


def test_a_capturing_step_compiles_whole(tmp_path):
    """Both kinds of layer (their norms where each has them) in one graph of a mixed step, captures and steering."""
    check_capturing_step_compiles(build(SQUARE(), tmp_path, "compiled"), "blocks.1.attn.hook_z")
