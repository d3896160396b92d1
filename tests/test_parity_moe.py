"""Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and FlexOlmo against HF on tiny random checkpoints: the router's logits and
chosen experts as taps (int64 ids, through trace and through generation), per-expert checkpoint tensors loaded into
stacked weights, Qwen2-MoE's shared expert and dense (mlp_only) layers, Qwen3-MoE's per-head q/k norm, OLMoE's q/k
norm over the whole projection and its clamp of q, k and v, FlexOlmo's OLMo 2 post-norms around the experts."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    TapParity,
    build,
    check_feature_matters,
    check_generation,
    check_transformer_lens_names,
    family_fixture,
    sequences,
)
from transformers import (
    AutoModelForCausalLM,
    FlexOlmoConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from vlens import LLM, Ablate, Capture, Patch, SamplingParams, Steer
from vlens.layers.moe import grouped_gemm_runs

CONFIGS = {
    "mixtral": lambda: MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "mixtral_window_top1": lambda: MixtralConfig(
        **COMMON, num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=1, sliding_window=7
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
    ),
    "qwen2_moe_normed_no_shared": lambda: Qwen2MoeConfig(
        **COMMON,
        num_key_value_heads=4,
        num_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=0,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "olmoe_clipped": lambda: OlmoeConfig(**COMMON, num_key_value_heads=2, num_experts=5, num_experts_per_tok=3,
                                         clip_qkv=0.5),  # fmt: skip
    # (FlexOlmo: OLMo 2's post-norms around OLMoE's experts)
    "flex_olmo": lambda: FlexOlmoConfig(**COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                        norm_topk_prob=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}

family = family_fixture(CONFIGS)
IDS = "blocks.0.mlp.hook_expert_ids"


class TestParity(TapParity):
    """Every tap (router logits, and expert ids exactly), packed against alone; generation is below."""


def test_config_and_hooks(family):
    name, _, llm, hf = family
    cfg, shapes = llm.config, llm.hook_names()
    k = hf.config.num_experts_per_tok
    assert cfg.experts_per_token == k and shapes["blocks.0.mlp.hook_expert_ids"] == (k,)
    assert shapes["blocks.0.mlp.hook_router_logits"] == (cfg.num_experts,)
    assert "blocks.0.mlp.hook_post" not in shapes  # a routed layer has no single MLP activation
    if name == "qwen2_moe":
        assert cfg.moe_layers == (True, False, True) and cfg.norm_topk_prob is False
        assert shapes["blocks.1.mlp.hook_post"] == (96,) and "blocks.1.mlp.hook_expert_ids" not in shapes
        assert shapes["blocks.0.mlp.shared_expert.hook_post"] == (48,)
    if name.startswith("mixtral"):
        assert cfg.norm_topk_prob and cfg.moe_layers == (True,) * 3
    if name == "qwen3_moe":
        assert cfg.moe_layers == (True, False, True) and cfg.qk_norm == "head" and cfg.round_routing_weights
        assert shapes["blocks.1.mlp.hook_post"] == (96,) and "blocks.0.mlp.shared_expert.hook_post" not in shapes
    if name == "flex_olmo":
        assert (cfg.qk_norm, cfg.post_norms, cfg.pre_norms, cfg.norm, cfg.norm_topk_prob) == ("projection", True, False,
                                                                                             "rms_float", True)
        assert cfg.round_routing_weights and "blocks.0.ln1_post.hook_scale" not in shapes
    if name == "olmoe_clipped":
        assert (cfg.qk_norm, cfg.clip_qkv, cfg.norm_topk_prob, cfg.moe_layers) == ("projection", 0.5, False, (True,) * 3)


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's own Mixtral on the same weights: the same values under every name both have, its expert
    weights (the softmax over every expert) and indices among them."""
    from transformer_lens.pretrained.weight_conversions import convert_mixtral_weights

    path = build(CONFIGS["mixtral"](), tmp_path, "mixtral")
    check_transformer_lens_names(path, convert_mixtral_weights, {
        "attn.hook_q", "attn.hook_pattern", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "hook_mlp_out"})


def test_olmoe_clamp_is_reached(tmp_path):
    check_feature_matters(CONFIGS["olmoe_clipped"](), tmp_path, clip_qkv=None)


def test_generation_matches_hf_and_captures_expert_ids(family):
    _, _, llm, hf = family
    prompts = sequences((20, 9, 3))
    outs = check_generation(llm, hf, prompts, extra_hooks=["blocks.*.mlp.hook_expert_ids"])
    for prompt, out in zip(prompts, outs):
        full = prompt + out.outputs[0].token_ids[:-1]
        traced = llm.trace([full], hooks="blocks.*.mlp.hook_expert_ids")[0]
        for hook, ids in traced.items():
            got = out.activations[hook]
            assert got.dtype == torch.int64 and torch.equal(got, ids), hook


def test_integer_tap_keeps_its_dtype_under_a_capture_dtype(family):
    _, _, llm, _ = family
    capture = Capture(hooks=["blocks.0.mlp.hook_expert_ids", "blocks.0.hook_resid_post"], dtype="bfloat16")
    params = SamplingParams(max_tokens=2, temperature=0, capture=capture)
    prompt = sequences((9,))[0]
    [out] = llm.generate([prompt], params, use_tqdm=False)
    ids = out.activations["blocks.0.mlp.hook_expert_ids"]
    assert ids.dtype == torch.int64
    assert out.activations["blocks.0.hook_resid_post"].dtype == torch.bfloat16
    # the prompt's rows are a copy, not a view the decode step's forward overwrote in the gather buffer
    traced = llm.trace([prompt + out.outputs[0].token_ids[:-1]], hooks="blocks.0.mlp.hook_expert_ids")[0]
    assert torch.equal(ids, traced["blocks.0.mlp.hook_expert_ids"])


