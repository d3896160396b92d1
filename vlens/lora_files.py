"""PEFT's LoRA adapters as saved (`save_pretrained`): what vlens reads of them, for the engine's adapters beside the
base model (vlens.engine.lora) and for a model loaded from an adapter's directory, merged (vlens.loader).

An adapter holds `adapter_config.json` (r, lora_alpha, use_rslora, the base model's name) and
`adapter_model.safetensors`, whose `<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r] update the
projection whose weight the base checkpoint names `<module>.weight` by s B A, s = lora_alpha / r (rsLoRA: / sqrt r).
What else PEFT can save (DoRA, biases, modules saved whole, per-module ranks, embeddings' LoRA) is refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # (PEFT's wrapper's prefix of every module path)


def read_lora(path: Path, where: str, max_rank: int | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter in `path`: module path -> (A [r, in], s B [out, r]); a ValueError naming `where` and what vlens
    cannot run."""
    files = path / CONFIG, path / WEIGHTS
    if not all(f.is_file() for f in files):
        raise ValueError(f"{where}: {str(path)!r} holds no {CONFIG} and {WEIGHTS} (a PEFT adapter's save_pretrained)")
    config = json.loads(files[0].read_text())
    unsupported = {
        "peft_type": config.get("peft_type", "LORA") != "LORA", "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none", "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")), "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }  # fmt: skip
    refused = [f"{name}={config.get(name)!r}" for name, bad in unsupported.items() if bad]
    if refused:
        raise ValueError(f"{where}: {', '.join(refused)} is not supported (vlens runs PEFT's LoRA: peft_type LORA, no "
                         "DoRA, no biases, no modules saved whole, one rank and alpha for every module)")  # fmt: skip
    rank = int(config["r"])
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is more than max_lora_rank={max_rank}; raise max_lora_rank")
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(str(files[1]))
    other = sorted(k for k in tensors if not k.endswith((".lora_A.weight", ".lora_B.weight")))
    if other:
        raise ValueError(f"{where}: {files[1].name} holds {other[:3]}, which are no LoRA A and B of a projection "
                         "(a module saved whole, an embedding's LoRA); vlens runs adapters of projections")  # fmt: skip
    updates = {}
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        updates[module] = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")] * scaling
    if not updates:
        raise ValueError(f"{where}: {str(files[1])!r} holds no lora_A weights")
    return updates


def base_model_of(path: Path) -> str | None:
    """The base model an adapter's directory names (base_model_name_or_path); None where `path` is a checkpoint, or
    holds no adapter."""
    if (path / "config.json").exists() or not (path / CONFIG).exists():
        return None
    base = json.loads((path / CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"model: {str(path)!r} is a LoRA adapter whose {CONFIG} names no base_model_name_or_path")
    return base
