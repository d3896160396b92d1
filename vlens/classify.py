"""Sequence classifiers (HF's *ForSequenceClassification; vLLM's LLM.classify and the server's /classify): a causal
LM's decoder under a head, `score`, that reads the final norm's row at a prompt's last token, in place of the
unembedding. A token classifier (*ForTokenClassification) has the same head (`classifier` in some families) over
every row: vlens.encode's "token_classify" reads it. One of a single class that reads two texts as one prompt is a
cross-encoder (a reranker: vLLM's LLM.score, /score and /rerank): a pair's score is its class's probability. The
decoder runs in the engine as any model's, in a prefill-only request that captures that one row (as LLM.embed reads a
hook); the head, a [classes, d] matrix, is applied here to the rows that come back. So a classifier's taps, steering,
adapters and the rest are a causal LM's, and its classes are read under them. A causal LM's checkpoint read as a
classifier (vLLM's classifier_from_token, set by hf_overrides: Qwen3-Reranker) has a head made of its unembedding's
rows of some tokens (token_rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from vlens.capture.interventions import Intervention
from vlens.capture.names import FINAL_NORM
from vlens.config import ModelConfig
from vlens.embedding import embedding_params
from vlens.layers.checkpoint import checkpoint_slots
from vlens.loader import LoadedModel, ModelLoadError, stored_name, weight_files
from vlens.outputs import ClassificationOutput, RequestOutput
from vlens.sampling_params import SamplingParams

# the head's names in HF's classifiers, beside the causal LM's own names for the decoder: every sequence classifier's,
# and most token classifiers' (GPT-NeoX's, Falcon's, Bloom's and a few more name theirs `classifier`)
HEADS = ("score", "classifier")
# ModelConfig.classifier_activation -> what it does to the head's logits
ACTIVATIONS = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid, "identity": lambda x: x}


@dataclass(frozen=True)
class ClassifierHead:
    weight: torch.Tensor  # [classes, d], the model's device and dtype
    bias: torch.Tensor | None
    labels: tuple[str, ...]  # the config's id2label, in class order
    activation: str  # ModelConfig.classifier_activation
    # a reward model's head is two layers (Qwen's: `score.0`, a ReLU, `score.2`): the first's weight [d, d] and bias,
    # before `weight` and `bias`; None for one layer
    hidden: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @classmethod
    def load(cls, loaded: LoadedModel) -> ClassifierHead:
        """The head of `loaded`'s classifier, in its model's device and dtype: its checkpoint's, or made of tokens'
        unembedding rows (ModelConfig.classifier_tokens)."""
        path, cfg, weight = loaded.path, loaded.config, loaded.model.lm_head.weight
        device, dtype = weight.device, weight.dtype
        if cfg.classifier_tokens:
            rows = token_rows(loaded).float()
            head = rows[1:] - rows[:1] if cfg.classifier_two_way else rows  # (in float32, as vLLM subtracts them)
            return cls(head.to(device, dtype), None, cfg.classifier_labels, cfg.classifier_activation)
        found: dict[str, torch.Tensor] = {}
        for file in weight_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                found |= {key: f.get_tensor(key) for key in f.keys() if key.split(".")[0] in HEADS}  # noqa: SIM118
        head = next((name for name in HEADS if f"{name}.weight" in found or f"{name}.0.weight" in found), HEADS[0])
        hidden = None
        if f"{head}.0.weight" in found:  # (a reward model's two layers)
            hidden = _layer(found, f"{head}.0", "hidden_size", cfg, path, device, dtype)
            head = f"{head}.2"
        weight, bias = _layer(found, head, "num_labels", cfg, path, device, dtype)
        return cls(weight, bias, cfg.classifier_labels, cfg.classifier_activation, hidden)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, d] final-norm rows -> the head's [n, classes] logits, computed in the model's dtype (as HF computes
        them), as float32."""
        rows = rows.to(self.weight.device, self.weight.dtype)
        if self.hidden is not None:
            rows = torch.relu(torch.nn.functional.linear(rows, *self.hidden))
        return torch.nn.functional.linear(rows, self.weight, self.bias).float()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits through the config's activation (as vLLM's classify gives them)."""
        return ACTIVATIONS[self.activation](logits)

    def classify(self, rows: torch.Tensor) -> list[ClassificationOutput]:
        """[n, d] final-norm rows -> each row's classes: its logits and probabilities."""
        logits = self.logits(rows)
        probs = self.probs(logits).cpu()
        return [ClassificationOutput(p.tolist(), self.labels[int(p.argmax())], z.tolist())
                for p, z in zip(probs, logits.cpu())]  # fmt: skip


