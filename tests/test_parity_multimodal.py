"""The text model of multimodal checkpoints (Mistral Small 3.1/3.2's and Ministral 3's
Mistral3ForConditionalGeneration, Llava's LlavaForConditionalGeneration, LLaVA-NeXT's, LLaVA-OneVision's, InternVL's,
Aya Vision's, Fuyu's, Idefics3's, SmolVLM's, Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and Qwen3-VL-MoE's; Gemma 3's is in
test_parity_gemma.py) against HF's multimodal model given text alone, on tiny random checkpoints: every
tap, packed against alone, greedy generation; the text model's tensors read from under language_model. (the vision
tower left unread), and the composite config's tying and eos followed."""

from __future__ import annotations

from pathlib import Path

import torch
from family_parity import COMMON, GenerationParity, TapParity, build, check_feature_matters, family_fixture, sequences
from transformers import (
    AyaVisionConfig,
    CLIPVisionConfig,
    Cohere2Config,
    FuyuConfig,
    Glm4vConfig,
    Glm4vMoeConfig,
    Idefics3Config,
    InternVLConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaNextConfig,
    LlavaOnevisionConfig,
    Ministral3Config,
    Mistral3Config,
    MistralConfig,
    PersimmonConfig,
    PixtralVisionConfig,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    SiglipVisionConfig,
    SmolVLMConfig,
)
from transformers.models.exaone4_5.configuration_exaone4_5 import Exaone4_5_Config

from vlens import LLM
from vlens.config import LEGACY

MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                   "beta_fast": 8.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)  # fmt: skip
GLM_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
GLM_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, image_size=28,
                  patch_size=14)  # fmt: skip
