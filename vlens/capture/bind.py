"""Binding a request's Capture and interventions to the loaded model: hook names resolved to taps,
positions checked against the rows the request can have, readouts and vectors shaped for the taps.

Everything here runs when a request is submitted, before any of it runs, so a bad request fails alone
with a ValueError naming its field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from vlens.capture.interventions import Ablate, Clamp, Intervention, Patch, Steer
from vlens.capture.names import (
    CTX,
    FINAL_NORM,
    LOGITS,
    PER_HEAD,
    HookSpecError,
    Part,
    is_pattern,
    resolve_hooks,
    tap_dtype,
)
from vlens.capture.positions import Positions
from vlens.capture.readouts import logit_lens, project
from vlens.capture.rows import RowStream
from vlens.capture.spec import Capture
from vlens.config import ModelConfig
from vlens.sae.clamp import clamp_rows
from vlens.sae.model import SAE
from vlens.sae.readout import SAEReadout, sae_parts

if TYPE_CHECKING:
    from vlens.models.base import DecoderLM
    from vlens.sampling_params import SamplingParams

# What an edit does to a row x with vector v (runtime.Tap applies it); a transcoder's clamp is computed
# where it reads and applied where it writes.
STEER, ABLATE, PATCH, CLAMP, TRANSCODER_CLAMP = 1, 2, 3, 4, 5
KINDS = {Steer: STEER, Ablate: ABLATE, Patch: PATCH}


@dataclass
class BoundIntervention:
    """An intervention bound to the model: its taps, and its vectors as rows of the runtime's vector table."""

    kind: int  # STEER | ABLATE | PATCH | CLAMP | TRANSCODER_CLAMP
    taps: list[str]
    positions: Positions
    prompt_len: int
    data: torch.Tensor  # [n, width] float32: scale * vector, the unit direction, the patch rows, or W_dec[f]
    mask: torch.Tensor | None = None  # [n, width] bool: the elements it edits (its heads); None: all
    value_positions: list[int] | None = None  # a multi-row patch: the position of each data row
    table_rows: list[int] | None = None  # where the runtime stored each row of `data` (set on upload)
    encoder: torch.Tensor | None = None  # a clamp: [1, width] W_enc[:, f] (see vlens.sae.clamp)
    params: torch.Tensor | None = None  # a clamp: [1, PARAMS] its bias, floor, value and normalisation
    reads: str | None = None  # a transcoder's clamp: the tap its latent is read at (before `taps`)

    def __post_init__(self) -> None:
        self.window = self.positions.window(self.prompt_len)  # its rows as one run, when they are (most are)

    @property
    def steady(self) -> bool:
        """Whether a decode step's edit is the step before's, one row on: one run of rows, one vector."""
        return self.window is not None and self.value_positions is None

    @property
    def width(self) -> int:
        return self.data.shape[1]

    def rows_at(self, start: int, end: int) -> tuple[Sequence[int], list[int]]:
        """(positions in [start, end) it edits, the vector-table row for each)."""
        if self.window is not None:  # (every step of most interventions: one range, no call)
            positions = range(max(start, self.window[0]), min(end, self.window[1]))
        else:
            positions = self.positions.candidates(start, end, self.prompt_len)
        if self.value_positions is None:
            return positions, self.table_rows * len(positions)
        row_of = dict(zip(self.value_positions, self.table_rows))
        return positions, [row_of[p] for p in positions]


@dataclass
class RequestTaps:
    """What one request does at the taps: the row streams it collects and the interventions it applies."""

    streams: list[RowStream] = field(default_factory=list)
    interventions: list[BoundIntervention] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Its decode rows make no Chunk (vlens.capture.plan.plan_decode): its streams batch them, its
        # interventions edit one run of rows with one vector
        steady = all(s.batched for s in self.streams) and all(iv.steady for iv in self.interventions)
        self.batched = steady and bool(self.streams or self.interventions)

    def reusable_prefix(self, num_tokens: int) -> int:
        """Leading tokens whose KV may come from the prefix cache without losing a wanted row."""
        return min([s.first_needed() for s in self.streams], default=num_tokens)


