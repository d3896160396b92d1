"""gpt-oss against HF on tiny random checkpoints: attention sinks (each head's learned logit in every softmax, in
the outputs and in hook_pattern, whose rows then sum to less than one), routed experts with biases, a router with
a bias that weighs its top k by their own softmax, the clamped SwiGLU, YaRN rotary, alternating sliding windows;
through trace, packed batches and generation; and checkpoints whose experts are stored as MXFP4, dequantised as
HF dequantises them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    FEATURE_TOL,
    GenerationParity,
    TapParity,
    build,
    check_feature_matters,
    check_transformer_lens_names,
    family_fixture,
    sequences,
)
from hf_reference import hf_taps, same
from safetensors.torch import load_file, save_file
from test_parity_moe import check_expert_paths
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config

from vlens import LLM, Ablate, Capture, SamplingParams, Steer
from vlens.attention import sdpa
from vlens.loader import dequantize_mxfp4

SIZES = COMMON | {"intermediate_size": 32}
# YaRN over an original context of 16 positions (the test sequences reach 40), its ramp's ends truncated
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 16, "truncate": True}  # fmt: skip
CONFIGS = {
    # HF's defaults (YaRN x32 over 4,096 positions, untruncated), windows of 7 on layers 0 and 2, GQA
    "gpt_oss": lambda: GptOssConfig(**SIZES, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=7),  # fmt: skip
    # one KV head, top-1 of 3 experts, a limit the SwiGLU's inputs pass (so the clamp acts), no attention biases
    "gpt_oss_mqa_clamped": lambda: GptOssConfig(
        **SIZES, num_key_value_heads=1, head_dim=24, num_local_experts=3, num_experts_per_tok=1, sliding_window=5,
        swiglu_limit=0.05, attention_bias=False, rope_parameters=YARN,
    ),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap (router logits, expert ids, scores and patterns with sinks), packed against alone, and greedy
    generation through the paged cache (the C decode kernel with sinks) against HF generate."""

    generation_hooks = ("blocks.1.attn.hook_pattern", "blocks.0.mlp.hook_expert_ids")

    def required_hooks(self, llm: LLM) -> list[str]:
        return ["blocks.0.attn.hook_pattern", "blocks.0.mlp.hook_router_logits", "blocks.2.mlp.hook_expert_ids"]


def test_sinks_take_weight_from_the_keys(family):
    """A pattern row sums to one less its sink's share; HF without sinks (their logits at -inf) differs."""
    _, path, llm, hf = family
    ids = sequences()[-1]
    out = llm.trace([ids], hooks=["blocks.1.attn.hook_pattern", "unembed.hook_out"])[0]
    sums = out["blocks.1.attn.hook_pattern"].sum(-1)
    assert (sums < 1).all() and (sums > 0).all() and sums[:4].max() < 0.99  # (few keys: the sink's share is large)
    sinkless = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer in sinkless.model.layers:
        layer.self_attn.sinks.data.fill_(float("-inf"))
    with torch.no_grad():
        assert rel_err(out["unembed.hook_out"], sinkless(torch.tensor([ids])).logits[0]) > FEATURE_TOL


def test_long_prompts_take_their_queries_in_chunks(family, monkeypatch):
    """The written-out attention (sinks, soft-caps) holds at most WRITTEN_SCORES scores at once: with room for a
    row or two, a packed trace equals the one that held every score."""
    llm = family[2]
    hooks = ["blocks.1.attn.hook_z", "blocks.2.attn.hook_pattern", "unembed.hook_out"]
    whole = llm.trace(sequences(), hooks=hooks)
    monkeypatch.setattr(sdpa, "WRITTEN_SCORES", 2 * 4 * 40)
    for a, b in zip(whole, llm.trace(sequences(), hooks=hooks)):
        for hook in hooks:
            assert rel_err(b[hook], a[hook]) <= 1e-6, hook


def test_the_clamp_and_yarn_are_reached(tmp_path):
    """The parity would prove nothing of the clamp or of YaRN's ramp unless HF without them differs."""
    check_feature_matters(CONFIGS["gpt_oss_mqa_clamped"](), tmp_path / "clamp", swiglu_limit=1e9)
    check_feature_matters(CONFIGS["gpt_oss_mqa_clamped"](), tmp_path / "yarn",
                          rope_parameters=YARN | {"beta_fast": 32.0, "truncate": False})  # fmt: skip


def test_steering_and_capture_in_a_mixed_batch(family):
    """A steered request beside plain ones: the plain ones get their own tokens and rows, as alone."""
    _, _, llm, _ = family
    prompts = sequences((11, 5))
    capture = Capture(["blocks.1.hook_resid_post", "blocks.1.mlp.hook_router_logits"])
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=capture)
    steer = Steer("blocks.0.hook_resid_post", torch.ones(64), scale=4.0)
    steered = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, interventions=[steer])
    alone = llm.generate([prompts[0]], plain, use_tqdm=False)[0]
    mixed = llm.generate(prompts, [plain, steered], use_tqdm=False)[0]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    for hook in capture.hooks:
        assert rel_err(mixed.activations[hook], alone.activations[hook]) <= 1e-5, hook


def test_grouped_gemm_equals_every_expert(family):
    """Biases and the clamped SwiGLU on both of the experts' paths."""
    check_expert_paths(family[2].model.layers[0].mlp.experts)


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's own gpt-oss on the same weights: the same values under every name both have, the sinks'
    patterns and the routers' expert weights and indices among them."""
    from transformer_lens.pretrained.weight_conversions import convert_gpt_oss_weights

    path = build(CONFIGS["gpt_oss"](), tmp_path, "gpt_oss")
    check_transformer_lens_names(path, convert_gpt_oss_weights, {
        "attn.hook_q", "attn.hook_k", "attn.hook_attn_scores", "attn.hook_pattern", "mlp.hook_expert_weights",
        "mlp.hook_expert_indices", "hook_mlp_out", "ln2.hook_normalized"})  # fmt: skip


