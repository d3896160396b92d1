"""Shared fixtures: the real SmolLM2 (vlens and HF side by side), the engines several modules use, and tiny
random checkpoints on disk.

Loading SmolLM2 costs seconds (540 MB read and copied, plus a 2 GiB KV cache zeroed for the default engine
settings), so each model a test needs is loaded once a session and shared; a test that needs other engine
settings asks for a small KV cache unless the size is what it checks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Triton's kernels (vlens.attention.paged_decode) run on the CPU under its interpreter, which Triton picks
# when it is first imported: so before anything imports it (torch._dynamo does, which a test's compile or vlens's
# flex backend brings in; torch alone does not), and only where there is no GPU to run them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from filelock import FileLock  # noqa: E402

import vlens  # noqa: E402
from vlens import LLM  # noqa: E402
from vlens.engine import memory  # noqa: E402
from vlens.loader import LoadedModel, cache_dir, default_gguf, hash_file, resolve_model_path  # noqa: E402

# An engine a test makes without kv_cache_memory takes 512 MiB of KV cache, not the CPU default of 2 GiB: over a file,
# fresh blocks go first, so the cache's pages all come to be touched, and two workers holding a few such engines (a
# served one stays alive: the web framework keeps its routes) came near this machine's 24 GiB.
memory.CPU_DEFAULT_KV_BYTES = 512 << 20

# `make test` runs two pytest-xdist workers: each worker's torch (and every process it starts) gets its
# share of the cores, as two workers spinning OpenMP threads over all of them run slower than one.
if _workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    _threads = max(1, len(os.sched_getaffinity(0)) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# The files that take longest (`--durations=0`, summed by file), first: pytest-xdist's loadfile hands the files out
# in collection order, so with these early the two workers end together, not one running a long file alone at the
# end (8 min 8 s before).
SLOWEST_FILES = ("test_harvest_ray.py", "test_tensor_parallel.py", "test_compile.py", "test_static_decode.py",
                 "test_lens.py", "test_patching.py")  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: each file's tests keep their order)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64: the parity metric of the issues."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --- the default model's GGUF, converted once a run -------------------------------------------------------


@dataclass
class FirstUse:
    """What loading the default GGUF twice did to a cache that lacked its conversion (test_loading checks it)."""

    cache: Path  # the $VLENS_CACHE it ran with
    entries_before: set[str]  # what cache/gguf held before
    conversions: list[list[str]]  # the GGUF files transformers dequantised: during the first load, the second
    first: LoadedModel  # weights dropped (`model` is None): only its path, name and tokenizer are looked at
    files: dict[str, int]  # the converted directory after the first load: file name -> mtime
    entries_after: set[str]  # what cache/gguf held after the first load
    second_path: Path
    files_after_second: dict[str, int]
    default_path: Path  # resolve_model_path(None) under the same cache
    weights: dict[str, str]  # the second load's weights: parameter name -> digest of its bytes


def weight_digests(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> sha256 of its bytes: equal digests are equal tensors, without keeping two copies."""
    state = model.state_dict()
    return {name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest() for name, t in state.items()}


def default_is_converted() -> bool:
    """Whether $VLENS_CACHE already holds the default GGUF's conversion (vlens.loader.convert_gguf's rule:
    a directory named after the file's content hash)."""
    return (cache_dir() / "gguf" / hash_file(default_gguf()).hexdigest()[:32] / "config.json").exists()


