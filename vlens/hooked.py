"""TransformerLens's calls over a vlens model, so a notebook moves to vlens by changing its import and
its loading line:

    model = HookedLM("path/or/hub-id", dtype="float32")        # was HookedTransformer.from_pretrained(...)
    logits, cache = model.run_with_cache(texts, names_filter="blocks.*.hook_resid_post")
    cache["resid_post", 5], cache.accumulated_resid(apply_ln=True)
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.3.attn.hook_z", ablate_head)])

What differs from TransformerLens: the values are HF's own (no LayerNorm folding, no weight
centring), and texts of different lengths run packed, never padded: every tensor comes back
right-padded to [batch, positions, ...] with zeros past each text's end (attention scores and patterns
[batch, heads, query_pos, key_pos], as in TransformerLens), and `cache.mask` says which positions are
real. A [batch, positions] token tensor is taken whole unless `attention_mask` says where each row ends.
Hook functions are the one place vlens runs user Python inside a forward: an eager path over one packed
forward, for notebooks, not the engine.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from vlens.capture.names import LOGITS, hook_shapes, is_pattern, layers_needed, resolve_hooks
from vlens.capture.rows import widen
from vlens.inputs import to_token_lists
from vlens.llm import LLM

ATTN_NAMES = {"q", "k", "v", "z", "pattern", "attn_scores", "result", "rot_q", "rot_k"}
MLP_NAMES = {"pre", "post", "mid", "pre_linear"}
# TransformerLens's other spellings of activations and layer types (utilities/components_utils.py)
ACT_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
               "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}  # fmt: skip
LAYER_TYPES = {"a": "attn", "m": "mlp", "attention": "attn", "b": None, "block": None, "blocks": None}
HookFn = Callable[..., "torch.Tensor | None"]
NamesFilter = "str | Sequence[str] | Callable[[str], bool] | None"


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


class HookPoint:
    """What a hook function gets as `hook`: the name of its tap."""

    def __init__(self, name: str):
        self.name = name

    def layer(self) -> int:
        match = re.match(r"blocks\.(\d+)\.", self.name)
        if match is None:
            raise ValueError(f"hook {self.name!r} belongs to no layer")
        return int(match.group(1))

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r})"


class Padding:
    """Packed rows of texts of different lengths <-> [batch, positions, ...], zeros past each end."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.width = max(lengths)
        self.mask = torch.arange(self.width)[None, :] < torch.tensor(lengths)[:, None]
        self._index = self.mask.flatten().nonzero().squeeze(1)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros(len(self.lengths) * self.width, *rows.shape[1:])
        out[self._index.to(rows.device)] = rows
        return out.view(len(self.lengths), self.width, *rows.shape[1:])

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.reshape(-1, *padded.shape[2:])[self._index.to(padded.device)]


class _UserHooks:
    """The hook functions at one tap, called on the padded batch in the order they were given."""

    def __init__(self, name: str, fns: list[HookFn], padding: Padding):
        self.point, self.fns, self.padding = HookPoint(name), fns, padding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        value = self.padding.pad(x)
        for fn in self.fns:
            out = fn(value, hook=self.point)
            if out is None:
                continue
            if not isinstance(out, torch.Tensor) or out.shape != value.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"fwd_hooks: the function at {self.point.name} returned {got}; a hook returns None or a "
                    f"tensor of the shape it was given, {tuple(value.shape)}"
                )
            value = out
        return self.padding.pack(value).to(x.dtype)


