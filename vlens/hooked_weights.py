"""TransformerLens's weight attributes over a vlens model (`model.W_U`, `model.W_O`, `model.blocks[L].attn.W_Q`,
`model.tokens_to_residual_directions(...)`), for direct logit attribution and circuit notebooks; and its hook
points where its module tree has them (`model.blocks[L].attn.hook_z`: HookTree).

The weights are HF's as the checkpoint holds them: no LayerNorm folding, no weight centring, which is what
TransformerLens's `from_pretrained_no_processing` gives (its `from_pretrained` folds each norm's weight into
the matrices after it and centres them). So `resid @ W_U` is not a logit: the final norm (its scale *and* its
weight) comes first, as `cache.apply_ln_to_stack` applies it (vlens.attribution).

Shapes are TransformerLens's: W_Q [n_layers, n_heads, d_model, d_head]; W_K and W_V the same, each key/value
head repeated for the query heads that share it (grouped-query attention), as TransformerLens's W_K / W_V
properties give them (`blocks[L].attn._W_K` / `_W_V` are the [n_key_value_heads, d_model, d_head] weights
themselves); W_O [n_layers, n_heads, d_head, d_model]; b_Q / b_K / b_V [n_layers, n_heads, d_head]; b_O
[n_layers, d_model]; W_U [d_model, d_vocab]; W_E [d_vocab, d_model]; W_pos [n_ctx, d_model]; the MLPs' W_in
and W_gate [n_layers, d_model, d_mlp], W_out [n_layers, d_mlp, d_model], b_in [n_layers, d_mlp], b_out
[n_layers, d_model], by TransformerLens's equations: act(x @ W_in + b_in) @ W_out + b_out (GPT-2, GPT-NeoX),
(act(x @ W_gate) * (x @ W_in) + b_in) @ W_out + b_out (gated: Llama, Gemma; W_gate is None for the others).
A bias the model does not have is zeros, as in TransformerLens. QK and OV (model-wide [n_layers, n_heads, ...]
and per layer) are TransformerLens's FactoredMatrix of W_Q @ W_Kᵀ and W_V @ W_O, made by its own class.
Routed experts (Mixtral, Qwen2-MoE) have no one W_in or W_out, so an MoE layer refuses `.mlp` by name. Treat them as read-only: some are views of the
live weights, others copies (TransformerLens's are its parameters), so an in-place edit may or may not reach
the model; edit `model.llm.model`'s modules instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vlens.models.base import AttentionHeads, DecoderLM
from vlens.models.deepseek import LatentAttention

if TYPE_CHECKING:
    from vlens.config import ModelConfig
    from vlens.llm import LLM

Tokens = int | str | Sequence[int] | torch.Tensor  # token ids, or a text that is one token


class HookTree:
    """TransformerLens's module paths to hook points (`model.blocks[3].attn.hook_z`, `model.blocks[3].ln1.hook_scale`):
    each attribute under `prefix` is a hook point of `model` (a HookedLM) or, where names go on, another HookTree."""

    def __init__(self, model: Any, prefix: str):
        self._model, self._prefix = model, prefix

    def __getattr__(self, name: str) -> Any:
        full, names = self._prefix + name, self._model._shapes
        if full in names:
            return self._model._point(full)
        if not name.startswith("_") and any(n.startswith(full + ".") for n in names):
            return HookTree(self._model, full + ".")
        under = sorted({n[len(self._prefix) :].split(".")[0] for n in names if n.startswith(self._prefix)})
        raise AttributeError(f"{self._prefix}{name}: no hook point of this model; under {self._prefix or 'the model'}: "
                             f"{', '.join(under)}")  # fmt: skip


class HooksOnly:
    """A layer part's hook points under tensor parallelism: another attribute (a weight) is refused as the
    weight attributes are there (ModelWeights._model says why)."""

    def __init__(self, tree: HookTree, hooked: Any):
        self._tree, self._hooked = tree, hooked

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._tree, name)
        except AttributeError:
            if name.startswith("_"):
                raise
            self._hooked._model()  # (raises: the whole matrices are not in this process)
            raise


def factored(left: torch.Tensor, right: torch.Tensor):
    """TransformerLens's FactoredMatrix of left @ right (its svd, eigenvalues, norms and indexing without the
    product), from transformer_lens itself, which a notebook that asks for QK and OV has."""
    try:
        from transformer_lens import FactoredMatrix
    except ImportError:
        raise ImportError(
            "QK / OV: TransformerLens's FactoredMatrix: pip install transformer-lens (or the products themselves: "
            "W_Q @ W_K.transpose(-2, -1), W_V @ W_O)"
        ) from None
    return FactoredMatrix(left, right)


def resolve_layer(layer: int | None, n_layers: int) -> int:
    """TransformerLens's layer argument: 0..n_layers, with n_layers, -1 and None the final norm's input."""
    if layer is None or layer == -1:
        return n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n_layers:
        raise ValueError(
            f"layer: {layer!r} is not in 0..{n_layers} (n_layers, -1 or None: the input of the final norm)"
        )
    return layer


def check_mlp_input(cfg: ModelConfig, layer: int, mlp_input: bool, as_sum: bool = True) -> None:
    """`mlp_input` (the stream entering layer `layer`'s MLP) needs an MLP there and, `as_sum` (the stream as
    the sum of what wrote it), one that reads the layer's input plus its attn_out, which GPT-NeoX's parallel
    residual does not (its pre-MLP norm of the layer input is defined: apply_ln_to_stack passes False)."""
    n = cfg.num_layers
    if mlp_input and layer == n:
        raise ValueError(f"mlp_input: layer {n} (-1, None) is the final norm's input, which no MLP reads; "
                         f"mlp_input=True goes with a layer in 0..{n - 1}")  # fmt: skip
    if mlp_input and cfg.part_at(layer) != "both":
        raise ValueError(f"mlp_input: {cfg.architecture}'s layer {layer} is one part alone (a token mixer or an MLP), "
                         "whose input is the layer's: mlp_input=False")  # fmt: skip
    if mlp_input and as_sum and cfg.parallel_residual:
        raise ValueError(
            f"mlp_input: {cfg.architecture} with a parallel residual runs attention and MLP side by side: "
            f"layer {layer}'s MLP reads the layer's input (mlp_input=False), not it plus the layer's attn_out"
        )


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's attention weights, per head, as TransformerLens's `blocks[L].attn` holds them."""

    W_Q: torch.Tensor  # [n_heads, d_model, d_head]
    _W_K: torch.Tensor  # [n_key_value_heads, d_model, d_head]
    _W_V: torch.Tensor
    W_O: torch.Tensor  # [n_heads, d_head, d_model]
    b_Q: torch.Tensor  # [n_heads, d_head]
    _b_K: torch.Tensor  # [n_key_value_heads, d_head]
    _b_V: torch.Tensor
    b_O: torch.Tensor  # [d_model]
    sinks: torch.Tensor | None = None  # [n_heads] gpt-oss's sink logits (TransformerLens has none); None: no sinks
    hooks: HookTree | None = field(default=None, repr=False, compare=False)  # its layer's attn.* hook points

    def __getattr__(self, name: str) -> object:  # (`blocks[L].attn.hook_z`: what no weight attribute is)
        if name.startswith("__") or self.__dict__.get("hooks") is None:
            raise AttributeError(name)
        return getattr(self.hooks, name)

    @classmethod
    def of(cls, heads: AttentionHeads, hooks: HookTree | None = None, keys: AttentionHeads | None = None
           ) -> AttentionWeights:  # fmt: skip
        """Read from a layer's attention module: its fused q/k/v projection cut into heads, its output
        projection's columns per head. `keys`: the earlier layer whose keys and values this one attends to
        (Gemma 4's shared layers): W_K, W_V, b_K and b_V are that layer's, which made them from its own input."""
        (W_Q, b_Q), *kv = _projections(heads)
        (W_K, b_K), (W_V, b_V) = kv if keys is None else _projections(keys)[1:]
        sinks = None if heads.attn.sinks is None else heads.attn.sinks.detach()
        W_O, b_O = _output(heads)
        return cls(W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, sinks, hooks)

    @property
    def _repeats(self) -> int:
        return self.W_Q.shape[0] // self._W_K.shape[0]

    W_K = property(lambda self: self._W_K.repeat_interleave(self._repeats, 0))
    W_V = property(lambda self: self._W_V.repeat_interleave(self._repeats, 0))
    b_K = property(lambda self: self._b_K.repeat_interleave(self._repeats, 0))
    b_V = property(lambda self: self._b_V.repeat_interleave(self._repeats, 0))
    # each head's bilinear maps, [n_heads, d_model, d_model] factored: queries against keys, values to outputs
    QK = property(lambda self: factored(self.W_Q, self.W_K.transpose(-2, -1)))
    OV = property(lambda self: factored(self.W_V, self.W_O))


