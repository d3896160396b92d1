"""Hook functions at vlens's taps, as TransformerLens runs them: `fn(value, hook)` on [batch, positions, ...]
(the packed rows of a forward laid out by `Padding`), a forward hook on the value, a backward hook on its
gradient; either may return a tensor of the shape it got, which replaces the value (or the gradient).

Backward hooks ride on tensors, not on modules: where a tap has one and the forward keeps an autograd graph
(HookedLM runs it outside inference mode when hooks are in force and gradients are on), the value leaving
the tap gets a tensor hook, which fires when anything computed from that forward is backpropagated, whenever
that is. No weight requires grad, so the graph starts at the first tap with a backward hook (or at a tensor
of a forward hook's that requires grad) and nothing before it is recorded.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlens.activation_cache import Padding

HookFn = Callable[..., "torch.Tensor | None"]
DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class Hook:
    """One hook in force: where (a hook name, glob, list of them, or a function of the name), the function,
    its direction, and whether reset_hooks keeps it."""

    where: Any
    fn: HookFn
    dir: str = "fwd"
    permanent: bool = False


class HookPoint:
    """What a hook function gets as `hook`, and what `model.hook_dict[name]` is: the name of its tap, `ctx`, a dict
    the hooks at it share (a forward hook can leave there what the backward hook reads) until reset_hooks clears
    it, and TransformerLens's add_hook / remove_hooks, which act on the model's hooks at this name (`model`: the
    HookedLM, which keeps its hook points: they refer to it weakly, so the two make no reference cycle, which under
    the engine's gc.freeze would keep a dropped model's weights for the life of the process)."""

    def __init__(self, name: str, model: Any):
        self.name, self._model = name, weakref.ref(model)
        self.ctx: dict = {}

    @property
    def model(self) -> Any:
        return self._model()

    def add_hook(self, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, prepend: bool = False) -> None:
        self.model.add_hook(self.name, hook, dir=dir, is_permanent=is_permanent, prepend=prepend)

    def add_perma_hook(self, hook: HookFn, dir: str = "fwd") -> None:
        self.add_hook(hook, dir, is_permanent=True)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False) -> None:
        """The hooks added at this very name (here, or by the model's add_hook with it; one added for a glob or a
        filter stays: reset_hooks removes that)."""
        self.model._remove_hooks(dir, including_permanent, at=self.name)

    def clear_context(self) -> None:
        self.ctx = {}

    def layer(self) -> int:
        match = re.match(r"blocks\.(\d+)\.", self.name)
        if match is None:
            raise ValueError(f"hook {self.name!r} belongs to no layer")
        return int(match.group(1))

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r})"


class TapHooks:
    """The hook functions at one tap, each direction's called in the order given. `keep`: hold the value
    leaving the tap, graph and all (`kept`): what a forward with a graph returns is read there, not from
    the captures, which are detached copies."""

    def __init__(self, point: HookPoint, fwd: list[HookFn], bwd: list[HookFn], padding: Padding, keep: bool = False):
        self.point, self.fwd, self.bwd, self.padding, self.keep = point, fwd, bwd, padding, keep
        self.kept: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        backward = bool(self.bwd) and torch.is_grad_enabled()
        if backward and not x.requires_grad:  # nothing before this tap is differentiated: the graph starts here,
            x = x.detach().requires_grad_()  # so what the forward hooks get is on it too
        if self.fwd:
            value = self.padding.pad(x)
            x = self.padding.pack(through(self.fwd, value, self.point, "fwd_hooks")).to(x.dtype)
        if backward:
            # A new tensor: where a model computes on from a tap's value only when the tap returned another (a
            # norm's scale), the gradient then flows through it.
            x = x.view_as(x)
            x.register_hook(self._backward)
        if self.keep:
            self.kept = x
        return x

    def _backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        value = self.padding.pad(grad)
        out = through(self.bwd, value, self.point, "bwd_hooks")
        return None if out is value else self.padding.pack(out).to(grad.dtype)


def through(fns: Sequence[HookFn], value: torch.Tensor, point: HookPoint, field: str) -> torch.Tensor:
    """`value` after the hook functions at `point`, in order: each one's returned tensor replaces it."""
    for fn in fns:
        out = fn(value, hook=point)
        if out is None:
            continue
        if not isinstance(out, torch.Tensor) or out.shape != value.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"{field}: the function at {point.name} returned {got}; a hook returns None or a "
                f"tensor of the shape it was given, {tuple(value.shape)}"
            )
        value = out
    return value


class PatternGrads:
    """Gradients at one layer's attention scores and pattern. vlens computes those beside the fused attention,
    off the gradient's path, so they are derived from the gradient at the layer's hook_z as it arrives
    (`__call__` is a backward hook there), as autograd gives them through z = pattern · v (TransformerLens's and
    HF's eager attention): d pattern = dz · vᵀ, each query head over its key-value head's values, and through
    the softmax d scores = pattern ⊙ (d pattern − Σ_k pattern ⊙ d pattern). Hooks there read them, [batch,
    heads, query_pos, key_pos]; what flows on is the gradient at hook_z. `values`: the run's hook_v and
    hook_pattern of the layer by tap, [batch, positions, ...] and [batch, heads, query_pos, key_pos], filled
    in once the forward has run; `saved`: pattern taps whose gradient goes to `grads` (incl_bwd)."""

    def __init__(
        self, layer: int, fns: dict[str, list[HookFn]], values: dict[str, torch.Tensor],
        grads: dict[str, torch.Tensor], saved: set[str], points: dict[str, HookPoint],
    ):  # fmt: skip
        self.fns, self.values, self.grads, self.saved, self.points = fns, values, grads, saved, points
        self.v, self.pattern = f"blocks.{layer}.attn.hook_v", f"blocks.{layer}.attn.hook_pattern"
        scores = any(not t.endswith("hook_pattern") for t in fns.keys() | saved)
        self.needs = [self.v, *([self.pattern] if scores else [])]  # what the forward must capture for them

    def __call__(self, grad_z: torch.Tensor, hook: HookPoint) -> None:
        v = self.values[self.v]
        v = v.repeat_interleave(grad_z.shape[2] // v.shape[2], dim=2)
        d_pattern = torch.einsum("bqhd,bkhd->bhqk", grad_z, v)
        for tap in sorted(self.fns.keys() | self.saved):
            grad = d_pattern
            if not tap.endswith("hook_pattern"):
                p = self.values[self.pattern].to(d_pattern.dtype)
                grad = p * (d_pattern - (p * d_pattern).sum(-1, keepdim=True))
            for fn in self.fns.get(tap, ()):
                if fn(grad, hook=self.points[tap]) is not None:
                    raise ValueError(
                        f"bwd_hooks: the function at {tap} returned a tensor; a gradient there is read, not replaced "
                        "(vlens computes scores and patterns off the gradient's path: change the one at attn.hook_z)"
                    )
            if tap in self.saved:
                self.grads[tap] = grad.detach()