def bind_request(
    params: SamplingParams, prompt_len: int, max_rows: int, model: DecoderLM, shapes: dict[str, tuple[int, ...]],
    enable_capture: bool,
) -> RequestTaps:  # fmt: skip
    """Check a request's capture and interventions against the model; `max_rows` is the most rows the
    request can have (prompt plus max_tokens, within the model length, minus one)."""
    capture = params.capture
    if (capture is not None or params.return_hidden_states) and not enable_capture:
        raise ValueError(
            "capture: this LLM was created with enable_capture=False; create it with "
            "LLM(..., enable_capture=True) to capture activations or hidden states"
        )
    streams = []
    if capture is not None:
        capture.positions.check_range(max_rows, "capture.positions", prompt_len, params.max_tokens)
        streams.append(_capture_stream(capture, prompt_len, model, shapes))
    if params.return_hidden_states:
        parts = {FINAL_NORM: (Part(shapes[FINAL_NORM], model.lm_head.weight.dtype),)}
        streams.append(RowStream("hidden_states", {FINAL_NORM: FINAL_NORM}, Positions("all"), prompt_len, parts))
    return RequestTaps(streams, bind_interventions(params.interventions, prompt_len, max_rows, model, shapes))


def bind_interventions(
    interventions: Sequence[Intervention], prompt_len: int, max_rows: int, model: DecoderLM,
    shapes: dict[str, tuple[int, ...]], field: str = "interventions",
) -> list[BoundIntervention]:  # fmt: skip
    """Interventions checked against the model, each named `field[i]` in its errors (a request's, a harvest's)."""
    return [
        _intervention(iv, f"{field}[{i}]", prompt_len, max_rows, model, shapes) for i, iv in enumerate(interventions)
    ]


def result_parts(capture: Capture, tap: str, shape: tuple[int | str, ...], model_dtype: torch.dtype) -> tuple[Part, ...]:
    """What a capture returns per row for a tap of per-token `shape`: the one answer the engine's results,
    the SAE readout and the server's size bound all use."""
    dtype = capture.dtype or model_dtype
    if capture.sae is not None:
        return sae_parts(capture.top_k, None if capture.features is None else len(capture.features), capture.sae_error, dtype)
    if capture.logit_lens is not None:
        return Part((capture.logit_lens,), torch.long), Part((capture.logit_lens,), torch.float32)
    if capture.project is not None:
        return (Part((capture.project[0].shape[1],), dtype),)
    if capture.heads is not None and tap.endswith(PER_HEAD):
        shape = (len(capture.heads), *shape[1:])
    return (Part(shape, dtype),)


def sae_tap(
    sae: SAE, cfg: ModelConfig, shapes: dict[str, tuple[int | str, ...]], field: str, writes: bool = False
) -> str:
    """The tap an SAE reads in this model (`writes`: the one it writes, a transcoder's hook_out): its hook must
    name one hook whose rows are d_in (d_out) wide."""
    hook, width, option = (sae.writes, sae.d_out, "hook_out") if writes else (sae.hook, sae.d_in, "hook")
    if hook is None:
        raise ValueError(f"{field}: this SAE names no hook (a Gemma Scope params.npz does not); load it with "
                         "SAE.load(path, hook=...)")  # fmt: skip
    try:
        taps = set(resolve_hooks(hook, cfg, shapes).values())
    except ValueError as e:
        raise ValueError(f"{field}: the SAE's {option} {hook!r} is not in this model: {e}") from None
    if len(taps) != 1:
        raise ValueError(f"{field}: the SAE's {option} {hook!r} names {len(taps)} hooks; an SAE uses one")
    tap = taps.pop()
    shape = shapes[tap]
    if CTX in shape or math.prod(shape) != width:
        raise ValueError(
            f"{field}: the SAE's {'d_out' if writes else 'd_in'} is {width} but its {option} {hook} has rows of "
            f"{shape} in this model; load it with SAE.load(path, {option}=...) to use a hook of its width"
        )
    return tap


