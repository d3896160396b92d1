"""Setting transcoder features and running the model on (circuit-tracer's `feature_intervention`): the check of
what an attribution graph claims — turn a feature off, or up, and see the logits move.

Each intervention (layer, position, feature, value) sets that feature's activation, on the prompt as the
interventions themselves change it, to `value`: the MLP outputs it decodes to (its layer's; a cross-layer
transcoder's, every later one's too) get W_dec[feature] times (value minus its activation there) added. The MLPs
stay the model's own, so everything else the change sets off propagates through them. `freeze_attention` keeps
every attention pattern at its value on the untouched prompt (each layer's queries and keys are put back to that
run's, which makes the same scores), as circuit-tracer does by default. Position 0 has no features (zeroed, as
in attribute), so an intervention there adds value times the decoder row.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vlens.attribution_graph import features_of, prompt_tokens
from vlens.replacement import CrossLayer, PerLayer, replacement

if TYPE_CHECKING:
    from vlens.hooked import HookedLM

Intervention = tuple[int, int, int, float]  # layer, position, feature, value


def feature_intervention(
    model: HookedLM, prompt: str | Sequence[int] | torch.Tensor, transcoders: Any,
    interventions: Sequence[Intervention], freeze_attention: bool = True, constrained_layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(logits [positions, vocab], activations [layers, positions, d_sae]) of `prompt` (tokenized as attribute
    tokenizes it: prompt_tokens) with the `interventions` in force; the activations are every layer's transcoder
    features as its transcoder reads them on the intervened run (a feature set shows what it reads there, not
    the value set: the change is in what it writes), as circuit-tracer returns them.

    `constrained_layers` (circuit-tracer's; a range of layers): the changes are those of the untouched run's
    activations, written to those layers only, whose MLP outputs are frozen at the untouched run's (but for what a
    skip connection passes on) and attention with them; with every layer constrained the norms' divisors are too,
    so what an intervention does is its direct effect alone — the attribution graph's edges."""
    tcs = replacement(model, transcoders)
    tokens = prompt_tokens(model, prompt)
    n, n_pos = model.cfg.num_layers, len(tokens)
    changes = _checked(interventions, n, n_pos, tcs)
    constrained = _constrained(constrained_layers, n)
    hooks, clean, frozen_out = [], {}, {}
    if (freeze_attention or constrained) and changes:
        frozen = [f"blocks.{layer}.attn.hook_{qk}" for layer in range(n) for qk in "qk"]
        if constrained == list(range(n)):
            frozen += [name for name in model._shapes if name.endswith(".hook_scale")]
        frozen_out = {layer: tcs.writes[layer] for layer in constrained}
        with torch.no_grad():
            _, clean = model.run_with_cache(tokens[None], names_filter=[*frozen, *frozen_out.values(), *tcs.reads])
        hooks += [(name, partial(_put, clean[name])) for name in frozen]
    inputs: list[torch.Tensor | None] = [None] * n  # each transcoder's input on this run, on the device
    acts: list[torch.Tensor | None] = [None] * n
    deltas: list[torch.Tensor | None] = [None] * n  # what each MLP output gets added, [positions, d_model]

    def read(layer: int, value: torch.Tensor, hook: Any) -> None:
        inputs[layer] = value[0].flatten(1)
        acts[layer] = features_of(tcs, layer, inputs[layer])
        if layer not in changes:
            return
        base = features_of(tcs, layer, clean[tcs.reads[layer]][0].flatten(1)) if constrained else acts[layer]
        for (position, feature), target in changes[layer].items():
            rows = (target - base[position, feature]) * tcs.decoder_rows(layer, torch.tensor([feature]))[0]
            for row, out in zip(rows, tcs.targets(layer)):
                deltas[out] = torch.zeros(n_pos, len(row)) if deltas[out] is None else deltas[out]
                deltas[out][position] += row

    def write(layer: int, value: torch.Tensor, hook: Any) -> torch.Tensor | None:
        if not changes or (constrained and layer not in frozen_out):
            return None
        if constrained:  # (the untouched run's output, and what the skip connection passes on of this run's input)
            x, x_clean = inputs[layer], clean[tcs.reads[layer]][0].flatten(1).to(value.device, value.dtype)
            skip, skip_clean = tcs.skip(layer, x), tcs.skip(layer, x_clean)
            value = clean[frozen_out[layer]].to(value.device, value.dtype)
            if skip is not None:
                value = value + (skip - skip_clean).view_as(value[0])
        if deltas[layer] is None:
            return value
        return value + deltas[layer].to(value.device, value.dtype).view_as(value[0])

    hooks += [(name, partial(read, layer)) for layer, name in enumerate(tcs.reads)]
    hooks += [(name, partial(write, layer)) for layer, name in enumerate(tcs.writes)]
    with torch.no_grad():
        logits = model.run_with_hooks(tokens[None], fwd_hooks=hooks)
    return logits[0], torch.stack(acts)


def _constrained(layers: Sequence[int] | None, n: int) -> list[int]:
    chosen = sorted(set(layers or ()))
    if not all(isinstance(layer, int) and 0 <= layer < n for layer in chosen):
        raise ValueError(f"constrained_layers: {layers!r} is not layers in 0..{n - 1} (a range of them)")
    return chosen


def _put(fixed: torch.Tensor, value: torch.Tensor, hook: Any) -> torch.Tensor:
    return fixed.to(value.device, value.dtype)


def _checked(
    interventions: Sequence[Intervention], n_layers: int, n_pos: int, tcs: PerLayer | CrossLayer
) -> dict[int, dict[tuple[int, int], float]]:
    """The interventions by layer: {(position, feature): value}, each in range (of two on one feature, the later
    one, as in circuit-tracer)."""
    by_layer: dict[int, dict[tuple[int, int], float]] = {}
    for i, item in enumerate(interventions):
        ok = isinstance(item, (tuple, list)) and len(item) == 4
        layer, position, feature, value = item if ok else (None,) * 4
        ints = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in (layer, position, feature))
        if not (ints and 0 <= layer < n_layers and -n_pos <= position < n_pos and 0 <= feature < tcs.d_sae[layer]
                and isinstance(value, (int, float)) and not isinstance(value, bool)):  # fmt: skip
            raise ValueError(f"interventions[{i}]: {item!r} is not (layer in 0..{n_layers - 1}, position in "
                             f"0..{n_pos - 1}, a feature of that layer's transcoder, value: a number)")  # fmt: skip
        by_layer.setdefault(layer, {})[position % n_pos, feature] = float(value)
    return by_layer
