"""TransformerLens's activation patching (`transformer_lens.patching`), many patches to a forward.

TransformerLens patches one index at a time: for each (layer, position[, head]) a forward of the whole
corrupted batch with the clean run's activation put in at that index, then the metric of its logits. Here
the corrupted batch runs once, into blocks of the engine's KV cache; then each patch is a copy of each text
it changes, and many copies run in one forward of the paged path. A patch changes nothing before its layer,
nor (the model being causal) before the first position it changes: so a copy starts at that layer, with the
corrupted run's stream entering it, and at that position, reading the corrupted run's keys and values before
it (its whole blocks shared, the slots of the block it starts in copied); a text the patch leaves as it was
takes the corrupted run's logits, and runs nothing. One function per patched tap puts each copy's patched
values in (one `index_put` a forward). What a patch changes is found before the forward: the patch setter
edits the corrupted run's activation at the tap (what the patched forward has there) and is compared with
it, so any setter of TransformerLens's form works, and what a patch leaves alone keeps the forward's own
values. The metric sees each patch's logits in the layout of the corrupted tokens, as TransformerLens gives
them.

vlens computes attention patterns beside the fused attention, so nothing reads a replaced pattern: a pattern
patch goes in as the heads' outputs it makes (hook_z), each changed row of a head's pattern times its
key-value head's values, which are the corrupted run's (its layer is the first that changes); a scores patch
as the pattern its changed rows make (their softmax, as HF's and TransformerLens's attention take it). The
names and arguments are TransformerLens's; `model` is a `vlens.HookedLM` in one process.

Path patching (ARENA's two functions, by name) runs the same way: a layer's sender heads are copies in one
forward from that layer, each with its sender's output put in and every later layer's attention output frozen at
the orig run's (every head frozen is that), so the change travels through MLPs alone; to receivers, what those
copies make of the receivers' inputs is read and then patched into copies of the orig run.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vlens.activation_cache import ActivationCache, get_act_name
from vlens.attention.sdpa import probabilities
from vlens.capture.names import is_pattern

if TYPE_CHECKING:
    from vlens.engine.block_manager import BlockManager
    from vlens.engine.model_runner import ModelRunner
    from vlens.hooked import HookedLM
    from vlens.images import PromptImages

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
    seqs, padding, images = model._sequences(corrupted_tokens, None)
    if index_df is None:
        ranges = [_axis_range(model, padding.width, activation_name, axis) for axis in index_axis_names]
        indices = [list(index) for index in itertools.product(*map(range, ranges))]
    else:
        indices = [[int(i) for i in row] for row in index_df.itertuples(index=False)]
    layers = sorted({index[0] for index in indices})
    names = {layer: get_act_name(activation_name, layer=layer) for layer in layers}
    taps = {name: tap for name in names.values() for tap in model._names(name).values()}
    through_values = any(is_pattern(tap) for tap in taps.values())
    # where the patch goes in: a pattern's rows (a patched score row's softmax), times the corrupted run's values,
    # are the heads' outputs (hook_z)
    targets = {layer: get_act_name("z", layer=layer) if through_values else names[layer] for layer in layers}
    # (the values a layer attends to: its own, or the earlier layer's it shares, Gemma 4's)
    values = {layer: get_act_name("v", layer=model.cfg.kv_layer_at(layer)) for layer in layers if through_values}
    taps |= {name: tap for name in targets.values() for tap in model._names(name).values()}
    lens = [len(s) for s in seqs]
    starts = {layer: model.llm.model.resume_layer(layer) for layer in names}  # (where a forward redoing it starts)
    streams = {layer: get_act_name("resid_pre", starts[layer]) for layer in names}
    wanted = sorted({*taps, *streams.values(), *values.values()})
    _, corrupted = model.run_with_cache(corrupted_tokens, names_filter=wanted, return_type=None)
    for name in names.values():
        if clean_cache[name].shape != corrupted[name].shape:
            raise ValueError(f"clean_cache: {name} is {tuple(clean_cache[name].shape)} there and "
                             f"{tuple(corrupted[name].shape)} in the corrupted run; patching needs clean and "
                             "corrupted tokens of one shape")  # fmt: skip
    metrics = [0.0] * len(indices)
    sweep = _Sweep(model, seqs, padding, patching_metric, images)
    try:
        for layer, name in names.items():
            entering = padding.pack(corrupted[streams[layer]]).split(lens)  # what every copy's layer reads
            before, copies = corrupted[name], []
            sinks = model.blocks[layer].attn.sinks if through_values and model.cfg.attn_sinks else None  # (gpt-oss)
            for i, index in enumerate(indices):
                if index[0] == layer:
                    after = patch_setter(before.clone(), index, clean_cache[name])
                    if through_values:
                        rows = (after != before).any(-1)  # [batch, heads, dest]: the rows a patch changed
                        pattern = after if taps[name].endswith("hook_pattern") else _softmax(after, sinks)
                        group = model.cfg.num_heads // model.cfg.kv_heads_at(layer)  # (query heads a value's)
                        after, changed = _through_values(pattern, rows, corrupted[values[layer]], group)
                    else:
                        changed = after != before
                    copies += _copies(i, {taps[targets[layer]]: (padding.pack(after), padding.pack(changed))}, lens)
                    metrics[i] = sweep.unpatched  # (unless it changed something)
            sweep.metrics(starts[layer], entering, copies, metrics)
    finally:
        sweep.close()
    out = torch.tensor(metrics)
    if index_df is None:
        out = out.view(ranges)
    if not return_index_df:
        return out
    if index_df is None:
        import pandas as pd

        index_df = pd.DataFrame(indices, columns=list(index_axis_names))
    return out, index_df


def get_path_patch_head_to_final_resid_post(
    model: HookedLM, orig_tokens: torch.Tensor, new_cache: ActivationCache,
    patching_metric: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """[n_layers, n_heads]: path patching from each head to the logits (the IOI paper's; ARENA's function of this
    name): the metric of `orig_tokens`' logits with that head's output (hook_z) taken from `new_cache`, a run of
    other tokens of the same shape, and every other head's frozen at its value in the orig run, so that the change
    reaches the logits directly or through MLPs, never through another head."""
    return _path_patch(model, orig_tokens, new_cache, patching_metric, model.cfg.num_layers, {})


def get_path_patch_head_to_heads(
    model: HookedLM, orig_tokens: torch.Tensor, new_cache: ActivationCache,
    patching_metric: Callable[[torch.Tensor], torch.Tensor], receiver_heads: Sequence[tuple[int, int]],
    receiver_input: str,
) -> torch.Tensor:  # fmt: skip
    """[last receiver layer, n_heads]: path patching from each head of the layers below the last receiver to the
    receivers' queries, keys or values (`receiver_input` "q", "k" or "v"; for "k" and "v" a receiver's head counts
    key-value heads). First, for each sender, the orig run with that head's output from `new_cache` and every other
    head frozen gives what the receivers' inputs become (through MLPs too); then the metric of the orig run with
    only the receivers' inputs patched to those values. ARENA's function of this name."""
    if receiver_input not in ("q", "k", "v"):
        raise ValueError(f"receiver_input: {receiver_input!r} is not one of q, k, v")
    receivers: dict[str, list[int]] = {}
    for layer, head in receiver_heads:
        valid = 0 <= layer < model.cfg.num_layers
        heads = model.cfg.kv_heads_at(layer) if receiver_input != "q" and valid else model.cfg.num_heads
        if not (valid and 0 <= head < heads):
            raise ValueError(f"receiver_heads: ({layer}, {head}) is not a (layer, head) of this model: layers 0.."
                             f"{model.cfg.num_layers - 1}, heads 0..{heads - 1} at {receiver_input}")  # fmt: skip
        receivers.setdefault(get_act_name(receiver_input, layer), []).append(head)
    if not receivers:
        raise ValueError("receiver_heads: give at least one (layer, head)")
    return _path_patch(model, orig_tokens, new_cache, patching_metric, max(map(_layer_of, receivers)), receivers)


def _path_patch(
    model: HookedLM, tokens: torch.Tensor, new_cache: ActivationCache, metric: Callable[[torch.Tensor], Any],
    senders: int, receivers: dict[str, list[int]],
) -> torch.Tensor:  # fmt: skip
    """The sender heads of the first `senders` layers, each patched from `new_cache` into a copy of each text it
    changes, every later layer's attention output frozen at the orig run's (every head frozen); to the logits, or
    to `receivers` (tap -> heads): their values in those copies, patched into the orig run."""
    n, heads = model.cfg.num_layers, model.cfg.num_heads
    z = [get_act_name("z", layer) for layer in range(senders)]
    streams = [get_act_name("resid_pre", layer) for layer in range(n)]
    attn_out = [get_act_name("attn_out", layer) for layer in range(n)]
    seqs, padding, images = model._sequences(tokens, None)
    lens = [len(s) for s in seqs]
    wanted = sorted({*z, *streams, *attn_out, *receivers})
    _, orig = model.run_with_cache(tokens, names_filter=wanted, return_type=None)
    for name in z:
        if new_cache[name].shape != orig[name].shape:
            raise ValueError(f"new_cache: {name} is {tuple(new_cache[name].shape)} there and {tuple(orig[name].shape)} "
                             "in the orig run; path patching needs orig and new tokens of one shape")  # fmt: skip
    packed = {name: padding.pack(orig[name]) for name in wanted}
    results = torch.empty(senders, heads)
    flat = results.view(-1)  # patch i: sender layer i // heads, head i % heads
    patched: dict[int, list[_Copy]] = {}  # to receivers: the orig run's copies, by the layer they run from
    sweep = _Sweep(model, seqs, padding, metric, images)
    try:
        results[:] = sweep.unpatched  # (where a patch changes nothing)
        for layer in range(senders):
            copies = []
            for head in range(heads):
                after = orig[z[layer]].clone()
                after[:, :, head] = new_cache[z[layer]][:, :, head].to(after.dtype)
                changes = {z[layer]: (padding.pack(after), padding.pack(after != orig[z[layer]]))}
                copies += _copies(layer * heads + head, changes, lens)
            for copy in copies:  # every head after the sender's layer frozen: each layer's attention output as it was
                for tap in attn_out[layer + 1 :]:
                    values = packed[tap].split(lens)[copy.text][copy.first :]
                    rows = torch.arange(copy.first, lens[copy.text])
                    copy.edits[tap] = _Edit(rows, values, torch.ones_like(values, dtype=torch.bool))
            start = model.llm.model.resume_layer(layer)
            entering = packed[streams[start]].split(lens)
            if not receivers:
                sweep.metrics(start, entering, copies, flat)
                continue
            # what each sender makes of the inputs of the receivers after its layer (rows before a copy's first, and
            # every receiver before, are the orig run's)
            later = [tap for tap in receivers if _layer_of(tap) > layer]
            if not later:
                continue
            made: dict[int, dict[str, torch.Tensor]] = {}
            for copy, _, seen in sweep.run(start, entering, copies, read=later):
                inputs = made.setdefault(copy.patch, {tap: packed[tap].clone() for tap in later})
                for tap, rows in seen.items():
                    start = sum(lens[: copy.text]) + copy.first
                    inputs[tap][start : start + len(rows), receivers[tap]] = rows[:, receivers[tap]]
            patched.setdefault(min(map(_layer_of, later)), []).extend(
                c for patch, inputs in made.items()
                for c in _copies(patch, {tap: (v, v != packed[tap]) for tap, v in inputs.items()}, lens)
            )  # fmt: skip
        for first, copies in patched.items():  # every sender's copies that run from one layer, together
            start = model.llm.model.resume_layer(first)
            sweep.metrics(start, packed[streams[start]].split(lens), copies, flat)
    finally:
        sweep.close()
    return results


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])


def _axis_range(model: HookedLM, width: int, activation_name: str, axis: str) -> int:
    cfg = model.cfg
    if axis == "layer":
        return cfg.num_layers
    if axis in ("pos", "src_pos", "dest_pos"):
        return width
    if axis in ("head_index", "head"):
        if activation_name not in ("k", "v", "k_input", "v_input"):
            return cfg.num_heads
        counts = sorted({cfg.kv_heads_at(layer) for layer in range(cfg.num_layers)})
        if len(counts) > 1:
            raise ValueError(f"index_axis_names: {cfg.architecture}'s layers have {' or '.join(map(str, counts))} "
                             f"key-value heads, so {activation_name} has no one head axis; give index_df with "
                             "each layer's own heads")  # fmt: skip
        return counts[0]
    raise ValueError(f"index_axis_names: {axis!r} is not one of layer, pos, head_index, head, src_pos, dest_pos")


@dataclass
class _Edit:
    """What a copy puts in at one tap."""

    rows: torch.Tensor  # positions it changes, in the text
    values: torch.Tensor  # [len(rows), ...] the activations there
    where: torch.Tensor  # [len(rows), ...] bool: which of their elements it changes


@dataclass
class _Copy:
    """One text of the corrupted batch under one patch: it runs from its first changed position on."""

    patch: int
    text: int
    first: int  # rows before it are the corrupted run's, at every layer
    edits: dict[str, _Edit]  # by tap


def _copies(patch: int, changes: dict[str, tuple[torch.Tensor, torch.Tensor]], lens: list[int]) -> list[_Copy]:
    """The copies of the texts a patch changes; `changes`: by tap, (the patched values, which elements they
    change), packed rows of the whole batch."""
    out, by_text = [], {tap: (after.split(lens), changed.split(lens)) for tap, (after, changed) in changes.items()}
    for text in range(len(lens)):
        edits = {}
        for tap, (afters, changed) in by_text.items():
            values, where = afters[text], changed[text]
            rows = where.reshape(len(where), -1).any(1).nonzero().squeeze(1)
            if len(rows):
                edits[tap] = _Edit(rows, values[rows], where[rows])
        if edits:
            out.append(_Copy(patch, text, min(int(e.rows[0]) for e in edits.values()), edits))
    return out


class _Sweep:
    """Copies of one batch run a forward at a time over the engine's KV cache: the batch's own run first (its
    keys and values, which every copy reads before its first changed position, and its logits, which a copy's
    rows before that position and every text a patch leaves alone keep), then the copies; `close` gives the
    blocks back. `images`: the rows each text's images give (vlens.images), which the batch's own run reads."""

    def __init__(
        self, model: HookedLM, seqs: list[list[int]], padding, metric: Callable[[torch.Tensor], Any],
        images: list[PromptImages | None] | None = None,
    ):  # fmt: skip
        self.runner, self.blocks = model.llm.runner, model.llm.engine.blocks
        if self.runner.model.executor is not None:
            raise ValueError("model: vlens.patching runs a model in one process (tensor_parallel_size=1); "
                             "TransformerLens's patching module runs on any HookedLM, a forward per patch")  # fmt: skip
        self.seqs, self.padding, self.metric = seqs, padding, metric
        # (the copies start at a layer, past the embedding; they need a text's images only where its image tokens
        # attend to each other both ways, Gemma 3's: for the rows' key limits; or take rotary positions of their
        # own, Qwen2-VL's)
        needed = [i is not None and (i.both_ways or i.rope is not None) for i in images or []]
        self.images = images if any(needed) else None
        self.lens = [len(s) for s in seqs]
        self.limit = min(model.llm.engine_config.max_num_batched_tokens, LOGIT_BYTES // (4 * model.cfg.vocab_size))
        self.base = _lend(self.blocks, self.lens)
        try:
            self.plain = self.runner.extend(seqs, [0] * len(seqs), self.base, {}, every_row=True,
                                            images=images).split(self.lens)  # fmt: skip
            self.unpatched = float(metric(padding.pad(torch.cat(self.plain))))
        except BaseException:
            self.close()
            raise

    def run(self, layer: int, entering: Sequence[torch.Tensor], copies: list[_Copy], read: Sequence[str] = ()):
        """(copy, its logits from its first changed position on, its rows at the taps `read` by tap), copy by copy;
        with taps to read, the forwards stop once those have fired, and there are no logits (None)."""
        if self.runner.stateful:  # (a state per sequence is of a whole prefix, which the corrupted run
            # keeps at no copy's first position: each copy runs from position 0, rows before its first unchanged)
            copies = [replace(copy, first=0) for copy in copies]
        elif self.images is not None:  # (a changed image row changes the rows of its image before it too)
            copies = [copy if (i := self.images[copy.text]) is None else replace(copy, first=i.opening(copy.first))
                      for copy in copies]  # fmt: skip
        for chunk in _chunks(copies, self.lens, self.limit, self.blocks):
            images = None if self.images is None else [self.images[c.text] for c in chunk]
            logits, seen = _run_copies(self.runner, self.blocks, self.seqs, self.base, layer, entering, chunk, read,
                                       images)  # fmt: skip
            for i, copy in enumerate(chunk):
                yield copy, None if logits is None else logits[i], {tap: rows[i] for tap, rows in seen.items()}

    def metrics(self, layer: int, entering: Sequence[torch.Tensor], copies: list[_Copy], out) -> None:
        """out[patch] = the metric of the batch's logits with each of the patch's copies in (a patch's logits are
        held while its copies run)."""
        remaining = collections.Counter(c.patch for c in copies)
        texts: dict[int, list[torch.Tensor]] = {}
        for copy, logits, _ in self.run(layer, entering, copies):
            mine = texts.setdefault(copy.patch, list(self.plain))
            mine[copy.text] = torch.cat((self.plain[copy.text][: copy.first], logits))
            remaining[copy.patch] -= 1
            if not remaining[copy.patch]:
                out[copy.patch] = float(self.metric(self.padding.pad(torch.cat(texts.pop(copy.patch)))))

    def close(self) -> None:
        for table in self.base:
            self.blocks.give_back(table)
        self.base = []


def _chunks(copies: list[_Copy], lens: list[int], limit: int, blocks: BlockManager) -> Iterator[list[_Copy]]:
    """Copies a forward at a time: at most `limit` rows, the KV blocks free and, for a model whose layers keep states,
    a free state slot each (but one copy, if it needs more)."""
    bs, free = blocks.block_size, len(blocks.free)
    slots = blocks.states_free() if blocks.num_states else len(copies)
    chunk, rows, held = [], 0, 0
    for copy in copies:
        new, fresh = lens[copy.text] - copy.first, -(-lens[copy.text] // bs) - copy.first // bs
        if chunk and (rows + new > limit or held + fresh > free or len(chunk) == slots):
            yield chunk
            chunk, rows, held = [], 0, 0
        chunk.append(copy)
        rows, held = rows + new, held + fresh
    if chunk:
        yield chunk


def _lend(blocks: BlockManager, lengths: list[int]) -> list[list[int]]:
    tables = blocks.lend(lengths)
    if tables is None:
        states = f" (and {blocks.states_free()} free state slots)" if blocks.num_states else ""
        raise ValueError(f"kv_cache_memory: the KV cache has {len(blocks.free)} free blocks of {blocks.block_size} "
                         f"tokens{states}, too few for {len(lengths)} texts of up to {max(lengths)} tokens; give the "
                         "engine more (kv_cache_memory=...)")  # fmt: skip
    return tables


def _run_copies(
    runner: ModelRunner, blocks: BlockManager, seqs: list[list[int]], base: list[list[int]], layer: int,
    entering: Sequence[torch.Tensor], copies: list[_Copy], read: Sequence[str] = (),
    images: list[PromptImages | None] | None = None,
) -> tuple[list[torch.Tensor] | None, dict[str, list[torch.Tensor]]]:  # fmt: skip
    """Each copy's logits from its first changed position on, in one forward from `layer`: its keys and
    values before that position are the corrupted run's (`base`'s blocks, and slots of the block it starts
    in copied to a fresh one), its stream entering `layer` the corrupted run's (`entering`), and a hook at
    each tap it edits puts its values in. With taps to `read`: the forward stops once they have fired, and gives
    each copy's rows there (from its first changed position on) by tap, and no logits (None)."""
    bs = blocks.block_size
    kept = [copy.first // bs for copy in copies]  # whole blocks of the corrupted run's that a copy reads
    fresh = _lend(blocks, [len(seqs[c.text]) - k * bs for c, k in zip(copies, kept)])
    try:
        tables = [base[c.text][:k] + table for c, k, table in zip(copies, kept, fresh)]
        source, target = [], []
        for c, k, table in zip(copies, kept, fresh):
            source += range(base[c.text][k] * bs, base[c.text][k] * bs + c.first - k * bs)
            target += range(table[0] * bs, table[0] * bs + c.first - k * bs)
        news = [len(seqs[c.text]) - c.first for c in copies]
        starts = dict(zip(map(id, copies), itertools.accumulate([0, *news[:-1]])))
        device = runner.device  # (the cached activations are the host's)
        hooks, seen = {}, {}
        for tap in dict.fromkeys(t for c in copies for t in c.edits):
            mine = [c for c in copies if tap in c.edits]
            rows = torch.cat([c.edits[tap].rows - c.first + starts[id(c)] for c in mine]).to(device)
            values, where = (torch.cat([getattr(c.edits[tap], f) for c in mine]).to(device) for f in ("values", "where"))
            hooks[tap] = partial(_replace, rows, values, where)
        for tap in read:
            hooks[tap] = _then_keep(hooks.get(tap), seen, tap)
        stream = torch.cat([entering[c.text][c.first :] for c in copies]).to(device)
        kv_copy = (source, target) if source else None
        until = max(map(_layer_of, read)) + 1 if read else None
        logits = runner.extend([seqs[c.text] for c in copies], [c.first for c in copies], tables, hooks,
                               every_row=True, resume=(layer, stream), kv_copy=kv_copy, num_layers=until,
                               images=images)  # fmt: skip
    finally:
        for table in fresh:
            blocks.give_back(table)
    return None if logits is None else list(logits.split(news)), {t: list(seen[t].cpu().split(news)) for t in read}


def _then_keep(edit: Callable | None, seen: dict[str, torch.Tensor], tap: str) -> Callable:
    """A hook that keeps the value leaving `tap` (after `edit`, if any) in `seen`."""

    def hook(x: torch.Tensor) -> torch.Tensor:
        x = x if edit is None else edit(x)
        seen[tap] = x
        return x

    return hook


def _through_values(
    pattern: torch.Tensor, rows: torch.Tensor, v: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A patched pattern [batch, heads, dest, src] as the heads' outputs it makes, [batch, dest, heads, d_head]
    (what hook_z holds), and which of them it changes (`rows` [batch, heads, dest], the rows the patch changed):
    each changed row of a head's pattern times the values of its key-value head, which are the corrupted run's
    (nothing before the layer changes)."""
    z = torch.einsum("bhqk,bkhd->bqhd", pattern.float(), v.float().repeat_interleave(group, dim=2))
    return z, rows.transpose(1, 2)[..., None].expand_as(z)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The pattern of [batch, heads, dest, src] attention scores (HF's: softmax in float32, over each head's sink
    too where the model has them, in the scores' dtype). A row with no key (a query past its text's end, which
    nothing reads) stays zeros rather than NaN."""
    return probabilities(scores, None if sinks is None else sinks.view(-1, 1)).nan_to_num(0.0).to(scores.dtype)


def _replace(rows: torch.Tensor, values: torch.Tensor, where: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x` (packed rows at a tap) with the elements `where` marks, in rows `rows`, set to `values`."""
    return x.index_put((rows,), torch.where(where, values.to(x.dtype), x[rows]))


def _setter(where: Callable[[Sequence[int]], tuple]) -> PatchSetter:
    """A patch setter of TransformerLens's: the clean activation put into the corrupted one at `where(index)`."""

    def setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor) -> torch.Tensor:
        at = where(index)
        corrupted[at] = clean[at]
        return corrupted

    return setter


# TransformerLens's setters (index: layer first): vectors are [batch, pos, head, ...], patterns [batch, head, dest, src]
_ALL = slice(None)
layer_pos_patch_setter = _setter(lambda index: (_ALL, index[1]))
layer_pos_head_vector_patch_setter = _setter(lambda index: (_ALL, index[1], index[2]))
layer_head_vector_patch_setter = _setter(lambda index: (_ALL, _ALL, index[1]))
layer_head_pattern_patch_setter = _setter(lambda index: (_ALL, index[1]))
layer_head_pos_pattern_patch_setter = _setter(lambda index: (_ALL, index[1], index[2]))
layer_head_dest_src_pos_pattern_patch_setter = _setter(lambda index: (_ALL, index[1], index[2], index[3]))


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
get_act_patch_attn_head_pattern_all_pos = _patcher(layer_head_pattern_patch_setter, "pattern", ("layer", "head_index"))
get_act_patch_attn_head_pattern_by_pos = _patcher(layer_head_pos_pattern_patch_setter, "pattern",
                                                  ("layer", "head_index", "dest_pos"))  # fmt: skip
get_act_patch_attn_head_pattern_dest_src_pos = _patcher(layer_head_dest_src_pos_pattern_patch_setter, "pattern",
                                                        ("layer", "head_index", "dest_pos", "src_pos"))  # fmt: skip


def get_act_patch_block_every(model: HookedLM, corrupted_tokens: torch.Tensor, clean_cache: ActivationCache,
                              metric: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """[3, n_layers, pos]: the residual stream entering each block, each attention output, each MLP output."""
    return torch.stack([fn(model, corrupted_tokens, clean_cache, metric)
                        for fn in (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)])  # fmt: skip


def get_act_patch_attn_head_all_pos_every(model: HookedLM, corrupted_tokens: torch.Tensor,
                                          clean_cache: ActivationCache,
                                          metric: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """[5, n_layers, n_heads]: each head's output, query, key, value (key-value heads: the first ones, the rest
    zeros, as TransformerLens pads them) and pattern, at every position."""
    fns = (get_act_patch_attn_head_out_all_pos, get_act_patch_attn_head_q_all_pos, get_act_patch_attn_head_k_all_pos,
           get_act_patch_attn_head_v_all_pos, get_act_patch_attn_head_pattern_all_pos)  # fmt: skip
    return _stack_heads([fn(model, corrupted_tokens, clean_cache, metric) for fn in fns])


def get_act_patch_attn_head_by_pos_every(model: HookedLM, corrupted_tokens: torch.Tensor,
                                         clean_cache: ActivationCache,
                                         metric: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """[5, n_layers, pos, n_heads]: as get_act_patch_attn_head_all_pos_every, by position (the pattern's by
    destination position)."""
    fns = (get_act_patch_attn_head_out_by_pos, get_act_patch_attn_head_q_by_pos, get_act_patch_attn_head_k_by_pos,
           get_act_patch_attn_head_v_by_pos)  # fmt: skip
    parts = [fn(model, corrupted_tokens, clean_cache, metric) for fn in fns]
    pattern = get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache, metric)
    return _stack_heads([*parts, pattern.transpose(1, 2)])  # ([layer, head, dest] -> [layer, pos, head])


def _stack_heads(parts: list[torch.Tensor]) -> torch.Tensor:
    """Results with the heads last stacked, those of key-value heads padded with zeros to the query heads'."""
    heads = parts[0].shape[-1]
    return torch.stack([torch.nn.functional.pad(p, (0, heads - p.shape[-1])) for p in parts])
