"""TransformerLens's ActivationCache over packed activations, and how its keys are spelled.

A cache holds [batch, positions, ...] tensors by hook name, built by HookedLM from one packed forward:
`Padding` lays each text's packed rows out at its positions (right after each other for texts, where an
attention mask says for a token tensor) and back. `get_act_name` is TransformerLens's rule for short
names ("resid_post", 5; "k6"), which the cache's keys and `vlens.hooked` (a notebook's `utils`) take.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

import torch

from vlens.attribution import Attribution
from vlens.capture.names import is_pattern
from vlens.hooked_weights import ModelWeights

ATTN_NAMES = {"q", "k", "v", "z", "pattern", "attn_scores", "result", "rot_q", "rot_k"}
MLP_NAMES = {"pre", "post", "mid", "pre_linear"}
# TransformerLens's other spellings of activations and layer types (utilities/components_utils.py)
ACT_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
               "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}  # fmt: skip
LAYER_TYPES = {"a": "attn", "m": "mlp", "attention": "attn", "b": None, "block": None, "blocks": None}
# TransformerLens's queries and keys after rotary: vlens's hook_q / hook_k, whose meaning is HF's (after rotary)
ROTATED = {"hook_rot_q": "hook_q", "hook_rot_k": "hook_k"}


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """TransformerLens's get_act_name, rule for rule: ("resid_post", 5) -> blocks.5.hook_resid_post, ("pattern", 3)
    and ("attn", 3) -> blocks.3.attn.hook_pattern, ("scale", 2, "ln1") -> blocks.2.ln1.hook_scale, "k6" ->
    blocks.6.attn.hook_k, "scale" -> ln_final.hook_scale; full names pass."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    compact = re.match(r"([a-z]+)(\d+)([a-z]?.*)", name)  # "k6", "scale4ln1"
    if compact is not None:
        name, layer, layer_type = compact[1], int(compact[2]), compact[3] or None
    name = ACT_ALIASES.get(name, name)
    if name in ATTN_NAMES:
        layer_type = "attn"
    elif name in MLP_NAMES:
        layer_type = "mlp"
    else:
        layer_type = LAYER_TYPES.get(layer_type, layer_type)
    if name in ("scale", "normalized") and layer is None:
        layer_type = "ln_final"
    parts = ([f"blocks.{layer}"] if layer is not None else []) + ([layer_type] if layer_type else [])
    return ".".join(parts + [f"hook_{name}"])


class Padding:
    """Packed rows of texts <-> [batch, positions, ...] in the layout of the input: text i's rows at the
    positions `mask[i]` marks (right after each other from 0 for texts, where an attention mask says for a
    token tensor, so a left-padded batch comes back left-padded), zeros elsewhere."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask.bool()
        self.width = self.mask.shape[1]
        self.lengths = self.mask.sum(1).tolist()
        self._index = self.mask.flatten().nonzero().squeeze(1)

    @classmethod
    def right(cls, lengths: list[int]) -> Padding:
        """Texts of these lengths from position 0, right-padded to the longest."""
        return cls(torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None])

    @classmethod
    def left(cls, lengths: list[int]) -> Padding:
        """Texts of these lengths ending at the last position, left-padded to the longest."""
        width = max(lengths)
        return cls(torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None])

    def positions(self, i: int) -> torch.Tensor:
        """Where text i's rows sit, in order."""
        return self.mask[i].nonzero().squeeze(1)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros(len(self.lengths) * self.width, *rows.shape[1:])
        out[self._index.to(rows.device)] = rows
        return out.view(len(self.lengths), self.width, *rows.shape[1:])

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.reshape(-1, *padded.shape[2:])[self._index.to(padded.device)]


