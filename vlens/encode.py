"""vLLM's pooling tasks (LLM.encode, LLM.reward, the server's /pooling): one tensor per prompt, read from the final
norm's rows as vLLM's poolers read a pooling model's last hidden states.

- "token_embed": every prompt token's row, each of unit length unless `normalize=False` ([tokens, d]): what vLLM
  users call for a causal LM's per-token hidden states.
- "token_classify": a classifier's head on every prompt token's row, through its activation unless
  `use_activation=False` ([tokens, classes]): LLM.reward's per-token rewards, where in a reply a reward model's score
  moves; with vLLM's step pooling, the rows of a step tag alone (a process reward model's score of each step).
- "embed": the last row, of unit length unless `normalize=False` ([d]; vLLM's pooler for a decoder: LLM.embed reads
  any hook, mean-pooled by default).
- "classify": a classifier's head on the last row ([classes]; LLM.classify's probabilities, or its logits).

An embedding model's sentence-transformers modules, where the checkpoint has them, set the embedding tasks' defaults
as vLLM's: "embed"'s pooling (the mean or the last row) and whether both normalise (vlens.embedding.EmbeddingDefaults).
Each task is a prefill-only engine request that captures the rows it reads (vlens.embedding's), so interventions
steer it as any request. An embedding model also scores pairs of texts, as a bi-encoder (LLM.score).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from vlens.capture import Capture
from vlens.capture.interventions import Intervention
from vlens.capture.names import FINAL_NORM
from vlens.classify import ClassifierHead
from vlens.config import ModelConfig
from vlens.embedding import POOLINGS, EmbeddingDefaults, check_dimensions, cut
from vlens.outputs import RequestOutput
from vlens.sampling_params import SamplingParams

POOLING_TASKS = ("token_embed", "token_classify", "embed", "classify")
CLASSIFYING = ("token_classify", "classify")  # the tasks that need a classifier's head


# the PoolingParams fields each task reads (vLLM refuses the others too)
READS = {"token_embed": ("normalize", "dimensions"), "embed": ("normalize", "dimensions"),
         "token_classify": ("use_activation", "step_tag_id", "returned_token_ids"), "classify": ("use_activation",)}


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams: `normalize` and `dimensions` (embedding tasks: a matryoshka model's vectors cut to their
    first dims, vlens.embedding.check_dimensions), `use_activation` (classifying tasks), and vLLM's step pooling for
    "token_classify": `returned_token_ids`, the head's classes kept (before the activation, as vLLM keeps them),
    `step_tag_id`, the rows kept, those of the prompt's step tags (a process reward model's score at each step's end).
    None is the task's default (True; the whole vector; every class and row), and a field the task does not read is
    refused."""

    normalize: bool | None = None
    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for field in ("normalize", "use_activation"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"pooling_params.{field}: {value!r} is not allowed; expected a bool or None")
        for field, least in (("dimensions", 1), ("step_tag_id", 0)):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"pooling_params.{field}: {value!r} is not allowed; expected an integer >= {least} "
                                 "or None")  # fmt: skip
        ids = self.returned_token_ids
        if ids is not None:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids or \
                    not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):  # fmt: skip
                raise ValueError(f"pooling_params.returned_token_ids: {ids!r} is not allowed; expected a non-empty "
                                 "list of class indices or None")  # fmt: skip
            object.__setattr__(self, "returned_token_ids", tuple(ids))

    def resolved(self, task: str, defaults: EmbeddingDefaults) -> PoolingParams:
        """These with `normalize` set for an embedding task: the checkpoint's where it says, else vLLM's (True)."""
        if task in CLASSIFYING or self.normalize is not None:
            return self
        return replace(self, normalize=defaults.normalize is not False)

    def check(self, task: str, cfg: ModelConfig, prefix: str = "pooling_params.", hook: str = FINAL_NORM) -> None:
        """Raise naming the field (after `prefix`) that `task` does not read (vLLM refuses it too), a width this
        model's embeddings (of `hook`: LLM.embed reads any) may not be cut to, or a class its head does not have."""
        for field in ("normalize", "use_activation", "dimensions", "step_tag_id", "returned_token_ids"):
            if getattr(self, field) is not None and field not in READS[task]:
                raise ValueError(f"{prefix}{field}: {task!r} does not read it; it reads {', '.join(READS[task])}")
        check_dimensions(self.dimensions, cfg, hook, f"{prefix}dimensions")
        classes = len(cfg.classifier_labels)
        for i in self.returned_token_ids or ():
            if not 0 <= i < classes:
                raise ValueError(f"{prefix}returned_token_ids: {i} is not allowed; the head's classes are 0 to "
                                 f"{classes - 1}")  # fmt: skip


