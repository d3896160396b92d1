"""Setting transcoder features and running the model on (circuit-tracer's `feature_intervention`): the check of
what an attribution graph claims — turn a feature off, or up, and see the logits move.

Each intervention (layer, position, feature, value) sets that feature's activation, on the prompt as the
interventions themselves change it, to `value`: the MLP outputs it decodes to (its layer's; a cross-layer
transcoder's, every later one's too) get W_dec[feature] times (value minus its activation there) added. The MLPs
stay the model's own, so everything else the change sets off propagates through them. `freeze_attention` keeps
every attention pattern at its value on the untouched prompt, as circuit-tracer does by default: each layer's
attention output (hook_z) is that run's pattern over this run's values, so the keys and values generation goes on
from are this run's, as circuit-tracer's are. Position 0 has no features (zeroed, as in attribute), so an
intervention there adds value times the decoder row.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vlens.attribution_graph import features_of, prompt_tokens
from vlens.capture.interventions import Clamp
from vlens.capture.names import LOGITS
from vlens.replacement import CrossLayer, PerLayer, check_frozen_attention, replacement
from vlens.sae.model import SAE

if TYPE_CHECKING:
    from vlens.hooked import HookedLM

Intervention = tuple[int, int | slice, int, float]  # layer, position (or positions), feature, value


def feature_intervention(
    model: HookedLM, prompt: str | Sequence[int] | torch.Tensor, transcoders: Any,
    interventions: Sequence[Intervention], freeze_attention: bool = True, constrained_layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(logits [positions, vocab], activations [layers, positions, d_sae]) of `prompt` (tokenized as attribute
    tokenizes it: prompt_tokens) with the `interventions` in force; the activations are every layer's transcoder
    features as its transcoder reads them on the intervened run (a feature set shows what it reads there, not
    the value set: the change is in what it writes), as circuit-tracer returns them. A position may be a slice
    (circuit-tracer's): the feature is set at each of those positions.

    `constrained_layers` (circuit-tracer's; a range of layers): the changes are those of the untouched run's
    activations, written to those layers only, whose MLP outputs are frozen at the untouched run's (but for what a
    skip connection passes on) and attention with them; with every layer constrained the norms' divisors are too,
    so what an intervention does is its direct effect alone — the attribution graph's edges."""
    run = _Run(model, transcoders, prompt, interventions, freeze_attention, constrained_layers)
    with torch.no_grad():
        logits = model.run_with_hooks(run.tokens[None], fwd_hooks=run.hooks)
    return logits[0], torch.stack([acts[0] for acts in run.acts])


def feature_intervention_generate(
    model: HookedLM, prompt: str | Sequence[int] | torch.Tensor, transcoders: Any,
    interventions: Sequence[Intervention], freeze_attention: bool = True, constrained_layers: Sequence[int] | None = None,
    max_new_tokens: int = 10, **generate: Any,
) -> tuple[str | torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """circuit-tracer's `feature_intervention_generate`: `prompt` run as in feature_intervention (its
    `freeze_attention` and `constrained_layers` act on that forward alone), then generated from with HookedLM's
    generate (`**generate`: its options; do_sample=True by default, as there) over its KV cache. An open-ended
    position, slice(p, None), sets the feature at the prompt's positions from p on and at every generated token's
    too (its activation there as the intervened run reads it, nothing frozen); the others act on the prompt only.

    Returns (the prompt and its continuation: a text for a text prompt, else tokens [1, positions + steps]),
    logits [steps, vocab] (the prompt's last position's, then each later step's) and activations [layers,
    positions + steps - 1, d_sae] (the prompt's, then each fed token's), as circuit-tracer returns them."""
    if not generate.get("use_past_kv_cache", True):
        raise ValueError("use_past_kv_cache: feature_intervention_generate runs each new token over the KV cache "
                         "(as circuit-tracer does); leave it True")  # fmt: skip
    run = _Run(model, transcoders, prompt, interventions, freeze_attention, constrained_layers)
    return_type = "str" if isinstance(prompt, str) else "tokens"
    with torch.no_grad(), model.hooks(fwd_hooks=[*run.hooks, (LOGITS, run.logits)]):
        out = model.generate(run.tokens[None], max_new_tokens=max_new_tokens, return_type=return_type, **generate)
    logits = torch.cat(run.logged)
    return out, logits, torch.stack([torch.cat(acts) for acts in run.acts])


def feature_clamps(
    model: HookedLM, transcoders: Any, interventions: Sequence[tuple[int, int, float]], positions: Any = "all"
) -> list[Clamp]:
    """The engine's interventions (SamplingParams(interventions=...), per request, in a batch, graphs kept) that set
    each (layer, feature, value) at `positions` of the run as it goes: a Clamp wherever the feature writes (a
    cross-layer transcoder's: its layer's MLP output and every later one's), each of a one-latent transcoder
    reading where the feature is read. What feature_intervention_generate does with open-ended positions,
    attention not frozen, with the feature's activation at position 0 its own (not zeroed)."""
    tcs = replacement(model, transcoders)
    n = model.cfg.num_layers
    clamps = []
    for i, item in enumerate(interventions):
        ok = isinstance(item, (tuple, list)) and len(item) == 3
        layer, feature, value = item if ok else (None,) * 3
        ints = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in (layer, feature))
        if not (ints and 0 <= layer < n and 0 <= feature < tcs.d_sae[layer]):
            raise ValueError(f"interventions[{i}]: {item!r} is not (layer in 0..{n - 1}, a feature of that layer's "
                             "transcoder, value)")  # fmt: skip
        encoder, bias, threshold = tcs.latent(layer, feature)
        rows = tcs.decoder_rows(layer, torch.tensor([feature]))[0]
        for row, target in zip(rows, tcs.targets(layer)):
            one = SAE(
                W_enc=encoder[:, None].clone(), b_enc=bias.reshape(1).clone(), W_dec=row[None].clone(),
                b_dec=torch.zeros(len(row)), threshold=None if threshold is None else threshold.reshape(1).clone(),
                architecture="standard" if threshold is None else "jumprelu", apply_b_dec_to_input=False,
                hook=tcs.reads[layer], hook_out=tcs.writes[target],
            )  # fmt: skip
            clamps.append(Clamp(one.writes, one, 0, value, positions=positions))
    return clamps


