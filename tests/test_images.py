"""Images in prompts (vlens.images): LLaVA's, LLaVA-NeXT's, LLaVA-OneVision's, InternVL's, Aya Vision's, Idefics3's,
SmolVLM's, Gemma 3's, Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's, GLM-4.1V's and GLM-4.5V's tiny random checkpoints, each with
its processor (SmolLM2's tokenizer and the image tokens), against HF's multimodal model given the same pixels: every tap
of the language model, traces, greedy generation, a mixed batch with text prompts and other images through chunked
prefill, the prefix cache kept apart by the pixels, chat and serving, two ranks, and the refusals."""

from __future__ import annotations

import base64
import io
import json
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import rel_err
from family_parity import build
from hf_reference import hf_taps, same
from PIL import Image
from replayed_graphs import replay_graphs
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    AyaVisionConfig,
    AyaVisionProcessor,
    CLIPImageProcessor,
    CLIPVisionConfig,
    Cohere2Config,
    Gemma3Config,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma3TextConfig,
    Glm4vConfig,
    Glm4vMoeConfig,
    GotOcr2ImageProcessor,
    Idefics3Config,
    Idefics3ImageProcessor,
    Idefics3Processor,
    InternVLConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaNextConfig,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaProcessor,
    MistralConfig,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    SiglipVisionConfig,
    SmolVLMConfig,
)
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

from vlens import LLM, Capture, SamplingParams
from vlens.capture.names import is_pattern
from vlens.images import VIDEO_PROCESSORS, PromptImages, images_only_processor
from vlens.inputs import ImagePrompt, prompt_list, to_token_lists

TOL = 1e-5
KV = 64 << 20  # bytes of KV cache an engine of these tiny models takes (the CPU default, 2 GiB, is resident)
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}  # fmt: skip
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
QWEN_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
               "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
GLM_TOKENS = {"image_token_id": "<|image|>", "video_token_id": "<|video|>",
              "image_start_token_id": "<|begin_of_image|>", "image_end_token_id": "<|end_of_image|>",
              "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>"}  # fmt: skip
AYA_TOKENS = ["<fake_token_around_image>", "<global-img>", "<|IMG_PATCH|>", "<|START_OF_IMG|>", "<|END_OF_IMG|>",
              "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL"]  # fmt: skip
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.1)  # fmt: skip
CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
            patch_size=14, projection_dim=32)  # fmt: skip


def _llava(tok):
    image_id = tok.convert_tokens_to_ids("<image>")
    config = LlavaConfig(text_config=LlamaConfig(**TEXT, vocab_size=len(tok)).to_dict(),
                         vision_config=CLIPVisionConfig(**CLIP).to_dict(), image_token_index=image_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")  # fmt: skip
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>",
    )  # fmt: skip
    return config, processor


def _llava_next(tok):
    """LLaVA-NeXT's any-resolution tiling: a grid of 28-pixel tiles by the image's shape, a newline row a line."""
    image_id = tok.convert_tokens_to_ids("<image>")
    grid = [[28, 28], [28, 56], [56, 28]]
    config = LlavaNextConfig(text_config=MistralConfig(**TEXT, vocab_size=len(tok), sliding_window=None).to_dict(),
                             vision_config=CLIPVisionConfig(**CLIP).to_dict(), image_token_index=image_id,
                             image_grid_pinpoints=grid, vision_feature_layer=-1)  # fmt: skip
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                image_grid_pinpoints=grid),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>",
    )  # fmt: skip
    return config, processor


def _aya_vision(tok):
    """Aya Vision: SigLIP, its rows shuffled down by 2 into a SwiGLU projector; Cohere 2's text model. Its processor
    writes an image as patch tokens between start and end tokens."""
    image_id = tok.convert_tokens_to_ids("<|IMG_PATCH|>")
    text = Cohere2Config(**TEXT, vocab_size=len(tok), sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)  # fmt: skip
    config = AyaVisionConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=image_id,
                             downsample_factor=2, adapter_layer_norm_eps=1e-5, vision_feature_layer=-1)  # fmt: skip
    processor = AyaVisionProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=False),
        tokenizer=tok, patch_size=14, img_size=56, downsample_factor=2, image_token="<image>",
    )  # fmt: skip
    return config, processor


def _idefics3(tok):
    """Idefics3: an image cut into crops plus a global view, each crop's SigLIP rows shuffled down by 2 (4 rows a
    crop), written between fake tokens with its row and column named in text. (SmolVLM's is the same model; its
    processor needs torchvision, which this machine lacks.)"""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14)  # fmt: skip
    config = Idefics3Config(text_config=LlamaConfig(**TEXT, vocab_size=len(tok)).to_dict(), vision_config=vision,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)  # fmt: skip
    images = Idefics3ImageProcessor(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    return config, Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4)


def _gemma3(tok):
    """Gemma 3: SigLIP's rows pooled to 4 a picture between its start and end tokens, which attend to each other both
    ways in the prefill (HF's mask given token_type_ids); a text model of sliding-window layers (8 tokens) and a
    global one."""
    text = Gemma3TextConfig(**TEXT, vocab_size=len(tok), head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)  # fmt: skip
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in GEMMA3_TOKENS.items()}
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"])  # fmt: skip
    images = Gemma3ImageProcessor(size={"height": 56, "width": 56})
    return config, Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4)


