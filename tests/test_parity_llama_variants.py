"""Llama's layer with one twist each, against HF on tiny random checkpoints: Helium (Kyutai: rotary by pairs, norms
scaled in float32), Seed-OSS (ByteDance: the output projection's bias its own flag), ERNIE 4.5 (Baidu: rotary by
pairs in float32, one bias flag for every projection), Arcee's AFM (an MLP not gated, of squared ReLUs) and Hunyuan
(Tencent, dense: q/k norms after rotary, its "dynamic" rope with a fixed alpha a larger base); every tap, packed
against alone, greedy generation; bfloat16 bit for bit."""

from __future__ import annotations

import pytest
from family_parity import COMMON, GenerationParity, TapParity, build, check_bfloat16_taps, family_fixture
from transformers import ArceeConfig, Ernie4_5Config, HeliumConfig, HunYuanDenseV1Config, SeedOssConfig

from vlens import LLM
from vlens.config import UnsupportedModelError

SIZES = COMMON | dict(num_key_value_heads=2, head_dim=16)
NTK_ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0}
CONFIGS = {
    "helium": lambda: HeliumConfig(**(SIZES | dict(attention_bias=True, mlp_bias=True))),
    "seed_oss": lambda: SeedOssConfig(**(SIZES | dict(attention_bias=True, attention_out_bias=True))),
    # (its q/k/v and output bias off: the released configs')
    "seed_oss_plain_out": lambda: SeedOssConfig(**(SIZES | dict(attention_out_bias=False, num_key_value_heads=1))),
    "ernie4_5": lambda: Ernie4_5Config(**(SIZES | dict(use_bias=True))),
    "arcee": lambda: ArceeConfig(**(SIZES | dict(mlp_bias=True))),
    "hunyuan": lambda: HunYuanDenseV1Config(**(SIZES | dict(attention_bias=True, rope_parameters=NTK_ALPHA))),
}
EXPECTED = {  # ModelConfig fields that set each apart
    "helium": dict(rotary_pairs=True, norm="rms_float", qkv_bias=True, o_bias=False, mlp_bias=True),
    "seed_oss": dict(qkv_bias=True, o_bias=True, mlp_bias=False),
    "seed_oss_plain_out": dict(qkv_bias=True, o_bias=False, num_kv_heads=1),
    "ernie4_5": dict(rotary_pairs=True, rope_float32=True, qkv_bias=True, o_bias=True, mlp_bias=True),
    "arcee": dict(family="arcee", hidden_act="relu2", mlp_bias=True),
    "hunyuan": dict(family="hunyuan", qk_norm="head_after_rotary", qkv_bias=True, o_bias=True,
                    rope_scaling={"rope_type": "ntk_alpha", "alpha": 1000.0}),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_post", "blocks.2.attn.hook_q")


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    assert {key: getattr(llm.config, key) for key in EXPECTED[name]} == EXPECTED[name]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_bfloat16_taps(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_dynamic_rope_without_alpha_is_refused(tmp_path):
    """HF's dynamic NTK rope (frequencies that change with the sequence's length) is refused by name; Hunyuan's, with
    a fixed alpha, runs (above)."""
    config = HunYuanDenseV1Config(**(SIZES | dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0})))
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic' is not supported"):
        LLM(model=build(config, tmp_path, "dynamic"), dtype="float32", device="cpu")