class ActivationCache(Attribution, Mapping):
    """Cached activations by hook name, [batch, positions, ...]; `cache["resid_post", 5]` works too. After
    `remove_batch_dim()` (a batch of one) every value, and what the methods return, lacks the batch dimension.
    Direct logit attribution (decompose_resid, stack_head_results, stack_neuron_results,
    get_full_resid_decomposition, apply_ln_to_stack, logit_attrs) is in vlens.attribution. `pos_slice`:
    run_with_cache's, where the tensors hold only those positions of each text.

    `ActivationCache(cache_dict, model, has_batch_dim=True)` is TransformerLens's constructor (a notebook builds
    one of the gradients its backward hooks kept): every position real unless `mask` [batch, positions] says
    which are; tensors without the batch dimension get it back (has_batch_dim=False reads them without it)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], model: ModelWeights, has_batch_dim: bool = True, *,
        mask: torch.Tensor | None = None, pos_slice=None,
    ):  # fmt: skip
        if not has_batch_dim and mask is None:  # (TransformerLens's form of one text's cache)
            tensors = {name: value[None] for name, value in tensors.items()}
        self._tensors, self.model = tensors, model
        self.mask = _all_real(tensors) if mask is None else mask
        self.has_batch_dim, self.pos_slice = has_batch_dim, pos_slice

    def __getitem__(self, key: str | tuple) -> torch.Tensor:
        """As TransformerLens's: a name, its short form ("k6") or (name, layer[, layer type]), the layer
        negative from the end."""
        if isinstance(key, tuple) and len(key) > 1 and key[1] is not None and key[1] < 0:
            key = (key[0], self.model.cfg.num_layers + key[1], *key[2:])
        name = get_act_name(*key) if isinstance(key, tuple) else key
        if name not in self._tensors and isinstance(key, str):
            name = get_act_name(key)
        head, _, leaf = name.rpartition(".")
        if name not in self._tensors and leaf in ROTATED:
            name = f"{head}.{ROTATED[leaf]}"
        if name not in self._tensors:
            hint = "; cache.compute_head_results() computes per-head results" if leaf == "hook_result" else ""
            raise KeyError(f"{name!r} is not in the cache{hint}; cached: {', '.join(self._tensors)}")
        return self._tensors[name] if self.has_batch_dim else self._tensors[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def to(self, device: str | torch.device) -> ActivationCache:
        tensors = {k: v.to(device) for k, v in self._tensors.items()}
        return ActivationCache(tensors, self.model, self.has_batch_dim, mask=self.mask, pos_slice=self.pos_slice)

    @property
    def cache_dict(self) -> dict[str, torch.Tensor]:
        """Every cached tensor by name, with its batch dimension (TransformerLens's attribute)."""
        return self._tensors

    def apply_slice_to_batch_dim(self, batch_slice: int | slice | Sequence[int]) -> ActivationCache:
        """TransformerLens's: a cache of some of the texts (an int keeps one, without the batch dimension)."""
        one = isinstance(batch_slice, int)
        index = [batch_slice] if one else batch_slice
        tensors = {name: value[index] for name, value in self._tensors.items()}
        return ActivationCache(tensors, self.model, not one, mask=self.mask[index], pos_slice=self.pos_slice)

    def toggle_autodiff(self, mode: bool = False) -> None:
        """TransformerLens's: torch's gradient mode, globally (off by default); as there, global state."""
        torch.set_grad_enabled(mode)

    def remove_batch_dim(self) -> ActivationCache:
        """TransformerLens's: a cache of one text drops its batch dimension (in place; returns the cache)."""
        one_text(self.mask.shape[0])
        self.has_batch_dim = False
        return self

    def stack_activation(self, activation: str, layer: int = -1, sublayer_type: str | None = None) -> torch.Tensor:
        """[layers, batch, positions, ...]: the activation at every layer below `layer` (-1: all)."""
        layer = self.model.cfg.num_layers if layer in (-1, None) else layer
        return torch.stack([self[(activation, i, sublayer_type)] for i in range(layer)])

    def accumulated_resid(
        self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False, pos_slice=None,
        return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """The residual stream entering each layer up to `layer` (all, and the last layer's output, by
        default), [components, batch, positions, d]. `apply_ln` puts every component through the
        model's own final norm (weight included, its scale computed per component), as a logit lens
        reads them, as TransformerLens 3 does for the whole stream (for an earlier `layer` it divides by that
        layer's cached ln1 scale instead). `pos_slice` keeps
        those positions of each text, as run_with_cache's does (an int: [components, batch, d])."""
        n = self.model.cfg.num_layers
        layer = n if layer in (-1, None) else layer
        names, labels = [], []
        for i in range(layer + 1):
            if i == n:
                names.append(f"blocks.{n - 1}.hook_resid_post")
                labels.append("final_post")
                continue
            names.append(f"blocks.{i}.hook_resid_pre")
            labels.append(f"{i}_pre")
            if incl_mid and i < layer:
                names.append(f"blocks.{i}.hook_resid_mid")
                labels.append(f"{i}_mid")
        stack = self._stack([self._cached(name, "accumulated_resid") for name in names], pos_slice)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, n, pos_slice=pos_slice, recompute_ln=True)
        return (stack, labels) if return_labels else stack

    # -- what the methods share (vlens.attribution's too) ------------------------------------------------

    def _cached(self, name: str, needed_by: str) -> torch.Tensor:
        """A hook's tensor with its batch dimension, or a KeyError saying who needs it."""
        if name not in self._tensors:
            raise KeyError(f"{needed_by} needs {name!r}, which this cache lacks: run_with_cache without a names_filter "
                           "caches every hook, or name it in the filter")  # fmt: skip
        return self._tensors[name]

    def _select(self, value: torch.Tensor, pos_slice) -> torch.Tensor:
        """`pos_slice` of each text's own positions of a [batch, positions, ...] tensor (None: all)."""
        if pos_slice is None:
            return value
        if self.pos_slice is not None:
            raise ValueError(f"pos_slice: this cache holds only positions {self.pos_slice!r} of each text "
                             "(run_with_cache's pos_slice); take positions there or here, not both")  # fmt: skip
        return keep_positions(value, Padding(self.mask), pos_slice)

    def _rows(self, pos_slice) -> torch.Tensor:
        """Which rows of a cached tensor, after `pos_slice`, are a text's (bool, [batch, positions] or [batch])."""
        return self._select(keep_positions(self.mask, Padding(self.mask), self.pos_slice), pos_slice)

    def _stack(self, parts: list[torch.Tensor], pos_slice) -> torch.Tensor:
        """[components, batch, positions, d] of batched tensors, `pos_slice` applied, without the batch
        dimension after remove_batch_dim."""
        if parts:
            stack = torch.stack([self._select(part, pos_slice) for part in parts])
        else:
            stack = torch.zeros(0, *self._rows(pos_slice).shape, self.model.cfg.hidden_size, dtype=self.model.llm.dtype)
        return stack if self.has_batch_dim else stack[:, 0]


def one_text(texts: int) -> None:
    if texts != 1:
        raise ValueError(f"remove_batch_dim: the batch holds {texts} texts; only a batch of one has a batch dimension "
                         "to remove")  # fmt: skip


def _all_real(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[batch, positions] all True, the layout of `tensors` ([batch, positions, ...]; patterns [batch, heads,
    query_pos, key_pos])."""
    if not tensors:
        return torch.ones(0, 0, dtype=torch.bool)
    name, value = next(iter(tensors.items()))
    shape = (value.shape[0], value.shape[2]) if is_pattern(name) else value.shape[:2]
    return torch.ones(shape, dtype=torch.bool)


def keep_positions(value: torch.Tensor, padding: Padding, pos_slice) -> torch.Tensor:
    """Keep `pos_slice` of each text's own positions (right-padded again where they differ in number);
    an int keeps one position and drops the position dimension, as TransformerLens does."""
    if pos_slice is None:
        return value
    picked = []
    for i, n in enumerate(padding.lengths):
        try:
            picked.append(value[i, padding.positions(i)[pos_slice]])
        except IndexError:
            raise ValueError(f"pos_slice: {pos_slice!r} is outside text {i}'s {n} positions") from None
    return torch.stack(picked) if isinstance(pos_slice, int) else torch.nn.utils.rnn.pad_sequence(picked, batch_first=True)