def _qwen2_vl(tok, v2_5: bool = False):
    """Qwen2-VL (Qwen2.5-VL with `v2_5`): patches of 14 pixels, 2x2 of them merged into a row, so an image's rows are a
    grid by its shape; its rows' rotary positions are their time, row and column in it (M-RoPE, in sections of 2, 3
    and 3 frequencies), the text after it going on from the largest. Qwen2.5-VL's tower attends in windows of 56
    pixels but at its last block."""
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in QWEN_TOKENS.items()}
    specials = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    text = dict(TEXT, vocab_size=len(tok), **specials, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if v2_5:
        vision |= dict(intermediate_size=64, out_hidden_size=TEXT["hidden_size"], window_size=56,
                       fullatt_block_indexes=[1])  # fmt: skip
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids, **specials)
    else:
        vision |= dict(embed_dim=32, hidden_size=TEXT["hidden_size"], mlp_ratio=2)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids, **specials)
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2)
    return config, images_only_processor("Qwen2VLProcessor", images, tok)


def _glm4v(tok, moe: bool = False):
    """GLM-4.1V (GLM-4.5V with `moe`): Qwen2-VL's grid of merged patches and its three rotary positions, over half of
    each head (in sections of 2, 1 and 1 frequencies), by pairs of dims (GLM-4.5V's by halves); GLM-4's sandwich-normed
    layer (GLM-4.5V's routed experts after a dense layer)."""
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in GLM_TOKENS.items()}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
    text = dict(TEXT, vocab_size=len(tok), rope_parameters=rope, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)  # fmt: skip
    if moe:
        text |= dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1)  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  image_size=28, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    config = (Glm4vMoeConfig if moe else Glm4vConfig)(text_config=text, vision_config=vision, **ids,
                                                      eos_token_id=tok.eos_token_id)  # fmt: skip
    images = Glm4vImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    return config, images_only_processor("Glm4vProcessor", images, tok)


def _qwen3_vl(tok, moe: bool = False):
    """Qwen3-VL (Qwen3-VL-MoE with `moe`): Qwen2-VL's grid of merged patches (of 16 pixels), its three rotary positions
    interleaved over the frequencies, and deepstack: after the language model's first layer, the image rows add what
    the tower's first layer made of them."""
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in QWEN_TOKENS.items()}
    specials = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text = dict(TEXT, vocab_size=len(tok), head_dim=16, **specials, rope_parameters=rope)
    if moe:
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2)  # fmt: skip
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(text_config=text, vision_config=vision, **ids, **specials)
    images = Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16, merge_size=2)
    return config, images_only_processor("Qwen3VLProcessor", images, tok)


def _llava_onevision(tok):
    """LLaVA-OneVision: SigLIP over any-resolution tiles (a base view and a grid of 28-pixel tiles by the image's
    shape, a newline row a line, pooled when over `anyres_max`), Qwen2's text model."""
    grid = [[28, 28], [28, 56], [56, 28], [56, 56]]
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=14)  # fmt: skip
    config = LlavaOnevisionConfig(text_config=Qwen2Config(**TEXT, vocab_size=len(tok)).to_dict(),
                                  vision_config=vision.to_dict(), image_grid_pinpoints=grid, vision_feature_layer=-1,
                                  image_token_index=tok.convert_tokens_to_ids("<image>"),
                                  vision_aspect_ratio="anyres_max_1")  # fmt: skip
    images = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=grid)
    return config, images_only_processor("LlavaOnevisionProcessor", images, tok, num_image_tokens=4,
                                         vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_1")


def _internvl(tok):
    """InternVL 3: an image cut into 28-pixel tiles plus a thumbnail, each tile's 16 patches shuffled down by 2 into
    4 rows, written between its start and end tokens; Qwen2's text model."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=[28, 28],
                  patch_size=[7, 7])  # fmt: skip
    config = InternVLConfig(text_config=Qwen2Config(**TEXT, vocab_size=len(tok)).to_dict(), vision_config=vision,
                            image_token_id=tok.context_image_token_id, image_seq_length=4)  # fmt: skip
    images = GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True, max_patches=4)
    return config, images_only_processor("InternVLProcessor", images, tok, image_seq_length=4)


def _smolvlm(tok):
    """SmolVLM: Idefics3's model and layout (crops and a global view, each crop's rows shuffled down by 2), its
    processor writing the crops' places in words (num2words)."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14)  # fmt: skip
    config = SmolVLMConfig(text_config=LlamaConfig(**TEXT, vocab_size=len(tok)).to_dict(), vision_config=vision,
                           image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)  # fmt: skip
    images = SmolVLMImageProcessorPil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    return config, images_only_processor("SmolVLMProcessor", images, tok, image_seq_len=4)


FAMILIES = {"gemma3": _gemma3, "llava": _llava, "llava_next": _llava_next, "aya_vision": _aya_vision,
            "idefics3": _idefics3, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": partial(_qwen2_vl, v2_5=True),
            "glm4v": _glm4v, "glm4v_moe": partial(_glm4v, moe=True), "qwen3_vl": _qwen3_vl,
            "qwen3_vl_moe": partial(_qwen3_vl, moe=True), "llava_onevision": _llava_onevision,
            "internvl": _internvl, "smolvlm": _smolvlm}  # fmt: skip