def load_default_gguf_twice(cache: Path) -> FirstUse:
    """Load the default GGUF twice with $VLENS_CACHE at `cache`, recording each dequantisation transformers does."""
    import transformers

    gguf, calls = default_gguf(), []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def counting(*args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return original(*args, **kwargs)

    def files(path: Path) -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    before = {p.name for p in (cache / "gguf").iterdir()} if (cache / "gguf").exists() else set()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLENS_CACHE", str(cache))
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", counting)
        first = vlens.load_model(str(gguf), dtype="float32", device="cpu")
        first_calls, first_files = list(calls), files(first.path)
        entries_after = {p.name for p in first.path.parent.iterdir()}
        second = vlens.load_model(str(gguf), dtype="float32", device="cpu")
        default_path = resolve_model_path(None)
    return FirstUse(
        cache, before, [first_calls, calls[len(first_calls) :]], first._replace(model=None), first_files,
        entries_after, second.path, files(second.path), default_path, weight_digests(second.model),
    )  # fmt: skip


@functools.cache
def first_use_lock() -> FileLock:
    """The lock the test workers take turns with for the default GGUF's first use. One object a process:
    filelock counts re-entries of an object, and a second object on the same file would wait for the first."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    return FileLock(cache_dir() / "tests-first-use.lock")


@pytest.fixture(scope="session")
def gguf_first_use(tmp_path_factory) -> FirstUse:
    """The default GGUF's first use. Converting it takes ~10 s, so a run does it at most once: where the
    cache already holds the conversion, into an empty cache of its own (removed after the run); on a
    machine whose cache lacks it (a fresh CI runner), into that cache, where `smol_path` then finds it.
    The test workers take turns (a file lock): the first converts into the cache, the others find it there."""
    with first_use_lock():
        use = None if default_is_converted() else load_default_gguf_twice(cache_dir())
    if use is not None:
        yield use
        return
    cache = tmp_path_factory.mktemp("vlens-cache")
    yield load_default_gguf_twice(cache)
    shutil.rmtree(cache, ignore_errors=True)  # half a gigabyte


# --- SmolLM2, and engines over it ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def smol_path(request) -> Path:
    with first_use_lock():  # another worker may be converting it now
        if not default_is_converted():
            request.getfixturevalue("gguf_first_use")  # the run's one conversion, observed for test_loading
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def smol(smol_path) -> LLM:
    return LLM(model=str(smol_path), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def served_smol(smol_path) -> LLM:
    """The SmolLM2 that the in-process server tests (test_server, test_server_concurrency,
    test_server_clients, test_sae_server) serve, each with its own server in turn (module fixtures, so
    never two at once); every server test leaves the engine idle."""
    from server_helpers import ENGINE

    return LLM(model=str(smol_path), enable_capture=True, **ENGINE)


# --- tiny checkpoints --------------------------------------------------------------------------------


def hf_auto_class(config):
    """The transformers Auto class of a config: a multimodal one's (with a vision tower) builds its ...Conditional-
    Generation model, as the causal-LM class does not for every family; the image-text one also builds the causal LMs
    transformers leaves out of its causal-LM table (Mistral 4's)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    causal = type(config) in AutoModelForCausalLM._model_mapping and not hasattr(config, "vision_config")
    return AutoModelForCausalLM if causal else AutoModelForImageTextToText


def save_tiny(config, path) -> str:
    """Random weights for `config` (a transformers config object), saved like a real checkpoint."""
    torch.manual_seed(0)
    model = hf_auto_class(config).from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smol4_path(smol_path, tmp_path_factory) -> Path:
    """SmolLM2 cut to its first four layers (embeddings, final norm and tokenizer kept): a third of the
    weights to read, for tests whose checks hold for any model and that load it again and again (in each
    Ray actor, in child processes): harvest files byte for byte, resuming after a kill, serving as an
    operator, command-line errors. Its rows are SmolLM2's width, so shard sizes are SmolLM2's."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("smol4")
    config = json.loads((smol_path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4}))
    with safe_open(smol_path / "model.safetensors", framework="pt") as f:
        kept = [k for k in f.keys() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4]  # noqa: SIM118
        save_file({k: f.get_tensor(k) for k in kept}, path / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smol_path / name, path / name)
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The harvest tests' corpus (test_harvest, test_harvest_ray): 40 English-like documents as JSON lines."""
    from harvest_helpers import documents, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", documents(40))


@pytest.fixture(scope="session")
def smol4(smol4_path) -> LLM:
    """An engine on smol4_path: for the engine's promises that hold for any model (isolation in mixed
    batches, preemption, the prefix cache), and the reference of the tests that run smol4 in a child."""
    return LLM(model=str(smol4_path), dtype="float32", device="cpu", kv_cache_memory=64 << 20)
