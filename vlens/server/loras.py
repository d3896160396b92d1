"""The LoRA adapters `vlens serve` serves as models of their own (vlens.engine.lora): those of `--lora-modules`, read
and checked at start (a bad one stops the server, not a request), and, with `--allow-runtime-lora-updating`, those
loaded and unloaded while it runs through vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from pydantic import BaseModel, ConfigDict, StrictStr

from vlens.engine.llm_engine import LLMEngine
from vlens.engine.lora import LoRARequest
from vlens.server.config import split_named_file
from vlens.server.protocol import APIError, from_value_error


class LoraAdapterRequest(BaseModel):
    """vLLM's body of /v1/load_lora_adapter (both fields) and /v1/unload_lora_adapter (the name)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_path: StrictStr | None = None


def load_loras(specs: tuple[str, ...] | None, engine: LLMEngine, taken: list[str]) -> dict[str, LoRARequest]:
    """The adapters of `--lora-modules` by name, ids in the order given. Each has a slot of its own (max_loras), so
    that no request waits for another adapter's to end."""
    if specs and engine.loras is not None and engine.loras.max_loras < len(specs):
        raise ValueError(f"lora_modules: {len(specs)} adapters, and the model was built with max_loras="
                         f"{engine.loras.max_loras}: give each a slot (LLM(..., max_loras={len(specs)}))")
    loras = {}
    for i, spec in enumerate(specs or ()):
        name, path = split_named_file(spec)
        if name in taken:
            raise ValueError(f"lora_modules: {name!r} is the served model's or a steering vector's name; give the "
                             "adapter another")  # fmt: skip
        loras[name] = LoRARequest(name, i + 1, str(Path(path).expanduser()))
        if engine.loras is None:
            raise ValueError("lora_modules: the model was built without enable_lora=True")
        engine.loras.read_one(loras[name])
    return loras


def load_adapter(
    body: LoraAdapterRequest, engine: LLMEngine, loras: dict[str, LoRARequest], taken: Collection[str]
) -> str:  # fmt: skip
    """Read and check `body`'s adapter (blocking: a thread of its own), then serve it under its name: vLLM's
    answer, or a 400 naming the field."""
    if body.lora_path is None:
        raise APIError(400, "lora_path: give the adapter's directory (a PEFT adapter's save_pretrained)", "lora_path")
    if body.lora_name in loras or body.lora_name in taken:
        raise APIError(400, f"lora_name: {body.lora_name!r} is served already (a model, a steering vector or an "
                            "adapter); unload it first or give another name", "lora_name")  # fmt: skip
    request = LoRARequest(body.lora_name, max(engine.loras.read, default=0) + 1, str(Path(body.lora_path).expanduser()))
    try:
        engine.loras.read_one(request)
    except ValueError as e:
        raise from_value_error(ValueError(f"lora_path: {e}")) from None
    loras[body.lora_name] = request
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


def unload_adapter(body: LoraAdapterRequest, loras: dict[str, LoRARequest]) -> str:
    """Stop serving the adapter named in `body` (requests under it that run, run on); a 404 if none is."""
    if loras.pop(body.lora_name, None) is None:
        raise APIError(404, f"lora_name: no adapter {body.lora_name!r} is served; loaded: {', '.join(loras) or 'none'}",
                       "lora_name", code="not_found")  # fmt: skip
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
