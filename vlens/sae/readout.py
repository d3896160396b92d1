"""SAE features as a capture readout: what a request gets from the rows it captured at an SAE's hook,
computed on the device so that only its top latents (or the few it names, or one error per row) leave it.

All the readouts of one SAE in one engine step share one encoding: the runtime hands `read_group` every
segment whose stream reads out with that SAE, and its rows go through one matmul with W_enc (in pieces
of at most `PIECE_ELEMENTS` latents, so a long prefill does not make a [rows, d_sae] tensor of gigabytes).
A transcoder's error needs the rows where it writes too: its stream gathers them at the same positions
(`RowStream.paired`) and the runtime hands them in beside the rows it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlens.capture.names import Part
from vlens.sae.model import SAE

if TYPE_CHECKING:
    from vlens.outputs import RequestOutput

PIECE_ELEMENTS = 1 << 24  # rows * d_sae encoded at once, at most


@dataclass(eq=False)
class SAEReadout:
    """One Capture's SAE readout: the top_k latents per row, or the `features` named, and/or the
    reconstruction error. Its per-step result is a tuple: (ids int32, values) for top_k, (values,) for
    features, then (error float32,) when asked."""

    sae: SAE  # placed on the engine's device and dtype
    top_k: int | None
    features: torch.Tensor | None  # [n] long, on the device
    error: bool
    dtype: torch.dtype  # of the values


    def place(self, out: RequestOutput, name: str, result: tuple[torch.Tensor, ...]) -> None:
        """Put a finished result where RequestOutput keeps it: sae_features[name], sae_errors[name]."""
        parts = list(result)
        if self.top_k is not None:
            out.sae_features[name] = (parts.pop(0), parts.pop(0))
        elif self.features is not None:
            out.sae_features[name] = parts.pop(0)
        if self.error:
            out.sae_errors[name] = parts.pop(0)


def sae_parts(top_k: int | None, features: int | None, error: bool, dtype: torch.dtype) -> tuple[Part, ...]:
    """What an SAE readout returns per row: (ids int32, values) of the top_k latents, or the values of the
    `features` named, then the float32 reconstruction error when asked."""
    parts: list[Part] = []
    if top_k is not None:
        parts += [Part((top_k,), torch.int32), Part((top_k,), dtype)]
    if features is not None:
        parts.append(Part((features,), dtype))
    if error:
        parts.append(Part((), torch.float32))
    return tuple(parts)


def read_group(
    readouts: list[SAEReadout], chunks: list[torch.Tensor], outputs: list[torch.Tensor | None] | None = None
) -> list[tuple[torch.Tensor, ...]]:  # fmt: skip
    """The results of readouts that share one SAE, one per chunk of rows, from one encoding of all the rows.
    A transcoder's error compares its reconstruction with what the model wrote where it writes: `outputs`, each
    chunk's rows there (for the readouts that ask for the error)."""
    sae = readouts[0].sae
    rows = torch.cat(chunks).flatten(1) if len(chunks) > 1 else chunks[0].flatten(1)
    k = max(r.top_k or 0 for r in readouts)
    named = [r.features for r in readouts if r.features is not None]
    columns = torch.cat(named) if named else None
    error = any(r.error for r in readouts)
    ids, values, dense, fits = [], [], [], []  # fits: an SAE's error per row, a transcoder's reconstruction
    for piece in _pieces(rows, sae):
        acts = sae.encode(piece)
        if k:
            v, i = acts.topk(k, dim=-1)
            ids.append(i.to(torch.int32))
            values.append(v)
        if columns is not None:
            dense.append(acts.index_select(1, columns))
        if error:
            reconstruction = sae.decode(acts, piece)
            fits.append(reconstruction if sae.transcoder else _error(piece, reconstruction))
    ids_all, values_all, dense_all, fits_all = (torch.cat(p) if p else None for p in (ids, values, dense, fits))
    results, start, column = [], 0, 0
    for i, (readout, chunk) in enumerate(zip(readouts, chunks)):
        end, parts = start + len(chunk), []
        if readout.top_k is not None:
            parts += [ids_all[start:end, : readout.top_k], values_all[start:end, : readout.top_k].to(readout.dtype)]
        if readout.features is not None:
            n = len(readout.features)
            parts.append(dense_all[start:end, column : column + n].to(readout.dtype))
            column += n
        if readout.error:
            fit = fits_all[start:end]
            parts.append(_error(outputs[i].flatten(1), fit) if sae.transcoder else fit)
        results.append(tuple(parts))
        start = end
    return results


def _pieces(rows: torch.Tensor, sae: SAE) -> tuple[torch.Tensor, ...]:
    return rows.split(max(1, PIECE_ELEMENTS // sae.d_sae))


def _error(x: torch.Tensor, reconstruction: torch.Tensor) -> torch.Tensor:
    """‖x − x̂‖² / ‖x‖² per row, in float32 (x: what the SAE reads, or what a transcoder's output stands for)."""
    x = x.float()
    return (x - reconstruction.float()).pow(2).sum(-1) / x.pow(2).sum(-1)
