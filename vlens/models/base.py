"""What every model family shares: the engine's contract (`DecoderLM`) and the per-head half of
attention (`AttentionHeads`).

The engine, trace and harvest see only this: `model(input_ids, num_layers=None)` returns the residual
stream of a packed batch laid out by vlens.context, `model.logits(hidden)` the logits, `model.cfg` the
description and `model.lm_head.weight` the device and dtype. A family supplies its modules (named as
in its HF checkpoints) and its embedding; the layer loop, early stop, final norm, soft-capped
unembedding and the taps around them live here once.
"""

from __future__ import annotations

from dataclasses import astuple

import torch
import torch.nn.functional as F
from torch import nn

from vlens.capture.names import LOGITS, post_norm_names
from vlens.config import ModelConfig
from vlens.context import ForwardContext, get_context, tap, tap_widened, tapped
from vlens.distributed.parallel import all_reduce
from vlens.layers import fused
from vlens.layers.attention import Alibi, Attention
from vlens.layers.norm import NormHooks, ProjectionNorm, UnscaledRMSNorm, make_norm
from vlens.layers.rotary import Rotary

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # rope kind -> (cos, sin), from Rotary.cos_sin
FINAL_NORM_HOOKS = NormHooks.at("ln_final")


class AttentionHeads(nn.Module):
    """Projections are the family's (and named as its checkpoints name them); the forward is the same in
    every family: q, k, v from one fused projection, q/k norm where the model has one (OLMo's over the whole
    projection, then a clamp where it clips; Qwen3's and Gemma 3's head by head, after the split into heads),
    rotary, taps, the attention backend, the output projection. Subclasses build the projections and name
    them `qkv` (a FusedLinear of parts q, k, v) and `out` (the output projection), whatever the checkpoint
    calls them, so that the forward and weight views (vlens.hooked_weights) read every family alike."""

    qkv: nn.Module
    out: nn.Module
    head_norms = ("q_norm", "k_norm")  # the checkpoint's names of the norms of each head's q and k (LFM2's differ)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        # this rank's heads (all of them in one process; vlens.distributed.parallel), of this layer's size
        kv_heads = cfg.kv_heads_at(layer)
        self.heads, self.kv_heads = len(cfg.parallel.units(cfg.num_heads)), len(cfg.parallel.units(kv_heads))
        self.head_dim = cfg.head_dim_at(layer)
        self.value_dim = cfg.v_head_dim or self.head_dim  # (DeepSeek's values are of their own size)
        scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5
        if cfg.attn_scale_inverse_layer:
            scale /= layer + 1
        window = cfg.sliding_windows[layer]
        p = f"blocks.{layer}.attn."
        patterns = (p + "hook_attn_scores", p + "hook_pattern")
        rank_heads = cfg.parallel.units(cfg.num_heads) if cfg.parallel.size > 1 else None
        # Gemma 4 E2B/E4B: its last layers attend to an earlier layer's keys and values (and have no k, v or their
        # norms), which that layer leaves in the forward's context for them
        self.layer, self.kv_layer = layer, cfg.kv_layer_at(layer)
        self.own_kv = self.kv_layer == layer
        cached_heads, key_dim, value_dim = self.cached_kv(cfg)
        self.attn = Attention(
            self.heads, cached_heads, key_dim, window, scale, cfg.attn_softcap, patterns, cfg.attn_sinks, rank_heads,
            None if self.own_kv else self.kv_layer, Alibi(cfg.num_heads, cfg.alibi) if cfg.alibi else None, value_dim,
            cfg.attention_chunks[layer] if cfg.attention_chunks else None,
        )
        self.qk_norm, self.clip, self.rope_float32 = cfg.qk_norm, cfg.clip_qkv, cfg.rope_float32 or cfg.rotate_float32
        self.rotary_pairs, self.temperature, self.query_scale = cfg.rotary_pairs, cfg.attn_temperature, cfg.query_scale
        self.key_scale = cfg.key_multiplier  # (Falcon-H1's µP: the keys as projected, before rotary)
        # Gemma 4's full layers: one projection gives the keys and, before the key norm, the values
        self.keys_are_values = bool(cfg.keys_are_values) and cfg.keys_are_values[layer] and self.own_kv
        self.kv_shared = any(cfg.kv_layer_at(i) == layer for i in range(layer + 1, cfg.num_layers))
        nope = bool(cfg.nope_layers) and cfg.nope_layers[layer]  # (SmolLM3's layers without positions)
        self.rope_kind = Rotary.kind(cfg, layer) if cfg.rotary_dim and not nope else None
        if cfg.qk_norm in ("head", "head_after_rotary"):
            setattr(self, self.head_norms[0], make_norm(cfg, self.head_dim))
            if self.own_kv:
                setattr(self, self.head_norms[1], make_norm(cfg, self.head_dim))
        elif cfg.qk_norm == "projection":
            self.q_norm, self.k_norm = ProjectionNorm(cfg, cfg.num_heads), ProjectionNorm(cfg, cfg.num_kv_heads)
        elif cfg.qk_norm == "l2_after_rotary" and self.rope_kind is not None:  # (Llama 4: its layers that rotate)
            self.q_norm, self.k_norm = UnscaledRMSNorm(cfg.norm_eps), UnscaledRMSNorm(cfg.norm_eps)
        self.norm_after_rotary = cfg.qk_norm == "head_after_rotary" or hasattr(self, "q_norm") and cfg.qk_norm == \
            "l2_after_rotary"  # fmt: skip
        # (Llama 4's layers without rotary: q times a temperature that grows with the position)
        self.nope_temperature = cfg.nope_temperature if nope else None
        self.v_norm = UnscaledRMSNorm(cfg.norm_eps) if cfg.v_norm and self.own_kv else None
        self.hook_q, self.hook_k, self.hook_v, self.hook_z = p + "hook_q", p + "hook_k", p + "hook_v", p + "hook_z"
        self.hook_result, self.hook_gate = p + "hook_result", p + "hook_gate"
        self.output_gate = cfg.attn_output_gate

    def cached_kv(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """(heads, key size, value size) of what a token leaves in the KV cache: its keys and values as the heads
        read them (DeepSeek's latent cache: its latent instead)."""
        return self.kv_heads, self.head_dim, self.value_dim

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope) -> torch.Tensor:
        """`x`: the normalised layer input [T, d] all three projections read, or (ResidualBlock.attention_input)
        one input each for q, k and v, that input [T, d] or one per head [T, heads, d]."""
        return self.output(self.attend(*self.project(x, rope), rope))

    def project(
        self, x: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(q [T, H*d], k and v [T, H_kv*d] or None, the output gate [T, H, d] or None), as projected: `attend` puts
        q and k through their norms and rotary (DeepSeek's latent attention rotates their parts itself)."""
        if isinstance(x, torch.Tensor):
            q, *kv = self.qkv.split(self.qkv(x))
        else:  # (where keys are values, the values are the key projection of the values' own input)
            parts = [*self.qkv.parts, *([list(self.qkv.parts)[1]] if self.keys_are_values else [])]
            q, *kv = map(self._project, parts, x)
        gate = None
        if self.output_gate:  # (Qwen 3.5: each head's rows of q_proj give its query, then its gate)
            q, gate = q.view(-1, self.heads, 2, self.head_dim).unbind(2)
            q = q.reshape(-1, self.heads * self.head_dim)
        # (none where the layer reads another's; the keys themselves where they are the values)
        k = kv[0] if kv else None
        return q, k, kv[1] if len(kv) > 1 else k, gate

    def output(self, z: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' outputs z [T, H*d_v], through each head's result where a tap asks."""
        if not tapped(self.hook_result):
            return self.out(z)
        # TransformerLens's attn.hook_result: each head's z times its columns of W_O, before the heads are summed
        w = self.out.weight.view(-1, self.heads, self.value_dim)
        result = torch.einsum("thd,mhd->thm", z.view(-1, self.heads, self.value_dim), w)
        edited = tap(self.hook_result, result)
        if edited is result:  # read, not edited: the output as HF computes it
            return self.out(z)
        out = all_reduce(edited.sum(1), self.out.parallel)  # (this rank's heads: summed over the ranks, as out's)
        return out if self.out.bias is None else out + self.out.bias

    def _project(self, part: str, x: torch.Tensor) -> torch.Tensor:
        """One part of the q/k/v projection [T, rows] of its own input: [T, d], or [T, heads, d] where each
        head reads its own (TransformerLens's split inputs), each through its rows of the weight."""
        rows = self.qkv.part_rows()[part]
        w, b = self.qkv.weight[rows], None if self.qkv.bias is None else self.qkv.bias[rows]
        if x.dim() == 2:
            return F.linear(x, w, b)
        heads = x.shape[1]
        y = torch.einsum("thm,hdm->thd", x, w.view(heads, -1, x.shape[-1]))
        return (y if b is None else y + b.view(heads, -1)).flatten(1)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, gate: torch.Tensor | None, rope: Rope,
    ) -> torch.Tensor:  # fmt: skip
        """[T, H*d], [T, H_kv*d] x2 -> the per-head attention output flattened to [T, H*d]; `k` and `v` None where
        the layer attends to an earlier layer's (Gemma 4's shared layers: those as that layer left them, taps and
        all). Rotary tables in float32 (ModelConfig.rope_float32) rotate in float32, the result rounded back to the
        model's dtype, as HF's OLMo 2; Cohere's tables, in the model's dtype, rotate so too (`rotate_float32`).
        `gate` [T, H, d] (Qwen 3.5): the output times its sigmoid, before hook_z, which is the output projection's
        input in every family."""
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (x.clamp(-self.clip, self.clip) for x in (q, k, v))
        dtype = q.dtype
        q = tap(self.hook_q, self._positioned(q, self.heads, self.head_norms[0], rope, dtype))
        if k is None:
            k, v = get_context().shared_kv[self.kv_layer]
        else:
            if self.key_scale != 1.0:
                k = k * self.key_scale
            k = tap(self.hook_k, self._positioned(k, self.kv_heads, self.head_norms[1], rope, dtype))
            v = v.reshape(-1, self.kv_heads, self.value_dim)
            v = tap(self.hook_v, v if self.v_norm is None else self.v_norm(v))
            if self.kv_shared:
                get_context().shared_kv[self.layer] = k, v
        z = self.attn(self.scaled_query(q), k, v)
        if gate is not None:
            z = z * torch.sigmoid(tap(self.hook_gate, gate))
        z = tap(self.hook_z, z)
        return z.flatten(1)

    def scaled_query(self, q: torch.Tensor) -> torch.Tensor:
        """hook_q's queries [T, H, d] as the scores take them, where the family scales them after hook_q."""
        if self.temperature is not None:  # (Ministral 3: after hook_q, as HF scales what its rotary returns)
            beta, original = self.temperature
            scale = 1 + beta * torch.log(1 + torch.floor(get_context().positions / original))
            q = q * scale[:, None, None].to(q.dtype)
        if self.nope_temperature is not None:  # (Llama 4: in float32, rounded back, as HF scales its query states)
            beta, floor_scale = self.nope_temperature
            scale = torch.log1p(torch.floor((get_context().positions.float() + 1) / floor_scale)) * beta + 1
            q = (q * scale[:, None, None]).to(q.dtype)
        if self.query_scale is not None:  # (OPT: after hook_q, as HF scales its projection's output)
            q = q * self.query_scale
        return q

    def _positioned(self, x: torch.Tensor, heads: int, norm: str, rope: Rope, dtype: torch.dtype) -> torch.Tensor:
        """Queries or keys [T, heads * d] -> [T, heads, d], through their per-head norm (`norm`: one of head_norms)
        where there is one and rotated by their positions, in `dtype` (where the layer has rotary); the norm first, or
        (Hunyuan's, "head_after_rotary"; Llama 4's weightless one, "l2_after_rotary") last."""
        x = x.reshape(-1, heads, self.head_dim)
        if self.qk_norm == "head":
            x = getattr(self, norm)(x)
        if self.rope_kind is not None:
            cos, sin = rope[self.rope_kind]
            if self.rope_float32 and cos.dtype != torch.float32:  # (Cohere: its tables rounded, its rotation float32)
                x, cos, sin = x.float(), cos.float(), sin.float()
            x = (fused.rotate_pairs if self.rotary_pairs else fused.rotate)(x, cos, sin)
            x = x.to(dtype) if self.rope_float32 else x  # (a float32 rotation: back to the model's dtype)
        return getattr(self, norm)(x) if self.norm_after_rotary else x


class ResidualBlock(nn.Module):
    """One decoder layer as TransformerLens names it, with its block-level taps written out once:
    x + attn(ln1(x)), then + mlp(ln2(x)); under a parallel residual (GPT-NeoX) both read x and there
    is no hook_resid_mid. Families keep their checkpoint's module names and map them onto `ln1`,
    `ln2`, `attn_heads` (the AttentionHeads) and `mlp` (a dense MLP with `fc_in` / `fc_out`, or routed
    experts); what the sublayers add is `attn_out` and `mlp_out`, their outputs (PostNormBlock puts Gemma's and
    OLMo 2's post-norms inside both, so there the heads' and the MLP's outputs are not what the layer adds; OLMo 2
    has no pre-norms, `pre_norms` False: its sublayers read the stream itself; Phi's ln2 is its ln1, `shared_norm`:
    the MLP takes the attention's normalised input unless a tap asks for ln2's values or edits either norm's)."""

    parallel = False
    pre_norms = True
    shared_norm = False
    residual_multiplier = 1.0  # (Granite's: each sublayer's output scaled before the add)
    attn_heads: AttentionHeads
    mlp: nn.Module

    def __init__(self, layer: int):
        super().__init__()
        p = f"blocks.{layer}."
        self.hook_resid_pre, self.hook_ln1 = p + "hook_resid_pre", NormHooks.at(p + "ln1")
        self.hook_attn_in = p + "hook_attn_in"
        self.hook_qkv_inputs = (p + "hook_q_input", p + "hook_k_input", p + "hook_v_input")
        self.hook_inputs = (self.hook_attn_in, *self.hook_qkv_inputs)
        self.hook_attn_out, self.hook_resid_mid = p + "hook_attn_out", p + "hook_resid_mid"
        self.hook_mlp_in, self.hook_ln2 = p + "hook_mlp_in", NormHooks.at(p + "ln2")
        self.hook_norms = (*astuple(self.hook_ln1), *astuple(self.hook_ln2))
        self.hook_mlp_out = p + "hook_mlp_out"
        self.hook_resid_post = p + "hook_resid_post"

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = tap(self.hook_resid_pre, x)
        h = normed = self.ln1(x, self.hook_ln1) if self.pre_norms else x
        a = self.mix(x, h, rope)
        if self.residual_multiplier != 1.0:  # (Granite: what the stream gets is the output scaled)
            a = a * self.residual_multiplier
        a = tap(self.hook_attn_out, a)
        if self.parallel:
            mid = x
        else:
            mid = x + a
            mid = tap(self.hook_resid_mid, mid)
        h = stream = tap(self.hook_mlp_in, mid)
        if self.shared_norm and h is x and not any(map(tapped, self.hook_norms)):
            h = normed  # (the one norm of the same input, computed once)
        elif self.pre_norms:
            h = self.ln2(h, self.hook_ln2)
        m = self.mlp_out(h, stream)
        if self.residual_multiplier != 1.0:
            m = m * self.residual_multiplier
        m = tap(self.hook_mlp_out, m)
        x = self.parallel_sum(x, a, m) if self.parallel else mid + m  # HF's order of the sums
        x = self.finish(x)
        x = tap(self.hook_resid_post, x)
        return x

    def parallel_sum(self, x: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The stream after a parallel residual's sublayers, summed in HF's order (GPT-NeoX's; Cohere's its own)."""
        return m + a + x

    def mix(self, x: torch.Tensor, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        """What the token mixer adds, from the layer's input `x` and its norm `h` (Falcon-H1: attention and a Mamba
        mixer side by side)."""
        return self.attn_out(self.attention_input(x, h), rope)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """What the family does to the layer's sums before hook_resid_post (Gemma 4: per-layer embeddings and a
        learned scalar)."""
        return x

    def attn_out(self, h: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope) -> torch.Tensor:
        return self.attn_heads(h, rope)

    def mlp_out(self, h: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """What the MLP adds, from `h`, the MLP norm's output (`stream`: that norm's input, which Gemma 4's experts
        beside the MLP read)."""
        return self.mlp(h)

    def attention_input(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What the q, k and v projections read: `h`, ln1 of the layer input `x`, unless one of
        TransformerLens's per-head input taps (hook_attn_in, hook_q_input, hook_k_input, hook_v_input) is
        armed and hands back another value; then each of q, k, v whose input changed reads ln1 of its own
        input, head by head (ln1's taps see `x` as it came). hook_attn_in, where the model has it, is what the
        other three start from; under grouped-query attention keys and values start from `x`, one copy per
        key-value head."""
        if not any(map(tapped, self.hook_inputs)):
            return h
        heads = self.attn_heads
        plain = x.unsqueeze(1).expand(-1, heads.heads, -1)
        attn_in = tap(self.hook_attn_in, plain)
        kv_plain = plain if heads.kv_heads == heads.heads else x.unsqueeze(1).expand(-1, heads.kv_heads, -1)
        kv_in = attn_in if heads.kv_heads == heads.heads else kv_plain
        inputs = [tap(name, y) for name, y in zip(self.hook_qkv_inputs, (attn_in, kv_in, kv_in))]
        unedited = [y is p for y, p in zip(inputs, (plain, kv_plain, kv_plain))]
        if all(unedited):
            return h
        return tuple(h if same else self.ln1(y) if self.pre_norms else y for y, same in zip(inputs, unedited))


class MixerBlock(ResidualBlock):
    """A layer of a model whose layers mix their tokens by attention on some layers and another mixer on the others
    (Qwen 3.5's linear attention, LFM2's short convolution, a Mamba 2 mixer), each under its checkpoint's name: the
    mixer's (`mixer_name`) or `self_attn`. The layer's hook_attn_out is either one's output."""

    mixer_name: str

    def add_mixer(self, cfg: ModelConfig, layer: int, attention: type[nn.Module], mixer: type[nn.Module]) -> None:
        self.attends = cfg.attends(layer)
        if self.attends:
            self.self_attn = attention(cfg, layer)
        else:
            setattr(self, self.mixer_name, mixer(cfg, layer))

    attn_heads = property(lambda self: self.self_attn)

    def attn_out(self, h: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope) -> torch.Tensor:
        return self.self_attn(h, rope) if self.attends else self._modules[self.mixer_name](h)


class SublayerBlock(ResidualBlock):
    """A layer that is one sublayer alone after its one norm, x + sublayer(norm(x)) (Mamba's layers, Nemotron-H's):
    its token mixer (`mixer`: attention or a Mamba mixer; what it adds is hook_attn_out, its norm ln1) or its MLP
    (`mixer` too, HF's name for either; hook_mlp_out, its norm ln2), as `cfg.part_at(layer)` says. Where the stream
    is kept in float32 (residual_float32: Mamba's residual_in_fp32), the norm reads it rounded to the model's dtype
    and the sum is float32, as HF adds the residual; the taps' rows are of the model's dtype."""

    mixer_name = "mixer"  # (as a hybrid layer's mixer_name says where its mixer is)

    def __init__(self, cfg: ModelConfig, layer: int, norm: nn.Module, mixer: nn.Module):
        super().__init__(layer)
        self.norm, self.mixer = norm, mixer
        self.part, self.attends, self.float32_stream = cfg.part_at(layer), cfg.attends(layer), cfg.residual_float32

    ln1 = property(lambda self: self.norm)
    ln2 = property(lambda self: self.norm)
    attn_heads = property(lambda self: self.mixer)
    mlp = property(lambda self: self.mixer)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        dtype = self.norm.weight.dtype
        x = tap_widened(self.hook_resid_pre, x, dtype)
        if self.part == "mlp":
            out = tap(self.hook_mlp_out, self.mixer(self.norm(x.to(dtype), self.hook_ln2)))
        else:
            h = self.norm(x.to(dtype), self.hook_ln1)
            out = self.mixer(self.attention_input(x, h), rope) if self.attends else self.mixer(h)
            out = tap(self.hook_attn_out, out)
        if self.float32_stream:
            x = x.float()
        return tap_widened(self.hook_resid_post, x + out, dtype)


class PostNormBlock(ResidualBlock):
    """A layer whose attention and MLP outputs are normalised before the residual add (Gemma's sandwich norms,
    OLMo 2's post-norms): hook_attn_out and hook_mlp_out are after the norms, attn.hook_out and mlp.hook_out
    before; the norms' taps take TransformerLens's names (vlens.capture.names.post_norm_names). A family builds
    `post_attention_layernorm` and `post_feedforward_layernorm`, HF's names for them in both."""

    post_attention_layernorm: nn.Module
    post_feedforward_layernorm: nn.Module
    # (the post-norms, which GLM-4 names otherwise: its post_attention_layernorm is its pre-MLP norm)
    attn_post_norm = property(lambda self: self.post_attention_layernorm)
    mlp_post_norm = property(lambda self: self.post_feedforward_layernorm)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        p = f"blocks.{layer}."
        self.hook_attn_norm, self.hook_mlp_norm = (
            NormHooks(p + norm + ".hook_scale", p + norm + ".hook_normalized") for norm in post_norm_names(cfg, layer)
        )  # (no hook_out: their outputs are hook_attn_out and hook_mlp_out)
        self.hook_attn_raw, self.hook_mlp_raw = p + "attn.hook_out", p + "mlp.hook_out"

    def attn_out(self, h: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope) -> torch.Tensor:
        return self.attn_post_norm(tap(self.hook_attn_raw, self.attn_heads(h, rope)), self.hook_attn_norm)

    def mlp_out(self, h: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        return self.mlp_post_norm(tap(self.hook_mlp_raw, self.mlp_block(h, stream)), self.hook_mlp_norm)

    def mlp_block(self, h: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """What the post-MLP norm normalises: the MLP's output (Gemma 4 26B-A4B: plus its experts')."""
        return self.mlp(h)


class DecoderLM(nn.Module):
    """A decoder-only LM as the engine runs it. Subclasses build their modules and define the
    `embed_tokens`, `layers`, `final_norm` and `lm_head` accessors; each layer is called as
    `layer(x, rope)` and has a `hook_resid_pre` name."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg, device)

    # -- what a family provides ---------------------------------------------------------------------

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Linear

    # Rank 0 of a tensor-parallel group: what runs each of its forwards on the other ranks
    # (vlens.distributed.executor.Executor); None in one process.
    executor = None

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Token ids -> the residual stream entering layer 0, firing hook_embed; families with learned positions
        override this. An image's rows read its features instead (HF's masked_scatter before its language model):
        hook_embed is what the language model reads, there as elsewhere."""
        x = self.embedding(input_ids)
        if ctx.embeds is not None:
            x = x.index_copy(0, ctx.embeds[0], ctx.embeds[1])
        return tap("hook_embed", x)

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding, no tap fired. Gemma scales it by sqrt(d), the factor rounded to the model dtype
        first as HF does."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale:
            x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)
        if self.cfg.embedding_multiplier != 1.0:  # (Granite)
            x = x * self.cfg.embedding_multiplier
        return x

    def resume_layer(self, layer: int) -> int:
        """The first layer a forward must run to redo layer `layer` and those after it: `layer`, or an earlier one
        whose keys and values a later layer attends to (Gemma 4's shared layers), which a forward from `layer` on
        would not make."""
        return min([layer, *(self.cfg.kv_layer_at(i) for i in range(layer, self.cfg.num_layers))])

    # -- shared ---------------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, num_layers: int | None = None, start: tuple[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Packed [T] ids -> [T, d]: every layer then the final norm when `num_layers` is None, else the
        raw residual after the first `num_layers` layers and no norm (a forward nobody reads past a layer
        stops there; a trace of the last layer's resid_post does not pay for the final norm). `start`:
        (layer, the residual stream entering it [T, d]) from a run of the same tokens, whose earlier layers
        this forward need not run again (vlens.patching: a patch changes nothing before its layer)."""
        ctx = get_context()
        first, x = (0, self.embed(input_ids, ctx)) if start is None else start
        rope = self.rotary.cos_sin(ctx, torch.float32 if self.cfg.rope_float32 else x.dtype)
        # (a ModuleList slice builds a module, ~50 us: the whole model's forward takes the list as it is)
        layers = self.layers if first == 0 and num_layers is None else self.layers[first:num_layers]
        deep = ctx.embeds[2] if ctx.embeds is not None and len(ctx.embeds) > 2 else None
        if deep is None:
            for layer in layers:
                x = layer(x, rope)
        else:  # (Qwen3-VL's deepstack: after each of the first layers the image rows add a tower layer's rows, as
            # HF's language model does between its layers: after one's hook_resid_post, before the next's resid_pre)
            for i, layer in enumerate(layers, first):
                x = layer(x, rope)
                if i < len(deep):
                    x = x.index_add(0, ctx.embeds[0], deep[i])
        if num_layers is not None:
            if num_layers < self.cfg.num_layers:
                # The input tap of the first layer not run lives in that layer's forward: fire it here,
                # else a trace of blocks.{num_layers}.hook_resid_pre would capture nothing.
                hook = self.layers[num_layers].hook_resid_pre
                x = tap_widened(hook, x, self.lm_head.weight.dtype)
            return x
        # (a stream kept in float32, Mamba's: normed so, then rounded, as HF's lm_head reads it)
        return self.final_norm(x, FINAL_NORM_HOOKS).to(self.lm_head.weight.dtype)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return tap(LOGITS, self._unembed(normed))

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Every row's logits: the forward and its unembedding in one call, what a compiled decode step compiles
        (its GEMM and tap beside a compiled forward cost more than inside it)."""
        return self.logits(self.forward(input_ids))

    def lens(self, residual: torch.Tensor) -> torch.Tensor:
        """Logits of arbitrary residual rows through the final norm and unembedding (logit lens);
        no taps fire."""
        if self.executor is not None:  # the other ranks hold the rest of the vocabulary
            self.executor.lens(residual)
        return self._unembed(self.final_norm(residual))

    def _unembed(self, normed: torch.Tensor) -> torch.Tensor:
        if self.cfg.no_token_logits:
            raise ValueError(self.cfg.no_token_logits)
        logits = self.lm_head(normed)
        if self.cfg.logit_scale != 1.0:  # (Cohere)
            logits = logits * self.cfg.logit_scale
        if self.cfg.logits_scaling != 1.0:  # (Granite)
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_softcap
        if cap is not None:  # Gemma 2/3: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        """Each layer's attention backend, in layer order: the engine binds its KV cache views to them."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight
