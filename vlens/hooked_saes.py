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

A transcoder reads one hook and writes another (`sae.hook_out`, SAELens's hook_name_out): it takes the value
leaving the hook it reads and replaces the one at the hook it writes, its steps named after that one, as
SAELens names them (`blocks.L.hook_mlp_out.hook_sae_acts_post` for an MLP transcoder); the error term is the
written hook's value minus the transcoder's output. A skip transcoder's output includes its skip connection,
x @ W_skip.T (its forward); SAELens's HookedSAETransformer splices in encode and decode alone, without it.
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
from vlens.sae.files import from_saelens
from vlens.sae.model import SAE

if TYPE_CHECKING:
    from vlens.hook_points import HookFn, HookPoint

_FROM_SAELENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SAELens SAE -> vlens SAE, read once
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id")
STEPS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
         "hook_sae_output")  # fmt: skip


class Splice:
    """One attached SAE as a forward hook at the tap it writes (`at`; a transcoder's `take` at the tap it reads,
    `reads`, keeps the input for it). `fns` and `bwd`: the forward and backward hook functions at its steps, by
    step name, for the forward about to run; `record`: the steps whose values that forward keeps."""

    def __init__(
        self, sae: SAE, use_error_term: bool, point: Callable[[str], HookPoint], exclude: torch.Tensor | None = None
    ):
        self.sae, self.use_error_term, self.point, self.exclude = sae, use_error_term, point, exclude
        self.reads, self.at = sae.hook, sae.writes
        # (the error term's step only where there is one)
        self.names = {step: f"{self.at}.{step}" for step in STEPS if use_error_term or step != "hook_sae_error"}
        self.fns: dict[str, list[HookFn]] = {}
        self.bwd: dict[str, list[HookFn]] = {}
        self.record: dict[str, torch.Tensor | None] = {}
        self.input: torch.Tensor | None = None  # a transcoder's, from the tap it reads, until the one it writes
        self.bypass: torch.Tensor | None = None  # [batch, pos] where the forward's tokens are `exclude`d ids

    def shapes(self, value: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Its steps as hook names with their per-token shapes, after the hook it writes, of per-token shape
        `value`."""
        sae = self.sae
        widths = dict(zip(STEPS, ((sae.d_in,), (sae.d_sae,), (sae.d_sae,), (sae.d_out,), value, value)))
        return {name: widths[step] for step, name in self.names.items()}

    def take(self, value: torch.Tensor, hook: HookPoint) -> None:
        """A transcoder's input, as the hooks at the tap it reads leave it."""
        self.input = value

    def bypassing(self, tokens: Callable[[], torch.Tensor]) -> None:
        """For the forward about to run, whose token ids laid out as its values are `tokens()`: where it bypasses."""
        self.bypass = None if self.exclude is None else torch.isin(tokens(), self.exclude)

    def __call__(self, value: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        sae = self.sae.placed(value.device, value.dtype)
        bypass = self.bypass
        if bypass is not None:  # ([batch, pos], against values of any per-token shape)
            bypass = bypass.to(value.device).view(*value.shape[:2], *[1] * (value.dim() - 2))
        source, self.input = (value if self.input is None else self.input), None
        if any(self.bwd.values()) and torch.is_grad_enabled() and not source.requires_grad:
            source = source.detach().requires_grad_()  # (nothing before is differentiated: the graph starts here)
        flat = source.flatten(2)  # (an attention SAE reads hook_z's heads flattened)
        x = self._at("hook_sae_input", flat)
        pre = self._at("hook_sae_acts_pre", sae.pre_acts(x))
        acts = self._at("hook_sae_acts_post", sae.activate(pre))
        out = sae.skip(sae.denormalise(self._at("hook_sae_recons", sae.recons(acts)), x), x).view_as(value)
        if self.use_error_term:
            with torch.no_grad():  # (a constant, as SAELens has it: gradients flow through the reconstruction)
                error = value - sae.decode(sae.encode(flat), flat).view_as(value)
                if bypass is not None:  # (an excluded position bypasses the SAE: no error there)
                    error = error.masked_fill(bypass, 0.0)
            out = out + self._at("hook_sae_error", error)
        if bypass is not None:
            out = torch.where(bypass, value, out)
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


def as_vlens_sae(sae: Any) -> SAE:
    """A vlens SAE as it is; a SAELens SAE (or transcoder) object read by SAE.from_saelens, once per object."""
    if isinstance(sae, SAE):
        return sae
    if type(sae).__module__.split(".")[0] != "sae_lens":
        raise TypeError(f"sae: expected a vlens.SAE or a SAELens SAE, got {type(sae).__name__}")
    if sae not in _FROM_SAELENS:
        _FROM_SAELENS[sae] = SAE.from_saelens(sae)
    return _FROM_SAELENS[sae]


class SAEMethods:
    """SAELens's HookedSAETransformer calls, mixed into HookedLM (which keeps the attached SAEs in `_saes`, by
    hook, and builds the hook functions of a forward from them: vlens.hooked)."""

    _saes: dict[str, Splice]

    def add_sae(
        self, sae: Any, use_error_term: bool | None = None, exclude_special_tokens: bool | Sequence[int] = False
    ) -> None:
        """Splice `sae` (a vlens SAE, or a SAELens one: SAE.from_saelens reads it; a transcoder too) in at the
        hook it writes, replacing one attached at the hook it reads or writing there, until reset_saes.
        use_error_term None: a SAELens SAE's own setting (False for a vlens one). exclude_special_tokens: True
        bypasses it at the tokenizer's BOS, EOS, PAD, SEP and decoder-start ids, a list at those ids (the value
        there passes as it came; the SAE's steps are still computed), as SAELens does."""
        if use_error_term is None:
            use_error_term = getattr(sae, "use_error_term", False)
        sae = as_vlens_sae(sae)
        self._check_hook(sae.hook, sae.d_in, "hook", "d_in")
        if sae.transcoder:
            self._check_hook(sae.hook_out, sae.d_out, "hook_out", "d_out")
        splice = Splice(sae, bool(use_error_term), self._point, self._excluded(exclude_special_tokens))
        self._saes = {k: s for k, s in self._saes.items() if k != splice.reads and s.at != splice.at}
        self._saes[splice.reads] = splice
        self._name_tables()

    def _check_hook(self, hook: str | None, width: int, option: str, size: str) -> None:
        shapes = self._shapes
        if hook not in shapes or ".hook_sae_" in hook or is_pattern(hook):
            raise ValueError(f"sae: its {option} {hook!r} is not a hook of this model it can use (SAE.load(path, "
                             f"{option}=...) names one)")  # fmt: skip
        got = int(torch.Size(shapes[hook]).numel())
        if got != width:
            raise ValueError(f"sae: {size} {width} does not match {hook}, {got} wide")

    def _excluded(self, exclude_special_tokens: bool | Sequence[int]) -> torch.Tensor | None:
        """The token ids an SAE is bypassed at (None: none)."""
        field = "exclude_special_tokens"
        if exclude_special_tokens is False:
            return None
        if exclude_special_tokens is True:
            if self.tokenizer is None:
                raise ValueError(f"{field}: True takes the tokenizer's special ids, and this model has no tokenizer; "
                                 "pass the token ids to exclude")  # fmt: skip
            ids = {getattr(self.tokenizer, attr, None) for attr in SPECIAL_TOKENS} - {None}
        else:
            ids = list(exclude_special_tokens)
            vocab = self.cfg.vocab_size
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
                raise ValueError(f"{field}: expected True, False or token ids in 0..{vocab - 1}; got {ids!r}")
        return torch.tensor(sorted(ids), dtype=torch.long)

    def reset_saes(self, act_names: str | Sequence[str] | None = None) -> None:
        """Take the SAEs reading these hooks out (None: every one)."""
        names = list(self._saes) if act_names is None else [act_names] if isinstance(act_names, str) else act_names
        for name in names:
            self._saes.pop(from_saelens(name), None)
        self._name_tables()

    @contextlib.contextmanager
    def saes(self, saes: Any = (), reset_saes_end: bool = True, use_error_term: bool | None = None,
             exclude_special_tokens: bool | Sequence[int] = False):  # fmt: skip
        """These SAEs attached inside the `with` block (the ones they displace back after it)."""
        saes = list(saes) if isinstance(saes, (list, tuple)) else [saes]
        before = dict(self._saes)
        for sae in saes:
            self.add_sae(sae, use_error_term, exclude_special_tokens)
        try:
            yield self
        finally:
            if reset_saes_end:
                self._saes = before
                self._name_tables()

    def run_with_saes(self, *args: Any, saes: Any = (), reset_saes_end: bool = True, use_error_term: bool | None = None,
                      exclude_special_tokens: bool | Sequence[int] = False, **kwargs: Any) -> Any:  # fmt: skip
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self(*args, **kwargs)

    def run_with_cache_with_saes(self, *args: Any, saes: Any = (), reset_saes_end: bool = True,
                                 use_error_term: bool | None = None,
                                 exclude_special_tokens: bool | Sequence[int] = False,
                                 **kwargs: Any) -> Any:  # fmt: skip
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self.run_with_cache(*args, **kwargs)

    def run_with_hooks_with_saes(self, *args: Any, saes: Any = (), reset_saes_end: bool = True,
                                 exclude_special_tokens: bool | Sequence[int] = False,
                                 **kwargs: Any) -> Any:  # fmt: skip
        with self.saes(saes, reset_saes_end, exclude_special_tokens=exclude_special_tokens):
            return self.run_with_hooks(*args, **kwargs)

