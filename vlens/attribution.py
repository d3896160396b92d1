"""Direct logit attribution over a vlens cache, with TransformerLens's calls: `cache.decompose_resid()`,
`cache.stack_head_results()`, `cache.stack_neuron_results()`, `cache.get_full_resid_decomposition()`,
`cache.apply_ln_to_stack(stack)`, `cache.logit_attrs(stack, tokens)`.

The weights are not folded (vlens.hooked_weights), so `apply_ln_to_stack` does what TransformerLens's
does on a folded model: each component is put through the norm with the whole stream's cached scale
(`hook_scale`) *and* the norm's weight (LayerNorm: centred first). TransformerLens only divides by the
scale, which is right only where its `fold_ln` moved the weight into W_U; here the weight is applied, so
that the components, unembedded (`logit_attrs`, with W_U as HF holds it), sum to the model's logit:

    logit[token] = sum of logit_attrs over the components of decompose_resid()
                   (+ the final LayerNorm's bias @ W_U[:, token] on GPT-2, GPT-NeoX and Phi: a constant of the
                   norm, no component's, and Phi's b_U[token]; Gemma: the logit before its final soft-capping,
                   cap·tanh(x/cap))

Per-head results (`hook_result`) are z_h @ W_O[h], without b_O, which belongs to no head: the heads of a
layer plus b_O sum to its hook_attn_out. Per-neuron results are hook_post_n * W_out[n], without b_out: a
layer's neurons plus b_out sum to its hook_mlp_out. (Granite scales each sublayer's output, biases included, by its
residual_multiplier: its heads' and neurons' results are scaled too.) Where a piece is not defined the call is refused:
Gemma's post-attention and post-feedforward norms normalise the heads' and the neurons' summed outputs
before they join the stream, so no head or neuron has a share of them; routed experts (MoE) have no one
W_out; GPT-NeoX's parallel residual has no "MLP input = layer input + attn_out".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vlens.hooked_weights import (
    MLPWeights,
    ModelWeights,
    Tokens,
    attention_weights,
    check_mlp_input,
    mixer_of,
    resolve_layer,
)

if TYPE_CHECKING:
    from vlens.models.base import DecoderLM

# TransformerLens's pos_slice and neuron_slice: an index, a slice or a list of indices (None: all)
Slice = int | slice | Sequence[int] | None

# What a norm between a sublayer and the residual add (Gemma) leaves undefined: each part's share of the output
POST_NORMS = {
    "attn": ("per-head results", "post-attention norm (post_attention_layernorm)", "heads' summed output", "head"),
    "mlp": ("per-neuron results", "post-feedforward norm (post_feedforward_layernorm)", "MLP's output", "neuron"),
}


class Attribution:
    """ActivationCache's attribution methods (mixed in). The cache provides the model, `_tensors` (each hook
    [batch, positions, ...]), `has_batch_dim`, `_cached` (a tensor a method needs, or a KeyError naming it),
    `_stack` (tensors -> [components, batch, positions, d] with `pos_slice` applied) and `_select` /
    `_rows` (`pos_slice` of each text's positions; which rows are a text's)."""

    model: ModelWeights  # the HookedLM
    has_batch_dim: bool
    _tensors: dict[str, torch.Tensor]

    def compute_head_results(self) -> None:
        """TransformerLens's: cache every layer's `blocks.L.attn.hook_result` [batch, positions, n_heads,
        d_model], each head's z times its rows of W_O (no b_O). Needs every layer's attn.hook_z."""
        for layer in range(self.model.cfg.num_layers):
            self._head_results(layer)

    def _head_results(self, layer: int) -> torch.Tensor:
        """A linear-attention layer's (Qwen 3.5's) heads are its value heads: its hook_z through out_proj's columns, as
        a Mamba 2 mixer's are its heads; a short convolution (LFM2's), Mamba's mixer (channels, not heads) and a layer
        that is an MLP alone (Nemotron-H's) have none; Falcon-H1's layers have the attention heads, then the Mamba 2
        mixer's, each times its output multiplier."""
        cfg = self.model.cfg
        part = "attn" if cfg.attends(layer) else mixer_of(cfg, layer)[1]
        name = f"blocks.{layer}.{part}.hook_result"
        if name not in self._tensors:
            if part in ("conv", "mlp") or (part == "mamba" and cfg.ssm_dt_rank):  # (no heads: [..., 0, d_model])
                x = self._cached(f"blocks.{layer}.hook_resid_pre", "per-head results")
                self._tensors[name] = x.new_zeros(*x.shape[:-1], 0, cfg.hidden_size)
            elif cfg.parallel_mixers:
                _, attn_out, _, ssm_out = cfg.mixer_multipliers
                parts = [self._heads(layer, "attn") * attn_out, self._heads(layer, "mamba") * ssm_out]
                self._tensors[name] = torch.cat(parts, dim=-2)
            else:
                self._tensors[name] = self._heads(layer, part)
        return self._tensors[name]

    def _heads(self, layer: int, part: str) -> torch.Tensor:
        """Each head's hook_z of layer `layer`'s `part` (attn, mamba or linear_attn) through its columns of the output
        projection, times the model's residual multiplier (Granite's): [..., heads, d_model]."""
        model, cfg = self._shares_of(layer, "attn"), self.model.cfg
        z = self._cached(f"blocks.{layer}.{part}.hook_z", "per-head results")
        if part == "attn":
            W_O = attention_weights(model.layers[layer].attn_heads).W_O
        elif part == "mamba":  # (its hook_z [..., heads * head dim])
            block = model.layers[layer]
            mixer = block.mamba if cfg.parallel_mixers else block._modules[block.mixer_name]
            W_O = mixer.out_proj.weight.detach().T.reshape(mixer.heads, mixer.head_dim, -1)
            z = z.unflatten(-1, (mixer.heads, mixer.head_dim))
        else:
            net = model.layers[layer].linear_attn
            W_O = net.out_proj.weight.detach().T.reshape(net.value_heads, net.value_dim, -1)
        W_O = W_O * cfg.residual_multiplier  # (Granite's scale of what the stream gets)
        return torch.einsum("...hd,hdm->...hm", z, W_O.to(z.device, z.dtype))

    def stack_head_results(
        self, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False,
        pos_slice: Slice = None, apply_ln: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """Every head's result in the layers below `layer` (-1 / None: all), [layer * n_heads, batch,
        positions, d_model], labelled "L{layer}H{head}"; `incl_remainder` adds the residual entering `layer`
        less their sum (embeddings, MLPs, the b_O biases). `pos_slice` keeps those positions of each text;
        `apply_ln` puts the stack through the norm `layer` reads (apply_ln_to_stack)."""
        layer = resolve_layer(layer, self.model.cfg.num_layers)
        results = [self._head_results(i) for i in range(layer)]
        parts = [r[..., h, :] for r in results for h in range(r.shape[-2])]
        labels = [f"L{i}H{h}" for i, r in enumerate(results) for h in range(r.shape[-2])]
        return self._finish(
            self._stack(parts, pos_slice), labels, layer, pos_slice, incl_remainder, apply_ln, return_labels
        )

    def stack_neuron_results(
        self, layer: int | None, pos_slice: Slice = None, neuron_slice: Slice = None,
        return_labels: bool = False, incl_remainder: bool = False, apply_ln: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """Every neuron's result in the MLPs below `layer` (-1 / None: all), hook_post_n * W_out[n],
        [layer * d_mlp, batch, positions, d_model], labelled "L{layer}N{neuron}": large, as in TransformerLens
        (take one position with `pos_slice`, some neurons with `neuron_slice`: an int, slice or list of them).
        `incl_remainder` adds the residual entering `layer` less their sum; `apply_ln` puts the stack through
        the norm `layer` reads (apply_ln_to_stack)."""
        layer = resolve_layer(layer, self.model.cfg.num_layers)
        neurons = self._neurons(neuron_slice)
        names = [f"blocks.{i}.mlp.hook_post" for i in range(layer)]
        scale = self.model.cfg.residual_multiplier * self.model.cfg.mlp_multipliers[1]  # (Granite's, Falcon-H1's)
        W_out = [MLPWeights.of(self._shares_of(i, "mlp"), i).W_out[neurons] * scale for i in range(layer)]
        posts = self._stack([self._cached(name, "per-neuron results")[..., neurons] for name in names], pos_slice)
        parts = [(post[..., None] * w.to(post.device, post.dtype)).movedim(-2, 0) for post, w in zip(posts, W_out)]
        stack = torch.cat(parts) if parts else posts  # no layer below `layer`: _stack's [0, ..., d_model]
        labels = [f"L{i}N{n}" for i in range(layer) for n in neurons.tolist()]
        return self._finish(stack, labels, layer, pos_slice, incl_remainder, apply_ln, return_labels)

    def get_neuron_results(
        self, layer: int, neuron_slice: Slice = None, pos_slice: Slice = None,
        project_output_onto: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """TransformerLens's: each neuron's result in layer `layer`'s MLP, hook_post_n * W_out[n], [batch,
        positions, neurons, d_model] (not cached: large, and cheap to make again); `project_output_onto`
        ([d_model], or [d_model, k]) contracts W_out with it first, so the d_model-wide product is never made
        ([batch, positions, neurons], or [..., k])."""
        n_layers = self.model.cfg.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not -n_layers <= layer < n_layers:
            raise ValueError(f"layer: {layer!r} is not a layer of this model (0 .. {n_layers - 1}, or negative)")
        layer %= n_layers
        neurons = self._neurons(neuron_slice)
        post = self._select(self._cached(f"blocks.{layer}.mlp.hook_post", "per-neuron results")[..., neurons], pos_slice)
        W_out = MLPWeights.of(self._shares_of(layer, "mlp"), layer).W_out[neurons].to(post.device, post.dtype)
        W_out = W_out * self.model.cfg.residual_multiplier * self.model.cfg.mlp_multipliers[1]
        if project_output_onto is not None:
            W_out = W_out @ project_output_onto.to(post.device, post.dtype)
        result = post * W_out if W_out.dim() == 1 else post[..., None] * W_out
        return result if self.has_batch_dim else result[0]

    def _neurons(self, neuron_slice: Slice) -> torch.Tensor:
        """TransformerLens's neuron_slice (None: all) as the neurons' indices."""
        d_mlp = self.model.cfg.intermediate_size
        try:
            return torch.arange(d_mlp)[slice(None) if neuron_slice is None else neuron_slice].reshape(-1)
        except (IndexError, TypeError, ValueError):
            raise ValueError(f"neuron_slice: {neuron_slice!r} is not an int, slice or list of ints in 0..{d_mlp - 1} "
                             "(None: every neuron)") from None  # fmt: skip

    def get_full_resid_decomposition(
        self, layer: int | None = None, mlp_input: bool = False, expand_neurons: bool = True, apply_ln: bool = False,
        pos_slice: Slice = None, return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """TransformerLens's: the residual stream entering `layer` (None / -1: the final norm's input;
        `mlp_input`: layer `layer`'s MLP, so its heads too) as every head's result ("L{l}H{h}"), every neuron's
        ("L{l}N{n}"; `expand_neurons=False`: each MLP's output, "{l}_mlp_out", its b_out in it), "embed",
        "pos_embed" (GPT-2) and "bias" (model.accumulated_bias; zero past each text's end), in that order, which
        sum to the stream. `apply_ln` puts the stack through the norm it enters (apply_ln_to_stack)."""
        layer = resolve_layer(layer, self.model.cfg.num_layers)
        check_mlp_input(self.model.cfg, layer, mlp_input)
        heads, labels = self.stack_head_results(layer + mlp_input, pos_slice=pos_slice, return_labels=True)
        if expand_neurons:
            mlps, mlp_labels = self.stack_neuron_results(layer, pos_slice=pos_slice, return_labels=True)
        else:
            mlps, mlp_labels = self.decompose_resid(layer, mlp_input, "mlp", pos_slice=pos_slice, incl_embeds=False,
                                                    return_labels=True)  # fmt: skip
        embeds, embed_labels = self.decompose_resid(0, pos_slice=pos_slice, return_labels=True)
        bias = self.model.accumulated_bias(layer, mlp_input, include_mlp_biases=expand_neurons)
        rows = self._rows(None)[..., None].to(embeds.device, embeds.dtype)
        stack = torch.cat([heads, mlps, embeds, self._stack([rows * bias.to(rows.device, rows.dtype)], pos_slice)])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        labels = labels + mlp_labels + embed_labels + ["bias"]
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self, layer: int | None = None, mlp_input: bool = False, mode: str = "all", apply_ln: bool = False,
        pos_slice: Slice = None, incl_embeds: bool = True, return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """The residual stream entering `layer` (None / -1: the final norm's input) as the sum of what wrote
        it: [components, batch, positions, d_model], labelled "embed", "pos_embed" (GPT-2), "{L}_attn_out",
        "{L}_mlp_out" (each with its biases). `mlp_input`: the stream entering layer `layer`'s MLP, so
        that layer's attn_out too; `mode` "attn" / "mlp" keeps only those outputs; `apply_ln` puts the stack
        through the norm it enters (apply_ln_to_stack)."""
        kinds = {"all": ("attn_out", "mlp_out"), "attn": ("attn_out",), "mlp": ("mlp_out",)}.get(mode)
        if kinds is None:
            raise ValueError(f"mode: {mode!r} is not one of all, attn, mlp")
        cfg = self.model.cfg
        if mode == "mlp" and not any(map(cfg.has_mlp, range(cfg.num_layers))):
            raise ValueError(f"mode: 'mlp': {cfg.architecture}'s layers have no MLP (a Mamba mixer alone); mode "
                             "'all' or 'attn' gives each layer's mixer output, '{L}_attn_out'")  # fmt: skip
        layer = resolve_layer(layer, cfg.num_layers)
        check_mlp_input(cfg, layer, mlp_input)
        if any(getattr(block, "layer_scalar", None) is not None for block in self.model.llm.model.layers[:layer]):
            raise ValueError(f"{cfg.architecture}: each layer multiplies the stream by a learned scalar "
                             "(layer_scalar), so the stream is not the sum of the layers' outputs; accumulated_resid "
                             "is exact")  # fmt: skip
        names, labels = [], []
        if incl_embeds:
            names.append("hook_embed")
            labels.append("embed")
            if cfg.learned_positions:
                names.append("hook_pos_embed")
                labels.append("pos_embed")
        for i in range(layer):  # (a layer that is one part alone, Mamba's or Nemotron-H's, adds that part's output)
            mine = [kind for kind in kinds if cfg.part_at(i) in ("both", "mlp" if kind == "mlp_out" else "mixer")]
            names += [f"blocks.{i}.hook_{kind}" for kind in mine]
            labels += [f"{i}_{kind}" for kind in mine]
        if mlp_input and mode != "mlp":
            names.append(f"blocks.{layer}.hook_attn_out")
            labels.append(f"{layer}_attn_out")
        stack = self._stack([self._cached(name, "decompose_resid") for name in names], pos_slice)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(
        self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
        pos_slice: Slice = None, recompute_ln: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Each component of a stack of the residual stream entering `layer` (None / -1: the final norm;
        `mlp_input`: that layer's pre-MLP norm, else its pre-attention norm) as it reaches the norm's
        output: divided by the whole stream's cached scale (`hook_scale`, so the cache needs it; LayerNorm
        centres each component first) and times the norm's weight, with no bias. The components then sum
        to the norm's output less its bias (TransformerLens divides by the scale only, right where its
        fold_ln has moved the weight into the next matrix; vlens folds nothing). `pos_slice`: the positions
        the stack holds (applied to the scale only, as in TransformerLens). `recompute_ln` (final norm only):
        the model's own final norm on each component, its scale computed from the component (logit lens).
        Rows past a text's end stay zero."""
        model, n = self.model.llm.model, self.model.cfg.num_layers
        layer = resolve_layer(layer, n)
        check_mlp_input(self.model.cfg, layer, mlp_input, as_sum=False)  # a pre-MLP norm reads some stream
        if recompute_ln and layer != n:
            raise ValueError(
                f"recompute_ln: True goes with the final norm (layer None, -1 or {n}), the one a logit lens reads; "
                f"layer {layer}'s norms take the cached scale (recompute_ln=False)"
            )
        if layer == n:
            norm, hook = model.final_norm, "ln_final.hook_scale"
        elif not model.cfg.pre_norms_at(layer):  # (OLMo 2: the layer's attention and MLP read the stream itself)
            return residual_stack
        else:
            ln = "ln2" if mlp_input or model.cfg.part_at(layer) == "mlp" else "ln1"  # (Nemotron-H: an MLP alone)
            norm, hook = getattr(model.layers[layer], ln), f"blocks.{layer}.{ln}.hook_scale"
        weight = model.lm_head.weight  # (the model's device and dtype)
        x = residual_stack.to(weight.device, weight.dtype)
        with torch.no_grad():
            if recompute_ln:
                rows = self._rows(pos_slice)
                out = norm(x) * (rows if self.has_batch_dim else rows[0])[..., None].to(x.device)
            else:
                scale = self._select(self._cached(hook, "apply_ln_to_stack"), pos_slice)
                scale = (scale if self.has_batch_dim else scale[0]).to(weight.device, weight.dtype)
                out = norm.apply_scale(x, scale.masked_fill(scale == 0, 1))  # past a text's end: 0 / 1, not 0 / 0
        return out.to(residual_stack.device, residual_stack.dtype)

    def logit_attrs(
        self, residual_stack: torch.Tensor, tokens: Tokens, incorrect_tokens: Tokens | None = None,
        pos_slice: Slice = None,
    ) -> torch.Tensor:  # fmt: skip
        """Each component's direct contribution to the logit of `tokens` (minus that of `incorrect_tokens`
        where given: a logit difference): apply_ln_to_stack(stack) dotted with W_U[:, token],
        [components, *batch_and_positions]. tokens: an int, a one-token string, or a tensor broadcasting
        against the stack's batch and position dimensions (e.g. [batch] for a stack at one position each).
        Summed over decompose_resid()'s components this is the logit itself (see the module doc for the
        LayerNorm bias and Gemma's soft-cap)."""
        directions = self.model._residual_directions(tokens, "tokens")
        if incorrect_tokens is not None:
            incorrect = self.model._residual_directions(incorrect_tokens, "incorrect_tokens")
            if incorrect.shape != directions.shape:
                raise ValueError(f"incorrect_tokens: shape {tuple(incorrect.shape[:-1])} differs from tokens' "
                                 f"{tuple(directions.shape[:-1])}")  # fmt: skip
            directions = directions - incorrect
        scaled = self.apply_ln_to_stack(residual_stack, pos_slice=pos_slice)
        return (scaled * directions.to(scaled.device, scaled.dtype)).sum(-1)

    # -- shared -----------------------------------------------------------------------------------------

    def _shares_of(self, layer: int, kind: str) -> DecoderLM:
        """The model, where layer `layer`'s attention ("attn") or MLP ("mlp") output is the sum of its heads' or
        neurons' shares, which a norm between it and the residual add (Gemma) makes it not."""
        model = self.model._model()
        if model.cfg.post_norms_at(layer):
            what, norm, summed, one = POST_NORMS[kind]
            raise ValueError(
                f"{model.cfg.architecture}: {what} are not defined: its {norm} normalises the {summed} before it "
                f"joins the residual stream, so no part of hook_{kind}_out is one {one}'s; decompose_resid's "
                f"{kind}_out per layer is exact"
            )
        return model

    def _finish(
        self, stack: torch.Tensor, labels: list[str], layer: int, pos_slice, incl_remainder: bool, apply_ln: bool,
        return_labels: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """What the stacks of heads and of neurons share: the remainder (the residual entering `layer` less the
        stack's sum), the norm `layer` reads, the labels."""
        if incl_remainder:
            total = self._stack(
                [self._cached(self._resid_entering(layer), "the remainder (incl_remainder)")], pos_slice
            )
            stack = torch.cat([stack, total - stack.sum(0)])
            labels = labels + ["remainder"]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def _resid_entering(self, layer: int) -> str:
        n = self.model.cfg.num_layers
        return f"blocks.{layer}.hook_resid_pre" if layer < n else f"blocks.{n - 1}.hook_resid_post"