def _in_bfloat16(path: Path) -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint in bfloat16, as gpt-oss's releases are (HF keeps the norms' weights in float32, vlens
    in the model's dtype: the same numbers once they are bfloat16's); returns its tensors."""
    file = path / "model.safetensors"
    weights = {key: w.bfloat16() for key, w in load_file(file).items()}
    save_file(weights, file, metadata={"format": "pt"})
    return weights


def test_bfloat16_taps_match_hf(tmp_path):
    """In bfloat16 every tap rounds where HF's does: the sink softmax's maximum taken off in bfloat16, each expert
    bias added after its product is rounded (within 1e-3: a rounding apart anywhere would be ~5e-3)."""
    path = Path(build(CONFIGS["gpt_oss"](), tmp_path, "bf16"))
    _in_bfloat16(path)
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = sequences()[-1]
    # (HF's scores are read back from its softmax's input, the maximum already taken off: in bfloat16 that cannot
    # be undone exactly; the patterns are compared)
    hooks = [h for h in llm.hook_names() if not h.endswith(("hook_expert_ids", "hook_expert_indices", "hook_attn_scores"))]
    got, ref = llm.trace([ids], hooks=hooks)[0], hf_taps(hf, ids, range(3))
    compared = [h for h in hooks if h in ref]
    assert len(compared) >= 60
    for hook in compared:
        assert same(got[hook].float(), ref[hook].float(), 1e-3), (hook, rel_err(got[hook].float(), ref[hook].float()))


def test_an_expert_ablated_through_its_routing_weight(family):
    """Ablate(hook_expert_weights, direction=expert e) sets e's weight to zero at every token of a layer: its output
    is dropped, the other chosen experts' weights kept; HF's logits with its router's weight for e zeroed. A plain
    request in the same batch gets its own logits."""
    _, _, llm, hf = family
    expert, prompts = 1, sequences((23, 9))
    ablate = Ablate("blocks.0.mlp.hook_expert_weights", direction=torch.eye(llm.config.num_experts)[expert])
    logits = Capture("unembed.hook_out", positions="all")
    common = dict(max_tokens=1, temperature=0, ignore_eos=True, capture=logits)
    ablated, plain = llm.generate(prompts, [SamplingParams(**common, interventions=[ablate]), SamplingParams(**common)],
                                  use_tqdm=False)  # fmt: skip

    def drop(module, args, out):
        scores, ids = out[1], out[2]
        return out[0], scores.masked_fill(ids == expert, 0.0), ids

    handle = hf.model.layers[0].mlp.router.register_forward_hook(drop)
    try:
        with torch.no_grad():
            want = hf(torch.tensor([prompts[0]])).logits[0]
    finally:
        handle.remove()
    with torch.no_grad():
        untouched = hf(torch.tensor([prompts[0]])).logits[0]
        plain_want = hf(torch.tensor([prompts[1]])).logits[0]
    assert rel_err(ablated.activations["unembed.hook_out"], want) <= 1e-5
    assert rel_err(want, untouched) > FEATURE_TOL  # (the expert was chosen, and mattered)
    assert rel_err(plain.activations["unembed.hook_out"], plain_want) <= 1e-5


def _as_mxfp4(path: Path) -> None:
    """Rewrite the checkpoint as gpt-oss's releases store it: in bfloat16, with MXFP4 blocks and scales in place of
    each expert projection, and a quantization_config that says so."""
    file = path / "model.safetensors"
    weights = _in_bfloat16(path)
    g = torch.Generator().manual_seed(0)
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, columns = weights.pop(key).transpose(1, 2).shape
        weights[f"{key}_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=g,
                                                 dtype=torch.uint8)  # fmt: skip
        weights[f"{key}_scales"] = torch.randint(121, 126, (experts, rows, columns // 32), generator=g,
                                                 dtype=torch.uint8)  # fmt: skip
    save_file(weights, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_load_as_hf_dequantises_them(tmp_path, dtype):
    """A checkpoint with MXFP4 experts gives HF's dequantised model's logits, in float32 and bfloat16 (the values
    are exact in both); the dequantisation itself equals HF's bit for bit."""
    config = GptOssConfig(**(COMMON | {"intermediate_size": 64}), num_key_value_heads=2, head_dim=16,
                          num_local_experts=4, num_experts_per_tok=2, sliding_window=7)  # fmt: skip
    path = Path(build(config, tmp_path, "mxfp4"))
    _as_mxfp4(path)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_file(path / "model.safetensors")
    blocks, scales = (stored[f"model.layers.1.mlp.experts.down_proj_{part}"] for part in ("blocks", "scales"))
    hf_dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), hf_dequantized)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True))
    llm = LLM(model=str(path), dtype=str(dtype).removeprefix("torch."), device="cpu")
    assert torch.equal(llm.model.model.layers[0].mlp.experts.down_bias, hf.model.layers[0].mlp.experts.down_proj_bias)
    hf_down = hf.model.layers[0].mlp.experts.down_proj  # [E, I, d]
    assert torch.equal(llm.model.model.layers[0].mlp.experts.down_proj, hf_down.transpose(1, 2))
    ids = sequences()[-1]
    got = llm.trace([ids], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    assert rel_err(got.float(), ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-3)
