"""Direct logit attribution over a vlens cache, with TransformerLens's calls: `cache.decompose_resid()`,
`cache.stack_head_results()`, `cache.apply_ln_to_stack(stack)`, `cache.logit_attrs(stack, tokens)`.

The weights are not folded (vlens.hooked_weights), so `apply_ln_to_stack` does what TransformerLens's
does on a folded model: each component is put through the norm with the whole stream's cached scale
(`hook_scale`) *and* the norm's weight (LayerNorm: centred first). TransformerLens only divides by the
scale, which is right only where its `fold_ln` moved the weight into W_U; here the weight is applied, so
that the components, unembedded (`logit_attrs`, with W_U as HF holds it), sum to the model's logit:

    logit[token] = sum of logit_attrs over the components of decompose_resid()
                   (+ the final LayerNorm's bias @ W_U[:, token] on GPT-2 and GPT-NeoX: a constant of the
                   norm, no component's; Gemma: the logit before its final soft-capping, cap·tanh(x/cap))

Per-head results (`hook_result`) are z_h @ W_O[h], without b_O, which belongs to no head: the heads of a
layer plus b_O sum to its hook_attn_out. Where a piece is not defined the call is refused: Gemma's
post-attention norm normalises the heads' summed output before it joins the stream, so no head has a share
of it; GPT-NeoX's parallel residual has no "MLP input = layer input + attn_out".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vlens.hooked_weights import AttentionWeights

if TYPE_CHECKING:
    from vlens.hooked import HookedLM


class Attribution:
    """ActivationCache's attribution methods (mixed in). The cache provides the model, `_tensors` (each hook
    [batch, positions, ...]), `has_batch_dim`, `_cached` (a tensor a method needs, or a KeyError naming it),
    `_stack` (tensors -> [components, batch, positions, d] with `pos_slice` applied) and `_select` /
    `_rows` (`pos_slice` of each text's positions; which rows are a text's)."""

    model: HookedLM
    has_batch_dim: bool
    _tensors: dict[str, torch.Tensor]

    def compute_head_results(self) -> None:
        """TransformerLens's: cache every layer's `blocks.L.attn.hook_result` [batch, positions, n_heads,
        d_model], each head's z times its rows of W_O (no b_O). Needs every layer's attn.hook_z."""
        for layer in range(self.model.cfg.num_layers):
            self._head_results(layer)

    def _head_results(self, layer: int) -> torch.Tensor:
        name = f"blocks.{layer}.attn.hook_result"
        if name not in self._tensors:
            model = self.model._model()
            if model.layers[layer].post_norms:
                raise ValueError(
                    f"{model.cfg.architecture}: per-head results are not defined: its post-attention norm "
                    "(post_attention_layernorm) normalises the heads' summed output before it joins the residual "
                    "stream, so no part of hook_attn_out is one head's; decompose_resid's attn_out per layer is exact"
                )
            z = self._cached(f"blocks.{layer}.attn.hook_z", "per-head results")
            W_O = AttentionWeights.of(model.layers[layer].attn_heads).W_O
            self._tensors[name] = torch.einsum("...hd,hdm->...hm", z, W_O.to(z.device, z.dtype))
        return self._tensors[name]

    def stack_head_results(
        self, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False, pos_slice=None,
        apply_ln: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """Every head's result in the layers below `layer` (-1 / None: all), [layer * n_heads, batch,
        positions, d_model], labelled "L{layer}H{head}"; `incl_remainder` adds the residual entering `layer`
        less their sum (embeddings, MLPs, the b_O biases). `pos_slice` keeps those positions of each text;
        `apply_ln` puts the stack through the norm `layer` reads (apply_ln_to_stack)."""
        layer = self._layer(layer)
        results = [self._head_results(i) for i in range(layer)]
        parts = [r[..., h, :] for r in results for h in range(r.shape[-2])]
        labels = [f"L{i}H{h}" for i, r in enumerate(results) for h in range(r.shape[-2])]
        if incl_remainder:
            total = self._cached(self._resid_entering(layer), "stack_head_results's remainder")
            parts.append(total - sum((r.sum(-2) for r in results), torch.zeros_like(total)))
            labels.append("remainder")
        stack = self._stack(parts, pos_slice)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self, layer: int | None = None, mlp_input: bool = False, mode: str = "all", apply_ln: bool = False,
        pos_slice=None, incl_embeds: bool = True, return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:  # fmt: skip
        """The residual stream entering `layer` (None / -1: the final norm's input) as the sum of what wrote
        it: [components, batch, positions, d_model], labelled "embed", "pos_embed" (GPT-2), "{L}_attn_out",
        "{L}_mlp_out" (each with its biases). `mlp_input`: the stream entering layer `layer`'s MLP, so
        that layer's attn_out too; `mode` "attn" / "mlp" keeps only those outputs; `apply_ln` puts the stack
        through the norm it enters (apply_ln_to_stack)."""
        kinds = {"all": ("attn_out", "mlp_out"), "attn": ("attn_out",), "mlp": ("mlp_out",)}.get(mode)
        if kinds is None:
            raise ValueError(f"mode: {mode!r} is not one of all, attn, mlp")
        layer = self._layer(layer)
        cfg = self.model.cfg
        self._check_mlp_input(layer, mlp_input)
        if mlp_input and cfg.parallel_residual:
            raise ValueError(
                f"mlp_input: {cfg.architecture} with use_parallel_residual runs attention and MLP side by side: "
                f"layer {layer}'s MLP reads the layer's input (decompose_resid with mlp_input=False), not it "
                "plus the layer's attn_out"
            )
        names, labels = [], []
        if incl_embeds:
            names.append("hook_embed")
            labels.append("embed")
            if cfg.learned_positions:
                names.append("hook_pos_embed")
                labels.append("pos_embed")
        for i in range(layer):
            names += [f"blocks.{i}.hook_{kind}" for kind in kinds]
            labels += [f"{i}_{kind}" for kind in kinds]
        if mlp_input and mode != "mlp":
            names.append(f"blocks.{layer}.hook_attn_out")
            labels.append(f"{layer}_attn_out")
        stack = self._stack([self._cached(name, "decompose_resid") for name in names], pos_slice)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(
        self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False, pos_slice=None,
        recompute_ln: bool = False,
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
        layer = self._layer(layer)
        self._check_mlp_input(layer, mlp_input)
        model, n = self.model.llm.model, self.model.cfg.num_layers
        if layer == n:
            norm, hook = model.final_norm, "ln_final.hook_scale"
        else:
            ln = "ln2" if mlp_input else "ln1"
            norm, hook = getattr(model.layers[layer], ln), f"blocks.{layer}.{ln}.hook_scale"
        weight = norm.weight
        x = residual_stack.to(weight.device, weight.dtype)
        with torch.no_grad():
            if recompute_ln and layer == n:
                rows = self._rows(pos_slice)
                out = norm(x) * (rows if self.has_batch_dim else rows[0])[..., None].to(x.device)
            else:
                scale = self._select(self._cached(hook, "apply_ln_to_stack"), pos_slice)
                scale = (scale if self.has_batch_dim else scale[0]).to(weight.device, weight.dtype)
                out = norm.apply_scale(x, scale.masked_fill(scale == 0, 1))  # past a text's end: 0 / 1, not 0 / 0
        return out.to(residual_stack.device, residual_stack.dtype)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None) -> torch.Tensor:
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

    def _layer(self, layer: int | None) -> int:
        """TransformerLens's layer argument: 0..n_layers, with n_layers, -1 and None the final norm's input."""
        n = self.model.cfg.num_layers
        if layer is None or layer == -1:
            return n
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
            raise ValueError(f"layer: {layer!r} is not in 0..{n} (n_layers, -1 or None: the input of the final norm)")
        return layer

    def _check_mlp_input(self, layer: int, mlp_input: bool) -> None:
        n = self.model.cfg.num_layers
        if mlp_input and layer == n:
            raise ValueError(f"mlp_input: layer {n} (-1, None) is the final norm's input, which no MLP reads; "
                             f"mlp_input=True goes with a layer in 0..{n - 1}")  # fmt: skip

    def _resid_entering(self, layer: int) -> str:
        n = self.model.cfg.num_layers
        return f"blocks.{layer}.hook_resid_pre" if layer < n else f"blocks.{n - 1}.hook_resid_post"
