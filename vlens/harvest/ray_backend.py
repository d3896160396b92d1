"""`harvest(..., backend="ray")`: the same harvest, its forwards spread over a pool of Ray actors.

Ray Data reads and tokenizes the source on the cluster, in source order (`ray_source`); the driver
packs those token lists into windows, cuts the same shards at the same window boundaries as the
single-machine run, and numbers them the same way. The forward and the shard write run on the
actors: each one loads the model once, and for a shard task runs its windows, writes the shard
straight into `out_dir` (a local path on shared storage, or any fsspec URL every node reaches) with
the atomic protocol of `writer` and returns the manifest entry plus the pieces of its statistics.
Each actor runs the local pipeline (vlens.harvest.rows): it takes two shard tasks at a time, on two
threads, and while one writes its shard the other runs its forwards, so the device stays busy.

The driver alone writes the manifest, and commits shards strictly in shard order: a shard that
finishes before an earlier one waits on the driver (its file already written) until the earlier one
is committed, while its actor goes on to the next task. So the manifest is always prefix-closed, the
same file a single-machine run would have at that shard, and a re-run after the driver dies resumes
through the single-machine logic: shard files ahead of the manifest are deleted and redone. At the end the shard
files and the manifest are byte-identical to a single-machine run on the same device and dtype.

A run of records with images (`image_field`) reads them on the driver, where the checkpoint's processor expands
their placeholders (as the local run's reading thread does); a window's vision inputs go to its actor with it, and
each actor runs the vision tower beside its model.

A generating run (`generate_tokens`, vlens.harvest.replies) makes each actor's model an engine: the driver
hands the chunks of documents to the actors in turn, one each in flight ahead of the windows it packs, and
writes their continuations' files itself; an actor's generation and its shard forwards take turns on its device
(they share the model's buffers). Each document's sample is seeded by its number, whichever actor draws it.

Fault tolerance comes from Ray: actors are created with unlimited restarts and task retries, so a
killed actor is started again (reloading the model) and its shard task re-runs; the re-run writes the
same bytes under the same name, so nothing is lost or doubled.

Ray is imported only when this backend runs: it is an optional extra (`pip install vlens[ray]`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from vlens.capture.names import request_shapes
from vlens.harvest.config import HarvestConfig
from vlens.harvest.edits import harvest_edits
from vlens.harvest.features import feature_harvest
from vlens.harvest.job import (
    HarvestSummary,
    Job,
    choose_batch_tokens,
    dtype_name,
    header,
    plan,
    source_of,
    store_shard,
    window_stream,
)
from vlens.harvest.model import generation_engine, image_encoder, resolve_model, runner_for
from vlens.harvest.ray_source import ray_token_documents
from vlens.harvest.replies import Generation, Start, generate_replies, with_replies
from vlens.harvest.rows import DeviceRows
from vlens.harvest.stats import Pieces
from vlens.harvest.windows import Window, token_documents
from vlens.harvest.writer import Store, read_manifest

# How far (in shards per actor) the tasks handed out may run ahead of the manifest: enough that an actor
# finds its next task queued while a slower one finishes, few enough that the windows held in flight,
# and the shards a dead driver leaves unlisted (redone by the next run), stay few.
_AHEAD_PER_WORKER = 3
_TASKS_PER_ACTOR = 2  # one running its forwards while the other writes its shard


class ShardWorker:
    """One model replica: runs shard tasks and writes their shards (wrapped by `ray.remote` at run time,
    with two threads: `run_shard` calls overlap, their forwards taking turns on the device).

    `config` is the run's, with the model as a name or path every node can load and out_dir as a URL
    every node reaches; `wanted` and `excluded` are what the driver resolved with the tokenizer."""

    def __init__(self, config: HarvestConfig, wanted: dict[str, str], excluded: list[int]) -> None:
        self.config = config
        # (a generating run's engine: its model is the one the forwards run, and it takes the device lock too)
        self.llm = generation_engine(config) if config.generate_tokens is not None else None
        model = config.model if self.llm is None else self.llm
        self.loaded = resolve_model(model, config, config.device)
        self.runner = runner_for(model, self.loaded)
        self.wanted = wanted
        self.excluded = torch.tensor(excluded, dtype=torch.long)
        self.store = Store.open(config.out_dir)
        self.features = feature_harvest(config, self.loaded.config)
        self.edits = harvest_edits(config, self.loaded)
        self.taps = sorted({*wanted.values(), *([self.features.tap] if self.features is not None else [])})
        self.encoder = image_encoder(model, self.loaded) if config.image_field is not None else None
        self.stage: DeviceRows | None = None
        self.device_lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        """What the manifest header records about the forward, as this replica would run it."""
        param = next(self.loaded.model.parameters())
        existing = read_manifest(self.store)
        return {
            "device": param.device.type, "dtype": dtype_name(param.dtype),
            "batch_tokens": choose_batch_tokens(self.config, self.runner, self.taps, existing),
        }  # fmt: skip

    def replies(
        self, prompts: list[list[int]], numbers: list[int], documents: int, first: int, generation: Generation
    ) -> list[list[int]]:  # fmt: skip
        """The continuations of one chunk of a generating run (vlens.harvest.replies), under the run's edits."""
        with self.device_lock:  # (the engine's forwards and a shard's share the model's buffers)
            given = self.edits.given if self.edits is not None else None
            return generate_replies(self.llm, prompts, numbers, documents, first, generation, given)

    def run_shard(
        self, batch_tokens: int, row_keys: tuple[str, ...], index: int, first: int, shard_windows: list[Window]
    ) -> dict[str, Any]:  # fmt: skip
        """Run, write and describe shard `index`; idempotent, so Ray may retry it after a kill."""
        with self.device_lock:  # one task's forwards at a time; the other task meanwhile writes
            if self.stage is None:
                self.stage = DeviceRows(
                    self.runner, self.wanted, request_shapes(self.loaded.config), self.config.out_dtype,
                    self.excluded, batch_tokens, self.features, self.edits, buffer_sets=_TASKS_PER_ACTOR,
                    row_keys=row_keys, pool=self.config.pool, encoder=self.encoder,
                )  # fmt: skip  (never closed: the actor ends with the run)
            shard = self.stage.shard(index, first, shard_windows)
        try:
            shard.ready()
            started = time.perf_counter()
            entry = store_shard(self.store, index, first, shard_windows, shard.tensors, self.config.seed)
            written = time.perf_counter() - started
        finally:
            self.stage.buffers.give(shard.buffers)
        stats = {name: Pieces(p.values.clone(), p.rows) for name, p in shard.stats.items()}  # out of pinned memory
        return {"index": index, "entry": entry, "stats": stats, "device_seconds": shard.forward_seconds,
                "write_seconds": written}  # fmt: skip


