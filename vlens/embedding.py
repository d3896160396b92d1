"""One vector per prompt, read from any hook: what `LLM.embed` and vlens serve's `/v1/embeddings` return.

A prompt's embedding is a prefill-only engine request capturing one hook: `pooling="mean"` is the capture's mean
readout over every prompt row (summed on the device step by step), `"last"` the last row. A batch of such requests
stops its forward after the hook's layer. An embedding model's checkpoint may say how it is read (a
sentence-transformers folder: its Pooling module's mode, a Normalize module), as vLLM reads it: EmbeddingDefaults.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vlens.capture import Capture
from vlens.capture.interventions import Intervention
from vlens.capture.names import FINAL_NORM, is_pattern, resolve_hooks
from vlens.config import ModelConfig
from vlens.outputs import RequestOutput
from vlens.sampling_params import SamplingParams

log = logging.getLogger("vlens")
DEFAULT_HOOK = FINAL_NORM  # the final norm's output: what the unembedding reads
POOLINGS = {"mean": "prompt", "last": "last"}  # pooling -> the rows it reads
# a sentence-transformers Pooling module's modes -> vlens's pooling (the others, CLS or max, a decoder's checkpoints
# do not use)
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class EmbeddingDefaults:
    """How a checkpoint's embeddings are read where a request does not say: its sentence-transformers modules'
    pooling and normalisation (modules.json, as vLLM reads them); None where it says nothing."""

    pooling: str | None = None
    normalize: bool | None = None

    @property
    def declared(self) -> bool:
        """Whether the checkpoint has sentence-transformers modules (it is made to embed)."""
        return self.normalize is not None

    @classmethod
    def of(cls, path: Path) -> EmbeddingDefaults:
        try:
            modules = json.loads((path / "modules.json").read_text())
        except (OSError, ValueError):
            return cls()
        pooling = None
        for module in modules:
            if not str(module.get("type", "")).endswith(".Pooling"):
                continue
            where = path / module.get("path", "") / "config.json"
            try:
                config = json.loads(where.read_text())
            except (OSError, ValueError) as e:
                log.warning("%s: unreadable (%s); embeddings are the mean unless asked", where, e)
                continue
            pooling = next((ours for mode, ours in ST_MODES.items() if config.get(mode)), None)
            if pooling is None:
                modes = [mode for mode, on in config.items() if mode.startswith("pooling_mode") and on]
                log.warning("%s pools by %s, which vlens does not; embeddings are the mean unless asked", path, modes)
        normalize = any(str(module.get("type", "")).endswith(".Normalize") for module in modules)
        return cls(pooling, normalize)


def check_hook(hook: str, cfg: ModelConfig) -> None:
    """Raise unless `hook` names one tap whose rows all have one width (an embedding is one of its rows)."""
    taps = set(resolve_hooks(hook, cfg).values())
    if len(taps) != 1:
        raise ValueError(f"{hook!r} matches {len(taps)} hooks; name one")
    if is_pattern(*taps):
        raise ValueError(f"{hook!r} is attention scores or a pattern, whose rows are as wide as their position; "
                         "embed a hook of fixed width")  # fmt: skip


def check_dimensions(dimensions: object, cfg: ModelConfig, hook: str = DEFAULT_HOOK, field: str = "dimensions") -> None:
    """Raise naming `field` unless an embedding of `hook` may be cut to its first `dimensions` (None: not cut), by
    vLLM's rule: only a matryoshka model's (ModelConfig.matryoshka; any other's first dims embed poorly), to a width
    it was trained for; and here only its embedding (the final norm's rows), not another hook's."""
    if dimensions is None:
        return
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= cfg.hidden_size:
        raise ValueError(f"{field}: {dimensions!r} is not allowed; expected a width from 1 to the embedding's "
                         f"{cfg.hidden_size}")  # fmt: skip
    if not cfg.matryoshka:
        raise ValueError(f"{field}: the model was not trained for shorter embeddings (matryoshka), so its first "
                         "dims alone would embed poorly (vLLM refuses them too); where it was, say so: "
                         "hf_overrides={\"is_matryoshka\": true}")  # fmt: skip
    if cfg.matryoshka_dimensions and dimensions not in cfg.matryoshka_dimensions:
        raise ValueError(f"{field}: {dimensions} is not allowed; the model was trained for widths "
                         f"{', '.join(map(str, cfg.matryoshka_dimensions))}")  # fmt: skip
    if set(resolve_hooks(hook, cfg).values()) != {FINAL_NORM}:
        raise ValueError(f"{field}: cuts the model's embedding (the final norm's rows, {FINAL_NORM}); "
                         f"{hook!r} is another hook")  # fmt: skip


def embedding_params(
    hook: str, pooling: str, cfg: ModelConfig, interventions: Sequence[Intervention] = (),
    truncate_prompt_tokens: int | None = None,
) -> SamplingParams:  # fmt: skip
    """The request that reads a prompt's embedding (under `interventions`: a steered model's)."""
    try:
        check_hook(hook, cfg)
    except ValueError as e:
        raise ValueError(f"hook: {' '.join(str(e).split())}") from None
    if pooling not in POOLINGS:
        raise ValueError(f"pooling: {pooling!r} is not allowed; expected one of {', '.join(POOLINGS)}")
    capture = Capture(hooks=hook, positions=POOLINGS[pooling], reduce="mean" if pooling == "mean" else "none")
    return SamplingParams(max_tokens=0, capture=capture, interventions=interventions,
                          truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip


def embedding_of(
    output: RequestOutput, hook: str, normalize: bool = False, dimensions: int | None = None
) -> torch.Tensor:
    """The vector an embedding request read: [d] (a hook with several dims per row, flattened); `dimensions`: its
    first ones alone (check_dimensions); `normalize`: then scaled to unit length (vLLM's normalize, for cosine
    similarities by dot products)."""
    vector = cut(output.activations[hook][0].flatten(), dimensions)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def cut(rows: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """A matryoshka embedding's rows cut to their first `dimensions` (None: whole), before any normalising, as vLLM
    cuts them."""
    return rows if dimensions is None else rows[..., :dimensions]