class ActivationCache(Mapping):
    """Cached activations by hook name, [batch, positions, ...]; `cache["resid_post", 5]` works too."""

    def __init__(self, tensors: dict[str, torch.Tensor], mask: torch.Tensor, model: HookedLM):
        self._tensors, self.mask, self.model = tensors, mask, model

    def __getitem__(self, key: str | tuple) -> torch.Tensor:
        """As TransformerLens's: a name, its short form ("k6") or (name, layer[, layer type]), the layer
        negative from the end."""
        if isinstance(key, tuple) and len(key) > 1 and key[1] is not None and key[1] < 0:
            key = (key[0], self.model.cfg.num_layers + key[1], *key[2:])
        name = get_act_name(*key) if isinstance(key, tuple) else key
        if name not in self._tensors and isinstance(key, str):
            name = get_act_name(key)
        if name not in self._tensors:
            raise KeyError(f"{name!r} is not in the cache; cached: {', '.join(self._tensors)}")
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def to(self, device: str | torch.device) -> ActivationCache:
        return ActivationCache({k: v.to(device) for k, v in self._tensors.items()}, self.mask, self.model)

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
        reads them; TransformerLens instead divides by the final norm's cached scale. `pos_slice` keeps
        those positions of each text, as run_with_cache's does (an int: [components, batch, d])."""
        n = self.model.cfg.num_layers
        layer = n if layer in (-1, None) else layer
        parts, labels = [], []
        for i in range(layer + 1):
            if i == n:
                parts.append(self[("resid_post", n - 1)])
                labels.append("final_post")
                continue
            parts.append(self[("resid_pre", i)])
            labels.append(f"{i}_pre")
            if incl_mid and i < layer:
                parts.append(self[("resid_mid", i)])
                labels.append(f"{i}_mid")
        stack = torch.stack(parts)
        if apply_ln:
            with torch.inference_mode():
                norm = self.model.llm.model.final_norm
                weight = next(norm.parameters())
                stack = norm(stack.to(weight.device, weight.dtype)).to(stack.device) * self.mask[..., None]
        if pos_slice is not None:
            padding = Padding(self.mask.sum(1).tolist())
            stack = torch.stack([_positions(part, padding, pos_slice) for part in stack])
        return (stack, labels) if return_labels else stack


