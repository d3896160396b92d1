"""TransformerLens's activation patching (`transformer_lens.patching`), many patches to a packed forward.

TransformerLens patches one index at a time: for each (layer, position[, head]) a forward of the corrupted
batch with the clean run's activation put in at that index, then the metric of its logits. The patches are
independent, so here each is a copy of the corrupted batch and many copies run in one packed forward, with
one function per patched tap that replaces, in each copy's rows, the elements its patch changes (one
`index_put` a tap a forward). The copies of one forward patch one layer, and start there: the stream
entering it is the corrupted run's, since a patch changes nothing before its own layer. What a patch changes is found before the forward: the patch setter edits the
corrupted run's activation at the tap (which is what the patched forward has there: a patch changes nothing
upstream of itself) and is compared with it. So any setter of TransformerLens's form works, elements a
patch leaves alone keep the forward's own values, and the metric sees each copy's logits in the layout of
the corrupted tokens, as TransformerLens gives them.

The names and arguments are TransformerLens's; `model` is a `vlens.HookedLM`. Attention patterns and scores
cannot be patched (vlens computes them beside the fused attention, so nothing reads a replaced pattern).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vlens.capture.names import LOGITS, is_pattern
from vlens.hooked import ActivationCache, get_act_name

if TYPE_CHECKING:
    from vlens.hooked import HookedLM

PatchSetter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], torch.Tensor]
LOGIT_BYTES = 256 << 20  # the logits of one packed forward of copies, at most (but one copy's, if more)


def generic_activation_patch(
    model: HookedLM,
    corrupted_tokens: torch.Tensor,
    clean_cache: ActivationCache,
    patching_metric: Callable[[torch.Tensor], torch.Tensor],
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Sequence[str] | None = None,
    index_df: Any = None,
    return_index_df: bool = False,
):
    """The metric of the corrupted run's logits [batch, pos, d_vocab] with each index patched from the clean
    run: a tensor with one dimension per axis of `index_axis_names` ("layer", "pos", "head_index" / "head"),
    or one value per row of `index_df` (a pandas DataFrame of indices, layer first). `patch_setter(corrupted,
    index, clean)` edits `corrupted` [batch, pos, ...] where `index` says and returns it."""
    if (index_axis_names is None) == (index_df is None):
        raise ValueError("index_axis_names / index_df: give exactly one (axis names, or a DataFrame of indices)")
    if index_df is None:
        ranges = [_axis_range(model, corrupted_tokens, activation_name, axis) for axis in index_axis_names]
        indices = [list(index) for index in itertools.product(*map(range, ranges))]
    else:
        indices = [[int(i) for i in row] for row in index_df.itertuples(index=False)]
    names = {layer: get_act_name(activation_name, layer=layer) for layer in sorted({index[0] for index in indices})}
    taps = {name: tap for name in names.values() for tap in model._names(name).values()}
    patterns = sorted(name for name, tap in taps.items() if is_pattern(tap))
    if patterns:
        raise ValueError(f"activation_name: {activation_name!r} names attention patterns or scores ({patterns[0]}, ...), "
                         "which vlens computes beside the fused attention and cannot patch; patch hook_q / hook_k / "
                         "hook_v / hook_z instead")  # fmt: skip
    seqs, padding = model._sequences(corrupted_tokens, None)
    streams = {layer: get_act_name("resid_pre", layer) for layer in names}
    _, corrupted = model.run_with_cache(corrupted_tokens, names_filter=sorted({*taps, *streams.values()}),
                                        return_type=None)  # fmt: skip
    runner = model.llm.runner
    resume = runner.model.executor is None  # (the ranks of a tensor-parallel model run every layer)
    per_copy = sum(len(s) for s in seqs)
    limit = min(model.llm.engine_config.max_num_batched_tokens, LOGIT_BYTES // (4 * model.cfg.vocab_size))
    copies = max(1, limit // per_copy)
    by_layer: dict[int, list[int]] = {}
    for i, index in enumerate(indices):
        by_layer.setdefault(index[0], []).append(i)
    metrics = [0.0] * len(indices)
    for layer, members in by_layer.items():
        entering = padding.pack(corrupted[streams[layer]])  # what every copy's layer `layer` reads
        for start in range(0, len(members), copies):
            chunk = members[start : start + copies]
            edits: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
            for copy, i in enumerate(chunk):
                name = names[layer]
                before = corrupted[name]
                after = patch_setter(before.clone(), indices[i], clean_cache[name])
                changed, values = padding.pack(after != before), padding.pack(after)
                rows = changed.reshape(len(changed), -1).any(1).nonzero().squeeze(1)
                edits.setdefault(taps[name], []).append((copy * per_copy + rows, values[rows], changed[rows]))
            hooks = {tap: partial(_replace, *map(torch.cat, zip(*parts))) for tap, parts in edits.items()}
            resumed = (layer, entering.repeat(len(chunk), 1)) if resume else None
            captured = runner.packed(seqs * len(chunk), [LOGITS], hooks=hooks, start=resumed)
            logits = [value for _, _, value in sorted(captured.pieces(), key=lambda piece: piece[0])]
            for copy, i in enumerate(chunk):
                copy_logits = padding.pad(torch.cat(logits[copy * len(seqs) : (copy + 1) * len(seqs)]))
                metrics[i] = float(patching_metric(copy_logits))
    out = torch.tensor(metrics)
    if index_df is None:
        out = out.view(ranges)
    if not return_index_df:
        return out
    if index_df is None:
        import pandas as pd

        index_df = pd.DataFrame(indices, columns=list(index_axis_names))
    return out, index_df


def _axis_range(model: HookedLM, tokens: torch.Tensor, activation_name: str, axis: str) -> int:
    cfg = model.cfg
    if axis == "layer":
        return cfg.num_layers
    if axis in ("pos", "src_pos", "dest_pos"):
        return tokens.shape[-1]
    if axis in ("head_index", "head"):
        return cfg.num_kv_heads if activation_name in ("k", "v") else cfg.num_heads
    raise ValueError(f"index_axis_names: {axis!r} is not one of layer, pos, head_index, head, src_pos, dest_pos")


def _replace(rows: torch.Tensor, values: torch.Tensor, where: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x` (packed rows at a tap) with the elements `where` marks, in rows `rows`, set to `values`."""
    return x.index_put((rows,), torch.where(where, values.to(x.dtype), x[rows]))


