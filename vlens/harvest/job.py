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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any

import torch
from tqdm import tqdm

from vlens.capture.names import is_pattern, request_shapes, resolve_hooks, tap_dtype
from vlens.engine.model_runner import ModelRunner
from vlens.engine.packed import PackedCapture
from vlens.harvest.config import HarvestConfig
from vlens.harvest.edits import HarvestEdits, harvest_edits
from vlens.harvest.features import FeatureHarvest, feature_harvest
from vlens.harvest.model import config_hash, tokenizer_info, weights_hash
from vlens.harvest.sources import Source, open_source
from vlens.harvest.stats import HookStats, Pieces
from vlens.harvest.windows import (
    Packing,
    TokenDoc,
    Window,
    check_chat_template,
    make_packing,
    stored_rows,
    windows,
)
from vlens.harvest.writer import Store, prepare_dir, read_manifest, shard_name, write_manifest, write_shard
from vlens.images import ImageEncoder, PromptImages
from vlens.version import __version__

FORMAT = "vlens-harvest/2"  # 2: expert ids stored as int64; a document led by BOS gets no second one
# Tokens per forward on a CPU when the caller sets none: a forward's activations then stay in the caches (SmolLM2's
# MLP rows of 1,024 tokens are 6 MB), which the elementwise work between GEMMs reads; 4,096 measured 0.8-1.0x the
# speed, with no gain past 1,024 from the GEMMs (benchmarks/bench_embeddings.py, --batch-tokens).
CPU_BATCH_TOKENS = 1024
# On CUDA the default is what fits: the free memory after a probe forward of PROBE_TOKENS, up to MAX_BATCH_TOKENS
# (a shard of 1 GiB holds about that many rows at d = 2048 in bf16, and no forward crosses a shard).
PROBE_TOKENS = 8192
MAX_BATCH_TOKENS = 1 << 18
MEMORY_SHARE = 0.8  # of the free device memory, the rest a margin for the allocator and the statistics
# Header fields that name things rather than fix the bytes: a re-run may spell them differently.
_NAMES = {"model.id", "source.location", "tokenizer.name_or_path", "sae.path", "interventions.steering_vector.path"}
# What each stored row has beside the hooks' values (dtype, bytes): its token, window, position in the window and
# document (the index of its record in the source). A run begun before rows had documents resumes without them.
ROW_KEYS = {
    "token_ids": (torch.int32, 4), "window": (torch.int64, 8), "position": (torch.int64, 8),
    "document": (torch.int64, 8),
}  # fmt: skip
LEGACY_ROW_KEYS = ("token_ids", "window", "position")
_PROGRESS = ("shards", "stats", "totals", "complete")  # what a manifest adds to its header as the run goes


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
    bytes_this_run: int
    device_seconds: float  # the forwards' time on the device (on a CPU: their wall time), all workers together
    write_seconds: float  # the time spent storing shards (serialising, writing, syncing, renaming)
    workers: int = 1
    generate_seconds: float = 0.0  # this call's generation of continuations (generate_tokens)

    def __str__(self) -> str:
        rate = self.tokens_this_run / self.seconds if self.seconds > 0 else 0.0
        busy = self.device_seconds / (self.seconds * self.workers) if self.seconds > 0 else 0.0
        writes = self.bytes_this_run / self.write_seconds / 1e6 if self.write_seconds > 0 else 0.0
        generating = f", {self.generate_seconds:.1f} s generating continuations" if self.generate_seconds else ""
        return (
            f"harvest: {self.windows:,} windows, {self.tokens:,} tokens -> {self.rows:,} rows "
            f"({self.rows_excluded:,} excluded) in {self.shards} shards, {_human(self.bytes)} at {self.out_dir}; "
            f"this run {self.tokens_this_run:,} tokens in {self.seconds:.1f} s: {rate:,.0f} tokens/s, device busy "
            f"{busy:.0%} of the time, writes {writes:,.0f} MB/s ({_human(self.bytes_this_run)} in "
            f"{self.write_seconds:.1f} s){generating}"
        )


def source_of(config: HarvestConfig) -> Source:
    """The run's source, opened before the model loads: a typo in its path fails at once."""
    return open_source(config.source, config.text_field, config.whole_file, config.split, config.image_field)


