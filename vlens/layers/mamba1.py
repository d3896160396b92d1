"""Mamba's mixer (the selective scan, S6): the token mixer of Mamba and Falcon Mamba, with HF's numerics and its taps.

One projection gives x and the gate z; x goes through the causal convolution (vlens.layers.causal_conv) and its
activation, then a second projection gives each token's B and C [state size] and the time step's low-rank input,
which dt_proj widens to one time step per channel (dt = softplus(dt + bias)). Each channel c keeps a state [state
size] (float32, in the runner's state slots: vlens.layers.slot_states), A = -exp(A_log) [channels, state size]; per
token: S = exp(dt * A) S + dt * B x, and the output is S·C + D x, gated by silu(z) and projected back. Falcon Mamba
RMS-normalises the time step's input, B and C (without weights) first, Jamba the same with weights.

Unlike Mamba 2, A differs per state dimension, so there is no attention-like form to run a chunk at once: a prompt's
rows run the recurrence itself, every chunk of CHUNK rows of every sequence at once, twice — first from zeros, for
what each chunk adds to the state and how much it decays it; then, the states carried across chunks sequence by
sequence, again from the state each chunk starts from, reading the outputs. That is 2 * CHUNK steps a layer whatever
the prompts' lengths (HF's eager scan takes one step a token), each step the arithmetic of HF's. A step in which every
sequence feeds one token runs the recurrence once, as HF's selective state update.

Taps, under `blocks.L.mamba.` (the names of every Mamba mixer's): hook_x [channels] (after the convolution), hook_b and
hook_c [state size], hook_dt [channels] (after its bias and softplus), hook_ssm_out [channels] (the scan's output, D's
skip included), hook_gate [channels] (z) and hook_z [channels] (the gated output, the output projection's input, as
attn.hook_z is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlens.attention.metadata import CHUNK, AttentionMetadata, LinearChunks
from vlens.config import ModelConfig
from vlens.context import get_context, tap, tap_widened
from vlens.layers.causal_conv import CausalConv
from vlens.layers.checkpoint import Slot, checkpoint_slots
from vlens.layers.linear import ColumnLinear, RowLinear
from vlens.layers.mamba2 import scan_sequences
from vlens.layers.mlp import activation
from vlens.layers.norm import make_norm
from vlens.layers.slot_states import Shapes, SlotStates


class MambaMixer(SlotStates):
    """Mamba's and Falcon Mamba's `mixer`, Jamba's `mamba`, its parameters named as HF's. Under tensor parallelism
    each rank holds its share of the channels (their rows of x and z, of the convolution, of dt_proj, A and D, their
    states; x_proj's and out_proj's matching columns, whose partial sums the ranks add up: B, C and the time step's
    low-rank input are whole on every rank)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        inner, n, rank, d, parallel = cfg.ssm_inner, cfg.ssm_state_size, cfg.ssm_dt_rank, cfg.hidden_size, cfg.parallel
        self.all_channels, self.mine = inner, parallel.units(inner)
        channels = len(self.mine)
        self.split = (rank, n, n)
        self.in_proj = nn.Linear(d, 2 * channels, bias=cfg.ssm_proj_bias)
        self.conv1d = CausalConv(channels, cfg.ssm_conv_kernel, bias=cfg.ssm_conv_bias)
        self.x_proj = RowLinear(inner, rank + 2 * n, False, parallel)
        self.dt_proj = ColumnLinear(rank, inner, True, parallel)
        self.A_log = nn.Parameter(torch.zeros(channels, n))
        self.D = nn.Parameter(torch.ones(channels))
        self.out_proj = RowLinear(inner, d, cfg.ssm_proj_bias, parallel)
        self.act = activation(cfg.ssm_hidden_act or cfg.hidden_act)
        self.norm_eps = cfg.ssm_bcdt_norm_eps
        if cfg.ssm_bcdt_norm_weights:  # (Jamba's norms of the time step's input, B and C have weights)
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = (make_norm(cfg, dim) for dim in self.split)
        p = f"blocks.{layer}.mamba."
        self.hook_x, self.hook_b, self.hook_c, self.hook_dt = p + "hook_x", p + "hook_b", p + "hook_c", p + "hook_dt"
        self.hook_ssm_out, self.hook_gate, self.hook_z = p + "hook_ssm_out", p + "hook_gate", p + "hook_z"
        self.state: torch.Tensor | None = None  # [slots, channels, state size]: the SSM states

    def slot_shapes(self) -> Shapes:
        return {"state": (tuple(self.A_log.shape), torch.float32)}

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        """This rank's rows of each stored tensor (all of them in one process): in_proj's x and z (their stored
        order), the convolution's, the channels' own parameters; the other projections their own (row- or
        column-parallel)."""
        mine = list(self.mine)
        rows, own = (torch.tensor(mine + [self.all_channels + c for c in mine]),), (torch.tensor(mine),)
        slots = {f"{path}.in_proj.{leaf}": Slot(t, source=rows) for leaf, t in self.in_proj.named_parameters()}
        slots |= {f"{path}.conv1d.{leaf}": Slot(t, source=own) for leaf, t in self.conv1d.named_parameters()}
        slots |= {f"{path}.{name}": Slot(getattr(self, name), source=own) for name in ("A_log", "D")}
        for name, child in self.named_children():
            if name not in ("in_proj", "conv1d"):
                slots |= checkpoint_slots(child, f"{path}.{name}")
        return slots

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        meta, dtype = get_context().attention, h.dtype
        x, gate = self.in_proj(h).chunk(2, -1)
        x = tap(self.hook_x, self.act(self.conv1d(x, meta)))
        dt, b, c = self.x_proj(x).split(self.split, -1)
        if hasattr(self, "dt_layernorm"):  # (Jamba)
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        elif self.norm_eps is not None:  # (Falcon Mamba)
            dt, b, c = (_weightless_rms(v, self.norm_eps) for v in (dt, b, c))
        b, c = tap(self.hook_b, b), tap(self.hook_c, c)
        dt = tap(self.hook_dt, F.softplus(F.linear(dt, self.dt_proj.weight) + self.dt_proj.bias.to(dtype)))
        y = tap_widened(self.hook_ssm_out, self.scan(x, b, c, dt, meta), dtype)
        z = tap_widened(self.hook_z, y * F.silu(tap(self.hook_gate, gate)), dtype)
        return self.out_proj(z.to(dtype))

    def scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, meta: AttentionMetadata):
        """The scan's output [T, channels] (D's skip included): float32 where prompts run in chunks, the model's dtype
        where every sequence feeds one token (as HF's two forms give it)."""
        a = -torch.exp(self.A_log.float())
        return scan_sequences(self, (_recurrent_step, _chunked), (x, b, c, dt), a, self.D, meta)


