"""vLLM's --generation-config: the sampling defaults a checkpoint's makers recommend in its generation_config.json
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), which every request that leaves them out
takes: offline, `LLM.generate` without sampling params (`LLM.get_default_sampling_params`); served, a body without
the field. "auto" reads the model's folder, a path another folder's file, "vllm" none (SamplingParams' defaults).
As vLLM, the file's other settings (do_sample among them) are not read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# generation_config.json's names -> SamplingParams'
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


def source_problem(value: str) -> str | None:
    """A `check` of the setting: "auto", "vllm" or a folder."""
    if value in ("auto", "vllm") or Path(value).expanduser().is_dir():
        return None
    return f"must be auto, vllm or a folder holding a generation_config.json, got {value!r}"


def sampling_defaults(source: str, model_path: str | Path) -> dict[str, Any]:
    """The SamplingParams fields the generation config sets (those that differ from transformers' defaults, as vLLM
    reads them); {} for "vllm" or a folder without the file."""
    if source == "vllm":
        return {}
    from transformers import GenerationConfig

    folder = Path(model_path if source == "auto" else source).expanduser()
    if not (folder / "generation_config.json").is_file():
        return {}
    given = GenerationConfig.from_pretrained(folder).to_diff_dict()
    return {ours: given[theirs] for theirs, ours in FIELDS.items() if given.get(theirs) is not None}
