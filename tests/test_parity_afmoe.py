"""AFMoE (Arcee's Trinity Nano, Mini and Large) against HF on tiny random checkpoints: Gemma's sandwich of OLMo 2's
norms, q/k norms head by head, an output gate of its own projection, rotary on the sliding-window layers alone (a
window the sequences outrun), DeepSeek's experts after a dense layer chosen by float32 sigmoids plus a bias per expert,
renormalised and scaled, beside shared ones; µP's embedding scale; every tap, packed against alone, greedy generation
through the paged cache, bfloat16 bit for bit; tensor parallelism (tests/test_tensor_parallel.py)."""

from __future__ import annotations

from family_parity import COMMON, GenerationParity, TapParity, build, check_bfloat16_taps, family_fixture
from safetensors.torch import load_file, save_file
from transformers import AfmoeConfig

from vlens import LLM

AFMOE = dict(num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
             num_shared_experts=1, route_scale=2.5, sliding_window=8, global_attn_every_n_layers=2)  # fmt: skip
CONFIGS = {
    "afmoe": lambda: AfmoeConfig(**COMMON, **AFMOE),
    "afmoe_mup_all_experts": lambda: AfmoeConfig(**COMMON, **AFMOE | dict(num_dense_layers=0), mup_enabled=True),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_expert_ids", "blocks.1.attn.hook_gate")


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "afmoe" and cfg.norm == "rms_float" and cfg.post_norms and cfg.attn_gate_width == 16
    assert cfg.sliding_windows == (8, None, 8) and cfg.nope_layers == (False, True, False)
    mup = name == "afmoe_mup_all_experts"
    assert cfg.moe_layers == ((True,) * 3 if mup else (False, True, True)) and cfg.routed_scaling == 2.5
    assert cfg.embedding_multiplier == (64**0.5 if mup else 1.0) and cfg.deepseek_moe and cfg.router_model_dtype


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    """The router in bfloat16, its sigmoids in float32, the bias float32 (as HF keeps it; a bfloat16 bias would round
    the choice of near ties): every tap HF's bit for bit."""
    check_bfloat16_taps(CONFIGS["afmoe"](), tmp_path)


def test_expert_bias_moves_the_choice(tmp_path):
    """A bias per expert that favours expert 3: every token's experts include it (the bias is read, and chooses)."""
    path = build(CONFIGS["afmoe"](), tmp_path, "afmoe")
    weights = load_file(f"{path}/model.safetensors")
    for key in [k for k in weights if k.endswith("mlp.expert_bias")]:
        weights[key] = weights[key] * 0 + 10.0 * (weights[key].new_tensor([0, 0, 0, 1.0]))
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    hook = "blocks.1.mlp.hook_expert_ids"
    out = LLM(model=path, dtype="float32", device="cpu").trace([list(range(1, 20))], hooks=hook)
    assert (out[0][hook] == 3).any(-1).all()