@dataclass(frozen=True)
class LatentAttentionWeights:
    """A layer of DeepSeek's latent attention, as far as TransformerLens's weights describe it: W_O and b_O. Its
    queries, keys and values come through low-rank projections with a norm between, so no matrix is W_Q, W_K or
    W_V; asking for one says so."""

    W_O: torch.Tensor  # [n_heads, d_head_v, d_model]
    b_O: torch.Tensor  # [d_model]
    hooks: HookTree | None = field(default=None, repr=False, compare=False)

    def __getattr__(self, name: str) -> object:
        if name in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "QK", "OV"):
            raise ValueError(
                f"attn.{name}: DeepSeek's latent attention makes its queries, keys and values through "
                "low-rank projections with a norm between (q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, "
                f"kv_a_layernorm, kv_b_proj), so no one matrix is {name}; W_O and b_O are its output's, and the "
                "projections are model.llm.model's modules"
            )
        return AttentionWeights.__getattr__(self, name)


def attention_weights(
    heads: AttentionHeads, hooks: HookTree | None = None, keys: AttentionHeads | None = None
) -> AttentionWeights | LatentAttentionWeights:
    """A layer's attention weights (`keys`: AttentionWeights.of's)."""
    if isinstance(heads, LatentAttention):
        return LatentAttentionWeights(*_output(heads), hooks)
    return AttentionWeights.of(heads, hooks, keys)


