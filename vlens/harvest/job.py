"""What both harvest backends drive: the plan of a run, its manifest header, the `Job` that grows a
harvest directory shard by shard, and the capture of one shard's rows.

The run is a pure function of its options: windows come from the source in a fixed order, shards
are cut at window boundaries by a byte budget that depends only on the windows' tokens, and forward
batches never cross a shard boundary. So a run killed at any moment and started again with the same
options redoes only the shard in flight and writes the same bytes an uninterrupted run would, whichever
backend ran the forwards.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any

import torch
from tqdm import tqdm

from vlens.capture.names import hook_shapes, is_pattern, resolve_hooks
from vlens.engine.model_runner import ModelRunner
from vlens.engine.packed import PackedCapture, token_batches
from vlens.harvest.config import HarvestConfig
from vlens.harvest.features import SAE_KEYS, FeatureHarvest, feature_harvest
from vlens.harvest.model import tokenizer_info, weights_hash
from vlens.harvest.sources import Source, open_source
from vlens.harvest.stats import HookStats
from vlens.harvest.windows import Packing, make_packing, windows
from vlens.harvest.writer import Store, prepare_dir, read_manifest, shard_name, write_manifest, write_shard
from vlens.version import __version__

FORMAT = "vlens-harvest/1"
# Tokens per forward when the caller sets no budget: past these, CPU throughput stops growing,
# and on a GPU the activations of one batch stay a small part of memory for models up to ~8B.
DEFAULT_BATCH_TOKENS = {"cpu": 4096, "cuda": 32768}
# Header fields that name things rather than fix the bytes: a re-run may spell them differently.
_NAMES = {"model.id", "source.location", "tokenizer.name_or_path", "sae.path"}
_META_KEYS = {"token_ids": (torch.int32, 4), "window": (torch.int64, 8), "position": (torch.int64, 8)}


@dataclass(frozen=True)
class HarvestSummary:
    out_dir: str  # the path or URL
    windows: int
    tokens: int
    rows: int
    rows_excluded: int
    shards: int
    bytes: int
    seconds: float  # this call's time
    tokens_this_run: int

    def __str__(self) -> str:
        rate = self.tokens_this_run / self.seconds if self.seconds > 0 else 0.0
        return (
            f"harvest: {self.windows:,} windows, {self.tokens:,} tokens -> {self.rows:,} rows "
            f"({self.rows_excluded:,} excluded) in {self.shards} shards, {_human(self.bytes)} at {self.out_dir}; "
            f"this run {self.tokens_this_run:,} tokens in {self.seconds:.1f} s ({rate:,.0f} tokens/s)"
        )


def plan(loaded: Any, config: HarvestConfig) -> tuple[dict[str, str], Packing, Source, FeatureHarvest | None]:
    """Check the options that need the model and open the source: the hooks' taps, the packing, the
    source, and the SAE whose latents to store."""
    wanted = resolve_hooks(config.hooks, loaded.config) if config.hooks else {}
    patterns = [name for name, tap in wanted.items() if is_pattern(tap)]
    if patterns:
        raise ValueError(
            f"hooks: {patterns} have one value per key of each row's context, a width that changes with the "
            "position; harvest stores fixed-width rows. Capture attention patterns with LLM.trace or "
            "LLM.generate (Capture) instead"
        )
    packing = make_packing(
        loaded.tokenizer, loaded.config, config.context_size, config.pack, config.prepend_bos, config.exclude_bos,
        config.exclude_token_ids,
    )  # fmt: skip
    features = feature_harvest(config, loaded.config)
    return wanted, packing, open_source(config.source, config.text_field, config.whole_file, config.split), features


@dataclass
class Job:
    """A harvest directory between shards, as both backends drive it: its manifest, statistics and shard plan.

    The manifest grows one shard at a time, in shard order, and is rewritten after each; that is what
    makes a run resumable from any kill and its files independent of how the forwards were run."""

    store: Store
    manifest: dict[str, Any]
    stats: dict[str, HookStats]
    excluded: torch.Tensor  # token ids whose rows are not stored
    max_rows: int  # rows per shard, from shard_bytes
    tokens_before: int  # tokens already on disk when this call started
    resumed: bool  # out_dir held a manifest of this run

    @classmethod
    def open(
        cls, out_dir: str | os.PathLike, header: dict[str, Any], cfg: Any, wanted: dict[str, str],
        out_dtype: torch.dtype, packing: Packing,
    ) -> Job:  # fmt: skip
        """The run in `out_dir` to resume (its options checked against `header`), or a new one."""
        store = Store.open(out_dir)
        existing = read_manifest(store)
        if existing is not None:
            _check_same(existing, header, store)
        manifest = existing or {**header, "shards": [], "stats": {}, "totals": _totals([]), "complete": False}
        shapes = hook_shapes(cfg)
        width = {name: math.prod(shapes[name]) for name in wanted}
        row_bytes = sum(w * out_dtype.itemsize for w in width.values()) + sum(b for _, b in _META_KEYS.values())
        if header.get("sae"):  # an int32 id and a value per latent
            row_bytes += header["sae"]["top_k"] * (4 + out_dtype.itemsize)
        stats = {
            name: HookStats.from_json(manifest["stats"][name]) if name in manifest["stats"] else HookStats.empty(w)
            for name, w in width.items()
        }
        excluded = torch.tensor(packing.excluded_token_ids, dtype=torch.long)
        return cls(store, manifest, stats, excluded, max(1, header["shard_bytes"] // row_bytes),
                   manifest["totals"]["tokens"], existing is not None)  # fmt: skip

    def shards(self, stream: Iterator[list[int]], src: Source) -> Iterator[tuple[int, int, list[list[int]]]]:
        """The shards still to do, as (index, first window, windows); cleans the directory first.

        The windows already on disk are tokenized again and skipped, not run."""
        done = self.manifest["totals"]["windows"]
        if not self.resumed:
            stream = _require_one(stream, src.location, self.manifest["context_size"])
        prepare_dir(self.store, self.manifest if self.resumed else None)
        write_manifest(self.store, self.manifest)
        groups = _shards(islice(stream, done, None), done, self.excluded, self.max_rows)
        for index, (first, group) in enumerate(groups, len(self.manifest["shards"])):
            yield index, first, group

    def commit(self, entry: dict[str, Any], bar: tqdm) -> None:
        """List a written shard (its statistics already in `stats`) in the manifest."""
        self.manifest["shards"].append(entry)
        self.manifest["stats"] = {name: s.to_json() for name, s in self.stats.items()}
        self.manifest["totals"] = _totals(self.manifest["shards"])
        write_manifest(self.store, self.manifest)
        bar.set_postfix_str(f"{_human(self.manifest['totals']['bytes'])} written")

    def finish(self) -> None:
        self.manifest["complete"] = True
        write_manifest(self.store, self.manifest)

    def progress_bar(self, desc: str, max_tokens: int | None, progress: bool) -> tqdm:
        bar = tqdm(
            total=max_tokens, initial=self.tokens_before, unit="tok", unit_scale=True, desc=desc,
            disable=not progress, dynamic_ncols=True, smoothing=0.05, file=sys.stderr,
        )  # fmt: skip
        bar.set_postfix_str(f"{_human(self.manifest['totals']['bytes'])} written")
        return bar

    def report(self, started: float, progress: bool) -> HarvestSummary:
        totals = self.manifest["totals"]
        summary = HarvestSummary(
            str(self.store), totals["windows"], totals["tokens"], totals["rows"], totals["rows_excluded"],
            len(self.manifest["shards"]), totals["bytes"], time.perf_counter() - started,
            totals["tokens"] - self.tokens_before,
        )  # fmt: skip
        if progress:
            print(summary, file=sys.stderr)
        return summary


def store_shard(
    store: Store, index: int, first: int, shard_windows: list[list[int]], tensors: dict[str, torch.Tensor],
    seed: int | None,
) -> dict[str, Any]:  # fmt: skip
    """Write shard `index` (its rows shuffled when there is a seed) and return its line in the manifest.

    Idempotent: the same shard always gets the same bytes under the same name, so a retry after a kill is safe."""
    if seed is not None:
        tensors = _shuffle(tensors, seed, index)
    return {
        "file": shard_name(index),
        "rows": len(tensors["token_ids"]),
        "windows": [first, first + len(shard_windows)],
        "tokens": sum(len(w) for w in shard_windows),
        "bytes": write_shard(store, index, tensors),
    }


def header(
    loaded: Any, src: Source, wanted: dict[str, str], packing: Packing, config: HarvestConfig, batch_tokens: int,
    features: FeatureHarvest | None,
) -> dict[str, Any]:  # fmt: skip
    """Everything that fixes a harvest's bytes (a resumed run must match it; see _check_same)."""
    param = next(loaded.model.parameters())
    shapes = hook_shapes(loaded.config)
    return {
        "format": FORMAT,
        "vlens_version": __version__,
        "model": {
            "id": loaded.name,
            "architecture": loaded.config.architecture,
            "weights_sha256": weights_hash(loaded.path),
            "dtype": dtype_name(param.dtype),
            "device": param.device.type,
        },
        "tokenizer": tokenizer_info(loaded.tokenizer, loaded.path),
        "source": src.describe(),
        "hooks": {name: {"tap": tap, "shape": list(shapes[name])} for name, tap in wanted.items()},
        "sae": features.describe() if features is not None else None,
        "dtype": dtype_name(config.out_dtype),
        "context_size": packing.context_size,
        "max_tokens": config.max_tokens,
        "packing": packing.describe(),
        "exclusions": {"token_ids": list(packing.excluded_token_ids)},
        "shard_bytes": config.shard_bytes,
        "batch_tokens": batch_tokens,
        "seed": config.seed,
    }