class HookedLM:
    """A vlens model with TransformerLens's calls (see the module doc). `model` and `settings` are
    those of `vlens.LLM`."""

    def __init__(self, model: str | None = None, **settings: Any):
        self.llm = LLM(model, **settings)
        self.cfg, self.tokenizer = self.llm.config, self.llm.tokenizer
        self._shapes = hook_shapes(self.cfg)
        self._context_hooks: list[tuple[Any, HookFn]] = []

    from_pretrained = classmethod(lambda cls, model=None, **settings: cls(model, **settings))

    # -- tokens ---------------------------------------------------------------------------------------

    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None) -> torch.Tensor:
        """[batch, positions] token ids, right-padded with the pad (else EOS) token. prepend_bos: None
        keeps the tokenizer's default, True puts the BOS token first, False takes it off."""
        lists = self._token_lists([text] if isinstance(text, str) else list(text), prepend_bos)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        out = torch.full((len(lists), max(map(len, lists))), pad if pad is not None else 0, dtype=torch.long)
        for i, ids in enumerate(lists):
            out[i, : len(ids)] = torch.tensor(ids)
        return out

    def to_string(self, tokens: torch.Tensor | Sequence[int]) -> str | list[str]:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 2:
            return [self.tokenizer.decode(row) for row in tokens.tolist()]
        return self.tokenizer.decode(tokens.tolist())

    def to_str_tokens(self, text: str, prepend_bos: bool | None = None) -> list[str]:
        return [self.tokenizer.decode([t]) for t in self._token_lists([text], prepend_bos)[0]]

    def _token_lists(self, texts: list[str], prepend_bos: bool | None) -> list[list[int]]:
        lists = to_token_lists(texts, self.tokenizer, self.cfg.vocab_size, field="input")
        bos = self.tokenizer.bos_token_id
        if prepend_bos is True and bos is not None:
            lists = [ids if ids[0] == bos else [bos] + ids for ids in lists]
        elif prepend_bos is False and bos is not None:
            lists = [ids[1:] if ids[0] == bos and len(ids) > 1 else ids for ids in lists]
        return lists

    def _sequences(self, input: Any, attention_mask: torch.Tensor | None) -> list[list[int]]:
        if isinstance(input, torch.Tensor):
            rows = input[None] if input.dim() == 1 else input
            if attention_mask is not None:
                return [r[m.bool()].tolist() for r, m in zip(rows, attention_mask)]
            return rows.tolist()
        return self._token_lists([input] if isinstance(input, str) else list(input), None)

    # -- forwards -------------------------------------------------------------------------------------

    def __call__(self, input: Any, return_type: str | None = "logits", attention_mask: torch.Tensor | None = None):
        return self.run_with_hooks(input, return_type=return_type, attention_mask=attention_mask)

    def run_with_cache(
        self,
        input: Any,
        names_filter: NamesFilter = None,
        stop_at_layer: int | None = None,
        pos_slice: int | slice | Sequence[int] | None = None,
        return_type: str | None = "logits",
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[Any, ActivationCache]:
        """(output, cache). names_filter: a name, glob, list of them, or a function of the name (None:
        every hook); stop_at_layer: run only the layers below it and return the residual entering it
        ([batch, positions, d]; negative counts from the last layer); pos_slice: keep these positions of
        each text, counted from its own start (negative: from its own end)."""
        names = self._names(names_filter)
        stop_at_layer = self._stop_layer(stop_at_layer)
        if stop_at_layer is not None:
            names = {n: t for n, t in names.items() if layers_needed(t, self.cfg) <= stop_at_layer}
        return self._run(input, names, stop_at_layer, pos_slice, return_type, attention_mask)

    def run_with_hooks(
        self,
        input: Any,
        fwd_hooks: Sequence[tuple[Any, HookFn]] = (),
        return_type: str | None = "logits",
        stop_at_layer: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        """The forward with `fn(value, hook)` run at each named tap (a name, glob or a function of the
        name); a hook that returns a tensor of the shape it got replaces the value."""
        with self.hooks(fwd_hooks):
            output, _ = self._run(input, {}, self._stop_layer(stop_at_layer), None, return_type, attention_mask)
        return output

    def _stop_layer(self, stop_at_layer: int | None) -> int | None:
        """TransformerLens's stop_at_layer, a bound on the layers as in `blocks[:stop_at_layer]`: negative counts
        from the last layer (-1 runs all but it), past the last runs them all."""
        n = self.cfg.num_layers
        if stop_at_layer is None:
            return None
        if not isinstance(stop_at_layer, int) or isinstance(stop_at_layer, bool) or stop_at_layer < -n:
            raise ValueError(f"stop_at_layer: {stop_at_layer!r} is not an int in -{n}..{n} (this model has {n} layers)")
        return stop_at_layer + n if stop_at_layer < 0 else min(stop_at_layer, n)

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[tuple[Any, HookFn]] = ()):
        """Hooks that apply to every forward inside the `with` block."""
        before = list(self._context_hooks)
        self._context_hooks += list(fwd_hooks)
        try:
            yield self
        finally:
            self._context_hooks = before

    def _names(self, names_filter: NamesFilter) -> dict[str, str]:
        """Requested name -> tap, for a filter in any TransformerLens form (aliases like hidden_states.i
        only when asked for by name)."""
        if names_filter is None:
            return {n: n for n in self._shapes if not n.startswith("hidden_states.")}
        if callable(names_filter):
            return {n: n for n in self._shapes if not n.startswith("hidden_states.") and names_filter(n)}
        return resolve_hooks(names_filter, self.cfg)

    def _user_hooks(self, padding: Padding) -> dict[str, _UserHooks]:
        by_tap: dict[str, list[HookFn]] = {}
        taps = [n for n in self._shapes if not n.startswith("hidden_states.")]
        for where, fn in self._context_hooks:
            chosen = [n for n in taps if where(n)] if callable(where) else list(resolve_hooks(where, self.cfg).values())
            read_only = [t for t in chosen if is_pattern(t)]
            if read_only:
                raise ValueError(
                    f"fwd_hooks: {', '.join(read_only)} cannot be hooked: vlens computes attention scores and patterns "
                    "beside the fused attention, not inside it, so a hook there could change nothing; read them with "
                    "run_with_cache, or edit attn.hook_q / hook_k / hook_v / hook_z"
                )
            for tap in chosen:
                by_tap.setdefault(tap, []).append(fn)
        return {tap: _UserHooks(tap, fns, padding) for tap, fns in by_tap.items()}

    def _run(self, input, names, stop_at_layer, pos_slice, return_type, attention_mask):
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type: {return_type!r} is not one of logits, loss, both, None")
        seqs = self._sequences(input, attention_mask)
        self.llm.check_fits(seqs, "input")
        padding = Padding([len(s) for s in seqs])
        taps = set(names.values())
        if stop_at_layer is not None:
            n = self.cfg.num_layers
            output = f"blocks.{stop_at_layer}.hook_resid_pre" if stop_at_layer < n else f"blocks.{n - 1}.hook_resid_post"
            taps.add(output)
        elif return_type is not None:
            taps.add(LOGITS)
        captured = self.llm.runner.packed(seqs, sorted(taps), hooks=self._user_hooks(padding))
        rows: dict[str, list[torch.Tensor]] = {t: [None] * len(seqs) for t in taps}
        for i, tap, value in captured.pieces():
            rows[tap][i] = value
        padded = {t: padding.pad(torch.cat(_same_width(t, parts, padding.width))) for t, parts in rows.items()}
        cached = {n: _heads_first(t, _positions(padded[t], padding, pos_slice)) for n, t in names.items()}
        cache = ActivationCache(cached, padding.mask, self)
        if stop_at_layer is not None:
            return padded[output], cache
        if return_type is None:
            return None, cache
        logits = padded[LOGITS]
        if return_type == "logits":
            return logits, cache
        loss = _loss(logits, seqs, padding)
        return (loss if return_type == "loss" else (logits, loss)), cache


def _same_width(tap: str, parts: list[torch.Tensor], width: int) -> list[torch.Tensor]:
    """Attention scores and patterns of each text are as wide as the text: widen them to the longest."""
    return [widen(tap, p, width) for p in parts] if is_pattern(tap) else parts


def _heads_first(tap: str, value: torch.Tensor) -> torch.Tensor:
    """Attention scores and patterns in TransformerLens's layout, [batch, heads, query_pos, key_pos]: a ported
    `cache["pattern", L][b, h]` must read head h, not position h (vlens's rows are per query position)."""
    return value.transpose(1, 2) if is_pattern(tap) and value.dim() == 4 else value


def _positions(value: torch.Tensor, padding: Padding, pos_slice) -> torch.Tensor:
    """Keep `pos_slice` of each text's own positions (right-padded again where they differ in number);
    an int keeps one position and drops the position dimension, as TransformerLens does."""
    if pos_slice is None:
        return value
    if isinstance(pos_slice, int):
        return torch.stack([value[i, torch.arange(n)[pos_slice]] for i, n in enumerate(padding.lengths)])
    picked = [value[i, torch.arange(n)[pos_slice]] for i, n in enumerate(padding.lengths)]
    return torch.nn.utils.rnn.pad_sequence(picked, batch_first=True)


def _loss(logits: torch.Tensor, seqs: list[list[int]], padding: Padding) -> torch.Tensor:
    """Mean next-token cross-entropy over every predicted position of every text (never a pad)."""
    total, count = 0.0, 0
    for i, ids in enumerate(seqs):
        if len(ids) < 2:
            continue
        logp = logits[i, : len(ids) - 1].float().log_softmax(-1)
        total = total - logp.gather(-1, torch.tensor(ids[1:])[:, None]).sum()
        count += len(ids) - 1
    return total / max(count, 1)