def _actor_start(actors: list[Any], generation: Generation) -> Start:
    """`with_replies`'s start on the actors: each chunk on the next actor in turn."""
    import ray

    turn = itertools.cycle(actors)

    def start(prompts: list[list[int]], numbers: list[int], documents: int, first: int) -> Callable[[], Any]:
        ref = next(turn).replies.remote(prompts, numbers, documents, first, generation)
        return lambda: ray.get(ref)

    return start


def harvest_ray(config: HarvestConfig) -> HarvestSummary:
    """The Ray backend of `vlens.harvest` (same options and result; see the module doc).

    The driver loads the model on its CPU only for the tokenizer, config and hashes; the actors load
    `model` themselves on `device` (one GPU each when it is CUDA, else one CPU each), so a path must
    be readable, or a hub id cached, on every node. An `LLM`/`LoadedModel` is used on the driver
    only; the actors load its checkpoint path at `model_dtype`."""
    import ray

    started = time.perf_counter()
    src = source_of(config)
    loaded = resolve_model(config.model, config, "cpu")
    cfg = loaded.config
    wanted, packing, features, edits = plan(loaded, config, src)
    store = Store.open(config.out_dir)

    if not ray.is_initialized():
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=config.progress)
    device = str(config.device)
    gpus = 1 if device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1) else 0
    actor_class = ray.remote(
        num_cpus=0 if gpus else config.cpus_per_worker, num_gpus=gpus, max_restarts=-1, max_task_retries=-1,
        max_concurrency=_TASKS_PER_ACTOR,
    )(ShardWorker)
    model = config.model
    replica = dataclasses.replace(
        config, model=str(loaded.path) if not isinstance(model, (str, os.PathLike)) and model is not None else model,
        out_dir=store.url,
    )  # fmt: skip
    actors = [actor_class.remote(replica, wanted, list(packing.excluded_token_ids)) for _ in range(config.workers)]
    try:
        info = ray.get(actors[0].info.remote())  # every actor runs the batches the first one chose
        batch_tokens = info["batch_tokens"]
        generation = None
        if config.generate_tokens is not None:
            generation = Generation(config.generate_tokens, config.temperature, config.samples)
        described = generation and generation.describe()
        encoder = image_encoder(config.model, loaded) if src.image_field is not None else None
        run_header = header(loaded, src, wanted, packing, config, batch_tokens, features, edits, described, encoder)
        run_header["model"].update(device=info["device"], dtype=info["dtype"])
        job = Job.open(config.out_dir, run_header, cfg, wanted, config.out_dtype, packing)
        if job.manifest["complete"]:
            return job.report(started, config.progress, config.workers)
        if encoder is not None:  # (its processor on the driver: a record's images travel with its window)
            token_docs = token_documents(src.documents(), loaded.tokenizer, cfg.vocab_size, encoder=encoder)
        else:
            token_docs = ray_token_documents(
                src, loaded.tokenizer, cfg.vocab_size, packing.roles, config.workers, generation is not None
            )  # fmt: skip
        if generation is not None:  # the actors generate, a chunk each at a time
            token_docs = with_replies(token_docs, generation, packing, job, _actor_start(actors, generation),
                                      ahead=config.workers)  # fmt: skip
        tasks = job.shards(window_stream(token_docs, packing, config.max_tokens), src)
        with job.progress_bar("harvest (ray)", config.max_tokens, config.progress) as bar:
            committed = submitted = len(job.manifest["shards"])
            waiting: dict[int, dict[str, Any]] = {}  # finished shards behind an unfinished one
            running: dict[Any, Any] = {}  # task -> its actor
            load = dict.fromkeys(actors, 0)

            def top_up() -> None:
                nonlocal submitted
                for actor in actors:
                    while load[actor] < _TASKS_PER_ACTOR and submitted < committed + config.workers * _AHEAD_PER_WORKER:
                        task = next(tasks, None)
                        if task is None:
                            return
                        running[actor.run_shard.remote(batch_tokens, job.row_keys, *task)] = actor
                        load[actor] += 1
                        submitted += 1

            top_up()
            while running:
                [ref], _ = ray.wait(list(running), num_returns=1)
                load[running.pop(ref)] -= 1
                result = ray.get(ref)
                waiting[result["index"]] = result
                while committed in waiting:  # the manifest grows in shard order only
                    result = waiting.pop(committed)
                    job.commit(result["entry"], result["stats"], bar)
                    job.device_seconds += result["device_seconds"]
                    job.write_seconds += result["write_seconds"]
                    committed += 1
                top_up()
            job.finish()
        return job.report(started, config.progress, config.workers)
    finally:
        for actor in actors:  # no task of this run may write into out_dir after it returns or dies
            ray.kill(actor, no_restart=True)
