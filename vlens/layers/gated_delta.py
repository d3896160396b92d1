"""Gated delta nets: the linear attention of Qwen 3.5's layers (and Qwen3-Next's), with HF's numerics and its taps.

A layer keeps, per sequence, a recurrent state S [value heads, key dim, value dim] (float32) and the last inputs of a
short causal convolution (vlens.layers.causal_conv), both in the runner's state slots (vlens.layers.slot_states).
Each token, after the convolution: S decays by exp(g), the value S predicts for the key moves towards the token's
value by beta (the delta rule), and the query reads S. Prompts run chunk by chunk (HF's chunked form: 64 tokens a
chunk, from each sequence's first row of the forward, so a sequence computes as it does alone; the runner plans the
chunks' layout, vlens.attention.metadata.chunk_layout); a step in which every sequence feeds one token runs the
recurrence itself, in fixed shapes, which is what a decode step's CUDA graph captures.

Taps, under `blocks.L.linear_attn.`: hook_q, hook_k [key heads, key dim] and hook_v [value heads, value dim] (after
the convolution, before the delta rule's L2 norm), hook_beta and hook_decay (g, the log of the decay) [value heads],
hook_core_out (what the queries read) and hook_gate (the gate's input) [value heads, value dim], and hook_z, the
output projection's input (the gated norm's output), as an attention layer's attn.hook_z is.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vlens.attention.metadata import CHUNK, AttentionMetadata, LinearChunks
from vlens.config import ModelConfig
from vlens.context import get_context, tap, tap_widened
from vlens.layers.causal_conv import CausalConv
from vlens.layers.checkpoint import Slot
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import activation
from vlens.layers.slot_states import Shapes, SlotStates, step_slots


class GatedRMSNorm(nn.Module):
    """RMS-normalised per head, scaled by w after the cast back, times silu(gate) in float32 (HF's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(SlotStates):
    """Qwen 3.5's and Qwen3-Next's `linear_attn`, its parameters named as HF's (Qwen 3.5's: vlens/config.py's
    `linear_stored_grouped` says how Qwen3-Next's load; OLMo Hybrid's: `OlmoHybridGatedDeltaNet`). Under tensor
    parallelism each rank holds its share of the key heads and the value heads they serve: their rows of every
    projection and of the convolution, their states, and out_proj's matching columns (summed over the ranks)."""

    norm_name, out_name = "norm", "out_proj"  # (the checkpoint's names of the gated norm and the output projection)

    def __init__(self, cfg: ModelConfig, layer: int, norm_eps: float | None = None):
        """`norm_eps`: the gated norm's (default the model's norm_eps)."""
        super().__init__()
        self.key_dim, self.value_dim, parallel = cfg.linear_key_dim, cfg.linear_value_dim, cfg.parallel
        self.all_key_heads, self.all_value_heads = cfg.linear_key_heads, cfg.linear_value_heads
        self.mine = parallel.units(self.all_key_heads)  # this rank's key heads, and the value heads they serve
        self.per_key = self.all_value_heads // self.all_key_heads
        self.key_heads, self.value_heads = len(self.mine), len(self.mine) * self.per_key
        keys, values, d = self.key_heads * self.key_dim, self.value_heads * self.value_dim, cfg.hidden_size
        self.split = (keys, keys, values)
        channels = 2 * keys + values
        # (one GEMM; the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a load into its rows)
        heads = self.value_heads
        self.in_proj = FusedLinear(d, {"in_proj_qkv": channels, "in_proj_z": values, "in_proj_b": heads,
                                       "in_proj_a": heads}, bias=False)  # fmt: skip
        self.stored_grouped = cfg.linear_stored_grouped
        self.conv1d = CausalConv(channels, cfg.linear_conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.norm_eps if norm_eps is None else norm_eps)
        self.beta_scale = cfg.linear_beta_scale
        self.out_proj = RowLinear(self.all_value_heads * self.value_dim, d, False, parallel, units=self.all_value_heads)
        self.act = activation(cfg.hidden_act)
        p = f"blocks.{layer}.linear_attn."
        self.hook_q, self.hook_k, self.hook_v = p + "hook_q", p + "hook_k", p + "hook_v"
        self.hook_beta, self.hook_decay, self.hook_core_out = p + "hook_beta", p + "hook_decay", p + "hook_core_out"
        self.hook_gate, self.hook_z = p + "hook_gate", p + "hook_z"
        self.state: torch.Tensor | None = None  # [slots, value heads, key dim, value dim]: the recurrent states

    def slot_shapes(self) -> Shapes:
        return {"state": ((self.value_heads, self.key_dim, self.value_dim), torch.float32)}

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        """Each stored tensor into its rows of `in_proj` (this rank's heads' rows of it: `_rows`); Qwen3-Next's
        checkpoints fuse the projections in two tensors grouped by key head, regrouped (q, k, v, z; b, a) as they
        load."""
        kd, vd, n_keys = self.key_dim, self.value_dim, self.all_key_heads
        q, v = self._rows(kd, self.mine), self._rows(vd, self._values)  # (z's rows are v's)
        qkv = [*q, *(r + n_keys * kd for r in q), *(r + 2 * n_keys * kd for r in v)]  # (in in_proj_qkv, stored)
        channels = (torch.tensor(qkv),)
        b = self._rows(1, self._values)
        slots = {
            f"{path}.conv1d.weight": Slot(self.conv1d.weight, source=channels),
            f"{path}.dt_bias": Slot(self.dt_bias, source=(torch.tensor(b),)),
            f"{path}.A_log": Slot(self.A_log, source=(torch.tensor(b),)),
            f"{path}.{self.norm_name}.weight": Slot(self.norm.weight),
            **self.out_proj.checkpoint_slots(f"{path}.{self.out_name}"),
        }
        return slots | self.projection_slots(path, qkv, q, v, b)

    def projection_slots(
        self, path: str, qkv: list[int], q: list[int], v: list[int], b: list[int]
    ) -> dict[str, Slot]:  # fmt: skip
        """The stored projections into `in_proj`'s rows, from this rank's rows of them: `qkv` in the q, k, v
        projection, `q` (`k`'s alike) and `v` in one head kind's own, `b` in beta's and the decay's."""
        rows, weight = self.in_proj.part_rows(), self.in_proj.weight
        kd, vd, n_keys, n_values = self.key_dim, self.value_dim, self.all_key_heads, self.all_value_heads
        if not self.stored_grouped:
            parts = {"in_proj_qkv": qkv, "in_proj_z": v, "in_proj_b": b, "in_proj_a": b}
            return {f"{path}.{name}.weight": Slot(weight, rows[name], source=(torch.tensor(parts[name]),))
                    for name in parts}  # fmt: skip
        ungrouped_z = [r + 2 * n_keys * kd + n_values * vd for r in v]  # (in in_proj_qkvz, regrouped: q, k, v, z)
        qkvz = slice(0, rows["in_proj_z"].stop)
        return {
            f"{path}.in_proj_qkvz.weight": Slot(weight, qkvz, partial(self._ungroup, (kd, kd)),
                                                (torch.tensor(qkv + ungrouped_z),)),
            f"{path}.in_proj_ba.weight": Slot(weight, slice(qkvz.stop, None), partial(self._ungroup, ()),
                                              (torch.tensor(b + [r + n_values for r in b]),)),
        }  # fmt: skip

    @property
    def _values(self) -> range:
        """This rank's value heads: those its key heads serve."""
        return range(self.mine.start * self.per_key, self.mine.stop * self.per_key)

    @staticmethod
    def _rows(size: int, heads: range) -> list[int]:
        """The rows of `heads` heads of `size` rows each, in a tensor of every head's, head after head."""
        return list(range(heads.start * size, heads.stop * size))

    def _ungroup(self, keys: tuple[int, ...], w: torch.Tensor) -> torch.Tensor:
        """Rows grouped by key head (each key head's `keys` parts, then two of its value heads') -> each part's rows
        for every head together, in order."""
        per_value = self.per_key * (self.value_dim if keys else 1)
        sizes = [*keys, per_value, per_value]
        parts = w.view(self.all_key_heads, sum(sizes), -1).split(sizes, 1)
        return torch.cat([part.flatten(0, 1) for part in parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = get_context().attention
        t = x.shape[0]
        qkv, gate, b, a = self.in_proj.split(self.in_proj(x))
        q, k, v = self.act(self.conv1d(qkv, meta)).split(self.split, -1)
        q = tap(self.hook_q, q.reshape(t, self.key_heads, self.key_dim))
        k = tap(self.hook_k, k.reshape(t, self.key_heads, self.key_dim))
        v = tap(self.hook_v, v.reshape(t, self.value_heads, self.value_dim))
        beta = b.sigmoid() if self.beta_scale == 1.0 else b.sigmoid() * self.beta_scale  # (OLMo Hybrid's: [0, 2])
        beta = tap(self.hook_beta, beta)
        decay = tap_widened(self.hook_decay, -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), x.dtype)
        out = tap(self.hook_core_out, self.delta_rule(q, k, v, decay, beta, meta).to(x.dtype))
        gate = tap(self.hook_gate, gate.reshape(t, self.value_heads, self.value_dim))
        z = tap(self.hook_z, self.norm(out, gate))
        return self.out_proj(z.flatten(1))

    def delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """What each row's query reads [T, value heads, value dim] (float32), from the sequences' saved states (or
        zeros), which are saved again after."""
        slots = step_slots(self, "state", meta)
        groups = self.value_heads // self.key_heads  # (each query/key head serves that many value heads)
        q, k = (x.float().repeat_interleave(groups, 1) if groups > 1 else x.float() for x in (q, k))
        q, k, v, beta = _l2norm(q), _l2norm(k), v.float(), beta.float()
        batch = len(meta.query_lens)
        shape = (batch, self.value_heads, self.key_dim, self.value_dim)
        if slots is None:
            state = q.new_zeros(shape)
        else:
            state = slots.read(self.state)
        chunks = meta.linear_chunks
        if chunks is None:  # (a row per sequence: the recurrence itself, as HF decodes)
            out, state = _recurrent_step(q / self.key_dim**0.5, k, v, decay, beta, state)
        else:  # (the sequences that feed several rows in chunks, HF's chunked form; the others by the recurrence)
            out, before, state = q.new_empty(v.shape), state, state.clone()
            rows, seqs = chunks.single_rows, chunks.single_seqs
            if len(rows):
                out[rows], state[seqs] = _recurrent_step(
                    q[rows] / self.key_dim**0.5, k[rows], v[rows], decay[rows], beta[rows], before[seqs]
                )  # fmt: skip
            seqs = chunks.chunked_seqs
            out[chunks.chunked_rows], state[seqs] = _chunked(
                q * self.key_dim**-0.5, k, v, decay, beta, before[seqs], chunks
            )  # fmt: skip
        if slots is not None:
            slots.write(self.state, state)
        return out


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    """OLMo Hybrid's `linear_attn`: Qwen 3.5's net, each projection stored apart (q_proj, k_proj, v_proj, g_proj: the
    gate's, a_proj, b_proj; o_proj) and the convolution's channels too (q_conv1d, k_conv1d, v_conv1d), its gated norm
    `o_norm` of eps 1e-5 whatever the model's, beta in [0, 2] where linear_allow_neg_eigval (cfg.linear_beta_scale)."""

    norm_name, out_name = "o_norm", "o_proj"
    float32_params = ("A_log",)  # (HF keeps it in float32 whatever the model's dtype; vlens.loader.keep_float32)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer, norm_eps=1e-5)

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        slots = super().checkpoint_slots(path)
        del slots[f"{path}.conv1d.weight"]
        q, v = self._rows(self.key_dim, self.mine), self._rows(self.value_dim, self._values)
        keys, _, values = self.split
        parts = {"q": (slice(0, keys), q), "k": (slice(keys, 2 * keys), q),
                 "v": (slice(2 * keys, 2 * keys + values), v)}  # fmt: skip
        return slots | {f"{path}.{part}_conv1d.weight": Slot(self.conv1d.weight, into, source=(torch.tensor(rows),))
                        for part, (into, rows) in parts.items()}  # fmt: skip

    def projection_slots(
        self, path: str, qkv: list[int], q: list[int], v: list[int], b: list[int]
    ) -> dict[str, Slot]:  # fmt: skip
        rows, (keys, _, values) = self.in_proj.part_rows(), self.split
        start = rows["in_proj_qkv"].start
        parts = {"q_proj": (slice(start, start + keys), q), "k_proj": (slice(start + keys, start + 2 * keys), q),
                 "v_proj": (slice(start + 2 * keys, start + 2 * keys + values), v), "g_proj": (rows["in_proj_z"], v),
                 "b_proj": (rows["in_proj_b"], b), "a_proj": (rows["in_proj_a"], b)}  # fmt: skip
        return {f"{path}.{name}.weight": Slot(self.in_proj.weight, into, source=(torch.tensor(source),))
                for name, (into, source) in parts.items()}  # fmt: skip


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each sequence (row b of sequence b): the state decays, learns the token's value for its key by
    beta, and the query reads it."""
    state = state * decay.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def _chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunks: LinearChunks,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The same recurrence over the chunked sequences' rows (of all T rows), CHUNK at a time (HF's chunked form):
    within a chunk, the delta rule's updates solved together as one triangular system; across chunks, the state
    carried sequence by sequence. Every chunk of every sequence is computed at once; the scan runs as many times as
    the longest sequence has chunks, each sequence reading a zero chunk (which leaves its state as it is) past its
    last. Returns their rows' outputs (in `chunks.chunked_rows`' order) and their states."""
    table, place = chunks.table, chunks.place
    heads_first = lambda x: x.transpose(1, 2)  # noqa: E731 - [N, CHUNK, H, ...] -> [N, H, CHUNK, ...]
    q, k, v, beta, decay = (heads_first(chunks.of(x)) for x in (q, k, v, beta, decay))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    total = decay.cumsum(-1)  # the log decay from the chunk's start to each position
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    between = (total[..., :, None] - total[..., None, :]).masked_fill(later, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * between
    within = (q @ k.transpose(-1, -2)) * between
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * total.exp()[..., None], upper=False, unitriangular=True)
    q = q * total.exp()[..., None]
    k = k * (total[..., -1:] - total).exp()[..., None]
    chunk_decay = total[..., -1].exp()[..., None, None]
    # (chunk N: zeros, which change no state: what a sequence reads past its last chunk)
    values, reads, q, k, within = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (values, reads, q, k, within))
    chunk_decay = torch.cat([chunk_decay, chunk_decay.new_ones(1, *chunk_decay.shape[1:])])
    out = values.new_empty(values.shape)
    for s in range(table.shape[1]):
        i = table[:, s]
        new = values[i] - reads[i] @ state
        out[i] = q[i] @ state + within[i] @ new
        state = state * chunk_decay[i] + k[i].transpose(-1, -2) @ new
    out = out[:-1].transpose(1, 2).flatten(0, 1)  # [N * CHUNK, H, value dim]
    return out[place], state
