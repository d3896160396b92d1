"""TransformerLens's weight attributes over a vlens model (`model.W_U`, `model.W_O`, `model.blocks[L].attn.W_Q`,
`model.tokens_to_residual_directions(...)`), for direct logit attribution and circuit notebooks.

The weights are HF's as the checkpoint holds them: no LayerNorm folding, no weight centring, which is what
TransformerLens's `from_pretrained_no_processing` gives (its `from_pretrained` folds each norm's weight into
the matrices after it and centres them). So `resid @ W_U` is not a logit: the final norm (its scale *and* its
weight) comes first, as `cache.apply_ln_to_stack` applies it (vlens.attribution).

Shapes are TransformerLens's: W_Q [n_layers, n_heads, d_model, d_head]; W_K and W_V the same, each key/value
head repeated for the query heads that share it (grouped-query attention), as TransformerLens's W_K / W_V
properties give them (`blocks[L].attn._W_K` / `_W_V` are the [n_key_value_heads, d_model, d_head] weights
themselves); W_O [n_layers, n_heads, d_head, d_model]; b_Q / b_K / b_V [n_layers, n_heads, d_head]; b_O
[n_layers, d_model]; W_U [d_model, d_vocab]; W_E [d_vocab, d_model]; W_pos [n_ctx, d_model]. A bias the
model does not have is zeros, as in TransformerLens. Treat them as read-only: some are views of the live
weights, others copies (TransformerLens's are its parameters), so an in-place edit may or may not reach the
model; edit `model.llm.model`'s modules instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlens.models.base import AttentionHeads, DecoderLM

if TYPE_CHECKING:
    from vlens.llm import LLM


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

    @classmethod
    def of(cls, heads: AttentionHeads) -> AttentionWeights:
        """Read from a layer's attention module: its fused q/k/v projection cut into heads, its output
        projection's columns per head."""
        d_head, qkv, out = heads.head_dim, heads.qkv, heads.out
        d_model = qkv.in_features
        counts = (heads.heads, heads.kv_heads, heads.kv_heads)
        weights = qkv.weight.detach().split(list(qkv.parts.values()))
        W_Q, W_K, W_V = (w.reshape(n, d_head, d_model).transpose(1, 2) for w, n in zip(weights, counts))
        if qkv.bias is None:
            b_Q, b_K, b_V = (qkv.weight.new_zeros(n, d_head) for n in counts)
        else:
            biases = qkv.bias.detach().split(list(qkv.parts.values()))
            b_Q, b_K, b_V = (b.reshape(n, d_head) for b, n in zip(biases, counts))
        W_O = out.weight.detach().T.reshape(heads.heads, d_head, -1)
        b_O = out.weight.new_zeros(out.out_features) if out.bias is None else out.bias.detach()
        return cls(W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O)

    @property
    def _repeats(self) -> int:
        return self.W_Q.shape[0] // self._W_K.shape[0]

    W_K = property(lambda self: self._W_K.repeat_interleave(self._repeats, 0))
    W_V = property(lambda self: self._W_V.repeat_interleave(self._repeats, 0))
    b_K = property(lambda self: self._b_K.repeat_interleave(self._repeats, 0))
    b_V = property(lambda self: self._b_V.repeat_interleave(self._repeats, 0))


@dataclass(frozen=True)
class Block:
    """What `model.blocks[L]` offers: its attention weights (`.attn`)."""

    attn: AttentionWeights


class ModelWeights:
    """TransformerLens's weight attributes, mixed into HookedLM (which holds the vlens model as `self.llm`)."""

    llm: LLM

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
        """`model.blocks[L].attn.W_O` and the rest, per layer (read afresh from the live weights)."""
        return [Block(AttentionWeights.of(layer.attn_heads)) for layer in self._model().layers]

    def _stacked(self, name: str) -> torch.Tensor:
        return torch.stack([getattr(block.attn, name) for block in self.blocks])

    W_Q = property(lambda self: self._stacked("W_Q"))
    W_K = property(lambda self: self._stacked("W_K"))
    W_V = property(lambda self: self._stacked("W_V"))
    W_O = property(lambda self: self._stacked("W_O"))
    b_Q = property(lambda self: self._stacked("b_Q"))
    b_K = property(lambda self: self._stacked("b_K"))
    b_V = property(lambda self: self._stacked("b_V"))
    b_O = property(lambda self: self._stacked("b_O"))

    @property
    def W_U(self) -> torch.Tensor:
        """[d_model, d_vocab]: the unembedding (a view of the live weight, tied or not)."""
        return self._model().lm_head.weight.detach().T

    @property
    def b_U(self) -> torch.Tensor:
        """[d_vocab] zeros: no supported model has an unembedding bias (TransformerLens's, unfolded)."""
        weight = self._model().lm_head.weight
        return weight.new_zeros(weight.shape[0])

    @property
    def W_E(self) -> torch.Tensor:
        """[d_vocab, d_model]: the embedding table as HF holds it (Gemma's hook_embed is a row of it times
        sqrt(d_model), rounded to the model's dtype)."""
        return self._model().embed_tokens.weight.detach()

    @property
    def W_pos(self) -> torch.Tensor:
        """[n_ctx, d_model]: the learned position embedding (GPT-2)."""
        model = self._model()
        if not model.cfg.learned_positions:
            raise AttributeError(f"W_pos: {model.cfg.architecture} has no learned position embedding (its "
                                 "positions are rotary)")  # fmt: skip
        return model.transformer.wpe.weight.detach()

    def tokens_to_residual_directions(self, tokens) -> torch.Tensor:
        """TransformerLens's: the unembedding vector of each token, W_U[:, token], the direction the final
        norm's output is dotted with to give its logit: [d_model] for one token (an int, a one-token
        string, a tensor of one element), else [*tokens.shape, d_model]. The final norm's weight is not in
        it (nothing is folded): `cache.logit_attrs` and `apply_ln_to_stack` apply the norm first."""
        return self._residual_directions(tokens, "tokens")

    def _residual_directions(self, tokens, field: str) -> torch.Tensor:
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        ids = torch.as_tensor(tokens)
        vocab = self._model().cfg.vocab_size
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{field}: token ids are integers; got a tensor of {ids.dtype}")
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise ValueError(f"{field}: token ids must be in 0..{vocab - 1} (this model's vocabulary); got "
                             f"{int(ids.min())}..{int(ids.max())}")  # fmt: skip
        rows = self._model().lm_head.weight.detach()
        return rows[int(ids.reshape(()))] if ids.numel() == 1 else rows[ids.to(rows.device)]
