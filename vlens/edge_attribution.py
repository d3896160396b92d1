"""Edge attribution patching (EAP; Syed, Rager and Conmy, 2023): every edge of a model's graph of heads and MLPs
scored at once, from one forward of the clean run and one forward and backward of the corrupted run — the
gradient-based first pass of circuit discovery that ACDC refines.

The graph is TransformerLens's, on its optional hooks (HookedLM's set_use_*, turned on for the two runs and back
after): upstream nodes write to the residual stream — the embeddings (token, plus position where the model learns
them), each head (attn.hook_result) and each MLP (hook_mlp_out); downstream nodes read it — each head's query, key
and value input (hook_q_input, hook_k_input and hook_v_input: key-value heads under grouped-query attention), each
MLP's input (hook_mlp_in) and the logits (the last layer's hook_resid_post, which only the final norm reads). An
edge u -> d exists where u writes before d reads (under GPT-NeoX's parallel residual a layer's MLP reads what its
heads have not written yet). Its score is the clean minus the corrupted output of u, dotted with the gradient of
the metric at d's input on the corrupted run, summed over texts and positions: the metric's change, to first
order, when that edge alone carries the clean value. Biases cancel in the difference. With `steps` > 1 the
gradients are averaged over the corrupted run with its stream entering layer 0 moved step by step towards the
clean run's (corrupted + k/steps (clean - corrupted), k = 0 .. steps - 1): EAP with integrated gradients (EAP-IG;
Hanna, Pezzelle and Belinkov, 2024), a forward and backward per step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlens.hooked import HookedLM

FLAGS = ("use_attn_result", "use_split_qkv_input", "use_hook_mlp_in")
STREAM = "blocks.0.hook_resid_pre"  # what EAP-IG moves from the corrupted run's towards the clean run's


def edge_attribution_patching(
    model: HookedLM, clean_tokens: torch.Tensor, corrupted_tokens: torch.Tensor,
    metric: Callable[[torch.Tensor], torch.Tensor], steps: int = 1,
) -> tuple[torch.Tensor, list[str], list[str]]:  # fmt: skip
    """(scores [upstream, downstream], upstream labels, downstream labels): "embed", "L{l}H{h}" (a head), "M{l}"
    (an MLP) upstream; "L{l}H{h}.q" / ".k" / ".v", "M{l}" and "logits" downstream. Where no edge exists the score
    is 0. `metric(logits)` is a scalar of the corrupted run's logits [batch, pos, d_vocab]; clean and corrupted
    tokens are of one shape. `steps`: 1, EAP; more, EAP-IG's steps."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: {steps!r} is not an int >= 1 (1: EAP; more: EAP-IG's interpolation steps)")
    cfg = model.cfg
    if cfg.any_post_norms:
        raise ValueError(f"{cfg.architecture}: a norm stands between each head (each MLP) and the residual stream, "
                         "so no edge carries one node's output alone")  # fmt: skip
    n = cfg.num_layers
    up = [f"blocks.{layer}.{hook}" for layer in range(n) for hook in ("attn.hook_result", "hook_mlp_out")]
    embed = ["hook_embed", *(["hook_pos_embed"] if cfg.learned_positions else [])]
    reads = ("hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in")
    down = [*(f"blocks.{layer}.{hook}" for layer in range(n) for hook in reads), f"blocks.{n - 1}.hook_resid_post"]
    was = {flag: getattr(cfg, flag) for flag in FLAGS}
    grads: dict[str, torch.Tensor] = {}
    try:
        for flag in FLAGS:
            model._use(flag, True)
        _, clean = model.run_with_cache(clean_tokens, names_filter=[*embed, *up, STREAM], return_type=None)
        save = [(name, lambda grad, hook: grads.__setitem__(hook.name, grads.get(hook.name, 0) + grad)) for name in down]
        for k in range(steps):  # (k = 0: the corrupted run itself)
            towards = [(STREAM, partial(_towards, clean[STREAM], k / steps))] if k else []
            with torch.enable_grad(), model.hooks(fwd_hooks=towards, bwd_hooks=save):
                if k:
                    logits = model(corrupted_tokens)
                else:
                    logits, corrupted = model.run_with_cache(corrupted_tokens, names_filter=[*embed, *up, STREAM])
                    if clean[STREAM].shape != corrupted[STREAM].shape:
                        raise ValueError(
                            "clean_tokens / corrupted_tokens: edge attribution needs two runs of one shape, got "
                            f"{tuple(clean[STREAM].shape[:2])} and {tuple(corrupted[STREAM].shape[:2])}"
                        )
                metric(logits).backward()
    finally:
        for flag, on in was.items():
            model._use(flag, on)

    # (each node's vectors [batch, pos, d_model], its label, and when it writes or reads: layer l's heads read at
    # 2l + 1 and write at 2l + 1.5, its MLP reads at 2l + 2, or 2l + 1 under a parallel residual, and writes at 2l + 2.5)
    def delta(name: str) -> torch.Tensor:
        return clean[name] - corrupted[name]

    writes = [(sum(map(delta, embed)), "embed", 0.0)]
    reading = []
    for layer in range(n):
        result, t = delta(f"blocks.{layer}.attn.hook_result"), 2 * layer
        writes += [(result[:, :, h], f"L{layer}H{h}", t + 1.5) for h in range(cfg.num_heads)]
        writes.append((delta(f"blocks.{layer}.hook_mlp_out"), f"M{layer}", t + 2.5))
        for hook, part in zip(reads[:3], "qkv"):
            grad = grads[f"blocks.{layer}.{hook}"]
            reading += [(grad[:, :, h], f"L{layer}H{h}.{part}", t + 1) for h in range(grad.shape[2])]
        reading.append((grads[f"blocks.{layer}.hook_mlp_in"], f"M{layer}", t + (1 if cfg.parallel_residual else 2)))
    reading.append((grads[down[-1]], "logits", 2 * n + 1))
    reading = [(grad / steps, label, t) for grad, label, t in reading]
    scores = torch.einsum("ubpd,vbpd->uv", *(torch.stack([v.float() for v, _, _ in nodes]) for nodes in (writes, reading)))
    exists = torch.tensor([[w < r for *_, r in reading] for *_, w in writes])
    return scores * exists, [label for _, label, _ in writes], [label for _, label, _ in reading]


def _towards(clean: torch.Tensor, alpha: float, corrupted: torch.Tensor, hook) -> torch.Tensor:
    return corrupted + alpha * (clean.to(corrupted.device, corrupted.dtype) - corrupted)