def _output(heads: AttentionHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_O [n_heads, d_head_v, d_model], b_O [d_model]): the output projection's columns per head, its bias."""
    out = heads.out
    W_O = out.weight.detach().T.reshape(heads.heads, heads.value_dim, -1)
    return W_O, out.weight.new_zeros(out.out_features) if out.bias is None else out.bias.detach()


def _projections(heads: AttentionHeads) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(W [n, d_model, d_head], b [n, d_head]) of each of q, k and v the layer projects: q alone where it attends
    to an earlier layer's keys and values; where keys are values (Gemma 4's full layers) W_V is W_K, the values'
    norm differing, not their weights."""
    qkv, sizes = heads.qkv, list(heads.qkv.parts.values())
    weights = list(qkv.weight.detach().split(sizes))
    biases = [None] * len(sizes) if qkv.bias is None else list(qkv.bias.detach().split(sizes))
    if heads.keys_are_values:
        weights.append(weights[1])
        biases.append(biases[1])
    counts, d = (heads.heads, heads.kv_heads, heads.kv_heads), heads.head_dim
    if heads.output_gate:  # (Qwen 3.5: each head's rows are its query's, then its output gate's)
        weights[0] = weights[0].view(heads.heads, 2, d, -1)[:, 0].flatten(0, 1)
        biases[0] = None if biases[0] is None else biases[0].view(heads.heads, 2, d)[:, 0].flatten()
    return [(w.reshape(n, d, -1).transpose(1, 2), w.new_zeros(n, d) if b is None else b.reshape(n, d))
            for w, b, n in zip(weights, biases, counts)]  # fmt: skip


def mixer_of(cfg: ModelConfig, layer: int) -> tuple[str, str]:
    """(what layer `layer` has in place of attention, where its hook points are)."""
    if cfg.part_at(layer) == "mlp":
        return "an MLP alone", "mlp"
    if cfg.is_linear_layer(layer):
        return "linear attention (a gated delta net)", "linear_attn"
    if cfg.is_conv_layer(layer):
        return "a gated short convolution", "conv"
    return ("a Mamba mixer" if cfg.ssm_dt_rank else "a Mamba 2 mixer"), "mamba"


@dataclass(frozen=True)
class MLPWeights:
    """One layer's MLP weights as TransformerLens's `blocks[L].mlp` holds them (equations: module doc)."""

    W_in: torch.Tensor  # [d_model, d_mlp]
    W_gate: torch.Tensor | None  # [d_model, d_mlp]; None for a plain MLP, as TransformerLens's W_gate
    W_out: torch.Tensor  # [d_mlp, d_model]
    b_out: torch.Tensor  # [d_model]
    _b_in: torch.Tensor | None  # HF's bias of x @ W_in (a gated MLP's gate has one too), None where it has none
    architecture: str
    hooks: HookTree | None = field(default=None, repr=False, compare=False)  # its layer's mlp.* hook points

    __getattr__ = AttentionWeights.__getattr__  # (`blocks[L].mlp.hook_post`)

    @classmethod
    def of(cls, model: DecoderLM, layer: int, hooks: HookTree | None = None) -> MLPWeights:
        """Read from a layer's dense MLP: fc_in's rows cut into its parts (gate, then up; or the one input
        projection), fc_out's columns per neuron."""
        cfg = model.cfg
        if cfg.is_moe_layer(layer) and not cfg.experts_beside_mlp:  # (Gemma 4's: the dense MLP beside them)
            raise ValueError(
                f"{cfg.architecture}: layer {layer}'s MLP is {cfg.num_experts} routed experts, chosen per token: it "
                "has no one W_in / W_gate / W_out / b_in / b_out (TransformerLens's MoE keeps them per expert) and no "
                "per-neuron results; its mlp_out is one component (decompose_resid, get_full_resid_decomposition("
                "expand_neurons=False), accumulated_bias(include_mlp_biases=False))"
            )
        if not cfg.has_mlp(layer):
            what, part = mixer_of(cfg, layer) if not cfg.attends(layer) else ("attention", "attn")
            raise ValueError(f"blocks[{layer}].mlp: {cfg.architecture}'s layer {layer} is {what} alone, with no MLP; "
                             f"its hook points are under blocks[{layer}].{part}")  # fmt: skip
        mlp = model.layers[layer].mlp
        fc_in, fc_out = mlp.fc_in, mlp.fc_out
        parts = list(fc_in.parts.values())
        *gate, W_in = (w.T for w in fc_in.weight.detach().split(parts))
        b_in = None if fc_in.bias is None else fc_in.bias.detach().split(parts)[-1]
        b_out = fc_out.weight.new_zeros(fc_out.out_features) if fc_out.bias is None else fc_out.bias.detach()
        return cls(W_in, gate[0] if gate else None, fc_out.weight.detach().T, b_out, b_in, cfg.architecture, hooks)

    @property
    def b_in(self) -> torch.Tensor:
        """[d_mlp]: added to x @ W_in before the activation (plain MLP), or to the gated product (zeros: HF's
        gated MLPs have no such bias)."""
        if self._b_in is None:
            return self.W_in.new_zeros(self.W_in.shape[1])
        if self.W_gate is None:
            return self._b_in
        raise ValueError(
            f"b_in: {self.architecture} with mlp_bias adds its biases to x @ W_gate and x @ W_in, before the gated "
            "product; TransformerLens's b_in is added after it (act(x @ W_gate) * (x @ W_in) + b_in), so no b_in "
            "gives this MLP: read gate_proj's and up_proj's biases from model.llm.model"
        )


