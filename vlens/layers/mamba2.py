"""Mamba 2 mixers (state space duality, SSD): the token mixer of Bamba's layers, with HF's numerics and its taps.

One projection gives the gate z, the convolution's input (x, B and C together) and each head's time step dt. After
the causal convolution (vlens.layers.causal_conv) and its activation, each head h keeps a state S [head dim, state
size] (float32, in the runner's state slots: vlens.layers.slot_states); per token, with dt = softplus(dt + dt_bias)
and A = -exp(A_log): S = exp(dt * A) S + dt * x Bᵀ, and the output is S C + D x (B and C shared by the heads of a
group). Prompts run chunk by chunk (HF's chunked form, SSD's: within a chunk an attention-like product of C and B
under the decays, across chunks the states carried sequence by sequence; the chunks' layout is linear attention's,
vlens.attention.metadata.chunk_layout); a step in which every sequence feeds one token runs the recurrence itself.
The output, gated by silu(z), is RMS-normalised group by group and projected back.

Taps, under `blocks.L.mamba.`: hook_x [heads, head dim], hook_b and hook_c [groups, state size] (after the
convolution), hook_dt [heads] (after dt_bias and softplus), hook_ssm_out [heads, head dim] (the scan's output, D's
skip included), hook_gate [inner] (z) and hook_z [inner] (the gated norm's output, the output projection's input, as
attn.hook_z is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlens.attention.metadata import CHUNK, AttentionMetadata, LinearChunks
from vlens.config import ModelConfig
from vlens.context import get_context, tap, tap_widened
from vlens.distributed.parallel import SINGLE, Parallel, all_reduce
from vlens.layers.causal_conv import CausalConv
from vlens.layers.checkpoint import Slot
from vlens.layers.linear import RowLinear
from vlens.layers.mlp import activation
from vlens.layers.slot_states import Shapes, SlotStates, step_slots


class GroupGatedRMSNorm(nn.Module):
    """x times silu(gate) in float32, RMS-normalised group by group, cast back to x's dtype and scaled by w (HF's
    order: Mamba 2's norm after the gate); `kind` (ModelConfig.ssm_norm) "gate_then_norm_float" scales by w in float32
    before the cast, "norm_then_gate" the same with the gate last (Falcon-H1's). `spread`: this rank holds a 1 /
    spread share of its one group (tensor parallelism over fewer groups than ranks), whose sum of squares the ranks
    add up."""

    def __init__(
        self, dim: int, groups: int, eps: float, parallel: Parallel = SINGLE, spread: int = 1,
        kind: str = "gate_then_norm",
    ):  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.parallel, self.spread, self.kind = groups, eps, parallel, spread, kind

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.kind != "norm_then_gate":
            h = h * F.silu(gate.float())
        h = h.view(*h.shape[:-1], self.groups, -1)
        if self.spread == 1:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = all_reduce(h.pow(2).sum(-1, keepdim=True), self.parallel) / (h.shape[-1] * self.spread)
        h = (h * torch.rsqrt(variance + self.eps)).flatten(-2)
        if self.kind == "gate_then_norm":
            return self.weight * h.to(x.dtype)
        h = self.weight * h  # (Falcon-H1: in float32)
        return (h * F.silu(gate.float()) if self.kind == "norm_then_gate" else h).to(x.dtype)


class Mamba2Mixer(SlotStates):
    """Bamba's and Granite 4.0's `mamba`, its parameters named as HF's. Under tensor parallelism each rank holds its
    share of the heads (their rows of z, x and dt, of the convolution, their states, out_proj's matching columns) and
    of the groups of B and C (where there are fewer groups than ranks, the one its heads read: replicated)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        parallel = cfg.parallel
        self.all_heads, self.all_groups = cfg.ssm_heads, cfg.ssm_groups
        self.mine, self.my_groups = parallel.units(self.all_heads), parallel.units(self.all_groups)
        self.heads, self.groups, self.head_dim = len(self.mine), len(self.my_groups), cfg.ssm_head_dim
        self.state_size, self.dt_limit = cfg.ssm_state_size, cfg.ssm_dt_limit
        inner, d = self.heads * self.head_dim, cfg.hidden_size
        channels = inner + 2 * self.groups * self.state_size
        self.split = (inner, channels, self.heads)
        self.in_proj = nn.Linear(d, sum(self.split), bias=cfg.ssm_proj_bias)
        self.conv1d = CausalConv(channels, cfg.ssm_conv_kernel, bias=cfg.ssm_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        spread = max(1, parallel.size // self.all_groups)  # (ranks a group's heads are spread over)
        if cfg.ssm_norm != "gate":  # (Falcon-H1's may have none: y times silu(z))
            self.norm = GroupGatedRMSNorm(inner, self.groups, cfg.norm_eps, parallel, spread, cfg.ssm_norm)
        out_bias = cfg.ssm_proj_bias if cfg.ssm_out_bias is None else cfg.ssm_out_bias
        self.out_proj = RowLinear(self.all_heads * self.head_dim, d, out_bias, parallel, units=self.all_heads)
        self.multipliers = cfg.ssm_multipliers  # (Falcon-H1's µP: z, x, B, C and dt as projected)
        self.act = activation(cfg.ssm_hidden_act or cfg.hidden_act)
        p = f"blocks.{layer}.mamba."
        self.hook_x, self.hook_b, self.hook_c, self.hook_dt = p + "hook_x", p + "hook_b", p + "hook_c", p + "hook_dt"
        self.hook_ssm_out, self.hook_gate, self.hook_z = p + "hook_ssm_out", p + "hook_gate", p + "hook_z"
        self.state: torch.Tensor | None = None  # [slots, heads, head dim, state size]: the SSM states

    def slot_shapes(self) -> Shapes:
        return {"state": ((self.heads, self.head_dim, self.state_size), torch.float32)}

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        """This rank's rows of each stored tensor (all of them in one process): in_proj's z, x, B, C and dt (their
        stored order), the convolution's x, B and C, the heads' own parameters."""
        p, n, inner = self.head_dim, self.state_size, self.all_heads * self.head_dim
        heads = list(range(self.mine.start * p, self.mine.stop * p))
        groups = list(range(self.my_groups.start * n, self.my_groups.stop * n))
        spans = self.all_groups * n
        xbc = heads + [inner + r for r in groups] + [inner + spans + r for r in groups]  # (the convolution's channels)
        dt = [2 * inner + 2 * spans + h for h in self.mine]
        rows = (torch.tensor(heads + [inner + r for r in xbc] + dt),)
        own = (torch.tensor(list(self.mine)),)
        slots = {f"{path}.in_proj.{leaf}": Slot(t, source=rows) for leaf, t in self.in_proj.named_parameters()}
        slots |= {f"{path}.conv1d.{leaf}": Slot(t, source=(torch.tensor(xbc),))
                  for leaf, t in self.conv1d.named_parameters()}  # fmt: skip
        slots |= {f"{path}.{name}": Slot(getattr(self, name), source=own) for name in ("dt_bias", "A_log", "D")}
        if hasattr(self, "norm"):
            slots[f"{path}.norm.weight"] = Slot(self.norm.weight, source=(torch.tensor(heads),))
        return slots | self.out_proj.checkpoint_slots(f"{path}.out_proj")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        meta, t = get_context().attention, h.shape[0]
        gate, xbc, dt = self.in_proj(h).split(self.split, -1)
        parts = (self.split[0], *(self.groups * self.state_size,) * 2)
        if self.multipliers:  # (Falcon-H1's, in the model's dtype, as HF's mup_vector holds them)
            z, xm, bm, cm, dm = (torch.tensor(m, dtype=h.dtype) for m in self.multipliers)
            gate, dt = gate * z, dt * dm
            xbc = torch.cat([v * m for v, m in zip(xbc.split(parts, -1), (xm, bm, cm))], -1)
        x, b, c = self.act(self.conv1d(xbc, meta)).split(parts, -1)
        x = tap(self.hook_x, x.reshape(t, self.heads, self.head_dim))
        b = tap(self.hook_b, b.reshape(t, self.groups, self.state_size))
        c = tap(self.hook_c, c.reshape(t, self.groups, self.state_size))
        dt = tap(self.hook_dt, F.softplus(dt + self.dt_bias))
        y = tap_widened(self.hook_ssm_out, self.scan(x, b, c, dt, meta), h.dtype)
        gate = tap(self.hook_gate, gate)
        y = y.flatten(1)
        z = self.norm(y, gate) if hasattr(self, "norm") else y * F.silu(gate)
        z = tap_widened(self.hook_z, z, h.dtype)  # (float32 after a chunked scan)
        return self.out_proj(z.to(h.dtype))

    def scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, meta: AttentionMetadata):
        """The scan's output [T, heads, head dim] (D's skip included): float32 where prompts run in chunks, the
        model's dtype where every sequence feeds one token (as HF's two forms give it)."""
        per_group = self.heads // self.groups
        b, c = (v.repeat_interleave(per_group, 1) for v in (b, c))  # [T, heads, state size]
        if meta.linear_chunks is not None:  # (HF's chunked scan clamps the time steps)
            dt = dt.clamp(*self.dt_limit)
        return scan_sequences(self, (_recurrent_step, _chunked), (x, b, c, dt), -torch.exp(self.A_log.float()),
                              self.D, meta)  # fmt: skip


def scan_sequences(
    layer: SlotStates, forms: tuple[Callable, Callable], rows: tuple[torch.Tensor, ...], a: torch.Tensor,
    d: torch.Tensor, meta: AttentionMetadata,
) -> torch.Tensor:  # fmt: skip
    """A Mamba mixer's scan over each sequence's `rows` (x, B, C, dt: [T, ...] each), from its saved state (or zeros),
    which is saved again after (`layer.state`): by the recurrence (`forms[0]`) where every sequence feeds one row,
    else the chunked form (`forms[1]`) for the sequences that feed several and the recurrence for the others. The
    output [T, ...], x's shape: float32 but where the recurrence alone ran (the model's dtype)."""
    recurrent, chunked = forms
    slots = step_slots(layer, "state", meta)
    shape, _ = layer.slot_shapes()["state"]
    x = rows[0]
    if slots is None:
        state = x.new_zeros((len(meta.query_lens), *shape), dtype=torch.float32)
    else:
        state = slots.read(layer.state)
    chunks = meta.linear_chunks
    if chunks is None:  # (a row per sequence)
        y, state = recurrent(*rows, a, d, state)
    else:
        y, before, state = x.new_empty(x.shape, dtype=torch.float32), state, state.clone()
        single, seqs = chunks.single_rows, chunks.single_seqs
        if len(single):
            y[single], state[seqs] = recurrent(*(v[single] for v in rows), a, d, before[seqs])
        seqs = chunks.chunked_seqs
        y[chunks.chunked_rows], state[seqs] = chunked(*rows, a, d, before[seqs], chunks)
    if slots is not None:
        slots.write(layer.state, state)
    return y


def _recurrent_step(
    x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of each sequence (row i of sequence i), as HF's selective state update computes it."""
    decay = torch.exp(dt.float()[..., None, None] * a[:, None, None])  # [B, heads, 1, 1]
    state = state * decay + ((dt[..., None] * b)[:, :, None, :] * x[..., None])
    y = (state.to(c.dtype) @ c[..., None])[..., 0]
    return (y + x * d[:, None]).to(x.dtype), state


def _chunked(
    x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, d: torch.Tensor,
    state: torch.Tensor, chunks: LinearChunks,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The same recurrence over the chunked sequences' rows (of all T rows), CHUNK at a time (SSD's chunked form, as
    HF's chunk scan computes within a chunk): the rows' outputs (in `chunks.chunked_rows`' order, float32) and the
    sequences' states after them."""
    x, b, c = x.float(), b.float(), c.float()
    skip = x * d.float()[:, None]
    x = x * dt.float()[..., None]
    log_decay = a * dt.float()  # [T, heads]
    x, b, c, log_decay = (chunks.of(v) for v in (x, b, c, log_decay))  # [N, CHUNK, ...]
    total = log_decay.cumsum(1)  # [N, CHUNK, heads]: from the chunk's start to each row
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).triu(1)
    between = (total[:, :, None] - total[:, None]).masked_fill(later[..., None], float("-inf")).exp()  # [N, l, s, h]
    within = torch.einsum("nlhs,nmhs->nlmh", c, b) * between
    y = torch.einsum("nlmh,nmhp->nlhp", within, x)
    to_end = torch.exp(total[:, -1:] - total)  # [N, CHUNK, heads]
    made = torch.einsum("nlhs,nlh,nlhp->nhps", b, to_end, x)  # each chunk's own contribution to the state
    chunk_decay = total[:, -1].exp()[..., None, None]  # [N, heads, 1, 1]
    # (chunk N: zeros, which change no state: what a sequence reads past its last chunk)
    c, total, made = (torch.cat([v, v.new_zeros(1, *v.shape[1:])]) for v in (c, total, made))
    chunk_decay = torch.cat([chunk_decay, chunk_decay.new_ones(1, *chunk_decay.shape[1:])])
    reads = y.new_empty(len(c), *y.shape[1:])
    for s in range(chunks.table.shape[1]):
        i = chunks.table[:, s]
        reads[i] = torch.einsum("blhs,bhps->blhp", c[i], state) * total[i].exp()[..., None]
        state = state * chunk_decay[i] + made[i]
    y = (y + reads[:-1]).flatten(0, 1)[chunks.place]  # [Tc, heads, head dim]
    return y + skip[chunks.chunked_rows], state
