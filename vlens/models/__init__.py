"""Model code by family; `MODEL_CLASSES` is the one place that says which class runs which family
(vlens.config.ARCHITECTURES says which family each HF architecture belongs to)."""

from __future__ import annotations

import torch

from vlens.config import ModelConfig
from vlens.models.afmoe import AfmoeForCausalLM
from vlens.models.bamba import BambaForCausalLM, FalconH1ForCausalLM
from vlens.models.base import DecoderLM
from vlens.models.bloom import BloomForCausalLM
from vlens.models.cohere import CohereForCausalLM
from vlens.models.dbrx import DbrxForCausalLM
from vlens.models.deepseek import DeepseekForCausalLM
from vlens.models.falcon import FalconForCausalLM
from vlens.models.gemma import GemmaForCausalLM, VaultGemmaForCausalLM
from vlens.models.gemma4 import Gemma4ForCausalLM
from vlens.models.glm import Glm4ForCausalLM
from vlens.models.gpt2 import GPT2LMHeadModel
from vlens.models.gpt_bigcode import GPTBigCodeForCausalLM
from vlens.models.gpt_neo import GPTNeoForCausalLM
from vlens.models.gpt_neox import GPTNeoXForCausalLM
from vlens.models.gptj import GPTJForCausalLM
from vlens.models.granite_hybrid import GraniteMoeHybridForCausalLM
from vlens.models.lfm2 import Lfm2ForCausalLM, Lfm3ForCausalLM
from vlens.models.llama import (
    ApertusForCausalLM,
    ArceeForCausalLM,
    CausalLM,
    HunYuanForCausalLM,
    HyperClovaxForCausalLM,
    NanoChatForCausalLM,
    Starcoder2ForCausalLM,
)
from vlens.models.llama4 import Llama4ForCausalLM
from vlens.models.mamba import MambaForCausalLM
from vlens.models.mpt import MptForCausalLM
from vlens.models.nemotron_h import NemotronHForCausalLM
from vlens.models.olmo import OlmoForCausalLM, OlmoHybridForCausalLM
from vlens.models.opt import BioGptForCausalLM, OPTForCausalLM, XGLMForCausalLM
from vlens.models.persimmon import PersimmonForCausalLM
from vlens.models.phi import PhiForCausalLM
from vlens.models.qwen3_5 import Qwen3_5ForCausalLM

MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "llama": CausalLM,
    "apertus": ApertusForCausalLM,
    "arcee": ArceeForCausalLM,
    "hunyuan": HunYuanForCausalLM,
    "nanochat": NanoChatForCausalLM,
    "starcoder2": Starcoder2ForCausalLM,
    "bloom": BloomForCausalLM,
    "afmoe": AfmoeForCausalLM,
    "falcon": FalconForCausalLM,
    "gemma": GemmaForCausalLM,
    "vaultgemma": VaultGemmaForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    "glm4": Glm4ForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "gpt_neo": GPTNeoForCausalLM,
    "gpt_bigcode": GPTBigCodeForCausalLM,
    "gpt_neox": GPTNeoXForCausalLM,
    "gptj": GPTJForCausalLM,
    "codegen": GPTJForCausalLM,
    "cohere": CohereForCausalLM,
    "deepseek": DeepseekForCausalLM,
    "olmo": OlmoForCausalLM,
    "olmo_hybrid": OlmoHybridForCausalLM,
    "opt": OPTForCausalLM,
    "persimmon": PersimmonForCausalLM,
    "xglm": XGLMForCausalLM,
    "biogpt": BioGptForCausalLM,
    "phi": PhiForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "lfm2": Lfm2ForCausalLM,
    "lfm3": Lfm3ForCausalLM,
    "bamba": BambaForCausalLM,
    "falcon_h1": FalconH1ForCausalLM,
    "granite": CausalLM,  # (Llama's layer with its multipliers: config flags)
    "hyperclovax": HyperClovaxForCausalLM,
    "granite_hybrid": GraniteMoeHybridForCausalLM,
    "llama4": Llama4ForCausalLM,
    "mamba": MambaForCausalLM,
    "mpt": MptForCausalLM,
    "dbrx": DbrxForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
}


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> DecoderLM:
    return MODEL_CLASSES[cfg.family](cfg, device)
