"""Reading a harvest back: `ActivationDataset`, memory-mapped shards, random access and shuffled batches.

Shards are mapped, not loaded: opening a dataset of any size costs a header read per shard, and a
read touches only the pages of the rows it asks for. Only shards the manifest lists are read, so a
dataset whose harvest is still running (or was killed) shows exactly its completed part.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from vlens.capture.names import tap_dtype
from vlens.harvest.features import SAE_KEYS
from vlens.harvest.job import LEGACY_ROW_KEYS
from vlens.harvest.writer import Store, read_manifest, read_replies
from vlens.steering import SteeringVector

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I32": torch.int32,
    "I64": torch.int64,
}


def mmap_shard(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of a private (copy-on-write) map of the file."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    size = int.from_bytes(mapped[:8], "little")
    header = json.loads(mapped[8 : 8 + size])
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // dtype.itemsize
        flat = (
            torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + size + begin)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[key] = flat.view(info["shape"])
    return tensors


def local_dir(out_dir: str | os.PathLike) -> Path:
    """The harvest directory as a local path: shards are memory-mapped, which a remote URL cannot be."""
    store = Store.open(out_dir)
    if not store.local:
        raise ValueError(
            f"out_dir: {str(out_dir)!r} is not on this machine's filesystem; reading memory-maps the shards, so "
            "copy the harvest here first (e.g. fsspec's `fs.get(url, local_dir, recursive=True)`)"
        )
    return Path(store.root)


def load_manifest(out_dir: str | os.PathLike) -> dict[str, Any]:
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise ValueError(f"out_dir: {str(out_dir)!r} holds no manifest.json; is it a vlens harvest directory?")
    return manifest


class ActivationDataset(IterableDataset):
    """The rows of one key of a harvest: a hook name, or `token_ids`, `window`, `position` or `document` (the
    index of the row's record in the source; not in runs begun before it was stored), and `sae_ids`,
    `sae_values` [rows, top_k] in a harvest with an SAE.

    `len(ds)` counts rows; `ds[i]`, `ds[a:b]` and `ds[index_tensor]` return new tensors in the stored
    dtype. Iterating (directly or through a torch DataLoader, with workers splitting the shards) yields
    shuffled batches: shards in a seeded random order, rows mixed through a shuffle buffer. The random
    draws depend only on the seed and the row counts, so iterators over two keys of one harvest with
    the same settings yield matching rows (activations with their token ids).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        hook: str,
        batch_size: int = 4096,
        seed: int = 0,
        shuffle_buffer: int = 1 << 16,
        drop_last: bool = False,
    ):
        super().__init__()
        self.out_dir = local_dir(out_dir)
        self.manifest = load_manifest(self.out_dir)
        row_keys = self.manifest.get("row_keys", LEGACY_ROW_KEYS)
        keys = [*self.manifest["hooks"], *row_keys, *(SAE_KEYS if self.manifest.get("sae") else ())]
        if hook not in keys:
            raise ValueError(f"hook: {hook!r} is not in the harvest at {str(out_dir)!r} (keys: {', '.join(keys)})")
        if batch_size < 1 or shuffle_buffer < 0:
            raise ValueError(f"batch_size must be >= 1 and shuffle_buffer >= 0, got {batch_size}, {shuffle_buffer}")
        self.hook, self.batch_size, self.seed = hook, batch_size, seed
        self.shuffle_buffer, self.drop_last = shuffle_buffer, drop_last
        self.files = [self.out_dir / s["file"] for s in self.manifest["shards"]]
        counts = [s["rows"] for s in self.manifest["shards"]]
        self.offsets = list(accumulate(counts, initial=0))
        if hook in self.manifest["hooks"]:
            self.shape = tuple(self.manifest["hooks"][hook]["shape"])
            self.dtype = tap_dtype(self.manifest["hooks"][hook]["tap"], getattr(torch, self.manifest["dtype"]))
        elif hook in SAE_KEYS:
            self.shape = (self.manifest["sae"]["top_k"],)
            self.dtype = torch.int32 if hook == "sae_ids" else getattr(torch, self.manifest["dtype"])
        else:
            self.shape, self.dtype = (), torch.int32 if hook == "token_ids" else torch.int64
        self._mapped: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def mean(self) -> torch.Tensor:
        """The mean stored row (float32, [*shape]), from the manifest's statistics (float64 sums of the rows
        as stored): no shard is read."""
        stats = self.manifest["stats"].get(self.hook)
        if stats is None or not stats["rows"]:
            raise ValueError(f"hook: the harvest at {str(self.out_dir)!r} holds no rows of {self.hook!r} to average")
        return torch.tensor(stats["mean"], dtype=torch.float64).reshape(self.shape).float()

    def replies(self) -> list[list[int]]:
        """The continuations a generating harvest (`generate_tokens`) wrote, one per document in source order:
        the token ids the model wrote (its tokenizer decodes them)."""
        if "generate" not in self.manifest:
            raise ValueError(f"the harvest at {str(self.out_dir)!r} generated no continuations (generate_tokens)")
        return read_replies(Store.open(self.out_dir))

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers map the shards themselves
        return {**self.__dict__, "_mapped": {}}

    def shard(self, index: int) -> torch.Tensor:
        """Rows of one shard, memory-mapped (a view: clone before writing to it)."""
        return self.mapped(index)[self.hook]

    def mapped(self, index: int) -> dict[str, torch.Tensor]:
        """Every key of one shard, memory-mapped."""
        if index not in self._mapped:
            self._mapped[index] = mmap_shard(self.files[index])
        return self._mapped[index]

    def max_activating(self, feature: int, n: int = 10, context: int = 8) -> list[FeatureExample]:
        """The n rows where SAE latent `feature` is largest, with their window, position and the tokens
        up to `context` positions either side: the max-activating examples of a latent, from a harvest
        with --sae (see vlens.harvest.features), read one shard at a time."""
        return max_activating(self, feature, n, context)

    def __getitem__(self, index: Any) -> torch.Tensor:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                return self._range(start, max(start, stop))
            return self._take(torch.arange(start, stop, step))
        if isinstance(index, int) or (hasattr(index, "__index__") and torch.as_tensor(index).dim() == 0):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"row {i} out of range for {n} rows")
            i %= n
            s = bisect.bisect_right(self.offsets, i) - 1
            return self.shard(s)[i - self.offsets[s]].clone()
        idx = torch.as_tensor(index)
        if idx.dtype == torch.bool:
            if idx.shape != (n,):
                raise IndexError(f"boolean index of shape {tuple(idx.shape)} for {n} rows")
            idx = idx.nonzero().squeeze(1)
        if idx.dim() != 1 or idx.is_floating_point():
            raise IndexError("index with an int, a slice, or a 1-D array of ints or bools")
        return self._take(idx.long())

    def _range(self, start: int, stop: int) -> torch.Tensor:
        first = bisect.bisect_right(self.offsets, start) - 1
        parts = []
        s = first
        while s < len(self.files) and self.offsets[s] < stop:
            lo, hi = max(start, self.offsets[s]) - self.offsets[s], min(stop, self.offsets[s + 1]) - self.offsets[s]
            parts.append(self.shard(s)[lo:hi])
            s += 1
        return torch.cat(parts) if parts else torch.empty(0, *self.shape, dtype=self.dtype)

    def _take(self, idx: torch.Tensor) -> torch.Tensor:
        n = len(self)
        if len(idx) and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"row index out of range for {n} rows")
        idx = torch.where(idx < 0, idx + n, idx)
        shard_of = torch.searchsorted(torch.tensor(self.offsets), idx, right=True) - 1
        out = torch.empty(len(idx), *self.shape, dtype=self.dtype)
        for s in shard_of.unique().tolist():
            mask = shard_of == s
            out[mask] = self.shard(s)[idx[mask] - self.offsets[s]]
        return out

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.batches()

    def batches(
        self,
        batch_size: int | None = None,
        seed: int | None = None,
        shuffle_buffer: int | None = None,
        drop_last: bool | None = None,
    ) -> Iterator[torch.Tensor]:
        """Shuffled batches of rows, each row once (arguments default to the constructor's)."""
        size = self.batch_size if batch_size is None else batch_size
        if size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {size}")
        seed = self.seed if seed is None else seed
        buffer = self.shuffle_buffer if shuffle_buffer is None else shuffle_buffer
        drop = self.drop_last if drop_last is None else drop_last
        order = torch.randperm(len(self.files), generator=torch.Generator().manual_seed(seed)).tolist()
        worker = get_worker_info()
        if worker is not None:
            order = order[worker.id :: worker.num_workers]
        draws = torch.Generator().manual_seed(seed + 1 + (worker.id if worker is not None else 0))
        chunks = self._chunks(order, size)
        batches = _mix(chunks, size, buffer, draws) if buffer else chunks
        for batch in batches:
            if len(batch) == size or not drop:
                yield batch

    def _chunks(self, order: list[int], size: int) -> Iterator[torch.Tensor]:
        """Consecutive rows of the shards in `order`, in pieces of exactly `size` (the last may be short)."""
        pending: list[torch.Tensor] = []
        have = 0
        for s in order:
            rows = self.shard(s)
            pos = 0
            while pos < len(rows):
                take = min(size - have, len(rows) - pos)
                pending.append(rows[pos : pos + take])
                have, pos = have + take, pos + take
                if have == size:
                    yield torch.cat(pending)
                    pending, have = [], 0
        if pending:
            yield torch.cat(pending)