# (LLaVA-1.5's conversation format; an image part where the processor's placeholder goes)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
GLM_PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"
# (where a prompt puts an image; the others' is <image>)
PLACEHOLDERS = {"gemma3": "<start_of_image>", "qwen2_vl": QWEN_PLACEHOLDER, "qwen2_5_vl": QWEN_PLACEHOLDER,
                "qwen3_vl": QWEN_PLACEHOLDER, "qwen3_vl_moe": QWEN_PLACEHOLDER,
                "glm4v": GLM_PLACEHOLDER, "glm4v_moe": GLM_PLACEHOLDER, "internvl": "<IMG_CONTEXT>"}  # fmt: skip
# (the families of the tests of a route, not of the numbers: three placeholders, and Qwen3-VL's rotary positions and
# deepstack rows)
PLUMBING = ["llava", "gemma3", "qwen3_vl"]


def at(name: str, text: str) -> str:
    """`text` with family `name`'s image placeholder for each <image>."""
    return text.replace("<image>", PLACEHOLDERS.get(name, "<image>"))


def image(seed: int, height: int = 40, width: int = 50) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


def checkpoint(name: str, smol_path, root) -> str:
    """A tiny random checkpoint of family `name`, saved with its processor."""
    # (Gemma 3's processor reads its image tokens from the tokenizer; LLaVA's would take its image_token too)
    extra = {"extra_special_tokens": {"gemma3": GEMMA3_TOKENS, "internvl": INTERNVL_TOKENS}[name]} \
        if name in ("gemma3", "internvl") else {}  # fmt: skip
    tok = AutoTokenizer.from_pretrained(smol_path, **extra)
    grid = QWEN_TOKENS if name.startswith("qwen") else GLM_TOKENS if name.startswith("glm") else {}
    tok.add_special_tokens({"additional_special_tokens": ["<image>", *AYA_TOKENS, *grid.values()]})
    config, processor = FAMILIES[name](tok)
    processor.chat_template = at(name, CHAT_TEMPLATE)
    path = build(config, root, name)
    if name == "gemma3":  # (HF starts its projection at zeros: every image's rows would be zeros)
        weights = load_file(f"{path}/model.safetensors")
        key = next(k for k in weights if k.endswith("mm_input_projection_weight"))
        weights[key] = torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(2))
        save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    if getattr(processor, "video_processor", 0) is None:  # (Qwen2-VL's without torchvision: HF saves no such one)
        processor.image_processor.save_pretrained(path)
        processor.tokenizer.save_pretrained(path)
        Path(path, "chat_template.jinja").write_text(processor.chat_template)
        settings = {k: v for k, v in processor.to_dict().items() if not isinstance(v, dict) and v is not None}
        settings["processor_class"] = type(processor).__mro__[1].__name__  # (HF's class, not the images-only one)
        Path(path, "processor_config.json").write_text(json.dumps(settings))
    else:
        processor.save_pretrained(path)
    return path


def load_processor(path: str):
    """The checkpoint's HF processor (Qwen2-VL's for images alone where torchvision is missing, as vlens builds it)."""
    arch = AutoConfig.from_pretrained(path).architectures[0]
    if arch in VIDEO_PROCESSORS:
        settings = json.loads(Path(path, "processor_config.json").read_text())
        settings = {k: v for k, v in settings.items() if k not in ("processor_class", "image_token", "video_token")}
        return images_only_processor(VIDEO_PROCESSORS[arch], AutoImageProcessor.from_pretrained(path),
                                     AutoTokenizer.from_pretrained(path), Path(path, "chat_template.jinja").read_text(),
                                     **settings)  # fmt: skip
    return AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, smol_path, tmp_path_factory):
    """(name, LLM with 4-token blocks and 16-token steps, HF model, processor) of a checkpoint saved with its
    processor."""
    path = checkpoint(request.param, smol_path, tmp_path_factory.mktemp(request.param))
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, kv_cache_memory=KV)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, llm, hf, load_processor(path)


def prompts(name: str) -> list[tuple[str, list[Image.Image]]]:
    """A text around one image; another image of another shape (LLaVA-NeXT tiles it otherwise); two images."""
    return [(at(name, "USER: <image>\nWhat is shown here? ASSISTANT:"), [image(0)]),
            (at(name, "Describe <image> briefly."), [image(1, 60, 30)]),
            (at(name, "Compare <image> with <image>:"), [image(2), image(3, 30, 60)])]  # fmt: skip


def hf_inputs(processor, text: str, images: list) -> dict:
    return dict(processor(text=text, images=[images], return_tensors="pt"))


def request(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images if len(images) > 1 else images[0]}}


def test_every_tap_is_hfs(family):
    """Each prompt alone, prefill only: every hook of the language model at every prompt row (the image rows among
    them) against HF's multimodal forward given the same pixels."""
    name, llm, hf, processor = family
    hooks = list(llm.hook_names())
    for text, images in prompts(name):
        inputs = hf_inputs(processor, text, images)
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask")
        assert sum(t == hf.config.image_token_id for t in ids) > 0
        out = llm.generate(request(text, images), SamplingParams(max_tokens=0, capture=Capture(hooks=hooks)),
                           use_tqdm=False)[0]  # fmt: skip
        assert out.prompt_token_ids == ids
        ranges = out.multi_modal_placeholders["image"]  # (vLLM's: where the image rows are, run by run)
        assert [p for r in ranges for p in range(r.offset, r.offset + r.length)] == \
            [p for p, t in enumerate(ids) if t == hf.config.image_token_id]  # fmt: skip
        assert len(ranges) >= len(images)
        ref = hf_taps(hf, ids, range(llm.config.num_layers), pixels=inputs)
        compared = [hook for hook in hooks if hook in ref]
        assert "hook_embed" in compared and "blocks.1.attn.hook_pattern" in compared
        bad = [hook for hook in compared if not same(out.activations[hook].reshape(ref[hook].shape), ref[hook], TOL)]
        assert bad == [], (text, bad)
        assert compared == [hook for hook in hooks if not is_pattern(hook) or hook in ref]