def window_stream(token_docs: Iterable[list[int]], packing: Packing, max_tokens: int | None) -> Iterator[list[int]]:
    """The run's windows, in order, up to the `max_tokens` budget."""
    used = 0
    for window in windows(token_docs, packing):
        used += len(window)
        if max_tokens is not None and used > max_tokens:
            return
        yield window


def _require_one(stream: Iterator[list[int]], location: str, context_size: int) -> Iterator[list[int]]:
    """Fail before anything is written when the source yields no window at all."""
    first = next(stream, None)
    if first is None:
        raise ValueError(
            f"source: {location!r} yields no window: no documents, or fewer tokens than one packed window "
            f"(context_size={context_size})"
        )
    return chain([first], stream)


def _shards(
    stream: Iterable[list[int]], first: int, excluded: torch.Tensor, max_rows: int
) -> Iterator[tuple[int, list[list[int]]]]:
    """Consecutive runs of whole windows whose kept rows fit `max_rows` (a larger window goes alone)."""
    group: list[list[int]] = []
    rows = 0
    for window in stream:
        kept = len(window) - (int(torch.isin(torch.tensor(window), excluded).sum()) if len(excluded) else 0)
        if group and rows + kept > max_rows:
            yield first, group
            first += len(group)
            group, rows = [], 0
        group.append(window)
        rows += kept
    if group:
        yield first, group


