"""The model side of a harvest: which model to run, and the hashes that pin its identity in the manifest."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlens.attention.sdpa import SdpaBackend
from vlens.distributed.executor import Executor
from vlens.engine.model_runner import ModelRunner
from vlens.images import ImageEncoder
from vlens.llm import LLM
from vlens.loader import LoadedModel, hash_file, load_model, resolve_device

if TYPE_CHECKING:
    from vlens.harvest.config import HarvestConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")
_hashes: dict[tuple, str] = {}
GENERATION_MEMORY = 0.5  # of a GPU, for a generating harvest's engine (weights and KV cache)


def resolve_model(model: Any, config: HarvestConfig, device: str) -> LoadedModel:
    """Reuse an `LLM` or `LoadedModel` the caller already holds (tests, notebooks); else load `model` (the
    config's, or a generation engine's) on `device`, split across the config's `tensor_parallel_size` ranks
    (the caller closes `model.executor` when done)."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, LLM):
        return LoadedModel(model.model, model.config, model.tokenizer, model.model_path, model.model_name,
                           model.adapter_path)  # fmt: skip
    dtype, size, revision = config.model_dtype, config.tensor_parallel_size, config.revision
    if size > 1:
        return Executor(model, dtype, resolve_device(device), size, "sdpa", revision=revision).loaded
    return load_model(model, dtype=dtype, device=device, revision=revision)


def generation_engine(config: HarvestConfig) -> LLM:
    """The engine that writes a generating harvest's continuations: the caller's `LLM`, else one loaded here
    (on CUDA within half the GPU's memory, weights and KV cache: the rest is the harvest's forwards')."""
    if isinstance(config.model, LLM):
        return config.model
    if isinstance(config.model, LoadedModel):
        raise ValueError("model: generate_tokens needs a generation engine: give an LLM or a model path, "
                         "not a LoadedModel")  # fmt: skip
    return LLM(
        config.model, revision=config.revision, dtype=config.model_dtype, device=config.device,
        tensor_parallel_size=config.tensor_parallel_size, gpu_memory_utilization=GENERATION_MEMORY,
    )  # fmt: skip


def runner_for(model: Any, loaded: LoadedModel) -> ModelRunner:
    """The runner of a harvest: an `LLM`'s own, else one over SDPA whose forwards on CUDA take the fused chains;
    every batch of the run reuses its buffers (they grow to the batch size on the first)."""
    if isinstance(model, LLM):
        return model.runner
    return ModelRunner(loaded.model, SdpaBackend(), max_tokens=4096, max_seqs=1, prefills=True)


def image_encoder(model: Any, loaded: LoadedModel) -> ImageEncoder:
    """The vision tower of a harvest of records with images: an `LLM`'s own (loaded once, its cache of image rows
    shared with its generations: a dataset that asks several questions of one image runs the tower once), else one
    of its own."""
    if isinstance(model, LLM):
        return model.image_encoder("image_field")
    param = next(loaded.model.parameters())
    return ImageEncoder(loaded.path, param.dtype, param.device, "image_field")


def files_hash(files: list[Path]) -> str:
    """sha256 over (name, bytes) of each file, memoised per (path, size, mtime) within the process:
    ~1 s for SmolLM2's 540 MB, paid once however many harvests a session runs."""
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _hashes:
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0")
            hash_file(f, digest)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def weights_hash(path: Path) -> str:
    return files_hash(sorted(Path(path).glob("*.safetensors")))


def config_hash(path: Path) -> str | None:
    """Of config.json, which fixes how the weights are used (RoPE scaling, norms, windows): the same weights
    under an edited config give other activations."""
    config = Path(path) / "config.json"
    return files_hash([config]) if config.exists() else None


def tokenizer_info(tokenizer: Any, path: Path, chat_template: str | None = None) -> dict[str, Any]:
    """The manifest's record of the tokenizer, with a hash of the `chat_template` that renders the source's
    conversations where it has them."""
    if tokenizer is None:
        return {"name_or_path": None, "vocab_size": None, "hash": None}
    files = [Path(path) / n for n in _TOKENIZER_FILES if (Path(path) / n).exists()]
    info = {
        "name_or_path": os.fspath(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "hash": files_hash(files) if files else None,
    }
    if chat_template is not None:
        info["chat_template_sha256"] = hashlib.sha256(chat_template.encode()).hexdigest()
    return info