def test_trace_packs_image_prompts_with_text(family):
    """LLM.trace of the image prompts and a text in one packed forward: each prompt's rows are HF's given its
    pixels alone (the image rows at their offsets in the pack)."""
    name, llm, hf, processor = family
    hooks = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "ln_final.hook_out"]
    texts = [request(t, i) for t, i in prompts(name)] + ["The capital of France is"]
    traced = llm.trace(texts, hooks=hooks)
    for (text, images), got in zip(prompts(name), traced):
        inputs = hf_inputs(processor, text, images)
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask")
        ref = hf_taps(hf, ids, range(2), patterns=False, pixels=inputs)
        for hook in hooks:
            assert same(got[hook].reshape(ref[hook].shape), ref[hook], TOL), (text, hook)
    alone = llm.trace(texts[-1], hooks=hooks)[0]
    assert all(same(traced[-1][hook], alone[hook], TOL) for hook in hooks)


def test_generation_in_a_mixed_batch(family, monkeypatch):
    """Every image prompt beside text prompts in one batch of 16-token steps (prefill chunks end inside an image's
    rows), twice over: greedy tokens and every row of the last hidden
    state as HF generates each prompt alone."""
    name, llm, hf, processor = family
    split = []  # (prefill chunks that took some of an image's rows, not all)
    within = PromptImages.within
    monkeypatch.setattr(PromptImages, "within", lambda self, start, n: split.append(
        0 < ((self.positions >= start) & (self.positions < start + n)).sum() < len(self.positions)
    ) or within(self, start, n))  # fmt: skip
    texts = ["Once upon a time", "The capital of France is"]
    batch = [request(t, i) for t, i in prompts(name)] + texts
    hook = f"hidden_states.{llm.config.num_layers}"
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, capture=Capture(hooks=[hook]))
    for _ in range(2):
        outs = llm.generate(batch, params, use_tqdm=False)
        for (text, images), out in zip(prompts(name), outs):
            tokens, ref = hf_greedy(hf, processor, text, images, 5)
            assert out.outputs[0].token_ids == tokens, text
            assert rel_err(out.activations[hook], ref) <= 1e-5, text
        for text, out in zip(texts, outs[len(prompts(name)) :]):
            alone = llm.generate(text, params, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert any(split)
    # two samples of one image prompt (the second takes the first's prompt blocks): both the greedy tokens
    [pair] = llm.generate(batch[:1], SamplingParams(n=2, max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in pair.outputs] == [outs[0].outputs[0].token_ids] * 2


def hf_greedy(hf, processor, text: str, images: list, max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens for a prompt alone and its last hidden state's rows (the prompt's, then the generated
    ones but the last)."""
    inputs = hf_inputs(processor, text, images)
    with torch.inference_mode():
        g = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                        output_hidden_states=True, return_dict_in_generate=True)  # fmt: skip
    return g.sequences[0, inputs["input_ids"].shape[1] :].tolist(), torch.cat([step[-1][0] for step in g.hidden_states])


def test_qwen2_vl_decode_graphs_read_each_steps_rotary_positions(smol_path, tmp_path):
    """Qwen2-VL's decode steps replayed from (emulated) CUDA graphs, padded to their batch buckets, beside a text
    prompt: a generated token's rotary positions follow its prompt's images (HF's rope delta), which a graph reads
    from the step's buffer like its other inputs: greedy tokens and rows as HF generates each prompt alone. The
    decode step compiled (compile_decode, inductor) reads them the same way."""
    path = checkpoint("qwen2_vl", smol_path, tmp_path)
    settings = dict(model=path, dtype="float32", device="cpu", block_size=4, kv_cache_memory=KV)
    llm = LLM(**settings)
    replay_graphs(llm.runner)
    hf, processor = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(), load_processor(path)
    hook = f"hidden_states.{llm.config.num_layers}"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=[hook]))
    batch = [request(t, i) for t, i in prompts("qwen2_vl")] + ["Once upon a time"]
    outs = llm.generate(batch, params, use_tqdm=False)
    for (text, images), out in zip(prompts("qwen2_vl"), outs):
        tokens, ref = hf_greedy(hf, processor, text, images, 6)
        assert out.outputs[0].token_ids == tokens and rel_err(out.activations[hook], ref) <= 1e-5, text
    assert llm.runner.graph_stats.graph_steps >= 4
    compiled = LLM(**settings, compile_decode=True)
    for a, b in zip(outs, compiled.generate(batch, params, use_tqdm=False)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert rel_err(b.activations[hook], a.activations[hook]) <= 1e-5
    assert compiled.runner.graph_stats.compiled_steps >= 4


def test_prefix_cache_keeps_images_apart(family):
    """One text with two images, one after the other: the second is computed anew from its first image row (the
    rows before it come from the cache), and is what it is alone in a fresh engine."""
    name, llm, hf, processor = family
    text = at(name, "USER: <image>\nWhat is shown here? ASSISTANT:")
    params = SamplingParams(max_tokens=1, temperature=0, capture=Capture(hooks=["ln_final.hook_out"], positions="last"))
    inputs = hf_inputs(processor, text, [image(11)])
    start = inputs["input_ids"][0].tolist().index(hf.config.image_token_id)
    ends = []
    for seed in (10, 11):
        before = llm.stats().tokens_computed
        out = llm.generate(request(text, [image(seed)]), params, use_tqdm=False)[0]
        ends.append(out.activations["ln_final.hook_out"])
        computed = llm.stats().tokens_computed - before
    assert computed == inputs["input_ids"].shape[1] - start // 4 * 4  # (the blocks before the image's from the cache)
    assert not torch.allclose(ends[0], ends[1])
    ref = hf_taps(hf, inputs.pop("input_ids")[0].tolist(), [], patterns=False,
                  pixels={k: v for k, v in inputs.items() if k != "attention_mask"})["ln_final.hook_out"]  # fmt: skip
    assert same(ends[1], ref[-1:], TOL)


def test_chat_with_image_parts(family, tmp_path):
    """LLM.chat with vLLM's image parts (a PIL image; a PNG as a data: URL; a file) renders through the processor's
    chat template and generates what HF generates from the processor's own rendering of the conversation."""
    name, llm, hf, processor = family
    first, second = image(20), image(21, 30, 60)
    second.save(tmp_path / "second.png")
    png = io.BytesIO()
    second.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    question = [{"type": "text", "text": "What differs between"}, {"type": "image_pil", "image_pil": first},
                {"type": "text", "text": " and "}]  # fmt: skip
    conversations = [[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": question + [{"type": "image_url", "image_url": {"url": source}}]}]
                     for source in (url, str(tmp_path / "second.png"))]  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.chat(conversations, params, use_tqdm=False)
    hf_conversation = [conversations[0][0], {"role": "user", "content": [
        {"type": "text", "text": "What differs between"}, {"type": "image", "image": first},
        {"type": "text", "text": " and "},
        {"type": "image", "image": second}]}]  # fmt: skip
    inputs = processor.apply_chat_template(hf_conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")  # fmt: skip
    with torch.inference_mode():
        g = hf.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    for out in outs:
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == g[0, n:].tolist()
    bad = [({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, r"vlens fetches no images"),
           ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, r"not an image vlens can read"),
           ({"type": "audio_url", "audio_url": {}}, r"messages\[0\]\.content\[1\]: a part's type is one of")]
    for part, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": first}, part]}], use_tqdm=False)


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_the_image_logit_lens_example(family, tmp_path, capsys):
    """examples/image_logit_lens.py: per layer, the top-1 logit-lens words over the image's rows, as HF's residual
    stream at those rows through HF's final norm and unembedding gives them."""
    import runpy

    name, llm, hf, processor = family
    image(50).save(tmp_path / "a.png")
    text = at(name, "USER: <image>\nWhat is this? ASSISTANT:")
    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "image_logit_lens.py"))
    table = example["image_lens"](llm, text, image(50), top=3)
    inputs = hf_inputs(processor, text, [image(50)])
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask")
    ref = hf_taps(hf, ids, [], patterns=False, pixels=inputs)
    rows = [p for p, t in enumerate(ids) if t == hf.config.image_token_id]
    model = hf.model.language_model
    for layer, words in table:
        hidden = ref[f"hidden_states.{layer + 1}"][rows]
        with torch.no_grad():  # (HF's last hidden state is normed already)
            logits = hf.lm_head(hidden if layer + 1 == len(table) else model.norm(hidden))
        cap = getattr(hf.config.get_text_config(), "final_logit_softcapping", None)  # (Gemma 3's)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        want = Counter(llm.tokenizer.decode([t]) for t in logits.argmax(-1).tolist()).most_common(3)
        assert [n for _, n in words] == [n for _, n in want] and dict(words) == dict(want), (layer, words, want)
    flags = ["--image", str(tmp_path / "a.png"), "--prompt", text, "--top", "2"]
    example["main"](["--model", str(llm.model_path), *flags])
    assert capsys.readouterr().out.count("layer ") == llm.config.num_layers


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_served_chat_with_an_image(family):
    """vlens serve's chat completions take an image as OpenAI's image_url part (a data: URL) and answer as LLM.chat
    does, with the request's activations; a file path, which a server must not read, and /tokenize's messages with
    an image are 400s naming messages."""
    import httpx
    from server_helpers import decode_activations, running_server

    from vlens.server.config import ServerConfig

    name, llm, _, _ = family
    png = io.BytesIO()
    image(30).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": content}]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                            capture=Capture(hooks=["hook_embed"], positions="prompt"))  # fmt: skip
    expected = llm.chat(messages, params, use_tqdm=False)[0]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "vlens": {"capture": {"hooks": ["hook_embed"], "positions": "prompt"}}}  # fmt: skip
    with running_server(llm, ServerConfig(enable_capture=True)) as base:
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["message"]["content"] == expected.outputs[0].text
        got = decode_activations(reply.json()["vlens"]["activations"], base)["hook_embed"]
        assert torch.equal(got, expected.activations["hook_embed"])  # (the image's rows among them)
        content[1]["image_url"]["url"] = "/etc/hostname"
        for route, sent in (("/v1/chat/completions", body), ("/tokenize", {"messages": messages})):
            refused = httpx.post(f"{base}{route}", json=sent, timeout=60)
            assert refused.status_code == 400 and "messages" in refused.json()["error"]["message"], refused.text


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_command_line_generate_with_an_image(family, tmp_path, capsys):
    """`vlens generate PROMPT --image FILE` completes as LLM.generate does with the image; with --chat the image
    goes before the message's text; a file that is no image is a one-line error before the model loads."""
    from vlens.cli import main

    name, llm, _, _ = family
    image(40).save(tmp_path / "a.png")
    text = at(name, "USER: <image>\nWhat is it? ASSISTANT:")
    expected = llm.generate(request(text, [image(40)]), SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    flags = ["--model", str(llm.model_path), "--dtype", "float32", "--device", "cpu", "--max-tokens", "3"]
    assert main(["generate", text, "--image", str(tmp_path / "a.png"), *flags]) == 0
    assert f"completion (3 tokens, length): {expected[0].outputs[0].text!r}" in capsys.readouterr().out
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image(40)},
                                                  {"type": "text", "text": "What is it?"}]}],
                    SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)  # fmt: skip
    assert main(["generate", "What is it?", "--chat", "--image", str(tmp_path / "a.png"), *flags]) == 0
    assert f"completion (3 tokens, length): {chat[0].outputs[0].text!r}" in capsys.readouterr().out
    (tmp_path / "b.png").write_text("not an image")
    assert main(["generate", text, "--image", str(tmp_path / "b.png"), *flags]) == 2
    assert capsys.readouterr().err.startswith("vlens: error: --image: not an image vlens can read")


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_images_seen_lately_skip_the_tower(family, monkeypatch):
    """An image prompt's rows are cached by its pixels: the same pixels twice in a call, or in a later call (a chat's
    next turn), go through the vision tower once and give the same rows and tokens; the least recently used go
    first when the cache is full."""
    from vlens import images as module

    name, llm, _, _ = family
    encoder = llm.image_encoder()
    text = at(name, "USER: <image>\nWhat is it? ASSISTANT:")
    params = SamplingParams(max_tokens=3, temperature=0, capture=Capture(hooks=["hook_embed"]))
    before = encoder.tower_prompts
    first = llm.generate([request(text, [image(80)]), request(text, [image(80)]), request(text, [image(81)])], params,
                         use_tqdm=False)  # fmt: skip
    assert encoder.tower_prompts == before + 2
    again = llm.generate(request(text, [image(80)]), params, use_tqdm=False)[0]
    assert encoder.tower_prompts == before + 2
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    assert torch.equal(again.activations["hook_embed"], first[0].activations["hook_embed"])
    llm.generate(request(text, [image(82)]), params, use_tqdm=False)  # (cached, least recently used first: 81, 80, 82)
    rows = encoder.rows([encoder.prepare(ImagePrompt(text, [image(82)]), "x")], ["x"])[0]  # (from the cache)
    size = sum(t.numel() * t.element_size() for t in (rows.features, rows.deep) if t is not None)  # (deepstack's too)
    monkeypatch.setattr(module, "CACHE_BYTES", size * 7 // 2)  # (room for three)
    llm.generate(request(text, [image(83)]), params, use_tqdm=False)  # (the least recently used out: 81's, older ones)
    count = encoder.tower_prompts
    llm.generate([request(text, [image(80)]), request(text, [image(83)])], params, use_tqdm=False)
    assert encoder.tower_prompts == count
    llm.generate(request(text, [image(81)]), params, use_tqdm=False)
    assert encoder.tower_prompts == count + 1


def hf_layer_hook(hf, layer: int, edit):
    """A forward hook on HF's language-model layer `layer` that edits its output [1, T, d] with `edit`."""

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (edit(output[0]), *output[1:])
        return edit(output)

    return hf.model.language_model.layers[layer].register_forward_hook(hook)


@pytest.fixture(scope="module")
def hooked_family(family):
    """(name, HookedLM over the family's checkpoint, its LLM, HF model, processor)."""
    from vlens import HookedLM

    name, llm, hf, processor = family
    return name, HookedLM(str(llm.model_path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=KV), llm, \
        hf, processor


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_hooked_lm_caches_and_edits_image_prompts(hooked_family):
    """HookedLM (TransformerLens's calls) takes vLLM's image prompts beside texts: run_with_cache's rows of each
    image prompt are HF's given its pixels, a text's its own; to_str_tokens lists the expanded placeholders at
    the cache's positions; run_with_hooks zeroing the image rows of layer 0's output gives the logits HF gives with
    the same edit; prepend_bos is refused for them by name."""
    name, model, llm, hf, processor = hooked_family
    (text, images), _, (text2, images2) = prompts(name)
    batch = [request(text, images), "The capital of France is", request(text2, images2)]
    hooks = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern", "ln_final.hook_out"]
    logits, cache = model.run_with_cache(batch, names_filter=hooks)
    alone = llm.trace(batch[1], hooks=hooks)[0]
    for i, (t, imgs) in ((0, (text, images)), (2, (text2, images2))):
        inputs = hf_inputs(processor, t, imgs)
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask")
        ref = hf_taps(hf, ids, range(2), pixels=inputs)
        n = len(ids)
        assert cache.mask[i].sum() == n
        assert same(logits[i, :n], ref["unembed.hook_out"], TOL)
        assert same(cache["blocks.0.hook_resid_post"][i, :n], ref["blocks.0.hook_resid_post"], TOL)
        assert same(cache["ln_final.hook_out"][i, :n], ref["ln_final.hook_out"], TOL)
        pattern = cache["blocks.1.attn.hook_pattern"][i, :, :n, :n]  # ([heads, query, key]: TransformerLens's)
        assert same(pattern.transpose(0, 1), ref["blocks.1.attn.hook_pattern"], TOL)
        words = model.to_str_tokens(batch[i])
        assert len(words) == n
        assert [w for w, t in zip(words, ids) if t == hf.config.image_token_id] == \
            [llm.tokenizer.decode([hf.config.image_token_id])] * ids.count(hf.config.image_token_id)  # fmt: skip
    n = len(alone["ln_final.hook_out"])
    assert same(cache["ln_final.hook_out"][1, :n], alone["ln_final.hook_out"], TOL)

    inputs = hf_inputs(processor, text, images)
    ids = inputs.pop("input_ids")[0].tolist()
    rows = torch.tensor([p for p, t in enumerate(ids) if t == hf.config.image_token_id])

    def zero_rows(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, rows] = 0
        return x

    edited = model.run_with_hooks(batch[0], fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: zero_rows(x))])
    handle = hf_layer_hook(hf, 0, zero_rows)
    try:
        with torch.inference_mode():
            want = hf(input_ids=torch.tensor([ids]), **inputs).logits
    finally:
        handle.remove()
    assert same(edited[0], want[0], TOL)
    assert not same(edited[0], logits[0, : len(ids)], 1e-3)
    with pytest.raises(ValueError, match=r"^prepend_bos: True is for texts; prompts with images"):
        model.run_with_cache(batch, prepend_bos=True)


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_hooked_lm_generates_from_an_image_prompt(hooked_family):
    """HookedLM.generate of an image prompt: on the engine, and step by step with a hook in force over the KV cache
    and without it (the prompt's image rows read in the first step), HF's greedy tokens; a hook that edits the
    image rows changes them alike with and without the cache."""
    name, model, llm, hf, processor = hooked_family
    text, images = prompts(name)[0]
    inputs = hf_inputs(processor, text, images)
    with torch.inference_mode():
        g = hf.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = g[0].tolist()
    prompt = request(text, images)
    kwargs = dict(max_new_tokens=4, do_sample=False, stop_at_eos=False, verbose=False, return_type="tokens")
    assert model.generate(prompt, **kwargs)[0].tolist() == want
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x)]):
        for cached in (True, False):
            assert model.generate(prompt, use_past_kv_cache=cached, **kwargs)[0].tolist() == want
    n = inputs["input_ids"].shape[1]
    rows = (inputs["input_ids"][0] == hf.config.image_token_id).nonzero().squeeze(1)

    def scale(x, hook):  # (the prompt's image rows, in every step that runs them: each step without the cache; found
        if x.shape[1] >= n:  # on Qwen3-VL, whose tokens told the two apart where `== n` edited only the first)
            x = x.clone()
            x[:, rows] *= 3
        return x

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", scale)]):
        runs = [model.generate(prompt, use_past_kv_cache=cached, **kwargs)[0].tolist() for cached in (True, False)]
    assert runs[0] == runs[1]
    text_out = model.generate(prompt, max_new_tokens=4, do_sample=False, stop_at_eos=False, verbose=False)
    assert isinstance(text_out, str) and text_out == llm.tokenizer.decode(want)


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_activation_patching_from_one_image_to_another(hooked_family):
    """vlens.patching between two images in the same text: each patch's metric is what run_with_hooks gives with
    that one patch put in (TransformerLens's definition, a forward per patch), the image rows among the
    positions (Gemma 3's: a patched image row changes the rows of its image before it, which see it both ways)."""
    from vlens import patching

    name, model, llm, hf, processor = hooked_family
    text = at(name, "USER: <image>\nWhat is it? ASSISTANT:")
    clean, corrupted = request(text, [image(60)]), request(text, [image(61)])
    _, clean_cache = model.run_with_cache(clean)
    weights = torch.randn(llm.config.vocab_size, generator=torch.Generator().manual_seed(3))

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[0] * weights).sum()

    got = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    base = float(metric(model(corrupted)))
    layers, width = got.shape
    assert (layers, width) == (llm.config.num_layers, len(model.to_str_tokens(corrupted)))
    want = torch.empty(layers, width)
    for layer in range(layers):
        for pos in range(width):
            def put(x, hook, pos=pos):
                x = x.clone()
                x[:, pos] = clean_cache[hook.name][:, pos]
                return x

            hooks = [(f"blocks.{layer}.hook_resid_pre", put)]
            want[layer, pos] = float(metric(model.run_with_hooks(corrupted, fwd_hooks=hooks)))
    assert (want - base).abs().max() > 1e-3
    assert (got - want).abs().max() <= 1e-4 * (want - base).abs().max()


