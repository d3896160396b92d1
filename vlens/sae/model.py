"""`SAE`: a sparse autoencoder as SAELens's inference SAEs compute it, written out once so that the
engine's readouts, harvest and the tests all encode the same way.

The formulas are those of SAELens (sae_lens/saes/*.py, `encode` and `decode`):
    x' = norm_in(x) - b_dec (the subtraction only when apply_b_dec_to_input)
    pre = x' @ W_enc + b_enc (topk with rescale_acts_by_decoder_norm: times each latent's |W_dec| row norm)
    standard: relu(pre); jumprelu: relu(pre) * (pre > threshold); topk: relu of the k largest, 0 elsewhere
    x_hat = norm_out(f @ W_dec + b_dec) (topk with rescale: f / |W_dec| @ W_dec)
A transcoder (SAELens's Transcoder, SkipTranscoder and their JumpReLU kinds) reads one hook and writes
another, `hook_out`: the same encoding without b_dec on the input (its b_dec is the output's), and
y_hat = f @ W_dec + b_dec (+ x @ W_skip.T for a skip transcoder), d_out wide.
Only two normalisations act at run time in SAELens's inference SAE, and only they do here: layer_norm
(centre, divide by the unbiased std + 1e-5; undone on the way out) and constant_norm_rescale (scale
each row to norm sqrt(d_in); undone). The others (expected_average_only_in, covariance_whitening) are
folded into the weights when SAELens training ends, so a saved SAE applies nothing for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from vlens.sae.files import from_circuit_tracer_object, from_saelens_object, read_sae

ARCHITECTURES = ("standard", "jumprelu", "topk")
RUNTIME_NORMS = ("none", "layer_norm", "constant_norm_rescale")
LAYER_NORM_EPS = 1e-5


@dataclass(eq=False, repr=False)
class SAE:
    """An SAE's weights and what its config says about encoding (see the module doc). Build one with
    `SAE.load(path)`; the weights stay float32 on the host, and `placed(device, dtype)` gives the copy a
    forward uses, made once and shared by every request that names this SAE."""

    W_enc: torch.Tensor  # [d_in, d_sae]
    b_enc: torch.Tensor  # [d_sae]
    W_dec: torch.Tensor  # [d_sae, d_in]
    b_dec: torch.Tensor  # [d_in]
    architecture: str = "standard"
    hook: str | None = None  # the hook it reads, TransformerLens-style (None: the file does not say)
    hook_out: str | None = None  # a transcoder's: the hook it writes (None: an SAE, which writes what it reads)
    threshold: torch.Tensor | None = None  # jumprelu [d_sae]
    W_skip: torch.Tensor | None = None  # a skip transcoder's [d_out, d_in]
    k: int | None = None  # topk
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"  # one of RUNTIME_NORMS
    rescale_acts_by_decoder_norm: bool = False  # topk
    path: str = ""  # where it was loaded from ("" when built in Python)
    sha256: str = ""  # of the weights and the encoding config: computed when not given

    def __post_init__(self) -> None:
        self._check()
        if not self.sha256:
            self.sha256 = self._digest()
        self._placed: dict[tuple[torch.device, torch.dtype], SAE] = {}

    @classmethod
    def load(cls, path: Any, hook: str | None = None, hook_out: str | None = None) -> SAE:
        """An SAE or transcoder saved in SAELens's layout (a directory with cfg.json and
        sae_weights.safetensors) or as Gemma Scope's params.npz (a file, or a directory holding one). `hook`
        overrides the hook the config names (a params.npz names none, so it needs one to be used), `hook_out`
        the hook a transcoder writes (given for a params.npz, it makes one of Gemma Scope's transcoders); the
        hooks are checked against a model when the SAE is used. ValueError naming the problem for anything
        unreadable."""
        fields = read_sae(path)
        fields.update({k: v for k, v in (("hook", hook), ("hook_out", hook_out)) if v is not None})
        return cls(**fields)

    @classmethod
    def from_saelens(cls, sae: Any) -> SAE:
        """The same SAE as a SAELens `SAE` object in memory (`sae_lens.SAE.from_pretrained(...)`'s)."""
        return cls(**from_saelens_object(sae))

    @classmethod
    def from_circuit_tracer(cls, transcoder: Any, hook: str, hook_out: str) -> SAE:
        """One of circuit-tracer's per-layer transcoders (a SingleLayerTranscoder: ReLU or JumpReLU, with or without
        a skip connection), reading `hook` and writing `hook_out` (vlens's names: its TranscoderSet says which)."""
        return cls(**from_circuit_tracer_object(transcoder), hook=hook, hook_out=hook_out)

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def transcoder(self) -> bool:
        return self.hook_out is not None

    @property
    def writes(self) -> str | None:
        """The hook its output (and a steer along a latent) goes to."""
        return self.hook_out if self.transcoder else self.hook

    def __repr__(self) -> str:  # also what salts the prefix cache of a request that clamps with it
        extra = f", k={self.k}" if self.k is not None else ""
        if self.transcoder:
            extra += f", hook_out={self.hook_out!r}, d_out={self.d_out}" + (", skip" if self.W_skip is not None else "")
        return (
            f"SAE({self.path!r}, hook={self.hook!r}, architecture={self.architecture!r}, d_in={self.d_in}, "
            f"d_sae={self.d_sae}{extra}, sha256={self.sha256!r})"
        )

    def __getstate__(self) -> dict[str, Any]:  # Ray ships the host weights; each process places its own
        return {**self.__dict__, "_placed": {}}

    def placed(self, device: torch.device | str, dtype: torch.dtype) -> SAE:
        """This SAE's weights on `device` in `dtype`, copied once per (device, dtype)."""
        key = (torch.device(device), dtype)
        if key not in self._placed:
            move = {
                f.name: getattr(self, f.name).to(device, dtype)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            }
            self._placed[key] = dataclasses.replace(self, **move)
        return self._placed[key]

    # -- the formulas -------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Latent activations [rows, d_sae] of rows [rows, d_in]."""
        return self.activate(self.pre_acts(x))

    def decode(self, acts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction of rows `x` from their latents `acts` (x gives the run-time normalisation), or a
        transcoder's output for its input rows `x` (a skip transcoder's skip connection included)."""
        return self.skip(self.denormalise(self.recons(acts), x), x)

    def skip(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` plus a skip transcoder's affine path from its input, x @ W_skip.T (nothing for the others)."""
        return out if self.W_skip is None else out + x @ self.W_skip.T

    # (the steps SAELens hooks between: hook_sae_acts_pre after pre_acts, hook_sae_acts_post after activate,
    # hook_sae_recons after recons; vlens.hooked_saes runs them one by one)

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        normalised, _ = self._normalise(x)
        if self.apply_b_dec_to_input:
            normalised = normalised - self.b_dec
        pre = normalised @ self.W_enc + self.b_enc
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        return pre

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        if self.architecture == "topk":
            values, ids = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, ids, values.relu())
        acts = pre.relu()
        if self.architecture == "jumprelu":
            acts = acts * (pre > self.threshold).to(acts.dtype)
        return acts

    def recons(self, acts: torch.Tensor) -> torch.Tensor:
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            acts = acts * (1 / self.W_dec.norm(dim=-1))
        return acts @ self.W_dec + self.b_dec

    def denormalise(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Undo the run-time normalisation of `x` on `out`."""
        _, stats = self._normalise(x)
        if self.normalize_activations == "layer_norm":
            std, mean = stats
            return out * std + mean
        if self.normalize_activations == "constant_norm_rescale":
            return out / stats
        return out

    def _normalise(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """norm_in(x), and what undoing it needs."""
        if self.normalize_activations == "layer_norm":
            mean = x.mean(dim=-1, keepdim=True)
            centred = x - mean
            std = centred.std(dim=-1, keepdim=True)
            return centred / (std + LAYER_NORM_EPS), (std, mean)
        if self.normalize_activations == "constant_norm_rescale":
            coefficient = self.d_in**0.5 / x.norm(dim=-1, keepdim=True)
            return x * coefficient, coefficient
        return x, None

    # -- validation ---------------------------------------------------------------------------------

    def _check(self) -> None:
        where = f" ({self.path})" if self.path else ""
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"sae: architecture {self.architecture!r}{where} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.normalize_activations not in RUNTIME_NORMS:
            raise ValueError(
                f"sae: normalize_activations {self.normalize_activations!r}{where} is not one of {', '.join(RUNTIME_NORMS)}"
            )
        if self.W_enc.dim() != 2:
            raise ValueError(f"sae: W_enc{where} must be [d_in, d_sae], got shape {tuple(self.W_enc.shape)}")
        d_in, d_sae = self.W_enc.shape
        d_out = self.W_dec.shape[-1] if self.transcoder else d_in
        expected = {"b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}
        if self.transcoder:
            self._check_transcoder(where)
            if self.W_skip is not None:
                expected["W_skip"] = (d_out, d_in)
        elif self.W_skip is not None:
            raise ValueError(f"sae: a W_skip tensor{where} but no hook_out; only a skip transcoder has one")
        if self.architecture == "jumprelu":
            expected["threshold"] = (d_sae,)
            if self.threshold is None:
                raise ValueError(f"sae: a jumprelu SAE needs a threshold [d_sae] tensor{where}")
        elif self.threshold is not None:  # SAELens refuses it too: encoding without it would ignore it
            raise ValueError(
                f"sae: a threshold tensor{where} but architecture {self.architecture!r}; only jumprelu SAEs have one "
                "(a config before SAELens 6 without `architecture` means standard)"
            )
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"sae: {name}{where} has shape {got}; W_enc [{d_in}, {d_sae}] makes it {shape}")
        if self.architecture == "topk" and not (isinstance(self.k, int) and 1 <= self.k <= d_sae):
            raise ValueError(f"sae: a topk SAE needs k, an int in 1..d_sae={d_sae}; got {self.k!r}{where}")

    def _check_transcoder(self, where: str) -> None:
        """What SAELens's transcoders refuse or leave undone: b_dec is the output's, so it cannot be subtracted
        from the input, and the output is not put back through a run-time normalisation of the input."""
        if self.apply_b_dec_to_input:
            raise ValueError(f"sae: a transcoder{where} with apply_b_dec_to_input; its b_dec is its output's "
                             "(SAELens refuses it too)")  # fmt: skip
        if self.normalize_activations != "none":
            raise ValueError(
                f"sae: a transcoder{where} with normalize_activations {self.normalize_activations!r}; transcoders "
                "here normalise nothing at run time (none)"
            )

    def _digest(self) -> str:
        """sha256 of what decides the encoding: the config fields, then each tensor's float32 bytes."""
        digest = hashlib.sha256()
        config = (self.architecture, self.k, self.apply_b_dec_to_input, self.normalize_activations,
                  self.rescale_acts_by_decoder_norm)  # fmt: skip
        digest.update(repr(config).encode())
        for t in (self.W_enc, self.b_enc, self.W_dec, self.b_dec, self.threshold, self.W_skip):
            if t is not None:
                digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy())
        return digest.hexdigest()