@pytest.mark.parametrize("make", [lambda k: Steer(IDS, [1.0] * k), lambda k: Ablate(IDS, [1.0] * k),
                                  lambda k: Patch(IDS, [0.0] * k)])  # fmt: skip
def test_chosen_experts_cannot_be_edited(family, make):
    """An edit of the int64 expert ids made other ids (a steer of 7 chose experts 10 and 8 of 4) and ran on."""
    _, _, llm, _ = family
    params = SamplingParams(max_tokens=2, interventions=[make(llm.config.experts_per_token)])
    with pytest.raises(ValueError, match=r"interventions\[0\]\.hook: .*hook_expert_ids.* cannot be edited"):
        llm.generate([sequences((5,))[0]], params, use_tqdm=False)
    assert not llm.engine.has_work()


def test_bfloat16_experts_are_summed_as_hf_sums_them(family):
    """HF weights each chosen expert's bfloat16 output in float32 (Qwen2-MoE: by its weight rounded to bfloat16)
    and sums a token's k of them in float32, rounding once. vlens added them up in bfloat16, rounding after each:
    0.3% off HF in every MoE block's output, where the dense families' blocks match HF bit for bit."""
    _, path, _, _ = family
    llm = LLM(model=path, dtype="bfloat16", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.randn(40, llm.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        got, ref = llm.model.layers[0].mlp(x), hf.model.layers[0].mlp(x[None])[0]
    assert rel_err(got, ref) <= 5e-4  # it was 2e-3 to 4e-3; on this CPU it is now 0


def test_bfloat16_expert_weights_are_captured_in_bfloat16(family):
    """TransformerLens's expert weights (the router's float32 softmax, from which HF picks the experts) are captured
    in the model's dtype, as every tap but the expert ids (a bfloat16 model's capture of them failed: float32 rows
    for a bfloat16 buffer); the experts are still chosen from the float32 values."""
    _, path, _, _ = family
    llm = LLM(model=path, dtype="bfloat16", device="cpu")
    hooks = ["blocks.0.mlp.hook_router_logits", "blocks.0.mlp.hook_expert_weights", "blocks.0.mlp.hook_expert_ids"]
    got = llm.trace([list(range(1, 30))], hooks=hooks)[0]
    logits, weights, ids = (got[hook] for hook in hooks)
    assert weights.dtype == torch.bfloat16
    assert torch.equal(weights, logits.float().softmax(-1).to(torch.bfloat16))
    assert torch.equal(ids, logits.float().softmax(-1).topk(ids.shape[-1]).indices)


def check_expert_paths(experts) -> None:
    """The two ways routed experts run give the same sums (float32, within 1e-6): torch's grouped GEMM over the
    (token, choice) pairs sorted by expert, and every expert on every token (what a compiled float32 forward and
    cards before sm90 take). Experts nobody chose, and a token's choices in any order, included."""
    g = torch.Generator().manual_seed(3)
    num, k = experts.gate_up_proj.shape[0], 2 if experts.gate_up_proj.shape[0] > 2 else 1
    x = torch.randn(33, experts.gate_up_proj.shape[-1], generator=g)
    logits = torch.randn(33, num, generator=g)
    logits[:, 0] = -1e9  # (expert 0 chosen by no token)
    weights, ids = logits.softmax(-1).topk(k)
    assert grouped_gemm_runs(x, experts.gate_up_proj.shape[1] // 2)
    with torch.no_grad():
        grouped, every = experts._grouped(x, ids, weights), experts._every_expert(x, ids, weights)
    assert rel_err(grouped, every) <= 1e-6


def test_grouped_gemm_equals_every_expert(family):
    check_expert_paths(family[2].model.layers[0].mlp.experts)


mixtral = family_fixture({name: CONFIGS[name] for name in CONFIGS if name.startswith("mixtral")}, "mixtral")


def test_an_expert_ablated_through_its_routing_weight_is_routed_around(mixtral):
    """Ablate(hook_expert_weights, direction=expert e) on Mixtral: e's probability is zero, so each token's top k are
    the next experts, renormalised: HF's logits with its router so changed."""
    _, _, llm, hf = mixtral
    expert, prompt = 1, sequences((23,))[0]
    ablate = Ablate("blocks.0.mlp.hook_expert_weights", direction=torch.eye(llm.config.num_experts)[expert])
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, interventions=[ablate],
                            capture=Capture("unembed.hook_out", positions="all"))  # fmt: skip
    [out] = llm.generate([prompt], params, use_tqdm=False)

    def route_around(module, args, output):
        probabilities = output[0].float().softmax(-1).index_fill(-1, torch.tensor([expert]), 0.0)
        top, ids = probabilities.topk(llm.config.experts_per_token, dim=-1)
        return output[0], top / top.sum(-1, keepdim=True), ids

    handle = hf.model.layers[0].mlp.gate.register_forward_hook(route_around)
    try:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
    finally:
        handle.remove()
    assert rel_err(out.activations["unembed.hook_out"], want) <= 1e-5
    with torch.no_grad():
        assert rel_err(want, hf(torch.tensor([prompt])).logits[0]) > 1e-3