@pytest.mark.parametrize("family", PLUMBING, indirect=True)
def test_command_line_trace_with_an_image(family, tmp_path, capsys):
    """`vlens trace TEXT --image FILE --hooks ... --out F`: the rows LLM.trace gives the image prompt, its token ids
    with the placeholders expanded, and the image's file in the metadata."""
    import json

    from safetensors import safe_open

    from vlens.cli import main

    name, llm, _, processor = family
    image(70).save(tmp_path / "a.png")
    text = at(name, "USER: <image>\nWhat is it? ASSISTANT:")
    hooks = ["hook_embed", "blocks.1.hook_resid_post"]
    flags = ["--model", str(llm.model_path), "--dtype", "float32", "--device", "cpu"]
    out = tmp_path / "acts.safetensors"
    assert main(["trace", text, "--image", str(tmp_path / "a.png"), "--hooks", *hooks, "--out", str(out), *flags]) == 0
    ids = hf_inputs(processor, text, [image(70)])["input_ids"][0].tolist()
    assert f"({len(ids)} tokens)" in capsys.readouterr().out
    want = llm.trace(request(text, [image(70)]), hooks=hooks)[0]
    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("token_ids").tolist() == ids
        assert all(same(f.get_tensor(h), want[h], TOL) for h in hooks)
        assert json.loads(f.metadata()["images"]) == [str(tmp_path / "a.png")]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_vl"])
