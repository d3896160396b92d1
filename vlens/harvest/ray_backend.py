"""`harvest(..., backend="ray")`: the same harvest, its forwards spread over a pool of Ray actors.

Ray Data reads and tokenizes the source on the cluster, in source order (`ray_source`); the driver
packs those token lists into windows, cuts the same shards at the same window boundaries as the
single-machine run, and numbers them the same way. The forward and the shard write run on the
actors: each one loads the model once, and for a shard task runs its windows, writes the shard
straight into `out_dir` (a local path on shared storage, or any fsspec URL every node reaches) with
the atomic protocol of `writer` and returns the manifest entry plus the pieces of its statistics.

The driver alone writes the manifest, and commits shards strictly in shard order: a shard that
finishes before an earlier one waits on the driver (its file already written) until the earlier one
is committed, while its actor goes on to the next task. So the manifest is always prefix-closed, the
same file a single-machine run would have at that shard, and a re-run after the driver dies resumes
through the single-machine logic: shard files ahead of the manifest are deleted and redone. At the end the shard
files and the manifest are byte-identical to a single-machine run on the same device and dtype.

Fault tolerance comes from Ray: actors are created with unlimited restarts and task retries, so a
killed actor is started again (reloading the model) and its shard task re-runs; the re-run writes the
same bytes under the same name, so nothing is lost or doubled.

Ray is imported only when this backend runs: it is an optional extra (`pip install vlens[ray]`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from tqdm import tqdm

from vlens.capture.names import hook_shapes
from vlens.harvest import run
from vlens.harvest.model import resolve_model
from vlens.harvest.ray_source import ray_token_documents
from vlens.harvest.stats import _BLOCK, HookStats
from vlens.harvest.writer import Store, write_shard

# How far (in shards per actor) the tasks handed out may run ahead of the manifest: enough that an actor
# finds its next task queued while a slower one finishes, few enough that the windows held in flight,
# and the shards a dead driver leaves unlisted (redone by the next run), stay few.
_AHEAD_PER_WORKER = 3


class ShardWorker:
    """One model replica: runs shard tasks and writes their shards (wrapped by `ray.remote` at run time)."""

    def __init__(
        self, model: str | None, model_dtype: str, device: str, wanted: dict[str, str], out_dtype: torch.dtype,
        excluded: list[int], batch_tokens: int | None, seed: int | None, out_url: str,
    ) -> None:  # fmt: skip
        self.loaded = resolve_model(model, model_dtype, device)
        self.wanted = wanted
        self.shapes = hook_shapes(self.loaded.config)
        self.out_dtype = out_dtype
        self.excluded = torch.tensor(excluded, dtype=torch.long)
        param = next(self.loaded.model.parameters())
        self.device = param.device.type
        self.model_dtype = run._dtype_name(param.dtype)
        self.batch_tokens = batch_tokens or run.DEFAULT_BATCH_TOKENS.get(self.device, 4096)
        self.seed = seed
        self.store = Store.open(out_url)

    def info(self) -> dict[str, Any]:
        """What the manifest header records about the forward, as this replica runs it."""
        return {"device": self.device, "dtype": self.model_dtype, "batch_tokens": self.batch_tokens}

    def run_shard(self, index: int, first: int, shard_windows: list[list[int]]) -> dict[str, Any]:
        """Run, write and describe shard `index`; idempotent, so Ray may retry it after a kill."""
        silent = tqdm(disable=True)
        tensors = run._capture(
            self.loaded.model, shard_windows, first, self.excluded, self.wanted, self.shapes, self.out_dtype,
            self.batch_tokens, silent,
        )  # fmt: skip
        pieces = {name: _stat_pieces(tensors[name]) for name in self.wanted}
        if self.seed is not None:
            tensors = run._shuffle(tensors, self.seed, index)
        entry = run.shard_entry(index, first, shard_windows, tensors, write_shard(self.store, index, tensors))
        return {"index": index, "entry": entry, "stats": pieces}


def _stat_pieces(x: torch.Tensor) -> list[HookStats]:
    """The statistics of each row block that `HookStats.add` would fold in, one by one.

    Folding these on the driver in order adds exactly the same float64 block sums in the same order
    as the single-machine run (a block's sum added to zeros is itself), so the manifest's statistics
    come out bit-identical; merging whole-shard sums would round differently."""
    pieces = []
    for start in range(0, len(x), _BLOCK):
        piece = HookStats.empty(math.prod(x.shape[1:]))
        piece.add(x[start : start + _BLOCK])
        pieces.append(piece)
    return pieces


def _fold(stats: HookStats, pieces: list[HookStats]) -> None:
    for piece in pieces:
        stats.total += piece.total
        stats.norm_total += piece.norm_total
        stats.max_norm = max(stats.max_norm, piece.max_norm)
        stats.rows += piece.rows


def harvest_ray(
    model: Any,
    source: str | os.PathLike,
    hooks: str | Iterable[str],
    out_dir: str | os.PathLike,
    *,
    context_size: int,
    dtype: str,
    max_tokens: int | None,
    shard_bytes: int,
    prepend_bos: bool,
    pack: bool,
    text_field: str,
    exclude_token_ids: Iterable[int] | None,
    exclude_bos: bool,
    whole_file: bool,
    split: str,
    batch_tokens: int | None,
    seed: int | None,
    device: str,
    model_dtype: str,
    progress: bool,
    workers: int,
    cpus_per_worker: float,
    ray_address: str | None,
) -> run.HarvestSummary:
    """The Ray backend of `vlens.harvest` (same arguments and result; see the module doc).

    The driver loads the model on its CPU only for the tokenizer, config and hashes; the actors load
    `model` themselves on `device` (one GPU each when it is CUDA, else one CPU each), so a path must
    be readable, or a hub id cached, on every node. An `LLM`/`LoadedModel` is used on the driver
    only; the actors load its checkpoint path at `model_dtype`."""
    import ray
    from ray.util import ActorPool

    started = time.perf_counter()
    out_dtype = run._out_dtype(dtype)  # this and the other numbers are checked by `harvest` already
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: must be a positive integer, got {workers!r}")
    if not isinstance(cpus_per_worker, (int, float)) or cpus_per_worker <= 0:
        raise ValueError(f"cpus_per_worker: must be a positive number, got {cpus_per_worker!r}")
    loaded = resolve_model(model, model_dtype, "cpu")
    cfg = loaded.config
    wanted, packing, src = run._plan(
        loaded, source, hooks, context_size, pack, prepend_bos, exclude_bos, exclude_token_ids, max_tokens,
        text_field, whole_file, split,
    )  # fmt: skip
    store = Store.open(out_dir)

    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=progress)
    gpus = 1 if device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1) else 0
    actor_class = ray.remote(
        num_cpus=0 if gpus else cpus_per_worker, num_gpus=gpus, max_restarts=-1, max_task_retries=-1
    )(ShardWorker)
    replica_model = str(loaded.path) if not isinstance(model, (str, os.PathLike)) and model is not None else model
    args = (replica_model, model_dtype, device, wanted, out_dtype, list(packing.excluded_token_ids), batch_tokens,
            seed, store.url)  # fmt: skip
    actors = [actor_class.remote(*args) for _ in range(workers)]
    try:
        info = ray.get(actors[0].info.remote())
        header = run._header(loaded, src, wanted, out_dtype, packing, max_tokens, shard_bytes, info["batch_tokens"],
                             seed)  # fmt: skip
        header["model"].update(device=info["device"], dtype=info["dtype"])
        job = run.Job.open(out_dir, header, cfg, wanted, out_dtype, packing)
        if job.manifest["complete"]:
            return job.report(started, progress)
        token_docs = ray_token_documents(src, loaded.tokenizer, cfg.vocab_size, concurrency=workers)
        plan = job.shards(run._window_stream(token_docs, packing, max_tokens), src)
        pool = ActorPool(actors)
        with job.progress_bar("harvest (ray)", max_tokens, progress) as bar:
            committed = submitted = len(job.manifest["shards"])
            waiting: dict[int, dict[str, Any]] = {}  # finished shards behind an unfinished one

            def top_up() -> None:
                nonlocal submitted
                while submitted < committed + workers * _AHEAD_PER_WORKER:
                    task = next(plan, None)
                    if task is None:
                        return
                    pool.submit(lambda actor, t: actor.run_shard.remote(*t), task)
                    submitted += 1

            top_up()
            while pool.has_next():
                result = pool.get_next_unordered()  # the actor takes its next task at once
                waiting[result["index"]] = result
                while committed in waiting:  # the manifest grows in shard order only
                    result = waiting.pop(committed)
                    for name in wanted:
                        _fold(job.stats[name], result["stats"][name])
                    job.commit(result["entry"], bar)
                    bar.update(result["entry"]["tokens"])
                    committed += 1
                top_up()
            job.finish()
        return job.report(started, progress)
    finally:
        for actor in actors:  # no task of this run may write into out_dir after it returns or dies
            ray.kill(actor, no_restart=True)
