"""Gradients at hooks: vlens's HookedLM (run_with_cache(incl_bwd=True): a packed forward and one backward)
against HF (a padded forward with output_hidden_states, retain_grad on each, one backward), in one run.

    .venv/bin/python benchmarks/bench_gradients.py [--repeats 2]

SmolLM2-135M float32 on this CPU; the loss (mean next-token cross-entropy over every text's tokens, pads
excluded on both sides) backpropagated, the residual stream entering every layer kept with its gradient
(attribution patching's inputs). Two batches: texts of very different lengths (HF pads them to the longest;
vlens packs them) and texts of one length (no padding anywhere: the engines' own cost). Printed: seconds,
the ratio to HF, and the largest relative difference of the gradients from HF's.
"""

from __future__ import annotations

import random

import torch
from bench_generate import best_alternating
from bench_patching import repeats_and_models

NAMES = "blocks.*.hook_resid_pre"


def batch(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random token ids (no 0) and their attention mask."""
    rng = random.Random(0)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.tensor([rng.randrange(1, vocab) for _ in range(n)])
    return ids, ids != 0


def main() -> None:
    repeats, hooked, hf = repeats_and_models(__doc__)
    hf.requires_grad_(False)  # gradients at activations only, as vlens computes them: the graph starts at the embedding
    hf.model.embed_tokens.register_forward_hook(lambda module, args, out: out.requires_grad_())
    layers = hooked.cfg.n_layers
    rng = random.Random(1)
    cases = {
        "16 texts of 16-256 tokens": [rng.randint(16, 256) for _ in range(16)],
        "4 texts of 128 tokens": [128] * 4,
    }
    print(f"\ngradients of the loss at every layer's resid_pre, SmolLM2-135M float32 ({layers} layers)")
    print(f"{'case':<30}{'HF s':>8}{'vlens s':>9}{'ratio':>8}{'rel diff':>10}")
    for name, lengths in cases.items():
        ids, mask = batch(lengths, hooked.cfg.d_vocab)
        got = {}

        def ours():
            _, cache = hooked.run_with_cache(ids, attention_mask=mask, names_filter=NAMES, return_type="loss",
                                             incl_bwd=True)  # fmt: skip
            got["vlens"] = [cache[f"blocks.{L}.hook_resid_pre_grad"] for L in range(layers)]

        def theirs():
            labels = ids.masked_fill(~mask, -100)
            out = hf(ids, attention_mask=mask.long(), labels=labels, output_hidden_states=True)
            hidden = out.hidden_states[:layers]
            for h in hidden:
                h.retain_grad()
            out.loss.backward()
            got["hf"] = [h.grad * mask[..., None] for h in hidden]

        times = best_alternating([theirs, ours], repeats)
        differs = max(
            ((a - b).norm() / b.norm()).item() for a, b in zip(got["vlens"], got["hf"], strict=True)
        )  # fmt: skip
        print(f"{name:<30}{times[0]:>8.2f}{times[1]:>9.2f}{times[1] / times[0]:>7.2f}x{differs:>10.1e}")


if __name__ == "__main__":
    main()