@dataclass(frozen=True)
class Block:
    """What `model.blocks[L]` offers: its attention weights (`.attn`) and its MLP's (`.mlp`), each read when
    asked, so that an MoE layer refuses `.mlp` alone; and its hook points as TransformerLens's module tree has
    them (`.hook_resid_pre`, `.ln1.hook_scale`, `.attn.hook_z`, `.mlp.hook_post`: HookPoints, `add_hook` and all)."""

    model: DecoderLM = field(repr=False)
    index: int
    hooked: object = field(default=None, repr=False)  # the HookedLM whose hook points these are

    def _hooks(self, part: str = "") -> HookTree:
        return HookTree(self.hooked, f"blocks.{self.index}.{part}")

    attn = property(lambda self: self._part("attn.", lambda: attention_weights(
        self._heads(self.index), self._hooks("attn."), self._keys())))  # fmt: skip

    def _heads(self, layer: int) -> AttentionHeads:
        cfg = self.model.cfg
        if not cfg.attends(layer):
            what, part = mixer_of(cfg, layer)
            raise ValueError(f"blocks[{layer}].attn: {cfg.architecture}'s layer {layer} is {what}, which has no "
                             f"attention heads and no W_Q, W_K, W_V or W_O; its hook points are under "
                             f"blocks[{layer}].{part}")  # fmt: skip
        return self.model.layers[layer].attn_heads

    def _keys(self) -> AttentionHeads | None:
        """The earlier layer whose keys and values this one attends to (Gemma 4's shared layers), or None."""
        heads = self._heads(self.index)
        return None if heads.own_kv else self._heads(heads.kv_layer)
    mlp = property(lambda self: self._part("mlp.", lambda: MLPWeights.of(self.model, self.index, self._hooks("mlp."))))

    def _part(self, prefix: str, weights: Callable[[], Any]) -> Any:
        """Its weights with their hook points; under tensor parallelism (this process holds a slice of each
        matrix) the hook points alone, a weight asked for refused with the reason."""
        if self.model.cfg.parallel.size == 1:
            return weights()
        return HooksOnly(self._hooks(prefix), self.hooked)

    def __getattr__(self, name: str) -> object:  # (hook_* and the norms' trees: ln1, ln2, ...)
        if name.startswith("__") or self.__dict__.get("hooked") is None:
            raise AttributeError(name)
        return getattr(self._hooks(), name)