def packed_forward(runner: ModelRunner, *args, **kwargs) -> PackedCapture:
    """The one forward of a harvest (tests stop a run here)."""
    return runner.packed(*args, **kwargs)


def capture(
    runner: ModelRunner,
    shard_windows: list[list[int]],
    first: int,
    excluded: torch.Tensor,
    wanted: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    out_dtype: torch.dtype,
    batch_tokens: int,
    bar: tqdm,
    features: FeatureHarvest | None = None,
) -> dict[str, torch.Tensor]:
    """Run one shard's windows in batches and gather the kept rows of every hook into shard tensors
    (and, with `features`, the SAE's top latents of each kept row)."""
    lens = torch.tensor([len(w) for w in shard_windows])
    flat = torch.tensor(list(chain.from_iterable(shard_windows)), dtype=torch.long)
    keep = ~torch.isin(flat, excluded) if len(excluded) else torch.ones(len(flat), dtype=torch.bool)
    starts = torch.cumsum(lens, 0) - lens
    position = torch.arange(len(flat)) - torch.repeat_interleave(starts, lens)
    window = torch.repeat_interleave(torch.arange(first, first + len(shard_windows)), lens)
    kept_rows = [k.nonzero().squeeze(1) for k in torch.split(keep, lens.tolist())]  # per window, local
    row_start = (torch.cumsum(keep, 0) - keep.long())[starts].tolist()  # each window's first row in the shard
    n_rows = int(keep.sum())
    tensors = {name: torch.empty(n_rows, *shapes[name], dtype=out_dtype) for name in wanted}
    if features is not None:
        tensors.update(zip(SAE_KEYS, (torch.empty(n_rows, features.top_k, dtype=d) for d in (torch.int32, out_dtype))))
    names_of: dict[str, list[str]] = {}
    for name, tap in wanted.items():
        names_of.setdefault(tap, []).append(name)
    taps = list(names_of)

    def collect(packed, batch: list[int]) -> None:
        for owner, tap, rows in packed.pieces():
            start = row_start[batch[owner]]
            for name in names_of[tap]:
                tensors[name][start : start + len(rows)].copy_(rows)
        bar.update(int(lens[batch].sum()))

    pending = None  # on a GPU, batch k's rows are collected while batch k + 1 runs
    for batch in token_batches(lens.tolist(), batch_tokens):
        if not any(len(kept_rows[i]) for i in batch):
            bar.update(int(lens[batch].sum()))
            continue
        packed = packed_forward(
            runner, [shard_windows[i] for i in batch], taps, rows=[kept_rows[i] for i in batch],
            hooks=None if features is None else _feature_hook(features, batch, lens, kept_rows, row_start, tensors),
        )  # fmt: skip
        if pending is not None:
            collect(*pending)
        pending = (packed, batch)
    if pending is not None:
        collect(*pending)
    tensors["token_ids"] = flat[keep].to(torch.int32)
    tensors["window"] = window[keep]
    tensors["position"] = position[keep]
    return tensors


