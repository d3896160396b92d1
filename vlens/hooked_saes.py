"""SAELens's HookedSAETransformer calls on HookedLM: SAEs spliced into the forward at their hooks, with their
inner hook points, so a notebook written for `HookedSAETransformer` runs on a HookedLM.

An attached SAE replaces the value at its hook (`sae.hook`) by its reconstruction (plus the error term, the
value minus the reconstruction the SAE makes without hook functions, with `use_error_term`, so the forward is
unchanged unless a hook edits a latent), and names its steps as SAELens does, after the hook:
`<hook>.hook_sae_input`, `.hook_sae_acts_pre`, `.hook_sae_acts_post`, `.hook_sae_recons` (before the run-time
normalisation is undone), `.hook_sae_error`, `.hook_sae_output`. Hook functions there run as at any hook (on
[batch, pos, ...], a returned tensor replacing the value; backward hooks on the gradient there, the graph starting
at the SAE's input where nothing before asks for one) and run_with_cache caches them (with incl_bwd, their
gradients too). Attention SAEs read hook_z with its heads flattened, and give it back unflattened.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vlens.capture.names import is_pattern
from vlens.hook_points import through
from vlens.sae.model import SAE

if TYPE_CHECKING:
    from vlens.hook_points import HookFn, HookPoint

_FROM_SAELENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SAELens SAE -> vlens SAE, read once
STEPS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
         "hook_sae_output")  # fmt: skip


class Splice:
    """One attached SAE as a forward hook at its tap. `fns` and `bwd`: the forward and backward hook functions at
    its steps, by step name, for the forward about to run; `record`: the steps whose values that forward keeps."""

    def __init__(self, sae: SAE, use_error_term: bool, point: Callable[[str], HookPoint]):
        self.sae, self.use_error_term, self.point = sae, use_error_term, point
        # (the error term's step only where there is one)
        self.names = {step: f"{sae.hook}.{step}" for step in STEPS if use_error_term or step != "hook_sae_error"}
        self.fns: dict[str, list[HookFn]] = {}
        self.bwd: dict[str, list[HookFn]] = {}
        self.record: dict[str, torch.Tensor | None] = {}

    def shapes(self, value: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Its steps as hook names with their per-token shapes, at a hook of per-token shape `value`."""
        flat, latents = (self.sae.d_in,), (self.sae.d_sae,)
        widths = dict(zip(STEPS, (flat, latents, latents, flat, value, value)))
        return {name: widths[step] for step, name in self.names.items()}

    def __call__(self, value: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        sae = self.sae.placed(value.device, value.dtype)
        if any(self.bwd.values()) and torch.is_grad_enabled() and not value.requires_grad:
            value = value.detach().requires_grad_()  # (nothing before is differentiated: the graph starts here)
        flat = value.flatten(2)  # (an attention SAE reads hook_z's heads flattened)
        x = self._at("hook_sae_input", flat)
        pre = self._at("hook_sae_acts_pre", sae.pre_acts(x))
        acts = self._at("hook_sae_acts_post", sae.activate(pre))
        out = sae.denormalise(self._at("hook_sae_recons", sae.recons(acts)), x).view_as(value)
        if self.use_error_term:
            with torch.no_grad():  # (a constant, as SAELens has it: gradients flow through the reconstruction)
                error = value - sae.decode(sae.encode(flat), flat).view_as(value)
            out = out + self._at("hook_sae_error", error)
        return self._at("hook_sae_output", out)

    def _at(self, step: str, x: torch.Tensor) -> torch.Tensor:
        name = self.names[step]
        x = through(self.fns.get(name, ()), x, self.point(name), "fwd_hooks")
        if name in self.record:
            self.record[name] = x.detach()
        if self.bwd.get(name) and x.requires_grad:
            x = x.view_as(x)  # (a tensor of its own to hook, as TapHooks does)
            x.register_hook(partial(self._backward, name))
        return x

    def _backward(self, name: str, grad: torch.Tensor) -> torch.Tensor | None:
        out = through(self.bwd[name], grad, self.point(name), "bwd_hooks")
        return None if out is grad else out


class SAEMethods:
    """SAELens's HookedSAETransformer calls, mixed into HookedLM (which keeps the attached SAEs in `_saes`, by
    hook, and builds the hook functions of a forward from them: vlens.hooked)."""

    _saes: dict[str, Splice]

    def add_sae(self, sae: Any, use_error_term: bool | None = None) -> None:
        """Splice `sae` (a vlens SAE, or a SAELens one: SAE.from_saelens reads it) in at its hook, replacing one
        attached there, until reset_saes."""
        if not isinstance(sae, SAE):
            if type(sae).__module__.split(".")[0] != "sae_lens":
                raise TypeError(f"sae: expected a vlens.SAE or a SAELens SAE, got {type(sae).__name__}")
            if sae not in _FROM_SAELENS:
                _FROM_SAELENS[sae] = SAE.from_saelens(sae)
            sae = _FROM_SAELENS[sae]
        shapes = self._shapes
        if sae.hook not in shapes or ".hook_sae_" in sae.hook or is_pattern(sae.hook):
            raise ValueError(f"sae: its hook {sae.hook!r} is not a hook of this model it can read (SAE.load(path, "
                             "hook=...) names one)")  # fmt: skip
        width = int(torch.Size(shapes[sae.hook]).numel())
        if width != sae.d_in:
            raise ValueError(f"sae: d_in {sae.d_in} does not match {sae.hook}, {width} wide")
        self._saes[sae.hook] = Splice(sae, bool(use_error_term), self._point)
        self._name_tables()

    def reset_saes(self, act_names: str | Sequence[str] | None = None) -> None:
        """Take the SAEs at these hooks out (None: every one)."""
        names = list(self._saes) if act_names is None else [act_names] if isinstance(act_names, str) else act_names
        for name in names:
            self._saes.pop(name, None)
        self._name_tables()

    @contextlib.contextmanager
    def saes(self, saes: Any = (), reset_saes_end: bool = True, use_error_term: bool | None = None):
        """These SAEs attached inside the `with` block (the ones they displace back after it)."""
        saes = list(saes) if isinstance(saes, (list, tuple)) else [saes]
        before = dict(self._saes)
        for sae in saes:
            self.add_sae(sae, use_error_term)
        try:
            yield self
        finally:
            if reset_saes_end:
                self._saes = before
                self._name_tables()

    def run_with_saes(self, *args: Any, saes: Any = (), reset_saes_end: bool = True,
                      use_error_term: bool | None = None, **kwargs: Any) -> Any:  # fmt: skip
        with self.saes(saes, reset_saes_end, use_error_term):
            return self(*args, **kwargs)

    def run_with_cache_with_saes(self, *args: Any, saes: Any = (), reset_saes_end: bool = True,
                                 use_error_term: bool | None = None, **kwargs: Any) -> Any:  # fmt: skip
        with self.saes(saes, reset_saes_end, use_error_term):
            return self.run_with_cache(*args, **kwargs)

    def run_with_hooks_with_saes(self, *args: Any, saes: Any = (), reset_saes_end: bool = True,
                                 **kwargs: Any) -> Any:  # fmt: skip
        with self.saes(saes, reset_saes_end):
            return self.run_with_hooks(*args, **kwargs)