class _Run:
    """The hooks of an intervened run, for the prompt's forward and (generation) each later one: each transcoder's
    features read where it reads, the changes added where they write, attention (and, constrained, MLP outputs and
    norms) frozen to the untouched prompt's on the prompt's forward."""

    def __init__(
        self, model: HookedLM, transcoders: Any, prompt: str | Sequence[int] | torch.Tensor,
        interventions: Sequence[Intervention], freeze_attention: bool, constrained_layers: Sequence[int] | None,
    ):  # fmt: skip
        self.tcs = tcs = replacement(model, transcoders)
        self.tokens = prompt_tokens(model, prompt)
        n, n_pos = model.cfg.num_layers, len(self.tokens)
        self.changes, self.open_ended = _checked(interventions, n, n_pos, tcs)
        self.constrained = _constrained(constrained_layers, n) if self.changes else []  # (none: the model's run)
        self.clean: dict[str, torch.Tensor] = {}
        frozen, patterns, self.frozen_out = [], [], {}
        if (freeze_attention or self.constrained) and self.changes:
            check_frozen_attention(model.cfg, "freeze_attention (and constrained_layers)")
            patterns = [f"blocks.{layer}.attn.hook_pattern" for layer in range(n)]
            if self.constrained == list(range(n)):
                frozen += [name for name in model._shapes if name.endswith(".hook_scale")]
            self.frozen_out = {layer: tcs.writes[layer] for layer in self.constrained}
            names = [*patterns, *frozen, *self.frozen_out.values(), *tcs.reads]
            with torch.no_grad():
                _, self.clean = model.run_with_cache(self.tokens[None], names_filter=names)
        self.step = 0  # forwards run so far: the prompt's is step 0
        self.inputs: list[torch.Tensor | None] = [None] * n  # each transcoder's input this forward, on the device
        self.acts: list[list[torch.Tensor]] = [[] for _ in range(n)]  # each layer's features, forward by forward
        self.deltas: list[torch.Tensor | None] = [None] * n  # what each MLP output gets added this forward
        self.logged: list[torch.Tensor] = []  # generation: each forward's last logits
        self.values: list[torch.Tensor | None] = [None] * n  # each layer's attention values (patterns frozen)
        self.hooks = [(name, partial(self._put, self.clean[name])) for name in frozen]
        for layer, name in enumerate(patterns):
            attend = partial(self._attend, self.clean[name][0], layer)
            self.hooks += [(f"blocks.{layer}.attn.hook_v", partial(self._keep_values, layer)),
                           (f"blocks.{layer}.attn.hook_z", attend)]  # fmt: skip
        self.hooks += [(name, partial(self._read, layer)) for layer, name in enumerate(tcs.reads)]
        self.hooks += [(name, partial(self._write, layer)) for layer, name in enumerate(tcs.writes)]

    def _put(self, fixed: torch.Tensor, value: torch.Tensor, hook: Any) -> torch.Tensor | None:
        return fixed.to(value.device, value.dtype) if self.step == 0 else None

    def _keep_values(self, layer: int, value: torch.Tensor, hook: Any) -> None:
        self.values[layer] = value[0] if self.step == 0 else None

    def _attend(self, pattern: torch.Tensor, layer: int, value: torch.Tensor, hook: Any) -> torch.Tensor | None:
        """The prompt's attention output with the untouched run's pattern [heads, queries, keys] over this run's
        values [keys, kv heads, d_head] (a key-value head serving several query heads)."""
        if self.step != 0:
            return None
        v = self.values[layer]
        v = v.repeat_interleave(pattern.shape[0] // v.shape[1], dim=1)
        z = torch.einsum("hqk,khd->qhd", pattern.to(v.device, v.dtype), v)
        return z[None].to(value.dtype)

    def _read(self, layer: int, value: torch.Tensor, hook: Any) -> None:
        tcs, prompt = self.tcs, self.step == 0
        x = self.inputs[layer] = value[0].flatten(1)
        # (a generated token's features: none zeroed, as circuit-tracer reads them one token at a time)
        acts = features_of(tcs, layer, x) if prompt else tcs.encode(layer, x.float().cpu())
        self.acts[layer].append(acts)
        if prompt:
            changes = self.changes.get(layer, {})
        else:  # (the open-ended ones, at the one position fed)
            changes = {(0, feature): v for feature, v in self.open_ended.get(layer, {}).items()}
        if not changes:
            return
        base = acts
        if prompt and self.constrained:
            base = features_of(tcs, layer, self.clean[tcs.reads[layer]][0].flatten(1))
        for (position, feature), target in changes.items():
            rows = (target - base[position, feature]) * tcs.decoder_rows(layer, torch.tensor([feature]))[0]
            for row, out in zip(rows, tcs.targets(layer)):
                if self.deltas[out] is None:
                    self.deltas[out] = torch.zeros(len(x), len(row))
                self.deltas[out][position] += row

    def _write(self, layer: int, value: torch.Tensor, hook: Any) -> torch.Tensor | None:
        delta, self.deltas[layer] = self.deltas[layer], None
        if self.step == 0 and self.constrained:
            if layer not in self.frozen_out:
                return None
            # (the untouched run's output, and what the skip connection passes on of this run's input)
            tcs, clean = self.tcs, self.clean
            x, x_clean = self.inputs[layer], clean[tcs.reads[layer]][0].flatten(1).to(value.device, value.dtype)
            skip, skip_clean = tcs.skip(layer, x), tcs.skip(layer, x_clean)
            value = clean[self.frozen_out[layer]].to(value.device, value.dtype)
            if skip is not None:
                value = value + (skip - skip_clean).view_as(value[0])
        if delta is None:
            return value if self.step == 0 and self.constrained else None
        return value + delta.to(value.device, value.dtype).view_as(value[0])

    def logits(self, value: torch.Tensor, hook: Any) -> None:
        """The last position's logits of each forward (the one generation samples from); the forward is done."""
        self.logged.append(value[0, -1:].float().cpu())
        self.step += 1


def _constrained(layers: Sequence[int] | None, n: int) -> list[int]:
    chosen = sorted(set(layers or ()))
    if not all(isinstance(layer, int) and 0 <= layer < n for layer in chosen):
        raise ValueError(f"constrained_layers: {layers!r} is not layers in 0..{n - 1} (a range of them)")
    return chosen


def _checked(
    interventions: Sequence[Intervention], n_layers: int, n_pos: int, tcs: PerLayer | CrossLayer
) -> tuple[dict[int, dict[tuple[int, int], float]], dict[int, dict[int, float]]]:
    """The interventions by layer: {(position, feature): value} on the prompt (of two on one feature, the later
    one, as in circuit-tracer), and the open-ended ones' {feature: value} for generated tokens; each in range."""
    by_layer: dict[int, dict[tuple[int, int], float]] = {}
    open_ended: dict[int, dict[int, float]] = {}
    for i, item in enumerate(interventions):
        ok = isinstance(item, (tuple, list)) and len(item) == 4
        layer, position, feature, value = item if ok else (None,) * 4
        ints = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in (layer, feature))
        where = position if isinstance(position, slice) else None
        ints = ints and (where is not None or (isinstance(position, int) and not isinstance(position, bool)))
        if not (ints and 0 <= layer < n_layers and (where is not None or -n_pos <= position < n_pos)
                and 0 <= feature < tcs.d_sae[layer] and isinstance(value, (int, float))
                and not isinstance(value, bool)):  # fmt: skip
            raise ValueError(f"interventions[{i}]: {item!r} is not (layer in 0..{n_layers - 1}, position in "
                             f"0..{n_pos - 1} or a slice, a feature of that layer's transcoder, value: a "
                             "number)")  # fmt: skip
        positions = range(n_pos)[where] if where is not None else [position % n_pos]
        for p in positions:
            by_layer.setdefault(layer, {})[p, feature] = float(value)
        if where is not None and where.stop is None:
            open_ended.setdefault(layer, {})[feature] = float(value)
    return by_layer, open_ended
