"""Crash-safe output: shards and the manifest reach their names only whole.

Every file is written under a hidden temporary name, fsynced, renamed over its final name, and the
directory is fsynced, so after a kill at any moment a name holds either nothing, the old bytes or the
new bytes. The manifest is rewritten this way after each shard and is the only record of which
shards are complete: a shard file that the manifest does not list is a leftover and is deleted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(out_dir: Path, index: int, tensors: dict[str, torch.Tensor]) -> int:
    """Write one shard (keys sorted by safetensors, no metadata: same tensors, same bytes); its size."""
    data = save({k: v.contiguous() for k, v in tensors.items()})
    atomic_write(out_dir / shard_name(index), data)
    return len(data)


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """Canonical JSON (sorted keys, fixed indent; floats as Python's shortest round-trip repr)."""
    return (json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write(out_dir / MANIFEST, manifest_bytes(manifest))


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:  # atomic writes make this a foreign file, not a torn one
        raise ValueError(f"out_dir: {str(path)!r} is not a vlens harvest manifest ({e})") from e


def prepare_dir(out_dir: Path, manifest: dict[str, Any] | None) -> None:
    """Create `out_dir`, or clean what a killed run left: temporary files and unlisted shards.

    A directory with other files and no manifest is refused rather than written into."""
    out_dir.mkdir(parents=True, exist_ok=True)
    listed = {s["file"] for s in manifest["shards"]} if manifest else set()
    for entry in out_dir.iterdir():
        ours = entry.name.startswith(TMP_PREFIX) or (entry.name.startswith("shard-") and entry.suffix == ".safetensors")
        if ours and entry.name not in listed:
            entry.unlink()
        elif manifest is None and not ours:
            raise ValueError(
                f"out_dir: {str(out_dir)!r} is not empty and holds no {MANIFEST}; give a new or empty directory"
            )
