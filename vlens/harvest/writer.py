"""Crash-safe output: shards and the manifest reach their names only whole, on any fsspec filesystem.

The output directory is a local path or a URL (`s3://…`, `gs://…`, `file://…`: whatever fsspec opens),
so that Ray workers on many machines can write into one place. Every file is written under a hidden
temporary name and then moved to its final name, so after a kill at any moment a name holds either
nothing, the old bytes or the new bytes: locally the file and the directory are fsynced and the move is
a POSIX rename; on an object store the move is a server-side copy, which makes an object visible whole
or not at all. The manifest is rewritten this way after each shard and is the only record of which
shards are complete: a shard file that the manifest does not list is a leftover and is deleted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any, BinaryIO

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from vlens import tensor_file

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
# What a kill left of a shard written by earlier versions, through safetensors' save_file (Rust's tempfile:
# ".tmp" and six letters or digits, in the same directory)
SAVE_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")
REPLIES = re.compile(r"replies-\d{5}\.json")


@dataclass(frozen=True)
class Store:
    """A harvest directory: the filesystem it lives on, and how another process opens it again."""

    fs: Any  # an fsspec filesystem
    root: str  # the directory as `fs` names it (an absolute path for a local one)
    url: str  # what a Ray worker passes to `Store.open` to reach the same directory

    @classmethod
    def open(cls, out_dir: str | os.PathLike) -> Store:
        fs, root = url_to_fs(str(out_dir))
        local = isinstance(fs, LocalFileSystem)
        return cls(fs, root.rstrip("/") or "/", root if local else str(out_dir))

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:  # object stores have no empty directories
            return []

    def __str__(self) -> str:
        return self.url


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def replies_name(index: int) -> str:
    """Of the continuations a generating run wrote for its documents' chunk `index` (vlens.harvest.replies)."""
    return f"replies-{index:05d}.json"


def atomic_write(store: Store, name: str, data: bytes) -> None:
    _write_then_name(store, name, lambda f: f.write(data))


def _write_then_name(store: Store, name: str, write: Callable[[BinaryIO], int]) -> int:
    """`write` into a temporary file, then give it `name`: a kill mid-write leaves no file of that name
    (prepare_dir removes the temporary); what `write` returned."""
    final, tmp = store.path(name), store.path(TMP_PREFIX + name)
    with store.fs.open(tmp, "wb") as f:
        size = write(f)
    if store.local:
        _sync_rename(store, tmp, final)
    else:
        store.fs.mv(tmp, final)
    return size


def _sync_rename(store: Store, tmp: str, final: str) -> None:
    """Make a local file whole on disk, then give it its name (and make the rename durable)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fd = os.open(store.root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(store: Store, index: int, tensors: dict[str, torch.Tensor]) -> int:
    """Write one shard (keys sorted as safetensors sorts them, no metadata: same tensors, same bytes); its
    size. Each tensor goes from its own memory to the file (vlens.tensor_file), never through a copy of the
    whole shard in bytes."""
    return _write_then_name(store, shard_name(index), lambda f: tensor_file.dump(tensors, f))


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """Canonical JSON (sorted keys, fixed indent; floats as Python's shortest round-trip repr)."""
    return (json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def write_manifest(store: Store, manifest: dict[str, Any]) -> None:
    atomic_write(store, MANIFEST, manifest_bytes(manifest))


def read_manifest(out_dir: Store | str | os.PathLike) -> dict[str, Any] | None:
    store = out_dir if isinstance(out_dir, Store) else Store.open(out_dir)
    path = store.path(MANIFEST)
    if not store.fs.exists(path):
        return None
    try:
        return json.loads(store.fs.cat_file(path))
    except json.JSONDecodeError as e:  # atomic writes make this a foreign file, not a torn one
        raise ValueError(f"out_dir: {path!r} is not a vlens harvest manifest ({e})") from e


def read_replies(store: Store) -> list[list[int]]:
    """The continuations a generating run wrote (vlens.harvest.replies), in document order: its chunks up to
    the first missing one."""
    replies: list[list[int]] = []
    for index in count():
        path = store.path(replies_name(index))
        if not store.fs.exists(path):
            return replies
        replies += json.loads(store.fs.cat_file(path))["replies"]
    return replies


def prepare_dir(store: Store, manifest: dict[str, Any] | None) -> None:
    """Create the directory, or clean what a killed run left: temporary files and unlisted shards.

    A directory with other files and no manifest is refused rather than written into, and so is a file."""
    if store.fs.isfile(store.root):
        raise ValueError(f"out_dir: {str(store)!r} is a file; give a directory (new, empty, or a run to resume)")
    store.fs.makedirs(store.root, exist_ok=True)
    listed = {s["file"] for s in manifest["shards"]} if manifest else set()
    for name in store.names():
        if REPLIES.fullmatch(name):
            continue  # kept: a generating run reads the continuations it wrote (a stale one it writes again)
        ours = (
            name.startswith(TMP_PREFIX) or SAVE_TMP.fullmatch(name) is not None
            or (name.startswith("shard-") and name.endswith(".safetensors"))
        )  # fmt: skip
        if ours and name not in listed:
            store.fs.rm_file(store.path(name))
        elif manifest is None and not ours:
            raise ValueError(
                f"out_dir: {str(store)!r} is not empty and holds no {MANIFEST}; give a new or empty directory"
            )
