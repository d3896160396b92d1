"""Every option of a harvest, declared once: the keywords of `vlens.harvest`, the flags of `vlens harvest`,
their validation, and what the Ray backend hands its actors all come from this dataclass (see
vlens.settings). It is checked whole before any model is looked for."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from vlens.capture.interventions import check_interventions
from vlens.engine.config import MODEL_HELP, REVISION_HELP
from vlens.loader import DTYPES, device_problem, dtype_problem
from vlens.settings import REQUIRED, positive, setting, validate


@dataclass(frozen=True, kw_only=True)
class HarvestConfig:
    model: Any = setting(
        None,
        MODEL_HELP + "; from Python also an LLM or LoadedModel to reuse (device and model_dtype then do not apply)",
    )
    revision: str | None = setting(None, REVISION_HELP)
    source: str | os.PathLike = setting(
        REQUIRED,
        ".txt (one document per line), .jsonl, .parquet, a `datasets` save_to_disk directory or a hub dataset id",
    )
    hooks: tuple[str, ...] | None = setting(
        None, "hook names or globs (see `vlens hooks`) whose rows to store; with --sae they may be left out"
    )
    out_dir: str | os.PathLike = setting(
        REQUIRED, "output directory or fsspec URL (new, empty, or a run to resume)", flag="--out"
    )
    context_size: int = setting(128, "tokens per window", minimum=2)
    dtype: str | torch.dtype = setting(
        "bfloat16",
        "what the rows are stored as: float32, float16 or bfloat16 (integer hooks, MoE expert ids, stay int64)",
        check=partial(dtype_problem, auto=False),
    )
    max_tokens: int | None = setting(
        None, "stop before the window that would take the harvest past this many tokens, BOS included (default: all)",
        minimum=1,
    )  # fmt: skip
    shard_bytes: int = setting(2**30, "bytes per shard, about (default: 1 GiB)", minimum=1)
    prepend_bos: bool = setting(
        True, "open each window with the model's BOS when it uses one (see vlens.harvest.windows)", flag="--no-bos",
        invert=True,
    )  # fmt: skip
    exclude_bos: bool = setting(True, "leave the rows at BOS tokens out", flag="--keep-bos", invert=True)
    pack: bool = setting(
        True, "lay documents end to end in full windows, as SAELens does, rather than one per window, truncated",
        flag="--no-pack", invert=True,
    )  # fmt: skip
    text_field: str = setting(
        "text", "column with the text, the token ids, or conversations (lists of {role, content} messages, rendered "
        "by the model's chat template); the default falls back to a tokens, input_ids or messages column",
    )  # fmt: skip
    image_field: str | None = setting(
        None, "column of each record's images, for a vision-language checkpoint (one or a list: a file path, relative "
        "ones from a .jsonl or .parquet source's directory; a data: URL; bytes; a `datasets` Image): the record's text "
        "holds their placeholders (or its conversation {\"type\": \"image\"} parts, which the processor's chat "
        "template renders), the checkpoint's processor expands them, and each record is one window (needs "
        "--no-pack), its image rows stored with the others (the manifest's image_token_id says which)",
    )  # fmt: skip
    exclude_token_ids: tuple[int, ...] | None = setting(None, "further token ids whose rows are left out")
    roles: tuple[str, ...] | None = setting(
        None, "with a source of conversations: store only the rows of these roles' messages (their contents' "
        "tokens, e.g. assistant), not the template's or other roles' (default: every row)",
    )  # fmt: skip
    pool: str | None = setting(
        None, "store one row per document (with --no-pack: one window each): last (its last stored row: the last "
        "token, or with --roles the role's last) or mean (the mean of its stored rows, taken in float32 on the "
        "device); the row's token_ids and position are its last stored row's (default: every row)",
        choices=("last", "mean"),
    )  # fmt: skip
    whole_file: bool = setting(False, "a .txt source is one document, not one per line")
    split: str | None = setting(None, "split of a datasets directory or hub dataset (default: train)")
    batch_tokens: int | None = setting(
        None, "tokens per forward (default: on CUDA as many as fit in the free memory, measured by a probe forward; "
        "1024 on a CPU; a resumed run keeps its own)", minimum=1,
    )  # fmt: skip
    pipeline: str = setting(
        "auto", "overlap the forwards, the shard writes and the reading of the source in threads of their own: on, "
        "off (one after the other; the same bytes), or auto: on with CUDA, off on a CPU, where the forward takes "
        "every core and measured no faster with them", choices=("auto", "on", "off"),
    )  # fmt: skip
    seed: int | None = setting(None, "shuffle the rows within each shard with this seed (default: window order)")
    device: str = setting("auto", "where harvest loads the model: auto, cpu, cuda or cuda:N", check=device_problem)
    model_dtype: str | torch.dtype = setting(
        "auto", "dtype of the forward: auto (float32 on CPU, bfloat16 on GPU), float32, float16 or bfloat16",
        check=dtype_problem,
    )  # fmt: skip
    progress: bool = setting(True, "a progress bar and a summary line on stderr", flag="--quiet", invert=True)
    backend: str = setting(
        "local", "where the forwards run: local (this process) or ray (a pool of Ray actors, which read the source "
        "with Ray Data; pip install 'vlens[ray]'); same files either way", choices=("local", "ray"), flag="--ray",
        const="ray",
    )  # fmt: skip
    tensor_parallel_size: int = setting(
        1, "ranks the model is split across (local backend): one process and one device each", minimum=1
    )
    workers: int = setting(1, "Ray actors, one GPU each on CUDA", minimum=1)
    cpus_per_worker: float = setting(1, "CPUs each Ray actor holds without a GPU", check=positive)
    ray_address: str | None = setting(None, "Ray cluster to join (default: a running one, else a new local one)")
    sae: Any = setting(
        None, "an SAE (a SAELens directory or a Gemma Scope params.npz; from Python also a vlens.SAE) whose top_k "
        "latents to store per row of its hook, as sae_ids (int32) and sae_values, beside the rows of --hooks",
    )  # fmt: skip
    sae_hook: str | None = setting(None, "the hook the SAE reads, if its files do not say (params.npz) or to override")
    top_k: int | None = setting(None, "latents stored per row with --sae", minimum=1)
    steering_vector: Any = setting(
        None, "a steering vector file (`vlens steering-vector`; from Python also a vlens.steering.SteeringVector) "
        "added at every position of every window: the rows stored are the steered model's",
    )  # fmt: skip
    multiplier: float | None = setting(None, "times --steering-vector (default: 1)")
    interventions: tuple[Any, ...] | None = setting(
        None, "Steer, Ablate, Patch or Clamp objects applied in every window, before a steering vector's, positions "
        "counted from the window's start (from Python)", flag="",
    )  # fmt: skip
    generate_tokens: int | None = setting(
        None, "first let the model continue each document by up to this many tokens (a conversation: the assistant's "
        "reply, after the template's generation prompt), then harvest the document with its continuation: rows of "
        "the model's own text. Kept in out_dir (replies-NNNNN.json): a resumed run reads them", minimum=1,
    )  # fmt: skip
    temperature: float = setting(
        0.0, "with --generate-tokens: sampling temperature (default 0: greedy); document i's samples are seeded by i",
        minimum=0,
    )  # fmt: skip
    samples: int = setting(
        1, "with --generate-tokens and a temperature: continuations per document, each harvested with it as a "
        "document of its own (row key document = samples x record + sample)", minimum=1,
    )  # fmt: skip

    def __post_init__(self) -> None:
        validate(self)
        if not self.hooks and self.sae is None:
            raise ValueError(
                "hooks: give at least one hook name or glob (see `vlens hooks`), or an SAE (--sae) to store its latents"
            )
        if (self.sae is None) != (self.top_k is None):
            raise ValueError("top_k: give it with sae, and only with sae: how many latents to store per row")
        if self.tensor_parallel_size > 1 and self.backend == "ray":
            raise ValueError("tensor_parallel_size: with the local backend; the Ray backend runs one model per actor")
        if self.revision is not None and self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError("revision: picks a version of a hub model named by `model`; the LLM or LoadedModel given "
                             "is loaded already")  # fmt: skip
        if self.sae_hook is not None and self.sae is None:
            raise ValueError("sae_hook: only with sae")
        if self.roles is not None and not self.roles:
            raise ValueError("roles: give at least one role (e.g. assistant) whose rows to store, or none for every row")
        check_interventions(self.interventions or ())
        if self.pool is not None and self.pack:
            raise ValueError(f"pool: {self.pool!r} takes one row per document, which needs pack=False (--no-pack): "
                             "packed windows cut documents apart")  # fmt: skip
        if self.image_field is not None:
            if self.pack:
                raise ValueError("image_field: a record with images is one window of its own, which needs pack=False "
                                 "(--no-pack): packing would cut images apart")  # fmt: skip
            for name, value in (("generate_tokens", self.generate_tokens), ("roles", self.roles)):
                if value is not None:
                    raise ValueError(f"{name}: {value!r} does not go with image_field; a harvest of images stores "
                                     "every row of the records' own text")  # fmt: skip
        if self.temperature and self.generate_tokens is None:
            raise ValueError("temperature: samples the continuations of generate_tokens; give it too")
        if self.samples > 1 and not self.temperature:
            raise ValueError(f"samples: {self.samples} continuations of a document need a temperature (greedy "
                             "ones would be the same) and generate_tokens")  # fmt: skip
        if self.multiplier is not None and self.steering_vector is None:
            raise ValueError("multiplier: scales steering_vector; give one")
        if self.pack and self.max_tokens is not None and self.max_tokens < self.context_size:
            raise ValueError(
                f"max_tokens: {self.max_tokens} is less than one window (context_size={self.context_size})"
            )

    def pipelined(self, device: torch.device) -> bool:
        """Whether the run on `device` overlaps its steps in threads (see `pipeline`)."""
        return self.pipeline == "on" or (self.pipeline == "auto" and device.type == "cuda")

    @property
    def out_dtype(self) -> torch.dtype:
        """The stored dtype as torch names it."""
        return self.dtype if isinstance(self.dtype, torch.dtype) else DTYPES[self.dtype]