def test_two_ranks_read_the_images_rank_0_encodes(smol_path, tmp_path, name):
    """Under tensor parallelism (2 ranks, gloo) rank 0 alone runs the vision tower and sends each forward's image
    rows with it, and how far each row sees (Gemma 3's images attend both ways, the patterns' heads on both ranks)
    or its rotary positions and deepstack rows (Qwen3-VL's): generation in a mixed batch and a trace equal one
    process's."""
    path = checkpoint(name, smol_path, tmp_path)
    batch = [request(t, i) for t, i in prompts(name)] + ["Once upon a time"]
    hooks = ["hook_embed", "blocks.0.attn.hook_pattern", "blocks.1.hook_resid_post", "ln_final.hook_out"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the workers take rank 0's)
    try:
        settings = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, kv_cache_memory=KV)
        one = LLM(model=path, **settings)
        with LLM(model=path, **settings, tensor_parallel_size=2) as two:
            for a, b in zip(one.generate(batch, params, use_tqdm=False), two.generate(batch, params, use_tqdm=False)):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                assert all(same(b.activations[h], a.activations[h], TOL) for h in hooks)
            for a, b in zip(one.trace(batch, hooks), two.trace(batch, hooks)):
                assert all(same(b[h], a[h], TOL) for h in hooks)
    finally:
        torch.set_num_threads(threads)