CONFIGS = {
    # the composite config ties the unembedding (HF follows it, not the text config's False); its own eos
    "mistral3": lambda: Mistral3Config(
        text_config=MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None).to_dict(),
        vision_config=PixtralVisionConfig(**VISION, head_dim=16).to_dict(), image_token_index=299, eos_token_id=[2, 7],
    ),
    # Ministral 3 (3B, 8B, 14B): YaRN and Llama 4's attention temperature over an original context of 16 (the
    # sequences reach 40: q scaled by 1 + 0.5 * log(1 + floor(position / 16)))
    "ministral3": lambda: Mistral3Config(
        text_config=Ministral3Config(**COMMON, num_key_value_heads=2, rope_parameters=MINISTRAL3_ROPE).to_dict(),
        vision_config=PixtralVisionConfig(**VISION, head_dim=16).to_dict(), image_token_index=299,
    ),
    # Qwen2.5-VL and Qwen3-VL: their multimodal rotary, given text alone, is the plain one; Qwen2.5-VL stores its text
    # model as a causal LM does, Qwen3-VL under model.language_model. (as transformers 5 saves)
    "qwen2_5_vl": lambda: Qwen2_5_VLConfig(
        text_config=dict(COMMON, num_key_value_heads=2, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[0]),
        image_token_id=299, video_token_id=298, vision_start_token_id=297, eos_token_id=2, bos_token_id=1,
    ),
    "qwen3_vl": lambda: Qwen3VLConfig(
        text_config=dict(COMMON, num_key_value_heads=2, head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], num_position_embeddings=16),
        image_token_id=299, video_token_id=298, vision_start_token_id=297, eos_token_id=2,
    ),
    # Qwen3-VL-MoE: Qwen3-MoE's layer, all experts in one tensor per projection (experts 48 wide: 2I = 96, not d = 64,
    # so the two layouts of the tensors differ in shape); `released` below stores them as the releases do
    "qwen3_vl_moe": lambda: Qwen3VLMoeConfig(
        text_config=dict(COMMON, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1], rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], num_position_embeddings=16),
        image_token_id=299, video_token_id=298, vision_start_token_id=297, eos_token_id=2,
    ),
    # Qwen2-VL: Qwen2.5-VL's layout, its own configs
    "qwen2_vl": lambda: Qwen2VLConfig(
        text_config=dict(COMMON, num_key_value_heads=2, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
        image_token_id=299, video_token_id=298, vision_start_token_id=297, eos_token_id=2, bos_token_id=1,
    ),
    "llava_next": lambda: LlavaNextConfig(
        text_config=MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None).to_dict(),
        vision_config=CLIPVisionConfig(**VISION).to_dict(), image_token_index=299, image_grid_pinpoints=[[28, 28]],
    ),
    "llava_onevision": lambda: LlavaOnevisionConfig(
        text_config=Qwen2Config(**COMMON, num_key_value_heads=2).to_dict(),
        vision_config=SiglipVisionConfig(**VISION).to_dict(), image_token_index=299, image_grid_pinpoints=[[28, 28]],
    ),
    "internvl": lambda: InternVLConfig(
        text_config=Qwen2Config(**COMMON, num_key_value_heads=2).to_dict(),
        vision_config=dict(VISION, image_size=[28, 28], patch_size=[14, 14]), image_token_id=299,
    ),
    # Aya Vision: Cohere 2's text model (its parallel layer, rotary on the windowed layers alone)
    "aya_vision": lambda: AyaVisionConfig(
        text_config=Cohere2Config(**COMMON, num_key_value_heads=2, sliding_window=8).to_dict(),
        vision_config=SiglipVisionConfig(**VISION).to_dict(), image_token_index=299,
    ),
    # Idefics3 and SmolVLM: Llama's text model under model.text_model
    "idefics3": lambda: Idefics3Config(text_config=LlamaConfig(**COMMON, num_key_value_heads=2).to_dict(),
                                       vision_config=VISION, image_token_id=299),  # fmt: skip
    "smolvlm": lambda: SmolVLMConfig(text_config=LlamaConfig(**COMMON, num_key_value_heads=1).to_dict(),
                                     vision_config=VISION, image_token_id=299, tie_word_embeddings=True),  # fmt: skip
    # GLM-4.1V and GLM-4.5V: GLM-4's text model and GLM-4.5's, their multimodal rotary (by pairs, over half of each
    # head) given text alone the plain one
    "glm4v": lambda: Glm4vConfig(text_config=dict(COMMON, num_key_value_heads=2, rope_parameters=GLM_ROPE),
                                 vision_config=GLM_VISION, image_token_id=299, video_token_id=298),  # fmt: skip
    "glm4v_moe": lambda: Glm4vMoeConfig(
        text_config=dict(COMMON, num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, rope_parameters=GLM_ROPE),
        vision_config=GLM_VISION, image_token_id=299, video_token_id=298,
    ),
    # EXAONE 4.5: EXAONE 4's text model (OLMo 2's post-norms; rotary on its windowed layers alone)
    "exaone4_5": lambda: Exaone4_5_Config(
        text_config=dict(COMMON, model_type="exaone4", num_key_value_heads=2, head_dim=16, sliding_window=8,
                         sliding_window_pattern=2),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
        image_token_id=299, video_token_id=298,
    ),
    # Fuyu: Persimmon's text model (a LayerNorm a head over q and over k), its images fed as patches
    "fuyu": lambda: FuyuConfig(text_config=PersimmonConfig(**COMMON).to_dict(), image_token_id=299),
    "llava_untied": lambda: LlavaConfig(
        text_config=LlamaConfig(**COMMON, num_key_value_heads=1, attention_bias=True).to_dict(),
        vision_config=CLIPVisionConfig(**VISION).to_dict(), image_token_index=299, tie_word_embeddings=False,
    ),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap of the text model against HF's multimodal model given text, packed against alone, generation."""