def plan(
    loaded: Any, config: HarvestConfig, src: Source
) -> tuple[dict[str, str], Packing, FeatureHarvest | None, HarvestEdits | None]:  # fmt: skip
    """Check the options that need the model: the hooks' taps, the packing, the SAE whose latents to
    store, the interventions, and a chat template for a source of conversations (with images, the processor's:
    checked as it loads)."""
    if src.form == "chat" and src.image_field is None:
        check_chat_template(loaded.tokenizer)
    wanted = resolve_hooks(config.hooks, loaded.config) if config.hooks else {}
    patterns = [name for name, tap in wanted.items() if is_pattern(tap)]
    if patterns:
        raise ValueError(
            f"hooks: {patterns} have one value per key of each row's context, a width that changes with the "
            "position; harvest stores fixed-width rows. Capture attention patterns with LLM.trace or "
            "LLM.generate (Capture) instead"
        )
    if config.roles is not None and src.form != "chat":
        column = f" column {src.field!r}" if src.field else ""
        raise ValueError(
            f"roles: for a source of conversations (lists of {{role, content}} messages); {src.location!r}{column} "
            f"holds {'token ids' if src.form == 'tokens' else 'text'}"
        )
    integer = [name for name, tap in wanted.items() if not tap_dtype(tap, torch.float32).is_floating_point]
    if config.pool == "mean" and integer:
        raise ValueError(f"pool: 'mean' of {integer} (integer ids: MoE experts) has no meaning; leave them out or "
                         "pool 'last'")  # fmt: skip
    if config.roles is not None and not getattr(loaded.tokenizer, "is_fast", False):
        raise ValueError("roles: a token's role is found through its character offsets, which only a fast "
                         "(Rust) tokenizer gives; this model's is not one")  # fmt: skip
    packing = make_packing(
        loaded.tokenizer, loaded.config, config.context_size, config.pack, config.prepend_bos, config.exclude_bos,
        config.exclude_token_ids, config.roles,
    )  # fmt: skip
    features = feature_harvest(config, loaded.config)
    return wanted, packing, features, harvest_edits(config, loaded)


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
    bytes_before: int
    resumed: bool  # out_dir held a manifest of this run
    row_keys: tuple[str, ...]  # of ROW_KEYS, those this run stores
    device_seconds: float = 0.0  # this call's forwards (see HarvestSummary)
    write_seconds: float = 0.0  # this call's shard writes
    generate_seconds: float = 0.0  # this call's continuations (vlens.harvest.replies)

    @classmethod
    def open(
        cls, out_dir: str | os.PathLike, header: dict[str, Any], cfg: Any, wanted: dict[str, str],
        out_dtype: torch.dtype, packing: Packing,
    ) -> Job:  # fmt: skip
        """The run in `out_dir` to resume (its options checked against `header`), or a new one."""
        store = Store.open(out_dir)
        existing = read_manifest(store)
        if existing is not None and "row_keys" not in existing:  # begun before rows had documents: as begun
            header = {key: value for key, value in header.items() if key != "row_keys"}
        if existing is not None:
            _check_same(existing, header, store)
        manifest = existing or {**header, "shards": [], "stats": {}, "totals": _totals([]), "complete": False}
        shapes = request_shapes(cfg)
        width = {name: math.prod(shapes[name]) for name in wanted}
        row_bytes = sum(w * tap_dtype(wanted[name], out_dtype).itemsize for name, w in width.items())
        row_keys = tuple(manifest.get("row_keys", LEGACY_ROW_KEYS))
        row_bytes += sum(ROW_KEYS[key][1] for key in row_keys)
        if header.get("sae"):  # an int32 id and a value per latent
            row_bytes += header["sae"]["top_k"] * (4 + out_dtype.itemsize)
        stats = {
            name: HookStats.from_json(manifest["stats"][name]) if name in manifest["stats"] else HookStats.empty(w)
            for name, w in width.items()
        }
        excluded = torch.tensor(packing.excluded_token_ids, dtype=torch.long)
        return cls(
            store, manifest, stats, excluded, max(1, header["shard_bytes"] // row_bytes), manifest["totals"]["tokens"],
            manifest["totals"]["bytes"], existing is not None, row_keys,
        )  # fmt: skip

    def shards(self, stream: Iterator[Window], src: Source) -> Iterator[tuple[int, int, list[Window]]]:
        """The shards still to do, as (index, first window, windows), cut lazily (the tokenizing of the
        source runs as they are asked for); the directory is cleaned now, before this returns.

        The windows already on disk are tokenized again and skipped, not run."""
        done = self.manifest["totals"]["windows"]
        if not self.resumed:
            stream = _require_one(stream, src.location, self.manifest["context_size"], self.manifest["max_tokens"])
        prepare_dir(self.store, self.manifest if self.resumed else None)
        write_manifest(self.store, self.manifest)
        pooled = self.manifest.get("pool") is not None
        groups = _shards(islice(stream, done, None), done, self.excluded, self.max_rows, pooled)
        return ((index, first, group) for index, (first, group) in enumerate(groups, len(self.manifest["shards"])))

    def run_header(self) -> dict[str, Any]:
        """The manifest without what the run adds as it goes: the options it was begun with, as first written
        (a re-run that names its model or source otherwise finds the same)."""
        return {key: value for key, value in self.manifest.items() if key not in _PROGRESS}

    def commit(self, entry: dict[str, Any], stats: dict[str, Pieces], bar: tqdm) -> None:
        """List a written shard in the manifest, its statistics folded into the run's. A shard with rows that
        are not finite stops the run unlisted: the manifest's JSON has no inf or nan, and rows that hold them
        are of no use to train on."""
        for name, pieces in stats.items():
            self.stats[name].fold(pieces)
            if not math.isfinite(self.stats[name].norm_total):
                raise ValueError(
                    f"dtype: rows of {name!r} in {entry['file']} are not finite as {self.manifest['dtype']} (inf: "
                    "past the dtype's range, as float16's 65504; nan: from the model's forward); store them as "
                    "bfloat16 or float32 (--dtype)"
                )
        self.manifest["shards"].append(entry)
        self.manifest["stats"] = {name: s.to_json() for name, s in self.stats.items()}
        self.manifest["totals"] = _totals(self.manifest["shards"])
        write_manifest(self.store, self.manifest)
        bar.set_postfix_str(f"{_human(self.manifest['totals']['bytes'])} written")
        bar.update(entry["tokens"])

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

    def report(self, started: float, progress: bool, workers: int = 1) -> HarvestSummary:
        totals = self.manifest["totals"]
        summary = HarvestSummary(
            str(self.store), totals["windows"], totals["tokens"], totals["rows"], totals["rows_excluded"],
            len(self.manifest["shards"]), totals["bytes"], time.perf_counter() - started,
            totals["tokens"] - self.tokens_before, totals["bytes"] - self.bytes_before, self.device_seconds,
            self.write_seconds, workers, self.generate_seconds,
        )  # fmt: skip
        if progress:
            print(summary, file=sys.stderr)
        return summary


def store_shard(
    store: Store, index: int, first: int, shard_windows: list[Window], tensors: dict[str, torch.Tensor],
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
        "tokens": sum(len(w.tokens) for w in shard_windows),
        "bytes": write_shard(store, index, tensors),
    }


def header(
    loaded: Any, src: Source, wanted: dict[str, str], packing: Packing, config: HarvestConfig, batch_tokens: int,
    features: FeatureHarvest | None, edits: HarvestEdits | None, generation: dict[str, Any] | None = None,
    encoder: ImageEncoder | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Everything that fixes a harvest's bytes (a resumed run must match it; see _check_same). `encoder`: the
    vision tower of a harvest of images, whose processor's template renders its conversations."""
    param = next(loaded.model.parameters())
    shapes = request_shapes(loaded.config)
    chat_template = None
    if src.form == "chat":
        template = loaded.tokenizer.chat_template
        chat_template = encoder.chat_template("text_field") if encoder is not None else str(template)
    model = {
        "id": loaded.name,
        "architecture": loaded.config.architecture,
        "weights_sha256": weights_hash(loaded.path),
        "config_sha256": config_hash(loaded.path),
        "dtype": dtype_name(param.dtype),
        "device": param.device.type,
    }
    if config.revision is not None:  # (only then: older manifests match)
        model["revision"] = config.revision
    if loaded.adapter is not None:  # (a LoRA adapter's directory as the model: its weights merged into the base's)
        model["adapter_sha256"] = weights_hash(loaded.adapter)
    if config.tensor_parallel_size > 1:  # split sums round otherwise than one process's: other bytes, not to mix
        model["tensor_parallel_size"] = config.tensor_parallel_size
    return {
        "format": FORMAT,
        "vlens_version": __version__,
        "model": model,
        "tokenizer": tokenizer_info(loaded.tokenizer, loaded.path, chat_template),
        "source": src.describe(),
        "hooks": {name: {"tap": tap, "shape": list(shapes[name])} for name, tap in wanted.items()},
        "sae": features.describe() if features is not None else None,
        "interventions": edits.describe() if edits is not None else None,
        **({"generate": generation} if generation is not None else {}),  # (only then: older manifests match)
        **({"pool": config.pool} if config.pool is not None else {}),
        **({"image_token_id": encoder.image_token_id} if encoder is not None else {}),  # (a harvest of images)
        "dtype": dtype_name(config.out_dtype),
        "context_size": packing.context_size,
        "max_tokens": config.max_tokens,
        "packing": packing.describe(),
        "exclusions": {"token_ids": list(packing.excluded_token_ids)},
        "shard_bytes": config.shard_bytes,
        "batch_tokens": batch_tokens,
        "seed": config.seed,
        "row_keys": list(ROW_KEYS),
    }


def window_stream(token_docs: Iterable[TokenDoc], packing: Packing, max_tokens: int | None) -> Iterator[Window]:
    """The run's windows, in order, up to the `max_tokens` budget."""
    used = 0
    for window in windows(token_docs, packing):
        used += len(window.tokens)
        if max_tokens is not None and used > max_tokens:
            return
        yield window


def _require_one(
    stream: Iterator[Window], location: str, context_size: int, max_tokens: int | None
) -> Iterator[Window]:
    """Fail before anything is written when the source yields no window at all (within the budget, which an
    unpacked first window may exceed)."""
    first = next(stream, None)
    if first is None:
        budget = f", or a first window longer than max_tokens={max_tokens}" if max_tokens is not None else ""
        raise ValueError(
            f"source: {location!r} yields no window: no documents, or fewer tokens than one packed window "
            f"(context_size={context_size}){budget}"
        )
    return chain([first], stream)


def _shards(
    stream: Iterable[Window], first: int, excluded: torch.Tensor, max_rows: int, pooled: bool
) -> Iterator[tuple[int, list[Window]]]:
    """Consecutive runs of whole windows whose kept rows (`pooled`: one a window that keeps any) fit `max_rows`
    (a larger window goes alone)."""
    group: list[Window] = []
    rows = 0
    for window in stream:
        kept = int(stored_rows([window], excluded)[1].sum()) if len(excluded) or window.dropped else len(window.tokens)
        kept = min(kept, 1) if pooled else kept
        if group and rows + kept > max_rows:
            yield first, group
            first += len(group)
            group, rows = [], 0
        group.append(window)
        rows += kept
    if group:
        yield first, group


def forward(
    runner: ModelRunner, sequences: list[list[int]], hooks: dict[str, Callable], edits: HarvestEdits | None,
    images: list[PromptImages | None] | None = None,
) -> PackedCapture:  # fmt: skip
    """Every forward of a harvest: `sequences` packed (with the rows their `images` give), `hooks` at their taps
    (they take the rows; see vlens.harvest.rows), after the edits. The one place that names the runner (tests stop
    a run here)."""
    return runner.packed(sequences, [], hooks=hooks, interventions=edits.bound if edits is not None else None,
                         images=images)  # fmt: skip


def choose_batch_tokens(
    config: HarvestConfig, runner: ModelRunner, taps: list[str], existing: dict[str, Any] | None
) -> int:
    """Tokens per forward: the option; else a resumed run's own (rows may round differently in another
    split, so a run keeps one); else on CUDA what fits in the free memory, on a CPU CPU_BATCH_TOKENS."""
    if config.batch_tokens is not None:
        return config.batch_tokens
    if existing is not None and "batch_tokens" in existing:
        return existing["batch_tokens"]
    if runner.device.type != "cuda":
        return CPU_BATCH_TOKENS
    return fitting_batch_tokens(runner, taps, config.context_size)


@torch.inference_mode()
def fitting_batch_tokens(runner: ModelRunner, taps: list[str], context_size: int) -> int:
    """The tokens per forward that fit in MEMORY_SHARE of the free device memory: the peak of a probe
    forward of whole windows through the harvest's deepest tap, scaled (activations grow with the tokens)."""
    device = runner.device
    windows = max(1, PROBE_TOKENS // context_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    forward(runner, [[0] * context_size] * windows, {tap: _keep for tap in taps}, None)
    torch.cuda.synchronize(device)
    per_token = max(1, torch.cuda.max_memory_allocated(device) - before) / (windows * context_size)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    fit = int(free * MEMORY_SHARE / per_token) // context_size * context_size
    return max(context_size, min(fit, MAX_BATCH_TOKENS))


def _keep(x: torch.Tensor) -> torch.Tensor:
    return x


def _shuffle(tensors: dict[str, torch.Tensor], seed: int, index: int) -> dict[str, torch.Tensor]:
    """Rows of shard `index` in a reproducible order drawn from (seed, index). Taken modulo 2**64, which torch
    does itself to the negative seeds it takes, so that any integer seed is one (the rest overflowed)."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**64)
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
