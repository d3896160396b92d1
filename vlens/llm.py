"""`LLM`: the user-facing entry point (vLLM-shaped), for generation with capture and for traces."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from vlens.engine.packed import packed_forward, token_batches
from vlens.hooks import hook_shapes, resolve_hooks
from vlens.inputs import to_token_lists
from vlens.loader import load_model


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        block_size: int = 16,
        enable_capture: bool = True,
        seed: int = 0,
    ):
        loaded = load_model(model, dtype=dtype, device=device)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_path, self.model_name = loaded.path, loaded.name
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens

    def hook_names(self) -> dict[str, tuple[int, ...]]:
        """Every hook name this model has, in forward order, with its per-token shape."""
        return hook_shapes(self.config)

    @torch.inference_mode()
    def trace(
        self, texts: str | Sequence[str] | Sequence[Sequence[int]], hooks: str | Sequence[str]
    ) -> list[dict[str, torch.Tensor]]:
        """One forward per text (packed together), every position: per text a dict hook -> CPU [tokens, ...].

        Texts are tokenized as the model's HF tokenizer does by default (special tokens included);
        token-id lists are taken as they are. The forward stops after the deepest requested layer."""
        wanted = resolve_hooks(hooks, self.config)
        taps = sorted(set(wanted.values()))
        token_lists = to_token_lists(texts, self.tokenizer, self.config.vocab_size, field="texts")
        captured: list[dict[str, torch.Tensor]] = [{} for _ in token_lists]
        for batch in token_batches([len(t) for t in token_lists], self.max_num_batched_tokens):
            plan = packed_forward(self.model, [token_lists[i] for i in batch], taps)
            for owner, tap, rows in plan.pieces():
                captured[batch[owner]][tap] = rows.clone()
        return [{name: c[tap] for name, tap in wanted.items()} for c in captured]

