"""Hook names (TransformerLens style), their per-token shapes, and resolution of user specs.

A spec is a name, a glob (`blocks.*.hook_resid_post`, `blocks.{3,7}.hook_attn_out`,
`blocks.{0..5}.ln1.hook_normalized`) or a list of them. Resolution maps every requested name to the
canonical tap that produces it: `hidden_states.{i}` are aliases with HF's index meaning (the stream entering layer
i; HF's Mamba and Falcon Mamba: the stream leaving it; Qwen3-VL's first ones: the stream leaving the layer before,
before its deepstack rows are added).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch

from vlens.config import ModelConfig
from vlens.sae.files import from_saelens

# Per-layer taps of a dense layer, in the order the forward reaches them.
LAYER_HOOKS = (
    "hook_resid_pre",
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "ln1.hook_out",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "ln2.hook_scale",
    "ln2.hook_normalized",
    "ln2.hook_out",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)
# Post-norms: the attention output's and the MLP's, whose outputs are the layer's hook_attn_out and hook_mlp_out,
# so only their scale and normalised input are taps of their own; and what each norms, the attention's and the
# MLP's own outputs, attn.hook_out and mlp.hook_out (circuit-tracer's name for what its transcoders replace), which
# elsewhere are hook_attn_out and hook_mlp_out themselves. post_norm_names says what TransformerLens calls them.
POST_NORMED = (("attn.hook_out", "hook_attn_out"), ("mlp.hook_out", "hook_mlp_out"))
# What an MoE layer has in place of mlp.hook_post: the router's logits, TransformerLens's expert weights [E] (the
# softmax over every expert where the router takes the top k of it; gpt-oss: the chosen k's weights, zeros
# elsewhere), the chosen experts (int64; TransformerLens's name for them is an alias) and, in Qwen2-MoE, the shared
# expert's hidden activation.
MOE_HOOKS = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_ids", "mlp.hook_expert_indices")
SHARED_EXPERT = "mlp.shared_expert.hook_post"
# Gemma 4 26B-A4B, whose experts run beside a dense MLP: each one's output after its own norm (their sum is
# mlp.hook_out), the router's taps between them.
BESIDE_MLP = ("mlp.hook_dense_out", *MOE_HOOKS, "mlp.hook_experts_out")
# Gemma 4 E2B/E4B's per-layer embeddings, after the MLP: the layer's own input (of per_layer_input_size), the gated
# branch's hidden activation act(gate(x)) * that input, and what the branch adds to the stream (after its norm).
PER_LAYER_HOOKS = ("hook_per_layer_input", "per_layer.hook_post", "hook_per_layer_out")
# What a layer that attends to another layer's keys and values (Gemma 4's shared layers) has none of.
OWN_KV_HOOKS = ("attn.hook_k", "attn.hook_v", "hook_k_input", "hook_v_input")
# DeepSeek's latent attention: the normed low-rank latents its queries and its keys and values come from (the
# first where the queries have one), before attn.hook_q
LATENT_HOOKS = ("attn.hook_q_latent", "attn.hook_kv_latent")
# Qwen 3.5's gated delta nets, which have these in place of attention's taps (vlens.layers.gated_delta): queries,
# keys and values after the convolution, the update's rate and log decay per value head, what the queries read, the
# output gate's input, and the output projection's input (as attn.hook_z is).
LINEAR_ATTN_HOOKS = tuple(
    f"linear_attn.hook_{name}" for name in ("q", "k", "v", "beta", "decay", "core_out", "gate", "z")
)
# LFM2's gated short convolutions, in place of attention's: the input projection's three parts (HF's B, C and x), the
# convolution of B * x, and C times it, the output projection's input.
CONV_HOOKS = tuple(f"conv.hook_{name}" for name in ("b", "c", "x", "conv_out", "z"))
# Bamba's Mamba 2 mixers, in place of attention's: x, B, C after the convolution, the time step (after its bias and
# softplus), the scan's output, the gate's input, and the gated norm's output, the output projection's input.
MAMBA_HOOKS = tuple(f"mamba.hook_{name}" for name in ("x", "b", "c", "dt", "ssm_out", "gate", "z"))
# What a layer without an MLP (Mamba's) has none of, besides the MLP's and its norm's own taps.
MLP_PART = ("hook_resid_mid", "hook_mlp_in", "hook_mlp_out")
ATTN_INPUT_HOOKS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")
# Layer hooks that are other names of a tap (TransformerLens's), as hidden_states.{i} are of the residual stream's.
LAYER_ALIASES = {"mlp.hook_expert_indices": "mlp.hook_expert_ids"}
# The final norm's taps; its output (after the weight) is HF's last hidden state, hidden_states.{N}.
FINAL_NORM_TAPS = ("ln_final.hook_scale", "ln_final.hook_normalized", "ln_final.hook_out")
FINAL_NORM = FINAL_NORM_TAPS[-1]
LOGITS = "unembed.hook_out"
# Attention scores and probabilities: one row of keys per query, as wide as the row's context (its
# position + 1), so their per-token shape is [heads, CTX]; they are computed only for the rows asked for.
PATTERNS = ("attn.hook_attn_scores", "attn.hook_pattern")
CTX = "ctx"
# Taps with one slice per attention head, which Capture(heads=...) and per-head interventions select (with
# TransformerLens's optional per-head ones).
PER_HEAD = ("attn.hook_q", "attn.hook_k", "attn.hook_v", *PATTERNS, "attn.hook_gate", "attn.hook_z", "attn.hook_result",
            *ATTN_INPUT_HOOKS)  # fmt: skip
# TransformerLens's optional taps, by the config flag that turns them on (HookedLM's set_use_*): the input of
# every head to its query, key and value projections, together (hook_attn_in) or apart (hook_q_input, ...);
# each head's share of the attention output, before the heads are summed (attn.hook_result, without b_O);
# the MLP's input. A forward computes a per-head one only where a tap is armed, and takes the per-head path
# only where an armed one hands back another value, so reading them changes no number. The engine's requests
# name them in full (resolve_hooks): a glob like `blocks.3.*` leaves them out, or it would cost a [heads, d_model]
# tensor per token per name.
OPTIONAL_HOOKS = {
    "use_attn_in": ("hook_attn_in",),
    "use_split_qkv_input": ("hook_q_input", "hook_k_input", "hook_v_input"),
    "use_attn_result": ("attn.hook_result",),
    "use_hook_mlp_in": ("hook_mlp_in",),
}
# A layer's taps with the optional ones in forward order (which layer_hooks keeps of them).
_WITH_OPTIONAL = (
    "hook_resid_pre", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", *LAYER_HOOKS[1:10],
    "attn.hook_result", *LAYER_HOOKS[10:12], "hook_mlp_in", *LAYER_HOOKS[12:],
)  # fmt: skip


class HookSpecError(ValueError):
    """A hook spec that names nothing the loaded model has."""


def layer_hooks(cfg: ModelConfig, layer: int, optional: Collection[str] = ()) -> tuple[str, ...]:
    """The tap kinds layer `layer` has, with the OPTIONAL_HOOKS of the flags in `optional`. Under NeoX's
    parallel residual nothing is ever the residual plus the attention output alone, so there is no
    hook_resid_mid; an MoE layer has router taps instead of one MLP hidden activation (each expert has its
    own). hook_attn_in, one input per query head for keys and values too, exists only where every query
    head has keys and values of its own (TransformerLens's has no meaning under grouped-query attention), and none
    of the inputs per head where the heads' keys share their rotating part (DeepSeek's latent attention). OLMo 2
    has no pre-norms; post-norms (Gemma's, OLMo's) add what they norm, their scale and normalised input
    (POST_NORMED) before the output each one makes. A layer that attends to another's keys and values (Gemma 4's
    shared layers) has none of its own to tap; per-layer embeddings add their taps before hook_resid_post. A
    linear-attention layer (Qwen 3.5's) has LINEAR_ATTN_HOOKS in place of attention's, a short convolution (LFM2's)
    CONV_HOOKS, a Mamba or Mamba 2 mixer MAMBA_HOOKS; a gated attention head its gate's input before hook_z; latent
    attention (DeepSeek's) its latents, LATENT_HOOKS, before hook_q. A layer
    that is its token mixer alone (Mamba's, some of Nemotron-H's) has no MLP, no ln2 and no hook_resid_mid; one that
    is its MLP alone (Nemotron-H's) has no ln1 and no token mixer's taps. Falcon-H1's layers have a Mamba 2 mixer's taps
    beside attention's, and each one's output (mamba.hook_out, attn.hook_out) before their sum, hook_attn_out."""
    chosen = {h for flag in optional for h in OPTIONAL_HOOKS[flag]}
    if cfg.kv_heads_at(layer) != cfg.num_heads:
        chosen.discard("hook_attn_in")
    if cfg.kv_lora_rank:  # (DeepSeek's keys share one rotating part, of one input: no input per head)
        chosen -= set(ATTN_INPUT_HOOKS)
    hooks = [h for h in _WITH_OPTIONAL if h in LAYER_HOOKS or h in chosen]
    if cfg.kv_layer_at(layer) != layer:
        hooks = [h for h in hooks if h not in OWN_KV_HOOKS]
    if not cfg.attends(layer) and cfg.part_at(layer) != "mlp":
        at, linear = hooks.index("attn.hook_q"), cfg.is_linear_layer(layer)
        mixer = LINEAR_ATTN_HOOKS if linear else CONV_HOOKS if cfg.is_conv_layer(layer) else MAMBA_HOOKS
        hooks = [h for h in hooks[:at] if h not in ATTN_INPUT_HOOKS] + list(mixer) + [
            h for h in hooks[at:] if not h.startswith("attn.")
        ]
    elif cfg.attn_output_gate or cfg.attn_gate_width:
        hooks.insert(hooks.index("attn.hook_z"), "attn.hook_gate")
    elif cfg.kv_lora_rank:
        at = hooks.index("attn.hook_q")
        hooks[at:at] = LATENT_HOOKS if cfg.q_lora_rank else LATENT_HOOKS[1:]
    if cfg.parallel_mixers:  # (Falcon-H1: a Mamba 2 mixer beside attention, run first; each one's output)
        at = hooks.index("attn.hook_q")
        hooks[at:at] = [*MAMBA_HOOKS, "mamba.hook_out"]
        hooks.insert(hooks.index("hook_attn_out"), "attn.hook_out")
    if cfg.per_layer_input_size:
        at = hooks.index("hook_resid_post")
        hooks[at:at] = PER_LAYER_HOOKS
    if cfg.parallel_residual:
        hooks.remove("hook_resid_mid")
    if cfg.is_moe_layer(layer):
        moe = MOE_HOOKS + (SHARED_EXPERT,) if cfg.shared_expert_intermediate_size else MOE_HOOKS
        at = hooks.index("mlp.hook_post")
        hooks[at : at + 1] = ("mlp.hook_post", *BESIDE_MLP) if cfg.experts_beside_mlp else moe
    if not cfg.pre_norms_at(layer):
        hooks = [h for h in hooks if not h.startswith(("ln1.", "ln2."))]
    if cfg.post_norms_at(layer):
        for norm, (raw, out) in zip(post_norm_names(cfg, layer), POST_NORMED):
            at = hooks.index(out)
            hooks[at:at] = (raw, f"{norm}.hook_scale", f"{norm}.hook_normalized")
    part = cfg.part_at(layer)
    if part == "mixer":  # (Mamba, Nemotron-H: the layer is its token mixer alone)
        return tuple(h for h in hooks if h not in MLP_PART and not h.startswith(("ln2.", "mlp.")))
    if part == "mlp":  # (Nemotron-H: its MLP alone)
        return tuple(h for h in hooks if h in ("hook_resid_pre", *MLP_PART[1:], "hook_resid_post")
                     or h.startswith(("ln2.", "mlp.")))  # fmt: skip
    return tuple(hooks)


def post_norm_names(cfg: ModelConfig, layer: int) -> tuple[str, str]:
    """TransformerLens's names for layer `layer`'s norms after attention and after the MLP: ln1_post and ln2_post
    beside pre-norms (Gemma), ln1 and ln2 where they are the layer's only norms (OLMo 2)."""
    return ("ln1_post", "ln2_post") if cfg.pre_norms_at(layer) else ("ln1", "ln2")


def layer_norms(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """Layer `layer`'s norms by TransformerLens's names: its pre-norms, then its post-norms."""
    pre, post = cfg.pre_norms_at(layer), cfg.post_norms_at(layer)
    return (("ln1", "ln2") if pre else ()) + (post_norm_names(cfg, layer) if post else ())


def mlp_input(cfg: ModelConfig, layer: int) -> str:
    """The tap of layer `layer` whose value its MLP reads: its pre-norm's output, or, with none, the stream itself."""
    return "ln2.hook_out" if cfg.pre_norms_at(layer) else "hook_resid_mid"


def hook_shapes(cfg: ModelConfig, optional: Collection[str] = ()) -> dict[str, tuple[int | str, ...]]:
    """Every hook name of the model, in forward order, with its per-token shape (CTX: as wide as the row's
    context); `optional`: flags of OPTIONAL_HOOKS whose taps are included (the runner's table has them all)."""
    d, heads = cfg.hidden_size, cfg.num_heads
    shapes: dict[str, tuple[int | str, ...]] = {"hook_embed": (d,)}
    if cfg.learned_positions:
        shapes["hook_pos_embed"] = (d,)
    for layer in range(cfg.num_layers):
        per_layer = _layer_shapes(cfg, layer, heads, cfg.kv_heads_at(layer), cfg.head_dim_at(layer))
        for hook in layer_hooks(cfg, layer, optional):
            shapes[f"blocks.{layer}.{hook}"] = per_layer.get(hook, (d,))
    shapes.update(dict(zip(FINAL_NORM_TAPS, [(1,), (d,), (d,)])))
    if not cfg.no_token_logits:  # (a classifier or a base model has none)
        shapes[LOGITS] = (cfg.vocab_size,)
    for i in range(cfg.num_layers + 1):
        shapes[f"hidden_states.{i}"] = (d,)
    return shapes


def _layer_shapes(cfg: ModelConfig, layer: int, heads: int, kv: int, dh: int) -> dict[str, tuple[int | str, ...]]:
    """The per-token shapes of layer `layer`'s taps other than (d_model,), for its numbers of heads and head size."""
    d = cfg.hidden_size
    return {
        "ln1.hook_scale": (1,),
        "ln2.hook_scale": (1,),
        "ln1_post.hook_scale": (1,),
        "ln2_post.hook_scale": (1,),
        "attn.hook_q": (heads, dh),
        "attn.hook_k": (kv, dh),
        "attn.hook_v": (kv, cfg.v_head_dim or dh),
        "attn.hook_attn_scores": (heads, CTX),
        "attn.hook_pattern": (heads, CTX),
        "attn.hook_gate": (heads, cfg.attn_gate_width or dh),  # (LFM3: one a head)
        "attn.hook_q_latent": (cfg.q_lora_rank,),
        "attn.hook_kv_latent": (cfg.kv_lora_rank,),
        "attn.hook_z": (heads, cfg.v_head_dim or dh),
        "linear_attn.hook_q": (cfg.linear_key_heads, cfg.linear_key_dim),
        "linear_attn.hook_k": (cfg.linear_key_heads, cfg.linear_key_dim),
        **{f"linear_attn.hook_{name}": (cfg.linear_value_heads, cfg.linear_value_dim)
           for name in ("v", "core_out", "gate", "z")},  # fmt: skip
        **(_mamba_shapes(cfg) if cfg.ssm_dt_rank else {
            "mamba.hook_x": (cfg.ssm_heads, cfg.ssm_head_dim),
            "mamba.hook_b": (cfg.ssm_groups, cfg.ssm_state_size),
            "mamba.hook_c": (cfg.ssm_groups, cfg.ssm_state_size),
            "mamba.hook_dt": (cfg.ssm_heads,),
            "mamba.hook_ssm_out": (cfg.ssm_heads, cfg.ssm_head_dim),
            "mamba.hook_gate": (cfg.ssm_heads * cfg.ssm_head_dim,),
            "mamba.hook_z": (cfg.ssm_heads * cfg.ssm_head_dim,),
        }),  # fmt: skip
        "linear_attn.hook_beta": (cfg.linear_value_heads,),
        "linear_attn.hook_decay": (cfg.linear_value_heads,),
        "attn.hook_result": (heads, d),
        "hook_attn_in": (heads, d),
        "hook_q_input": (heads, d),
        "hook_k_input": (kv, d),
        "hook_v_input": (kv, d),
        "mlp.hook_router_logits": (cfg.num_experts,),
        "mlp.hook_expert_weights": (cfg.num_experts,),
        "mlp.hook_expert_ids": (cfg.experts_per_token,),
        "mlp.hook_expert_indices": (cfg.experts_per_token,),
        "mlp.hook_post": (cfg.intermediate_size_at(layer),),
        "mlp.shared_expert.hook_post": (cfg.shared_expert_intermediate_size,),
        "hook_per_layer_input": (cfg.per_layer_input_size,),
        "per_layer.hook_post": (cfg.per_layer_input_size,),
    }


def _mamba_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Mamba's mixer (vlens.layers.mamba1): one state per channel, B and C shared by all of them."""
    channels = (cfg.ssm_inner,)
    return {"mamba.hook_b": (cfg.ssm_state_size,), "mamba.hook_c": (cfg.ssm_state_size,)} | {
        f"mamba.hook_{name}": channels for name in ("x", "dt", "ssm_out", "gate", "z")}  # fmt: skip


def canonical(name: str, cfg: ModelConfig) -> str:
    """The tap behind a (valid) name: aliases map to the tap with the same values."""
    if name.startswith("hidden_states."):
        i = int(name.split(".")[1])
        if i == cfg.num_layers:
            return FINAL_NORM
        if 0 < i <= cfg.deepstack_layers:  # (HF's: the layer before's output, before its deepstack rows are added)
            return f"blocks.{i - 1}.hook_resid_post"
        return f"blocks.{i}.hook_resid_post" if cfg.hidden_states_after_layers else f"blocks.{i}.hook_resid_pre"
    block, _, kind = name.partition(".")[2].partition(".")
    return f"blocks.{block}.{LAYER_ALIASES[kind]}" if name.startswith("blocks.") and kind in LAYER_ALIASES else name


def is_pattern(tap: str) -> bool:
    return tap.endswith(PATTERNS)


@dataclass(frozen=True)
class Part:
    """One tensor of what a request gets back for one hook, per row: its shape (CTX: one entry per key of
    the row's context) and dtype. Activations are one part; a logit lens, (ids, log-probabilities); an
    SAE readout, its ids, values and errors (vlens.capture.bind.result_parts says which)."""

    shape: tuple[int | str, ...]
    dtype: torch.dtype

    def empty(self) -> torch.Tensor:
        """No rows of it."""
        return torch.empty(0, *(0 if n == CTX else n for n in self.shape), dtype=self.dtype)


def row_size(shape: tuple[int | str, ...], context: int, heads: int | None = None) -> int:
    """Elements in one row of a tap of per-token `shape`: CTX counts `context` keys, and a per-head tap
    keeps `heads` of its heads where a capture selects some."""
    sizes = [context if d == CTX else d for d in shape]
    if heads is not None:
        sizes[0] = heads
    return math.prod(sizes)


def tap_dtype(tap: str, model_dtype: torch.dtype) -> torch.dtype:
    """What a tap's rows hold: the chosen MoE experts are int64 ids, every other tap is in the model's dtype."""
    return torch.long if tap.endswith("hook_expert_ids") else model_dtype


def layers_needed(tap: str, cfg: ModelConfig) -> int:
    """How many decoder layers must run before this tap has fired."""
    if tap in ("hook_embed", "hook_pos_embed"):
        return 0
    if tap.startswith("blocks."):
        layer, hook = tap[len("blocks.") :].split(".", 1)
        return int(layer) + (hook != "hook_resid_pre")
    return cfg.num_layers


def forward_depth(taps: Iterable[str], cfg: ModelConfig) -> int | None:
    """The layers a forward must run for all these taps to fire; None when one needs the final norm or
    the logits, i.e. the whole model (a forward of num_layers=k stops before the final norm)."""
    taps = list(taps)
    if any(t in FINAL_NORM_TAPS or t == LOGITS for t in taps):
        return None
    return max((layers_needed(t, cfg) for t in taps), default=0)


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    if re.fullmatch(r"\d+\.\.\d+", body):
        lo, hi = map(int, body.split(".."))
        options = [str(i) for i in range(lo, hi + 1)]
    else:
        options = [o.strip() for o in body.split(",")]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [expanded for option in options for expanded in _expand_braces(head + option + tail)]


_GLOB_CHARS = re.compile(r"[*?\[]")


def _no_match(name: str, pattern: str, valid: dict, cfg: ModelConfig) -> HookSpecError:
    close = difflib.get_close_matches(name, list(valid), n=5, cutoff=0.5)
    hint = f"; closest valid names: {', '.join(close)}" if close else ""
    leaf = _leaf(name)
    flag = next((f for f, hooks in OPTIONAL_HOOKS.items() if leaf in hooks), None)
    if flag is not None and name in hook_shapes(cfg, OPTIONAL_HOOKS):
        hint = f"; it is one of TransformerLens's optional hooks, which HookedLM.set_{flag}(True) turns on"
    elif from_saelens(name) in valid:
        hint = f"; SAELens's name for the MLP's input, which vlens calls {from_saelens(name)}"
    elif leaf in ("attn.hook_out", "mlp.hook_out") and not cfg.any_post_norms:  # (taps only where a post-norm follows)
        hint = f"; vlens calls it hook_{leaf.split('.')[0]}_out where no post-norm follows"
    where = f"{name!r}" if name == pattern else f"{name!r} (from {pattern!r})"
    return HookSpecError(
        f"hooks: {where} matches no hook of this model ({cfg.architecture}, "
        f"{cfg.num_layers} layers, blocks.0..blocks.{cfg.num_layers - 1}){hint}; "
        "`vlens hooks` lists them all"
    )


def resolve_hooks(
    spec: str | Iterable[str], cfg: ModelConfig, valid: dict[str, tuple[int | str, ...]] | None = None,
    optional_by_glob: bool = False,
) -> dict[str, str]:
    """Requested name -> canonical tap, in forward order, for a name/glob or list of them. `valid`:
    `request_shapes(cfg)` where the caller keeps it (the engine, per request: building it is most of the cost).

    TransformerLens's optional hooks (OPTIONAL_HOOKS) are matched where a spec spells their name out —
    `blocks.3.attn.hook_result`, `blocks.*.attn.hook_result` — and not by a wildcard standing for it
    (`blocks.3.*` keeps its size), unless `optional_by_glob` (HookedLM, whose set_use_* turned them on).
    Raises HookSpecError naming the closest valid names when a pattern, or one of its brace
    alternatives without wildcards, matches nothing."""
    patterns = [spec] if isinstance(spec, str) else list(spec)
    if not patterns:
        raise HookSpecError("hooks: empty spec; give at least one hook name or glob (see `vlens hooks`)")
    valid = request_shapes(cfg) if valid is None else valid
    chosen: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise HookSpecError(f"hooks: expected hook names (str), got {type(pattern).__name__}: {pattern!r}")
        found: list[str] = []
        for expanded in _expand_braces(pattern):
            matches = [expanded] if expanded in valid else fnmatch.filter(valid, expanded)
            if not optional_by_glob:
                matches = [m for m in matches if not _optional(m) or expanded.endswith("." + _leaf(m))]
            # A brace alternative spelled out in full (`blocks.{3,40}...`) names one hook: if the model
            # lacks it, say so rather than silently return the others. Wildcards may match nothing.
            if not matches and not _GLOB_CHARS.search(expanded):
                raise _no_match(expanded, pattern, valid, cfg)
            found += matches
        if not found:
            raise _no_match(pattern, pattern, valid, cfg)
        chosen.update(found)
    return {name: canonical(name, cfg) for name in valid if name in chosen}


def request_shapes(cfg: ModelConfig) -> dict[str, tuple[int | str, ...]]:
    """The hooks a request may name (hook_shapes with TransformerLens's optional ones, which it names in full)."""
    return hook_shapes(cfg, OPTIONAL_HOOKS)


_OPTIONAL_LEAVES = frozenset(h for hooks in OPTIONAL_HOOKS.values() for h in hooks)


def _leaf(name: str) -> str:
    return name.split(".", 2)[-1]


def _optional(name: str) -> bool:
    return name.startswith("blocks.") and _leaf(name) in _OPTIONAL_LEAVES