def _elsewhere(field: str, given: object, sae: SAE, writes: bool = False) -> ValueError:
    """Requests use an SAE where it reads (a steer along a latent: where it writes) and nowhere else."""
    hook, option = (sae.writes, "hook_out") if writes else (sae.hook, "hook")
    return ValueError(
        f"{field}: {given!r} is not the hook this SAE {'writes' if writes else 'reads'} ({hook}); load it with "
        f"SAE.load(path, {option}=...) to use it at another hook of its width"
    )


def _capture_stream(capture: Capture, prompt_len: int, model: DecoderLM, shapes: dict) -> RowStream:
    cfg = model.cfg
    sae_at = None if capture.sae is None else sae_tap(capture.sae, cfg, shapes, "capture.sae")
    paired = None  # a transcoder's error compares its reconstruction with the rows where it writes
    if sae_at is not None and capture.sae_error and capture.sae.transcoder:
        paired = sae_tap(capture.sae, cfg, shapes, "capture.sae", writes=True)
    hooks = resolve_hooks(capture.hooks, cfg, shapes)
    taps = set(hooks.values())
    if sae_at is not None and taps != {sae_at}:
        raise _elsewhere("capture.hooks", capture.hooks, capture.sae)
    weight = model.lm_head.weight  # (a module attribute: looked up once, not per tap)
    parts = {t: result_parts(capture, t, shapes[t], weight.dtype) for t in taps}
    shapes = {t: shapes[t] for t in taps}
    patterns = sorted(t for t in taps if is_pattern(t))
    if patterns and (capture.project is not None or capture.reduce != "none"):
        field = "capture.project" if capture.project is not None else "capture.reduce"
        raise ValueError(f"{field}: not for attention scores or patterns ({patterns}), whose rows differ in width")
    heads, head_taps = None, frozenset()
    if capture.heads is not None:
        head_taps = frozenset(t for t in taps if t.endswith(PER_HEAD))
        if not head_taps:
            raise ValueError(f"capture.heads: none of {sorted(taps)} has heads; heads select at {', '.join(PER_HEAD)}")
        for t in head_taps:
            _check_heads(capture.heads, shapes[t][0], "capture.heads", t)
            shapes[t] = (len(capture.heads), *shapes[t][1:])
        heads = torch.tensor(capture.heads)
    readout = None
    if capture.project is not None:
        w, b = capture.project
        bad = {t: s for t, s in shapes.items() if (w.shape[0],) != (math.prod(s),)}
        if bad:
            raise ValueError(f"capture.project: W has {w.shape[0]} rows; taps {bad} have rows of another size")
        b = None if b is None else b.to(weight.device, weight.dtype)
        readout = partial(project, w=w.to(weight.device, weight.dtype), b=b)
    if capture.logit_lens is not None:
        if cfg.no_token_logits:
            raise ValueError(f"capture.logit_lens: {cfg.no_token_logits}")
        # (the final norm's output has been through the norm the lens applies: its top tokens are the logits')
        bad = [t for t, s in shapes.items() if s != (cfg.hidden_size,) or t in (LOGITS, FINAL_NORM)]
        if bad:
            raise ValueError(
                f"capture.logit_lens: needs residual-stream taps of width {cfg.hidden_size}, which it puts through "
                f"the final norm; not {bad} (past the final norm: capture {LOGITS})"
            )
        if capture.logit_lens > cfg.vocab_size:  # else the step's topk fails, and every request in it
            raise ValueError(f"capture.logit_lens: {capture.logit_lens} is more than the vocabulary's {cfg.vocab_size}")
        translators = None
        if capture.tuned_lens is not None:
            translators = capture.tuned_lens.placed(weight.device, weight.dtype).translators(sorted(taps), cfg)
        readout = partial(logit_lens, model=model, k=capture.logit_lens, translators=translators)
    if capture.sae is not None:
        device, dtype = weight.device, weight.dtype
        features = None if capture.features is None else torch.tensor(capture.features, device=device)
        readout = SAEReadout(capture.sae.placed(device, dtype), capture.top_k, features, capture.sae_error,
                             capture.dtype or dtype)  # fmt: skip
    outside = sorted(t for t in capture.exclude_token_ids if t >= cfg.vocab_size)  # (ints >= 0: Capture checked)
    if outside:
        raise ValueError(f"capture.exclude_token_ids: {outside[:5]} are not token ids in [0, {cfg.vocab_size})")
    exclude = torch.tensor(sorted(capture.exclude_token_ids), dtype=torch.long) if capture.exclude_token_ids else None
    return RowStream(
        "capture", hooks, capture.positions, prompt_len, parts, exclude, capture.dtype, readout, capture.reduce,
        capture.logit_lens, heads, head_taps, paired,
    )  # fmt: skip


def _check_heads(heads: list[int], count: int, field: str, tap: str) -> None:
    bad = [h for h in heads if not 0 <= h < count]
    if bad:
        raise ValueError(f"{field}: {bad} out of range; {tap} has heads 0..{count - 1}")


def _intervention(
    iv: Intervention, where: str, prompt_len: int, max_rows: int, model: DecoderLM, shapes: dict
) -> BoundIntervention:
    # An SAE's Clamp acts where the SAE reads; Steer(sae=...), and a transcoder's Clamp, where it writes
    sae = getattr(iv, "sae", None)
    writes = isinstance(iv, Steer) or (sae is not None and sae.transcoder)
    sae_at = None if sae is None else sae_tap(sae, model.cfg, shapes, f"{where}.sae", writes)
    try:
        taps = sorted(set(resolve_hooks(iv.hook, model.cfg, shapes).values()))
    except HookSpecError as e:  # its message names `hooks`, a capture's field: name this intervention's
        raise HookSpecError(f"{where}.hook: {str(e).removeprefix('hooks: ')}") from None
    if LOGITS in taps or any(is_pattern(t) for t in taps):
        raise ValueError(f"{where}.hook: {iv.hook!r} cannot be edited (logits, attention scores and patterns are "
                         "read-only); steer the residual, or attn.hook_z per head, instead")  # fmt: skip
    if model.cfg.latent_kv_cache and any(t.endswith(("attn.hook_k", "attn.hook_v")) for t in taps):
        raise ValueError(f"{where}.hook: {iv.hook!r} cannot be edited with latent_kv_cache=True: the KV cache holds "
                         "each token's latent, not its keys and values; edit attn.hook_kv_latent, or load the model "
                         "without latent_kv_cache")  # fmt: skip
    if any(tap_dtype(t, torch.float32) == torch.long for t in taps):  # an edit would make other, invalid ids
        raise ValueError(f"{where}.hook: {iv.hook!r} holds the chosen experts' ids (integers), which cannot be "
                         "edited; steer or patch mlp.hook_router_logits instead")  # fmt: skip
    if sae_at is not None and taps != [sae_at]:
        raise _elsewhere(f"{where}.hook", iv.hook, sae, writes)
    shape_set = {shapes[t] for t in taps}
    if len(shape_set) > 1:
        raise ValueError(f"{where}.hook: {iv.hook!r} matches taps of different shapes {sorted(shape_set)}")
    shape = shape_set.pop()
    if isinstance(iv, Clamp):
        _check_listed(iv.positions, max_rows, where)
        decoder, encoder, params = clamp_rows(sae, iv.feature, iv.value)
        reads = sae_tap(sae, model.cfg, shapes, f"{where}.sae") if sae.transcoder else None
        if reads is not None and list(shapes).index(reads) >= list(shapes).index(sae_at):
            raise ValueError(f"{where}.sae: the transcoder reads {sae.hook}, which the forward reaches after "
                             f"{sae.hook_out}, the hook it writes; a clamp needs its latent first")  # fmt: skip
        kind = CLAMP if reads is None else TRANSCODER_CLAMP
        return BoundIntervention(kind, taps, iv.positions, prompt_len, decoder, encoder=encoder, params=params,
                                 reads=reads)  # fmt: skip
    kind, data = KINDS[type(iv)], _data(iv, shape)
    if iv.heads is not None:
        if not all(t.endswith(PER_HEAD) for t in taps):
            raise ValueError(f"{where}.heads: {iv.hook!r} has no heads; heads apply at attn.hook_q/k/v/z, "
                             "attn.hook_result and the per-head inputs")  # fmt: skip
        _check_heads(iv.heads, shape[0], f"{where}.heads", taps[0])
        if isinstance(iv, Ablate):
            kind = PATCH  # a head ablation sets the heads' values
        if data.numel() == shape[-1] and not isinstance(iv, Patch):
            data = data.reshape(-1).repeat(len(iv.heads))  # one [d_head] vector (or [1, d_head]) for every head named
    row = shape if iv.heads is None else (len(iv.heads), shape[-1])  # what one row of data covers
    width = math.prod(row)
    value_positions = None
    if isinstance(iv, Patch) and not _rows(data, row, 1):
        rows = iv.positions.explicit_rows(prompt_len)
        if rows is None or not _rows(data, row, len(rows)):
            raise ValueError(
                f"{where}.values: shape {tuple(data.shape)} fits neither one row of {iv.hook} {row} nor one row "
                f"per position of {iv.positions}" + ("" if rows is None else f" ({len(rows)} rows)")
            )
        value_positions = rows
    elif not _rows(data, row, 1):
        raise ValueError(f"{where}: vector of shape {tuple(data.shape)} does not fit {iv.hook}, whose rows are {row}")
    _check_listed(iv.positions, max_rows, where)
    data, mask = data.reshape(-1, width), None
    if iv.heads is not None:  # spread over the whole row; the mask keeps the other heads as they are
        full = torch.zeros(len(data), *shape)
        full[:, iv.heads] = data.view(len(data), len(iv.heads), shape[-1])
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[iv.heads] = True
        data, mask = full.flatten(1), mask.flatten().expand(len(data), -1)
    return BoundIntervention(kind, taps, iv.positions, prompt_len, data, mask, value_positions)


def _rows(data: torch.Tensor, row: tuple[int, ...], count: int) -> bool:
    """Whether `data` is `count` rows of shape `row`, each whole or flattened (a [2, 32] vector has the
    elements of a row of 64, not its shape: it would be read as one, silently)."""
    shape = tuple(data.shape)
    return data.numel() == count * math.prod(row) and (shape[-len(row) :] == row or shape[-1:] == (math.prod(row),))


def _check_listed(positions: Positions, max_rows: int, where: str) -> None:
    if positions.kind == "list":
        bad = [p for p in positions.indices if p >= max_rows]
        if bad:
            raise ValueError(f"{where}.positions: {bad} out of range; this request has at most {max_rows} rows")


def _data(iv: Steer | Ablate | Patch, shape: tuple[int, ...]) -> torch.Tensor:
    """What an intervention writes: scale * vector, the unit direction (or a head ablation's value,
    zeros by default), or the patch rows."""
    if isinstance(iv, Steer):
        return iv.vector * iv.scale
    if isinstance(iv, Patch):
        return iv.values
    if iv.heads is not None:
        return iv.value if iv.value is not None else torch.zeros(shape[-1])
    return iv.direction