def check_task(task: object, cfg: ModelConfig, field: str = "pooling_task") -> str:
    """`task` if this model can run it; a ValueError naming `field` and the allowed values otherwise."""
    if task not in POOLING_TASKS:
        raise ValueError(f"{field}: {task!r} is not allowed; expected one of {', '.join(POOLING_TASKS)}")
    if task in CLASSIFYING and not cfg.classifier_labels:
        raise ValueError(f"{field}: {task!r} needs a classifier's head (a ...ForSequenceClassification checkpoint); "
                         f"{cfg.headless_kind}: token_embed or embed read its rows")  # fmt: skip
    if task == "classify" and cfg.classifier_per_token:
        raise ValueError(f"{field}: 'classify' reads a whole prompt; {cfg.classifier_name} classifies every token: "
                         "token_classify reads its classes")  # fmt: skip
    return task


def pooling_request(
    task: str, defaults: EmbeddingDefaults, interventions: Sequence[Intervention] = (),
    truncate_prompt_tokens: int | None = None,
) -> SamplingParams:  # fmt: skip
    """The prefill-only request that reads `task`'s rows: the final norm's at every prompt token, or its last (its
    mean, for "embed" where the checkpoint pools so)."""
    if task.startswith("token_"):
        capture = Capture(hooks=FINAL_NORM, positions="prompt")
    elif task == "embed" and defaults.pooling == "mean":
        capture = Capture(hooks=FINAL_NORM, positions=POOLINGS["mean"], reduce="mean")
    else:
        capture = Capture(hooks=FINAL_NORM, positions="last")
    return SamplingParams(max_tokens=0, capture=capture, interventions=interventions,
                          truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip


def pooled(task: str, output: RequestOutput, params: PoolingParams, head: ClassifierHead | None) -> torch.Tensor:
    """What `task` returns for one request read by pooling_request, under `params` resolved for the checkpoint
    (PoolingParams.resolved): float32, [tokens, ...] for a token task."""
    rows = output.activations[FINAL_NORM]
    if task in CLASSIFYING:
        assert head is not None  # (check_task)
        data = head.logits(rows)
        if params.returned_token_ids is not None:
            data = data[:, list(params.returned_token_ids)]
        data = data if params.use_activation is False else head.probs(data)
        if params.step_tag_id is not None:
            data = data[torch.tensor(output.prompt_token_ids) == params.step_tag_id]
    else:
        data = cut(rows.float(), params.dimensions)
        data = torch.nn.functional.normalize(data, dim=-1) if params.normalize else data
    return data.cpu() if task.startswith("token_") else data[0].cpu()


def bi_encoder(cfg: ModelConfig, defaults: EmbeddingDefaults) -> bool:
    """Whether LLM.score and the server's /score and /rerank score pairs with this model as a bi-encoder, each text
    embedded ("embed") and a pair's score the cosine of its two vectors (vLLM's for embedding models): a checkpoint
    made to embed, a base model's or one with sentence-transformers modules, that is no classifier."""
    return not cfg.classifier_labels and (bool(cfg.base_model) or defaults.declared)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()