def _feature_hook(
    features: FeatureHarvest, batch: list[int], lens: torch.Tensor, kept_rows: list[torch.Tensor], row_start: list[int],
    tensors: dict[str, torch.Tensor],
) -> dict[str, Any]:  # fmt: skip
    """The tap hook that writes a batch's top latents into the shard: the batch's kept rows are
    consecutive rows of the shard, from its first window's first row on."""
    offsets = torch.cumsum(lens[batch], 0) - lens[batch]  # each window's first row in the packed batch
    rows = torch.cat([kept_rows[i] + offset for i, offset in zip(batch, offsets.tolist())])
    start = row_start[batch[0]]
    ids, values = (tensors[key][start : start + len(rows)] for key in SAE_KEYS)
    return {features.tap: features.reader(rows, ids, values)}


def _shuffle(tensors: dict[str, torch.Tensor], seed: int, index: int) -> dict[str, torch.Tensor]:
    """Rows of shard `index` in a reproducible order drawn from (seed, index)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    order = torch.randperm(len(tensors["token_ids"]), generator=generator)
    return {k: v.index_select(0, order) for k, v in tensors.items()}


def _totals(shards: list[dict[str, Any]]) -> dict[str, int]:
    windows = sum(s["windows"][1] - s["windows"][0] for s in shards)
    tokens = sum(s["tokens"] for s in shards)
    rows = sum(s["rows"] for s in shards)
    return {
        "windows": windows,
        "tokens": tokens,
        "rows": rows,
        "rows_excluded": tokens - rows,
        "bytes": sum(s["bytes"] for s in shards),
    }


def _check_same(manifest: dict[str, Any], header: dict[str, Any], out: Store) -> None:
    if manifest.get("format") != FORMAT:
        raise ValueError(f"out_dir: {str(out)!r} holds a manifest of another format ({manifest.get('format')!r})")
    old, new = _flatten({k: manifest.get(k) for k in header}), _flatten(header)
    differ = sorted(k for k in old.keys() | new.keys() if k not in _NAMES and old.get(k) != new.get(k))
    if differ:
        lines = "; ".join(f"{k}: {old.get(k)!r} on disk, {new.get(k)!r} now" for k in differ)
        raise ValueError(
            f"out_dir: {str(out)!r} holds a harvest made with other options ({lines}); "
            "re-run with the same options to resume, or give another --out"
        )


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "hooks":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