def _mix(chunks: Iterator[torch.Tensor], size: int, capacity: int, draws: torch.Generator) -> Iterator[torch.Tensor]:
    """A shuffle buffer done a batch at a time: once full, each incoming batch takes the slots of
    `size` rows drawn at random from the buffer, which leave as the next batch; the rest drains shuffled."""
    capacity = -(-max(capacity, size) // size) * size  # whole batches, so filling ends on a batch boundary
    buffer: torch.Tensor | None = None
    filled = 0
    tail = None
    for chunk in chunks:
        if len(chunk) < size:  # the last, short piece: drained with the buffer
            tail = chunk
            break
        if buffer is None:
            buffer = chunk.new_empty(capacity, *chunk.shape[1:])
        if filled < capacity:
            buffer[filled : filled + size] = chunk
            filled += size
            continue
        slots = torch.randperm(capacity, generator=draws)[:size]
        out = buffer[slots]
        buffer[slots] = chunk
        yield out
    rest = [t for t in (None if buffer is None else buffer[:filled], tail) if t is not None]
    if not rest:
        return
    remaining = torch.cat(rest)
    order = torch.randperm(len(remaining), generator=draws)
    for start in range(0, len(remaining), size):
        yield remaining[order[start : start + size]]


def difference_of_means(
    positive: str | os.PathLike, negative: str | os.PathLike, hooks: Iterable[str] | None = None
) -> SteeringVector:  # fmt: skip
    """A steering vector at each of `hooks` (default: every hook both harvests stored): the mean row of the
    `positive` harvest minus that of the `negative` one (e.g. the assistant's rows, `roles`, of conversations
    with and without a trait), from their manifests' statistics. Both must be of one model."""
    manifests = [load_manifest(local_dir(d)) for d in (positive, negative)]
    weights = [m["model"]["weights_sha256"] for m in manifests]
    if weights[0] != weights[1]:
        raise ValueError(f"negative: the harvests are of different models (weights {weights[0][:12]}..., "
                         f"{weights[1][:12]}...)")  # fmt: skip
    stored = manifests[0]["hooks"]
    steerable = [h for h in stored if tap_dtype(stored[h]["tap"], torch.float32) != torch.long]  # (not expert ids)
    both = [h for h in steerable if h in manifests[1]["hooks"]]
    hooks = both if hooks is None else list(hooks)
    missing = [h for h in hooks if h not in both]
    if missing or not hooks:
        raise ValueError(f"hooks: {missing or 'none'} not stored by both harvests as rows a vector can steer "
                         f"(these are: {both})")  # fmt: skip
    return SteeringVector(
        {h: ActivationDataset(positive, h).mean - ActivationDataset(negative, h).mean for h in hooks}
    )


@dataclass(frozen=True)
class FeatureExample:
    """A row where a latent fires: its value, where the row sits (its index in the dataset, its window
    and position) and the tokens around it in its window (rows left out, such as BOS, are missing)."""

    value: float
    row: int
    window: int
    position: int
    token_id: int
    context_ids: list[int]
    context_positions: list[int]


def max_activating(ds: ActivationDataset, feature: int, n: int, context: int) -> list[FeatureExample]:
    """The n rows of the harvest where `feature` is largest (ties: the earlier row), one shard mapped at a time."""
    described = ds.manifest.get("sae")
    if not described:
        raise ValueError("feature: this harvest stored no SAE latents; harvest with --sae PATH --top-k K")
    d_sae = described["d_sae"]
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < d_sae:
        raise ValueError(
            f"feature: {feature!r} is not a latent of the harvest's SAE; expected an int in 0..{d_sae - 1}"
        )
    if n < 1 or context < 0:
        raise ValueError(f"n must be >= 1 and context >= 0, got {n}, {context}")
    values, rows = torch.empty(0), torch.empty(0, dtype=torch.long)
    for s in range(len(ds.files)):
        shard = ds.mapped(s)
        local, column = (shard["sae_ids"] == feature).nonzero(as_tuple=True)
        if not len(local):
            continue
        values = torch.cat([values, shard["sae_values"][local, column].float()])
        rows = torch.cat([rows, local + ds.offsets[s]])  # ascending, so a stable sort breaks ties by row
        order = torch.sort(values, descending=True, stable=True).indices[:n]
        values, rows = values[order], rows[order]
    return [_example(ds, float(v), int(r), context) for v, r in zip(values, rows)]


def _example(ds: ActivationDataset, value: float, row: int, context: int) -> FeatureExample:
    s = bisect.bisect_right(ds.offsets, row) - 1
    shard = ds.mapped(s)
    local = row - ds.offsets[s]
    window, position = int(shard["window"][local]), int(shard["position"][local])
    near = (shard["window"] == window) & ((shard["position"] - position).abs() <= context)
    order = torch.argsort(shard["position"][near])
    return FeatureExample(
        value, row, window, position, int(shard["token_ids"][local]), shard["token_ids"][near][order].tolist(),
        shard["position"][near][order].tolist(),
    )  # fmt: skip