def _weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Falcon Mamba's norm of the time step's input, B and C: RMS in float32, no weight, back to x's dtype."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _recurrent_step(
    x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of each sequence (row i of sequence i), as HF's selective state update computes it."""
    decay = torch.exp(dt.float()[..., None] * a)  # [B, channels, state size]
    state = state * decay + (dt.float()[..., None] * b.float()[:, None, :]) * x.float()[..., None]
    y = (state.to(c.dtype) @ c[..., None])[..., 0]
    return (y + x * d).to(x.dtype), state


def _chunked(
    x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, d: torch.Tensor,
    state: torch.Tensor, chunks: LinearChunks,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The recurrence over the chunked sequences' rows (of all T rows; dt float32), as HF's scan steps it: the rows'
    outputs (in `chunks.chunked_rows`' order, float32) and the sequences' states after them. A place past a
    sequence's last row has dt = 0 there: it changes no state."""
    dtype, skip = x.dtype, x[chunks.chunked_rows] * d.float()
    x, b, c, dt = (chunks.of(v) for v in (x, b, c, dt))  # [N, CHUNK, ...]

    def step(s: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        decay = torch.exp(a * dt[:, at, :, None])  # [N, channels, state size]
        return decay * s + (dt[:, at, :, None] * b[:, at, None, :].float()) * x[:, at, :, None].float(), decay

    made, decay = torch.zeros_like(state[:1]).expand(len(x), -1, -1), None
    for at in range(CHUNK):  # each chunk from zeros: what it adds to the state, and by how much it decays one
        made, step_decay = step(made, at)
        decay = step_decay if decay is None else decay * step_decay
    # (chunk N: zeros added, no decay: what a sequence reads past its last chunk)
    made, decay = torch.cat([made, made.new_zeros(1, *made.shape[1:])]), torch.cat([decay, decay.new_ones(1,
                                                                                    *decay.shape[1:])])  # fmt: skip
    start = torch.empty_like(made)
    for s in range(chunks.table.shape[1]):  # across chunks, sequence by sequence: the state each one starts from
        i = chunks.table[:, s]
        start[i] = state
        state = decay[i] * state + made[i]
    s, ys = start[:-1], []
    for at in range(CHUNK):  # each chunk again from its start, reading its rows' outputs
        s, _ = step(s, at)
        ys.append((s.to(dtype) @ c[:, at, :, None])[..., 0])
    y = torch.stack(ys, 1).flatten(0, 1)[chunks.place]  # [Tc, channels]
    return y + skip, state