def test_gemma3_images_attend_both_ways(smol_path, tmp_path, monkeypatch):
    """Gemma 3's image tokens see each other both ways in the prefill (HF's mask given token_type_ids): its causal
    mask alone gives other rows, vlens's are the both-ways ones; prefill chunks of 6 tokens end in no image's middle
    (its 4 tokens take one step) and generate HF's tokens; chunks shorter than an image are refused by name."""
    path = checkpoint("gemma3", smol_path, tmp_path)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    text, images = prompts("gemma3")[2]
    inputs = hf_inputs(processor, text, images)
    ids = inputs.pop("input_ids")[0].tolist()
    pixels = {k: v for k, v in inputs.items() if k != "attention_mask"}
    both = hf_taps(hf, ids, [], patterns=False, pixels=pixels)["ln_final.hook_out"]
    causal = hf_taps(hf, ids, [], patterns=False, pixels={"pixel_values": pixels["pixel_values"]})["ln_final.hook_out"]
    runs = [(offset, offset + 4) for offset, t in enumerate(ids) if t == hf.config.boi_token_index]
    assert not same(causal[runs[0][0] + 1 : runs[0][1] + 1], both[runs[0][0] + 1 : runs[0][1] + 1], 1e-3)
    chunks = []
    within = PromptImages.within
    monkeypatch.setattr(PromptImages, "within",
                        lambda self, start, n: chunks.append((start, n)) or within(self, start, n))  # fmt: skip
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=6, kv_cache_memory=KV)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, capture=Capture(hooks=["ln_final.hook_out"]))
    out = llm.generate(request(text, images), params, use_tqdm=False)[0]
    assert same(out.activations["ln_final.hook_out"][: len(ids)], both, TOL)
    with torch.inference_mode():
        g = hf.generate(**hf_inputs(processor, text, images), max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert out.outputs[0].token_ids == g[0, len(ids) :].tolist()
    image_runs = [(r.offset, r.offset + r.length) for r in out.multi_modal_placeholders["image"]]
    assert len(image_runs) == 2 and all(not lo < start + n < hi for start, n in chunks for lo, hi in image_runs)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: 3 is less than an image's 4 tokens"):
        LLM(model=path, dtype="float32", device="cpu", max_num_batched_tokens=3).generate(request(text, images))


def test_refusals(family, smol4):
    name, llm, _, _ = family
    with pytest.raises(ValueError, match=r"^multi_modal_data: LlamaForCausalLM takes no images .*LlavaForConditional"):
        smol4.generate(request("a <image>", [image(0)]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages: LlamaForCausalLM takes no images"):
        smol4.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image(0)}]}], use_tqdm=False)
    bad = [
        ({"prompt": "a <image>", "multi_modal_data": {"audio": 1}}, r"prompts\[1\]\.multi_modal_data: .*\['audio'\]"),
        ({"prompt": "a <image>", "multi_modal_data": {"image": []}}, r"multi_modal_data\.image: an empty list"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image(0)}}, r"gives its text as 'prompt'"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": image(0)}}, r"prompts\[1\]: the processor refused"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate(["fine", prompt], use_tqdm=False)
    with pytest.raises(ValueError, match=r"input\[1\]: multi_modal_data is taken by LLM.generate, LLM.chat, LLM.trac"):
        prompts = prompt_list(["a", request("a <image>", [image(0)])])
        to_token_lists(prompts, llm.tokenizer, llm.config.vocab_size, field="input")
    assert not llm.engine.has_work()
