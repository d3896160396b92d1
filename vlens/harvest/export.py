"""Export a harvest to the Hugging Face `datasets` layout that SAELens's cached-activations loader reads.

One row per window: `{hook_name: Array2D((context_size, d)), "token_ids": List(int32, context_size)}`,
with multi-axis hooks (q, k, v, z) flattened to d = heads * head_dim as SAELens's d_in expects.
Arrow has no bfloat16, so values are written as float32 (exact for bfloat16 and float16 shards).
That layout has no room for a missing position, so it needs whole windows: a harvest whose rows
at BOS or other tokens were left out cannot be exported (harvest again with `--keep-bos`, without
`--exclude-token-ids`); neither can unpacked windows shorter than `context_size`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlens.harvest.dataset import load_manifest, local_dir, mmap_shard

FORMATS = ("saelens",)
EXPORT_DTYPES = ("float32", "float16")


def export(out_dir: str | os.PathLike, to: str | os.PathLike, format: str = "saelens", dtype: str = "float32") -> Path:
    """Write the complete harvest in `out_dir` as a `datasets` directory at `to` (new or empty); returns `to`."""
    if format not in FORMATS:
        raise ValueError(f"format: {format!r} is not one of {', '.join(FORMATS)}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    out_dir = local_dir(out_dir)
    manifest = load_manifest(out_dir)
    _check_exportable(manifest, out_dir)
    target = Path(to)
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"to: {str(target)!r} exists and is not empty")
    import datasets

    ctx = manifest["context_size"]
    width = {name: math.prod(h["shape"]) for name, h in manifest["hooks"].items()}
    features = datasets.Features(
        {
            **{name: datasets.Array2D(shape=(ctx, d), dtype=dtype) for name, d in width.items()},
            "token_ids": datasets.List(datasets.Value("int32"), length=ctx),
        }
    )
    files = [str(out_dir / s["file"]) for s in manifest["shards"]]
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=target.parent, prefix=".vlens-export-")
    try:
        try:
            dataset = datasets.Dataset.from_generator(
                _windows,
                features=features,
                cache_dir=scratch,
                # datasets splits list-valued gen_kwargs across workers: only `files` may be a list
                gen_kwargs={"files": files, "hooks": tuple(width), "context_size": ctx, "dtype": dtype},
            )
        except datasets.exceptions.DatasetGenerationError as e:  # (our own ValueError, wrapped by datasets)
            if isinstance(e.__cause__, ValueError):
                raise e.__cause__ from None
            raise
        dataset.save_to_disk(str(target))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _check_exportable(manifest: dict[str, Any], out_dir: Any) -> None:
    totals, ctx = manifest["totals"], manifest["context_size"]
    if not manifest["hooks"]:
        raise ValueError(
            f"out_dir: the harvest in {str(out_dir)!r} stored SAE latents only; the SAELens layout holds dense rows: "
            "harvest with --hooks"
        )
    if not manifest["complete"]:
        raise ValueError(
            f"out_dir: the harvest in {str(out_dir)!r} is not complete ({len(manifest['shards'])} shards so far); "
            "re-run the same harvest command to finish it"
        )
    if manifest.get("pool"):
        raise ValueError(
            f"out_dir: the harvest in {str(out_dir)!r} stored one row per document (pool={manifest['pool']!r}); the "
            "SAELens layout holds every row of full windows: harvest without --pool"
        )
    if totals["rows_excluded"]:
        roles = manifest["packing"].get("roles")
        why = f"token ids {manifest['exclusions']['token_ids']}" + (f"; rows not of roles {roles}" if roles else "")
        flags = "--exclude-token-ids or --roles" if roles else "--exclude-token-ids"
        raise ValueError(
            f"out_dir: the harvest in {str(out_dir)!r} left out {totals['rows_excluded']} rows ({why}); the SAELens "
            f"layout needs whole windows: harvest with --keep-bos and no {flags}"
        )
    if totals["tokens"] != totals["windows"] * ctx:
        raise ValueError(
            f"out_dir: the harvest in {str(out_dir)!r} has windows shorter than context_size={ctx} (unpacked "
            "documents); the SAELens layout needs full windows: harvest with packing"
        )


def _windows(
    files: list[str], hooks: tuple[str, ...], context_size: int, dtype: str
) -> Iterator[dict[str, np.ndarray]]:
    """One example per window, in window order (shards hold whole windows; rows may be shuffled inside)."""
    for file in files:
        shard = mmap_shard(Path(file))
        order = torch.argsort(shard["window"] * context_size + shard["position"])
        count = len(order) // context_size
        values = {name: _cast(shard[name].index_select(0, order), dtype, name, file) for name in hooks}
        values = {name: v.reshape(count, context_size, -1).numpy() for name, v in values.items()}
        tokens = shard["token_ids"].index_select(0, order).reshape(count, context_size).numpy()
        for i in range(count):
            yield {**{name: v[i] for name, v in values.items()}, "token_ids": tokens[i]}


def _cast(rows: torch.Tensor, dtype: str, hook: str, file: str) -> torch.Tensor:
    """`rows` as `dtype`, refusing values it cannot hold (bfloat16 rows past 65,504 are inf in float16)."""
    out = rows.to(getattr(torch, dtype))
    if out.is_floating_point() and not bool(torch.isfinite(out).all()) and bool(torch.isfinite(rows).all()):
        raise ValueError(f"dtype: rows of {hook!r} in {Path(file).name} are past {dtype}'s range; export as float32")
    return out