class ModelWeights:
    """TransformerLens's weight attributes, mixed into HookedLM (which holds the vlens model as `self.llm`)."""

    llm: LLM
    cfg: ModelConfig

    def _model(self) -> DecoderLM:
        """The whole model: under tensor parallelism this process holds a slice of each matrix only."""
        model = self.llm.model
        ranks = model.cfg.parallel.size
        if ranks > 1:
            raise ValueError(
                f"tensor_parallel_size: {ranks}: the weight attributes (W_U, W_O, ...) and "
                "tokens_to_residual_directions need whole matrices, and this process holds 1/"
                f"{ranks} of each; load the model with tensor_parallel_size=1 for them"
            )
        return model

    @property
    def blocks(self) -> list[Block]:
        """`model.blocks[L].attn.W_O`, `model.blocks[L].mlp.W_out` and the rest, per layer (read afresh from the
        live weights), and the hook points (under tensor parallelism those alone)."""
        model = self.llm.model
        return [Block(model, i, self) for i in range(len(model.layers))]

    def _stacked(self, part: str, name: str) -> torch.Tensor:
        cfg = self.cfg
        full = [i for i in range(cfg.num_layers) if cfg.attends(i)]
        if part == "attn" and len(full) < cfg.num_layers:
            if not full:
                raise ValueError(f"{name}: {cfg.architecture} has no attention (its layers are Mamba mixers), so no "
                                 f"{name}; their hook points are under model.blocks[L].mamba")  # fmt: skip
            raise ValueError(f"{name}: {cfg.architecture}'s layers but {full} are linear attention, short "
                             f"convolutions or Mamba mixers, without attention heads; read model.blocks[L].attn.{name} "
                             "of those layers")  # fmt: skip
        per_layer = [getattr(getattr(block, part), name) for block in self.blocks]
        shapes = sorted({tuple(w.shape) for w in per_layer})
        if len(shapes) > 1:
            raise ValueError(f"{name}: {self.cfg.architecture}'s layers differ in shape ("
                             f"{', '.join(map(str, shapes))}: heads of two sizes), so no one [n_layers, ...] tensor "
                             f"holds them; read model.blocks[L].{part}.{name} layer by layer")  # fmt: skip
        return torch.stack(per_layer)

    W_Q = property(lambda self: self._stacked("attn", "W_Q"))
    W_K = property(lambda self: self._stacked("attn", "W_K"))
    W_V = property(lambda self: self._stacked("attn", "W_V"))
    W_O = property(lambda self: self._stacked("attn", "W_O"))
    b_Q = property(lambda self: self._stacked("attn", "b_Q"))
    b_K = property(lambda self: self._stacked("attn", "b_K"))
    b_V = property(lambda self: self._stacked("attn", "b_V"))
    b_O = property(lambda self: self._stacked("attn", "b_O"))
    QK = property(lambda self: factored(self.W_Q, self.W_K.transpose(-2, -1)))  # [n_layers, n_heads, d_model, d_model]
    OV = property(lambda self: factored(self.W_V, self.W_O))
    W_in = property(lambda self: self._stacked("mlp", "W_in"))
    W_out = property(lambda self: self._stacked("mlp", "W_out"))
    b_in = property(lambda self: self._stacked("mlp", "b_in"))
    b_out = property(lambda self: self._stacked("mlp", "b_out"))

    @property
    def W_gate(self) -> torch.Tensor | None:
        """[n_layers, d_model, d_mlp] of a gated MLP (Llama, Gemma); None for a plain one, as in TransformerLens."""
        gates = [block.mlp.W_gate for block in self.blocks]
        return None if gates[0] is None else torch.stack(gates)

    def accumulated_bias(
        self, layer: int | None, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> torch.Tensor:
        """TransformerLens's: [d_model], the biases the layers below `layer` add to the residual stream (each b_O,
        and each b_out with include_mlp_biases); `mlp_input`: layer `layer`'s b_O too. `layer` in 0..n_layers
        (-1, None: n_layers)."""
        model = self._model()
        layer = resolve_layer(layer, model.cfg.num_layers)
        check_mlp_input(model.cfg, layer, mlp_input)
        blocks, attends = self.blocks, model.cfg.attends  # (a layer that keeps states: no b_O; LFM2's convolution's
        # out_proj bias is in its hook_attn_out, as a whole)
        bias = model.lm_head.weight.new_zeros(model.cfg.hidden_size)
        for block in blocks[:layer]:
            if attends(block.index):
                bias += block.attn.b_O
            if include_mlp_biases and model.cfg.has_mlp(block.index):
                bias += block.mlp.b_out
        if mlp_input and attends(layer):
            bias += blocks[layer].attn.b_O
        return bias

    @property
    def W_U(self) -> torch.Tensor:
        """[d_model, d_vocab]: the unembedding (a view of the live weight, tied or not)."""
        return self._model().lm_head.weight.detach().T

    @property
    def b_U(self) -> torch.Tensor:
        """[d_vocab]: the unembedding's bias (Phi's; zeros where the model has none, as TransformerLens's)."""
        head = self._model().lm_head
        return head.weight.new_zeros(head.weight.shape[0]) if head.bias is None else head.bias.detach()

    @property
    def ln_final(self) -> torch.nn.Module:
        """The final norm, a module (TransformerLens's `model.ln_final(resid)`, a logit lens's first step), with
        HF's numerics: what the model's last layer's stream goes through."""
        return self._model().final_norm

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        """`normed @ W_U + b_U`, TransformerLens's unembedding (Gemma 2's final soft-cap, which the model applies
        after it, is not part of it, as in TransformerLens)."""
        return self._model().lm_head(normed)

    @property
    def W_E(self) -> torch.Tensor:
        """[d_vocab, d_model]: the embedding table as HF holds it (Gemma's hook_embed is a row of it times
        sqrt(d_model), rounded to the model's dtype)."""
        return self._model().embed_tokens.weight.detach()

    @property
    def W_pos(self) -> torch.Tensor:
        """[n_ctx, d_model]: the learned position embedding (GPT-2, GPT-Neo, OPT: from position 0 on)."""
        model = self._model()
        if not model.cfg.learned_positions:
            raise AttributeError(f"W_pos: {model.cfg.architecture} has no learned position embedding (its "
                                 "positions are rotary)")  # fmt: skip
        return model.position_embeddings.detach()

    def tokens_to_residual_directions(self, tokens: Tokens) -> torch.Tensor:
        """TransformerLens's: the unembedding vector of each token, W_U[:, token], the direction the final
        norm's output is dotted with to give its logit: [d_model] for one token (an int, a one-token
        string, a tensor of one element), else [*tokens.shape, d_model]. The final norm's weight is not in
        it (nothing is folded): `cache.logit_attrs` and `apply_ln_to_stack` apply the norm first."""
        return self._residual_directions(tokens, "tokens")

    def _residual_directions(self, tokens: Tokens, field: str) -> torch.Tensor:
        """The rows the final norm's output is dotted with: the unembedding's of token ids, or a classifier's head's
        of class indices (or one class's label): so on a classifier `cache.logit_attrs` gives each component's share
        of a class's logit (a reward model's score, a yes/no reranker's yes less no)."""
        head = self.llm.classifier
        if head is None and self.llm.config.no_token_logits:  # (a base model's: no head, no unembedding)
            raise ValueError(f"{field}: {self.llm.config.no_token_logits}")
        if head is not None and head.hidden is not None:
            raise ValueError(f"{field}: {self.llm.config.classifier_name}'s head is two layers with a ReLU between, "
                             "so its logits are no sum of the components' shares")  # fmt: skip
        if isinstance(tokens, str):
            if head is not None and tokens not in head.labels:
                raise ValueError(f"{field}: {tokens!r} is no class of this classifier; its classes: "
                                 f"{', '.join(head.labels)}")  # fmt: skip
            tokens = head.labels.index(tokens) if head is not None else self.to_single_token(tokens)
        ids = torch.as_tensor(tokens)
        what = "class indices" if head is not None else "token ids"
        count = len(head.labels) if head is not None else self._model().cfg.vocab_size
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{field}: {what} are integers; got a tensor of {ids.dtype}")
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < count):
            raise ValueError(f"{field}: {what} must be in 0..{count - 1} (this model's "
                             f"{'classes' if head is not None else 'vocabulary'}); got "
                             f"{int(ids.min())}..{int(ids.max())}")  # fmt: skip
        rows = head.weight if head is not None else self._model().lm_head.weight.detach()
        return rows[int(ids.reshape(()))] if ids.numel() == 1 else rows[ids.to(rows.device)]
