"""`harvest()`: run a model over a corpus and keep the activations of chosen hooks on disk.

This module is the entry and the local backend (the forwards in this process); `ray_backend` is the
other. Both drive the same `job.Job`, which is what makes their files identical and any run resumable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from vlens.capture.names import request_shapes
from vlens.harvest.config import HarvestConfig
from vlens.harvest.job import HarvestSummary, Job, choose_batch_tokens, header, plan, source_of, window_stream
from vlens.harvest.model import generation_engine, image_encoder, resolve_model, runner_for
from vlens.harvest.pipeline import run_shards
from vlens.harvest.replies import Generation, local_start, with_replies
from vlens.harvest.rows import DeviceRows
from vlens.harvest.sources import Source
from vlens.harvest.windows import token_documents
from vlens.harvest.writer import read_manifest
from vlens.llm import LLM
from vlens.loader import LoadedModel
from vlens.settings import from_kwargs


def harvest(
    model: Any, source: str | os.PathLike, hooks: str | Iterable[str] | None, out_dir: str | os.PathLike, **options: Any
) -> HarvestSummary:
    """Harvest activations of `hooks` over `source` into safetensors shards under `out_dir` (with
    `sae=` and `top_k=`, also, or only when `hooks` is None, an SAE's top latents per row).

    model: a path, hub id or GGUF (as `LLM`), None for the default, or an `LLM`/`LoadedModel` to reuse.
    options: the other fields of `HarvestConfig` (context_size, dtype, max_tokens, seed, backend, ...),
      which says what each does and allows; an unknown or invalid one is a ValueError naming it, raised
      before any model is loaded.
    Re-running into the same `out_dir` with the same options resumes after the last complete shard;
    with different options it raises ValueError naming them.
    out_dir: a local path or any fsspec URL (s3://, gs://, file://, ...); reading back needs a local copy.
    """
    return harvest_with(
        from_kwargs(HarvestConfig, {"model": model, "source": source, "hooks": hooks, "out_dir": out_dir, **options})
    )


def harvest_with(config: HarvestConfig) -> HarvestSummary:
    """`harvest` with its options already gathered (as `vlens harvest` does), on the backend they name."""
    if config.backend == "ray":
        from vlens.harvest.ray_backend import harvest_ray  # ray is an optional extra

        return harvest_ray(config)
    return _harvest_local(config)


def _harvest_local(config: HarvestConfig) -> HarvestSummary:
    started = time.perf_counter()
    src = source_of(config)
    model = generation_engine(config) if config.generate_tokens is not None else config.model
    loaded = resolve_model(model, config, config.device)
    try:
        return _harvest_loaded(config, model, loaded, src, started)
    finally:
        if loaded.model.executor is not None and not isinstance(config.model, (LLM, LoadedModel)):
            loaded.model.executor.close()  # the group this harvest started


def _harvest_loaded(
    config: HarvestConfig, model: Any, loaded: LoadedModel, src: Source, started: float
) -> HarvestSummary:  # fmt: skip
    wanted, packing, features, edits = plan(loaded, config, src)
    generation = None
    if config.generate_tokens is not None:
        generation = Generation(config.generate_tokens, config.temperature, config.samples)
    taps = sorted({*wanted.values(), *([features.tap] if features is not None else [])})
    runner = runner_for(model, loaded)
    batch_tokens = choose_batch_tokens(config, runner, taps, read_manifest(config.out_dir))
    encoder = None  # (a checkpoint whose images cannot be read fails here, before anything is written)
    if src.image_field is not None:
        encoder = image_encoder(model, loaded)
    run_header = header(
        loaded, src, wanted, packing, config, batch_tokens, features, edits, generation and generation.describe(),
        encoder,
    )  # fmt: skip
    job = Job.open(config.out_dir, run_header, loaded.config, wanted, config.out_dtype, packing)
    if job.manifest["complete"]:
        return job.report(started, config.progress)
    token_docs = token_documents(
        src.documents(), loaded.tokenizer, loaded.config.vocab_size, packing.roles, generation is not None, encoder
    )  # fmt: skip
    if generation is not None:
        token_docs = with_replies(token_docs, generation, packing, job, local_start(model, generation, edits))
    # (a generating run reads its source in this thread: the engine and the harvest share the model's buffers)
    pipelined = config.pipelined(next(loaded.model.parameters()).device) and generation is None
    stage = DeviceRows(
        runner, wanted, request_shapes(loaded.config), config.out_dtype, job.excluded, batch_tokens, features, edits,
        buffer_sets=2 if pipelined else 1, row_keys=job.row_keys, pool=config.pool, encoder=encoder,
    )  # fmt: skip
    try:
        with job.progress_bar("harvest", config.max_tokens, config.progress) as bar:
            tasks = job.shards(window_stream(token_docs, packing, config.max_tokens), src)
            run_shards(job, stage, tasks, config.seed, bar, pipelined)
            job.finish()
    finally:
        stage.close()
    return job.report(started, config.progress)