def test_config_is_the_text_models(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.stored_as is not None and cfg.num_layers == 3
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (llm.model.lm_head.weight is llm.model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    if name == "mistral3":
        assert cfg.architecture == "MistralForCausalLM" and cfg.tie_word_embeddings and cfg.eos_token_ids == (2, 7)
    elif name == "qwen3_vl_moe":
        assert cfg.architecture == "Qwen3VLMoeTextModel" and cfg.moe_layers == (True, False, True)
        assert cfg.norm_topk_prob and cfg.round_routing_weights
        assert cfg.stored_as == ("model.language_model.", "lm_head.")
    elif name.startswith("qwen"):
        qwen2 = name in ("qwen2_5_vl", "qwen2_vl")
        assert cfg.architecture == ("Qwen2ForCausalLM" if qwen2 else "Qwen3ForCausalLM")
        assert cfg.stored_as == (("model.", "lm_head.") if qwen2 else ("model.language_model.", "lm_head."))
        # (their images: tests/test_images.py; Qwen3-VL's rotary positions interleaved, its deepstack after layer 0)
        assert cfg.mrope_section == (2, 3, 3)
        assert (cfg.mrope_interleaved, cfg.deepstack_layers) == ((False, 0) if qwen2 else (True, 1))
    elif name.startswith("glm4v"):
        assert cfg.architecture == ("Glm4MoeForCausalLM" if name == "glm4v_moe" else "Glm4vTextModel")
        assert cfg.stored_as == ("model.language_model.", "lm_head.") and cfg.rotary_dim == 8
        assert cfg.mrope_section == (2, 1, 1)  # (their images: tests/test_images.py)
    elif name == "exaone4_5":
        assert cfg.architecture == "Exaone4ForCausalLM" and cfg.stored_as == ("model.language_model.", "lm_head.")
        assert cfg.post_norms and cfg.nope_layers == (False, True, False)
    elif name in ("idefics3", "smolvlm"):
        assert cfg.architecture == "LlamaForCausalLM" and cfg.stored_as == ("model.text_model.", "lm_head.")
    elif name in ("llava_next", "llava_onevision", "internvl", "aya_vision", "fuyu"):
        text = {"llava_next": "Mistral", "llava_onevision": "Qwen2", "internvl": "Qwen2", "aya_vision": "Cohere2",
                "fuyu": "Persimmon"}  # fmt: skip
        assert cfg.architecture == text[name] + "ForCausalLM" and cfg.stored_as == LEGACY
    elif name == "ministral3":
        assert cfg.architecture == "Ministral3ForCausalLM" and cfg.attn_temperature == (0.5, 16)
        assert cfg.rope_scaling["rope_type"] == "yarn"
    else:
        assert cfg.architecture == "LlamaForCausalLM" and cfg.qkv_bias and not cfg.tie_word_embeddings


def test_ministral3_temperature_is_reached(tmp_path):
    """HF's Ministral 3 without the attention temperature differs: the sequences reach past its original context."""
    config = Ministral3Config(**COMMON, num_key_value_heads=2, rope_parameters=MINISTRAL3_ROPE)
    check_feature_matters(config, tmp_path, rope_parameters=MINISTRAL3_ROPE | {"llama_4_scaling_beta": 0.0})


def test_qwen3_vl_moe_experts_as_the_releases_store_them(tmp_path):
    """Qwen3-VL-MoE's releases keep each projection's experts with the input dimension first ([E, d, 2I], [E, I, d]);
    transformers 5 saves them the other way round: both load to the same model."""
    from safetensors.torch import load_file, save_file

    path = Path(build(CONFIGS["qwen3_vl_moe"](), tmp_path, "qwen3_vl_moe"))
    saved = LLM(model=str(path), dtype="float32", device="cpu").trace(sequences()[1:], hooks="unembed.hook_out")
    weights = load_file(path / "model.safetensors")
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[key] = weights[key].transpose(1, 2).contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    released = LLM(model=str(path), dtype="float32", device="cpu").trace(sequences()[1:], hooks="unembed.hook_out")
    assert all(torch.equal(a["unembed.hook_out"], b["unembed.hook_out"]) for a, b in zip(saved, released))
