"""Routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, Gemma 4 26B-A4B, Qwen 3.5's, LFM2-MoE): a linear
router picks the top-k of E gated experts per token, weighted by their softmax probabilities (renormalised over the
chosen k where the model says so; gpt-oss: the softmax of the chosen k logits alone; Phi-3.5-MoE: SparseMixer's
two; LFM2-MoE: sigmoids, chosen with a learned bias per expert; DeepSeek-V2 and V3, Nemotron 3, GLM-4.5, ERNIE 4.5,
Mistral 4: DeepSeek's, `DeepseekMoE`; Llama 4: vlens.models.llama4); Qwen2-MoE adds an always-on shared expert scaled
by a sigmoid gate. gpt-oss's router and experts have biases, and its experts a clamped SwiGLU (`ClampedExperts`); Gemma
4's router reads a normed, scaled stream and scales each expert's weight (`NormedRouter`), and its experts run beside a
dense MLP (vlens.models.gemma4).

Taps: the router's logits [E], TransformerLens's expert weights [E] (an edit there reroutes) and the chosen
experts [k] (int64, in descending weight order, as torch.topk gives them) — which experts ran is the first thing
one asks of an MoE activation.
The experts' weights are stacked ([E, 2I, d] and [E, d, I], as HF 5 holds them); checkpoints keep
one tensor per expert, which loads into its slice (Gemma 4's keep them stacked too). Under tensor parallelism
every rank holds every expert's share of the intermediate columns (gate, up and the matching columns of down)
and the experts' summed partial outputs are added across the ranks once; the router runs whole on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from vlens.config import ModelConfig
from vlens.context import tap, tap_widened, tapped
from vlens.distributed.parallel import SINGLE, Parallel, all_reduce
from vlens.layers.checkpoint import Slot, checkpoint_slots
from vlens.layers.mlp import GatedMLP, activation
from vlens.layers.norm import UnscaledRMSNorm


class Experts(nn.Module):
    def __init__(
        self, num: int, hidden: int, intermediate: int, act: str, names: tuple[str, str, str] | None,
        parallel: Parallel = SINGLE, bias: bool = False, gated: bool = True, weigh_inputs: bool = False,
    ):  # fmt: skip
        super().__init__()
        # (Llama 4's: a chosen expert reads the token times its weight and gives its output as it is)
        self.weigh_inputs = weigh_inputs
        columns = parallel.units(intermediate)
        n = len(columns)
        # (`gated` False, Nemotron 3's: act(up), no gate; the one projection in gate_up_proj's place)
        self.gated = gated
        self.gate_up_proj = nn.Parameter(torch.empty(num, (2 if gated else 1) * n, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, n))
        self.gate_up_bias = nn.Parameter(torch.empty(num, 2 * n)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num, hidden)) if bias else None
        self.act = activation(act)
        self.columns, self.parallel = slice(columns.start, columns.stop), parallel
        self.intermediate = intermediate
        self.names = names  # the checkpoint's names for each expert's gate, up and down projections (None: fused)

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        n = self.columns.stop - self.columns.start
        if self.names is None:  # (all experts in one tensor per projection, in vlens's own layout, [E, 2I, d] and
            # [E, d, I], as Gemma 4's and transformers 5 save them, or the input dimension first, as Qwen3-VL-MoE's
            # releases hold them; where d = 2I (d = I) the two look alike, and vlens's is taken)
            columns, full, hidden = self.columns, self.intermediate, self.down_proj.shape[1]

            def gate_up(w: torch.Tensor) -> torch.Tensor:  # -> this rank's gate rows, then its up rows
                gate, up = (w if w.shape[1] == 2 * full else w.transpose(1, 2)).chunk(2, dim=1)
                return torch.cat([gate[:, columns], up[:, columns]], dim=1)

            def down(w: torch.Tensor) -> torch.Tensor:
                return (w if w.shape[1] == hidden else w.transpose(1, 2))[..., columns]

            return {f"{path}.gate_up_proj": Slot(self.gate_up_proj, transform=gate_up),
                    f"{path}.down_proj": Slot(self.down_proj, transform=down)}  # fmt: skip
        gate, up, down = self.names
        rows, cols = ((self.columns,), (slice(None), self.columns)) if self.parallel.size > 1 else (None, None)
        slots = {}
        ups = slice(n, 2 * n) if self.gated else slice(0, n)  # (not gated, Nemotron 3's: up alone)
        for e in range(self.gate_up_proj.shape[0]):
            if self.gated:
                slots[f"{path}.{e}.{gate}.weight"] = Slot(self.gate_up_proj, (e, slice(0, n)), None, rows)
            slots[f"{path}.{e}.{up}.weight"] = Slot(self.gate_up_proj, (e, ups), None, rows)
            slots[f"{path}.{e}.{down}.weight"] = Slot(self.down_proj, (e,), None, cols)
        return slots

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(x), kept in float32 and rounded once, as HF's
        (grouped_mm) experts sum a token's k weighted outputs (in bfloat16 a rounding per expert put every MoE
        output 0.3% off HF's). Which tokens an expert takes is data, not shape, so no host sync (and no graph
        break) decides it either way: torch's grouped GEMM where it runs (`grouped_gemm_runs`), else every
        expert on every token."""
        grouped = grouped_gemm_runs(x, self.columns.stop - self.columns.start)
        out = self._grouped(x, ids, weights) if grouped else self._every_expert(x, ids, weights)
        return all_reduce(out.to(x.dtype), self.parallel)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """HF's way: the (token, choice) pairs sorted by expert, one grouped GEMM per projection over them (each
        expert's rows a contiguous group; an expert nobody chose, an empty one), then back in token order and the
        k outputs of a token summed."""
        tokens, k = ids.shape
        chosen = ids.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        experts = chosen.index_select(0, order)
        ends = (chosen[:, None] == torch.arange(self.gate_up_proj.shape[0], device=x.device)).sum(0).cumsum(0)
        ends = ends.to(torch.int32)  # (a fixed [E] however the tokens chose: no shape depends on the data)
        rows, weights = x.index_select(0, order // k), weights.reshape(-1).index_select(0, order)[:, None]
        if self.weigh_inputs:
            rows = rows * weights
        gate_up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias.index_select(0, experts)
        out = F.grouped_mm(self.hidden(gate_up), self.down_proj.transpose(1, 2), offs=ends)
        if self.down_bias is not None and self.parallel.rank == 0:  # (a bias after a split sum: added once)
            out = out + self.down_bias.index_select(0, experts)
        if not self.weigh_inputs:
            out = out * weights
        out = torch.empty_like(out).index_copy_(0, order, out)
        return out.view(tokens, k, -1).sum(dim=1, dtype=torch.float32)

    def _every_expert(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, the weights of the tokens that did not choose it zero (an exact zero
        added); num_experts / experts_per_token times the expert FLOPs."""
        out = torch.zeros_like(x, dtype=torch.float32)
        first = self.parallel.rank == 0  # (a bias after a split sum is added by one rank)
        for e in range(self.gate_up_proj.shape[0]):
            weight = (weights * (ids == e)).sum(dim=-1, keepdim=True)  # [T, 1]; a token picks an expert once
            gate_up_bias, down_bias = (None if b is None else b[e] for b in (self.gate_up_bias, self.down_bias))
            if self.weigh_inputs:  # (an expert not chosen reads zeros, and without biases gives zeros)
                out += _linear(self.hidden(_linear(x * weight, self.gate_up_proj[e], None)), self.down_proj[e], None)
                continue
            h = self.hidden(_linear(x, self.gate_up_proj[e], gate_up_bias))
            out += _linear(h, self.down_proj[e], down_bias if first else None) * weight
        return out

    def hidden(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' hidden activation from their first projection's output."""
        return self.glu(*gate_up.chunk(2, dim=-1)) if self.gated else self.act(gate_up)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class ClampedExperts(Experts):
    """gpt-oss's experts: biases, and a SwiGLU whose gate is clamped above and up both sides at `limit`, with
    a sigmoid of gain `alpha` and up + 1. Its checkpoints hold all experts in one tensor per projection, the
    input dimension first and gate and up columns interleaved ([E, d, 2I]: gate, up, gate, ...)."""

    def __init__(self, cfg: ModelConfig):
        sizes = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        super().__init__(*sizes, ("", "", ""), cfg.parallel, bias=True)
        self.alpha, self.limit = cfg.swiglu_clamp

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        columns = self.columns

        def gate_up(stored: torch.Tensor) -> torch.Tensor:  # [E, (d,) 2I] interleaved -> [E, 2n(, d)]
            w = stored if stored.dim() == 2 else stored.transpose(1, 2)
            return torch.cat([w[:, 0::2][:, columns], w[:, 1::2][:, columns]], dim=1)

        return {
            f"{path}.gate_up_proj": Slot(self.gate_up_proj, transform=gate_up),
            f"{path}.gate_up_proj_bias": Slot(self.gate_up_bias, transform=gate_up),
            f"{path}.down_proj": Slot(self.down_proj, transform=lambda w: w[:, columns].transpose(1, 2)),
            f"{path}.down_proj_bias": Slot(self.down_bias),
        }


def grouped_gemm_runs(x: torch.Tensor, intermediate: int) -> bool:
    """Whether torch's grouped GEMM (F.grouped_mm) takes these experts' products: in bfloat16 on the CPU or a
    CUDA card of sm90 on (H100, H200); in float32 on the CPU, uncompiled (a compiled one asks for bfloat16);
    every row of the inputs and weights a multiple of 16 bytes. A host-side decision on dtype, device and
    sizes alone, the same for every step of a model."""
    if not hasattr(F, "grouped_mm") or any(n * x.element_size() % 16 for n in (x.shape[-1], intermediate)):
        return False
    if x.dtype == torch.bfloat16:
        return x.device.type == "cpu" or (x.device.type == "cuda" and _capability(x.device) >= (9, 0))
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with the product rounded before the bias is added, as HF's grouped experts add it (in bfloat16 a
    fused addmm, rounding once, put gpt-oss's MoE outputs 0.5% off HF's)."""
    y = F.linear(x, weight)
    return y if bias is None else y + bias


class Routing:
    """How a router's logits [T, E] become each token's k experts and their weights, with the taps there: the
    softmax over every expert, its top k (renormalised where the model says so; gpt-oss: the softmax of the top k
    logits alone, Llama 4: their sigmoids; LFM2-MoE: each expert's sigmoid, the top k of it plus a learned bias;
    MiniMax-M2 the same, its sigmoids in float32), rounded to the logits' dtype where the model does (Qwen-MoE,
    OLMoE)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        self.top_k, self.norm_topk, self.pnorm = cfg.experts_per_token, cfg.norm_topk_prob, cfg.norm_topk_pnorm
        self.softmax_after_topk, self.sigmoid_after_topk = cfg.softmax_after_topk, cfg.sigmoid_after_topk
        self.sigmoid, self.sigmoid_float32 = cfg.sigmoid_routing, cfg.sigmoid_float32
        self.scaling, self.norm_min = cfg.routed_scaling, cfg.routing_norm_min
        self.norm_eps = cfg.sigmoid_norm_eps if cfg.sigmoid_routing else 0.0  # (added to the sum of the top k)
        self.round_weights = cfg.round_routing_weights
        self.groups, self.group_top2 = cfg.expert_groups, cfg.group_scores_top2
        self.softmax_dtype = None if cfg.router_model_dtype else torch.float32
        self.sparsemixer_eps = cfg.sparsemixer_eps
        p = f"blocks.{layer}.mlp."
        self.hook_router_logits, self.hook_expert_ids = p + "hook_router_logits", p + "hook_expert_ids"
        self.hook_expert_weights = p + "hook_expert_weights"

    def __call__(
        self, logits: torch.Tensor, bias: torch.Tensor | None = None, rows: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]); `bias` [E]: what the choice adds to each expert's score (LFM2-MoE);
        `rows`: the taps' dtype, the model's, where the logits are wider (Nemotron 3's float32 router)."""
        rows, normalised = rows or logits.dtype, False
        logits = tap_widened(self.hook_router_logits, logits, rows)
        if self.sigmoid:  # (TransformerLens's expert weights: every expert's score)
            scores = (logits.float() if self.sigmoid_float32 else logits).sigmoid()
            scores = tap_widened(self.hook_expert_weights, scores, rows)
            choice = self._in_best_groups(scores if bias is None else scores + bias.float(), float("-inf"))
            ids = choice.topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, ids)
        elif self.softmax_after_topk or self.sigmoid_after_topk or self.sparsemixer_eps is not None:
            if self.sparsemixer_eps is not None:
                weights, ids = sparsemixer(logits, self.sparsemixer_eps)
            else:  # (in the logits' dtype, as HF's gpt-oss; Llama 4's sigmoids in float32, rounded back)
                top, ids = logits.topk(self.top_k, dim=-1)
                weights = torch.softmax(top, dim=-1) if self.softmax_after_topk else top.float().sigmoid().to(top.dtype)
                if self.sigmoid_after_topk and self.norm_topk:  # (Cohere 2's MoE: renormalised before they weigh)
                    weights, normalised = weights / weights.sum(dim=-1, keepdim=True), True
            if tapped(self.hook_expert_weights):  # (TransformerLens's [E]: the chosen k's weights, zeros elsewhere)
                every = torch.zeros_like(logits).scatter(-1, ids, weights)
                weights = tap(self.hook_expert_weights, every).gather(-1, ids)
        else:
            # (float32, as HF's softmaxes are; Mistral 4's in its logits' dtype)
            probabilities = torch.softmax(logits, dim=-1, dtype=self.softmax_dtype)
            if tapped(self.hook_expert_weights):  # (seen in the model's dtype, as every tap but the ids are; the
                # experts chosen from the float32 values, as HF chooses, unless an edit gives others)
                seen = probabilities.to(rows)
                edited = tap(self.hook_expert_weights, seen)
                probabilities = probabilities if edited is seen else edited.float()
            choice = self._in_best_groups(probabilities, 0.0)  # (ERNIE 4.5: plus its bias per expert)
            ids = (choice if bias is None else choice + bias.float()).topk(self.top_k, dim=-1).indices
            weights = probabilities.gather(-1, ids)
        if self.pnorm is not None:  # (DBRX's: the top k over their p-norm, as HF divides them)
            weights = weights / torch.norm(weights, p=self.pnorm, dim=-1, keepdim=True)
        elif self.norm_topk and not normalised:
            total = weights.sum(dim=-1, keepdim=True)  # (ERNIE 4.5's: at least norm_min)
            weights = weights / (total.clamp(min=self.norm_min) if self.norm_min else total + self.norm_eps)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        if self.round_weights:
            weights = weights.to(rows)
        return weights, tap(self.hook_expert_ids, ids)

    def _in_best_groups(self, scores: torch.Tensor, fill: float) -> torch.Tensor:
        """`scores` [T, E], those of the experts outside each token's best groups set to `fill` (DeepSeek's
        group-limited routing, `cfg.expert_groups`: a group scored by its best two scores, as HF's DeepSeek-V3 and
        Mistral 4 score them, or by its best one, as V2); `scores` itself where routing is not limited."""
        groups, kept = self.groups
        if kept == groups:
            return scores
        grouped = scores.view(-1, groups, scores.shape[-1] // groups)
        score = grouped.topk(2, dim=-1).values.sum(-1) if self.group_top2 else grouped.amax(-1)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter(1, score.topk(kept, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], fill).flatten(1)


def sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's choice of two experts, as HF's SparseMixer makes it at inference, in the logits' dtype: the best
    logit's expert, weighed by the softmax of the logits within `2 eps` (relative) of it; then the best of the rest's,
    weighed by the softmax of the rest within `2 eps` of theirs. (weights [T, 2], ids [T, 2])."""

    def pick(rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best, chosen = rest.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
        return torch.softmax(rest.masked_fill(far, float("-inf")), dim=-1).gather(-1, chosen), chosen

    first, ids = pick(logits)
    second, other = pick(logits.scatter(-1, ids, float("-inf")))
    return torch.cat([first, second], dim=-1), torch.cat([ids, other], dim=-1)


class NormedRouter(nn.Module):
    """Gemma 4's router: it reads the stream RMS-normalised (no weight), times a learned scale and 1/sqrt(d), and
    the chosen experts' renormalised weights are multiplied by a learned scale per expert."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.norm = UnscaledRMSNorm(cfg.norm_eps)
        self.routing = Routing(cfg, layer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.routing(self.proj(self.norm(x) * self.scale * x.shape[-1] ** -0.5))
        return weights * self.per_expert_scale[ids], ids


class SparseMoE(nn.Module):
    """`stored_as`: this block's name in checkpoints (Mixtral: block_sparse_moe; HF 5 calls it mlp), its
    router's (gpt-oss: router; the rest: gate) and, where it is not expert_bias, its bias per expert's; `shared_as`:
    its shared expert's (Cohere 2's MoE models: shared_experts)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, stored_as: tuple[str, ...], expert_names: tuple[str, str, str] | None,
        shared_as: str = "shared_expert",
    ):  # fmt: skip
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        if cfg.swiglu_clamp is not None:
            self.experts = ClampedExperts(cfg)
        else:
            experts = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act, expert_names)
            self.experts = Experts(*experts, cfg.parallel)
        self.routing = Routing(cfg, layer)
        self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.expert_bias else None  # (LFM2-MoE's)
        self.stored_as = stored_as
        p = f"blocks.{layer}.mlp."
        self.shared, self.shared_as = cfg.shared_expert_intermediate_size > 0, shared_as
        self.shared_mix = cfg.shared_expert_mix
        if self.shared:
            size = cfg.shared_expert_intermediate_size
            hook = p + "shared_expert.hook_post"
            self.shared_expert = GatedMLP(cfg.hidden_size, size, cfg.hidden_act, False, hook, parallel=cfg.parallel)
            if self.shared_mix == "gate":
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        block, router, *bias = self.stored_as
        stored = f"{path.rpartition('.')[0]}.{block}"
        slots: dict[str, Slot] = {}
        renamed = {"gate": router, "shared_expert": self.shared_as}
        for name, child in self.named_children():
            slots |= checkpoint_slots(child, f"{stored}.{renamed.get(name, name)}")
        if self.expert_bias is not None:
            slots[f"{stored}.{bias[0] if bias else 'expert_bias'}"] = Slot(self.expert_bias)
        return slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing(self.gate(x), self.expert_bias)
        out = self.experts(x, ids, weights)
        if self.shared_mix == "gate" and self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared:  # (Cohere 2's MoE models: their sum, or its half)
            out = out + self.shared_expert(x)
            out = out / 2 if self.shared_mix == "average" else out
        return out


class DeepseekRouter(nn.Module):
    """DeepSeek's router (Nemotron 3's, GLM-4.5's, ERNIE 4.5's, Hunyuan's), in float32 whatever the model's dtype, as
    HF keeps it (Mistral 4's and AFMoE's, `cfg.router_model_dtype`, in the model's): its weight and, where the model
    has them (`cfg.expert_bias`: DeepSeek-V3's), each expert's correction bias, which the choice adds to the expert's
    score (ERNIE 4.5 stores it [1, E])."""

    float32_params = ("weight", "e_score_correction_bias")  # (vlens.loader.keep_float32)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.expert_bias else None
        self.float32 = not cfg.router_model_dtype
        if not self.float32:  # (AFMoE's bias stays float32, as HF keeps it)
            self.float32_params = ("e_score_correction_bias",)

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        slots = {f"{path}.weight": Slot(self.weight)}
        if self.e_score_correction_bias is not None:
            slots[f"{path}.e_score_correction_bias"] = Slot(self.e_score_correction_bias, transform=torch.ravel)
        return slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float() if self.float32 else x, self.weight)


class DeepseekMoE(nn.Module):
    """Routed experts chosen as DeepSeek chooses them (V2: a softmax; V3, Nemotron 3, GLM-4.5: sigmoids plus a
    correction bias per expert; ERNIE 4.5: a softmax plus one; Mistral 4: a softmax in the model's dtype; their top k
    renormalised and scaled as cfg's routing flags say) from a float32 router's logits (Mistral 4's: the model's
    dtype), beside `shared`, the always-on expert (`shared_experts`; None: none); the experts' gate, up and down one
    tensor each in the checkpoint (`gated` False, Nemotron 3's: up and down alone). `stored_as`: the checkpoint's
    names, within the block, of those of its tensors it names otherwise (by vlens's name or a module's: ERNIE 4.5's
    correction bias in `moe_statics`, Hunyuan's router `gate.wg`)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, shared: nn.Module | None, gated: bool = True,
        stored_as: Mapping[str, str] | None = None,
        expert_names: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj"),
    ):  # fmt: skip
        """`expert_names`: each expert's projections' names in the checkpoint; None where it holds all experts in
        one tensor per projection (Mistral 4's)."""
        super().__init__()
        self.gate = DeepseekRouter(cfg)
        self.stored_as = dict(stored_as or {})
        sizes = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        self.experts = Experts(*sizes, expert_names, cfg.parallel, gated=gated)
        self.shared_experts = shared
        self.routing = Routing(cfg, layer)

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        slots = {}
        for name, child in self.named_children():
            for key, slot in checkpoint_slots(child, name).items():
                ours = next((o for o in self.stored_as if key == o or key.startswith(o + ".")), None)
                slots[f"{path}.{key if ours is None else self.stored_as[ours] + key[len(ours):]}"] = slot
        return slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing(self.gate(x), self.gate.e_score_correction_bias, x.dtype)
        out = self.experts(x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)