# The patch setters of TransformerLens's (index: layer first, then as the name says)


def layer_pos_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor) -> torch.Tensor:
    _, pos = index
    corrupted[:, pos, ...] = clean[:, pos, ...]
    return corrupted


def layer_pos_head_vector_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor) -> torch.Tensor:
    _, pos, head = index
    corrupted[:, pos, head] = clean[:, pos, head]
    return corrupted


def layer_head_vector_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor) -> torch.Tensor:
    _, head = index
    corrupted[:, :, head] = clean[:, :, head]
    return corrupted


def _patcher(setter: PatchSetter, name: str, axes: tuple[str, ...]):
    fn = partial(generic_activation_patch, patch_setter=setter, activation_name=name, index_axis_names=axes)
    fn.__doc__ = f"generic_activation_patch at {name}, every index of ({', '.join(axes)}): a tensor of that shape."
    return fn


get_act_patch_resid_pre = _patcher(layer_pos_patch_setter, "resid_pre", ("layer", "pos"))
get_act_patch_resid_mid = _patcher(layer_pos_patch_setter, "resid_mid", ("layer", "pos"))
get_act_patch_attn_out = _patcher(layer_pos_patch_setter, "attn_out", ("layer", "pos"))
get_act_patch_mlp_out = _patcher(layer_pos_patch_setter, "mlp_out", ("layer", "pos"))
get_act_patch_attn_head_out_by_pos = _patcher(layer_pos_head_vector_patch_setter, "z", ("layer", "pos", "head"))
get_act_patch_attn_head_q_by_pos = _patcher(layer_pos_head_vector_patch_setter, "q", ("layer", "pos", "head"))
get_act_patch_attn_head_k_by_pos = _patcher(layer_pos_head_vector_patch_setter, "k", ("layer", "pos", "head"))
get_act_patch_attn_head_v_by_pos = _patcher(layer_pos_head_vector_patch_setter, "v", ("layer", "pos", "head"))
get_act_patch_attn_head_out_all_pos = _patcher(layer_head_vector_patch_setter, "z", ("layer", "head"))
get_act_patch_attn_head_q_all_pos = _patcher(layer_head_vector_patch_setter, "q", ("layer", "head"))
get_act_patch_attn_head_k_all_pos = _patcher(layer_head_vector_patch_setter, "k", ("layer", "head"))
get_act_patch_attn_head_v_all_pos = _patcher(layer_head_vector_patch_setter, "v", ("layer", "head"))


def get_act_patch_block_every(model: HookedLM, corrupted_tokens: torch.Tensor, clean_cache: ActivationCache,
                              metric: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """[3, n_layers, pos]: the residual stream entering each block, each attention output, each MLP output."""
    return torch.stack([fn(model, corrupted_tokens, clean_cache, metric)
                        for fn in (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)])  # fmt: skip