def _layer(
    found: dict[str, torch.Tensor], name: str, outputs: str, cfg: ModelConfig, path, device, dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A head layer's weight ([`outputs` (num_labels or hidden_size), d]) and bias (None where it has none), on the
    model's device and dtype."""
    weight, bias = found.get(f"{name}.weight"), found.get(f"{name}.bias")
    shape = (len(cfg.classifier_labels) if outputs == "num_labels" else cfg.hidden_size, cfg.hidden_size)
    if weight is None or tuple(weight.shape) != shape:
        got = "none" if weight is None else f"shape {tuple(weight.shape)}"
        raise ModelLoadError(f"model: {cfg.classifier_name}'s head {name}.weight should be {shape[0]} x {shape[1]} "
                             f"({outputs} x hidden_size); {str(path)!r} has {got}")  # fmt: skip
    return weight.to(device, dtype), None if bias is None else bias.to(device, dtype)


def token_rows(loaded: LoadedModel) -> torch.Tensor:
    """[tokens, d]: the unembedding's rows of the config's classifier tokens, as the checkpoint stores them: its
    lm_head's, or where the causal LM ties it, its embedding's (a headless model's lm_head is a placeholder)."""
    cfg, tokenizer = loaded.config, loaded.tokenizer
    ids = []
    for token in cfg.classifier_tokens:
        id = tokenizer.convert_tokens_to_ids(token)
        if id is None or (id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ModelLoadError(f"classifier_from_token: {token!r} is no token of the model's vocabulary (a token as "
                                 "the tokenizer spells it: convert_tokens_to_ids)")  # fmt: skip
        ids.append(id)
    embedding = loaded.model.embed_tokens.weight  # (tied to the placeholder: both slots name it, the head's first)
    keys = [key for key, slot in checkpoint_slots(loaded.model).items() if slot.param is embedding]
    names = [stored_name(key, cfg) for key in sorted(keys, key=lambda key: not key.startswith("lm_head."))]
    files = {}  # name -> the file holding it (a sharded checkpoint's lm_head and embedding may lie apart)
    for file in weight_files(loaded.path):
        with safe_open(file, framework="pt", device="cpu") as f:
            files |= {name: file for name in names if name in f.keys()}  # noqa: SIM118
    name = next((name for name in names if name in files), None)
    if name is None:
        raise ModelLoadError(f"model: {str(loaded.path)!r} has no unembedding ({' or '.join(names)}) to read "
                             "classifier_from_token's rows from")  # fmt: skip
    with safe_open(files[name], framework="pt", device="cpu") as f:
        stored = f.get_slice(name)
        return torch.cat([stored[i : i + 1] for i in ids])


def classification_params(
    cfg: ModelConfig, interventions: Sequence[Intervention] = (), truncate_prompt_tokens: int | None = None
) -> SamplingParams:
    """The request that reads what the head reads: the final norm's last prompt row."""
    return embedding_params(FINAL_NORM, "last", cfg, interventions, truncate_prompt_tokens)


def last_rows(outputs: list[RequestOutput]) -> torch.Tensor:
    """[n, d]: each classification request's row, as classification_params read it."""
    return torch.stack([output.activations[FINAL_NORM][0] for output in outputs])


def pairs(
    data_1: str | Sequence[str], data_2: str | Sequence[str], fields: tuple[str, str] = ("data_1", "data_2")
) -> list[tuple[str, str]]:
    """vLLM's pairing of LLM.score's texts: one text with each of the others (1:N), or two lists item by item (N:N);
    a ValueError naming the field (`fields`: the two's names) otherwise."""
    def texts(data: str | Sequence[str], field: str) -> list[str]:
        listed = [data] if isinstance(data, str) else list(data) if isinstance(data, Sequence) else None
        if not listed or not all(isinstance(t, str) and t for t in listed):
            raise ValueError(f"{field}: expected a non-empty text or a non-empty list of them, got {data!r}")
        return listed

    first, second = texts(data_1, fields[0]), texts(data_2, fields[1])
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"{fields[1]}: {len(second)} texts for {fields[0]}'s {len(first)}; give one text and many, or "
                         "as many of each")  # fmt: skip
    return list(zip(first, second))


def pair_tokens(tokenizer: Any, cfg: ModelConfig, first: str, second: str) -> list[int]:
    """A cross-encoder's prompt of a pair, as vLLM tokenizes it: the tokenizer's pair of texts (its separators), or
    where the model reads them joined (ModelConfig.pairs_joined: an LLM as a reranker), the two as one text."""
    encoded = tokenizer(first + second) if cfg.pairs_joined else tokenizer(first, second)
    return encoded["input_ids"]


def check_sequence_classifier(cfg: ModelConfig, field: str) -> None:
    """Raise unless the model classifies whole prompts: a sequence classifier's checkpoint."""
    if not cfg.classifier_labels:
        raise ValueError(f"{field}: {cfg.headless_kind}, without the head ({HEADS[0]}) of a sequence classifier's "
                         "checkpoint (...ForSequenceClassification)")  # fmt: skip
    if cfg.classifier_per_token:
        raise ValueError(f"{field}: {cfg.classifier_name} classifies every token, not a whole prompt; "
                         "LLM.encode(..., pooling_task='token_classify') (the server's /pooling) reads its classes")


def check_cross_encoder(cfg: ModelConfig, field: str) -> None:
    """Raise unless the model scores pairs read as one prompt: a sequence classifier of one class (vLLM's rule; an
    embedding model scores them as a bi-encoder instead: vlens.encode.bi_encoder)."""
    if cfg.classifier_per_token:
        check_sequence_classifier(cfg, field)
    if len(cfg.classifier_labels) != 1:
        what = f"{cfg.classifier_name} has {len(cfg.classifier_labels)} classes" if cfg.classifier_labels else \
            cfg.headless_kind  # fmt: skip
        raise ValueError(f"{field}: scores pairs with a cross-encoder (a sequence classifier of one class, as vLLM) "
                         "or an embedding model (a base model's or a sentence-transformers checkpoint); "
                         f"{what}")  # fmt: skip
