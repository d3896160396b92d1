"""Nothing lost: a harvest SIGKILLed at any point and run again ends byte-identical to an uninterrupted run,
and the pipelined harvest (source, forwards and writes in threads of their own) writes the bytes of the
serial one.

The child processes kill themselves with SIGKILL at exact points (mid-shard forward, shard written but
not renamed, shard renamed but not in the manifest, the writer thread holding a shard it has not
written while the forwards go on), chained on one directory, so that each resume starts from the wreck
the previous kill left. The reference is an uninterrupted run without the pipeline."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest
from harvest_helpers import conversations, dir_bytes, documents, write_jsonl

from vlens import harvest
from vlens.distributed.ranks import PRELOAD
from vlens.harvest import job
from vlens.harvest.writer import read_manifest

OPTIONS = {
    "context_size": 16,
    "shard_bytes": 80_000,  # three windows of 16 rows per shard
    "batch_tokens": 32,  # two windows per forward: shards take two forwards
    "pipeline": "on",  # the threads, which a CPU run goes without by default
    "progress": False,
}
HOOKS = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_v"]

def _harvest_dying_at(model: str, source: str, out: str, point: str, nth: int, options: dict) -> None:
    """A harvest that SIGKILLs its own process at the `nth` time it reaches `point` (the target of `_kill_at`'s
    process: this module's state there is the fork server's, untouched by the test's patches)."""
    from vlens.harvest import replies

    replies.CHUNK = 4  # (continuations generated four documents at a time, as in the parent's reference run)
    calls = {"n": 0}

    def die_on_nth(real, before=None, after=None):
        def wrapped(*args, **kwargs):
            hit = before is None or before(*args)
            if hit:
                calls["n"] += 1
            if hit and calls["n"] == nth and after is None:
                os.kill(os.getpid(), signal.SIGKILL)
            result = (after or real)(*args, **kwargs)
            if hit and calls["n"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return wrapped

    if point == "forward":  # mid-shard: some batches of the shard have run
        job.forward = die_on_nth(job.forward)
    elif point == "before-rename":  # the shard is whole and fsynced under its temporary name
        os.replace = die_on_nth(os.replace, before=lambda src, dst: "shard-" in str(dst))
    elif point == "after-rename":  # the shard has its name but the manifest does not list it yet
        job.write_shard = die_on_nth(job.write_shard, after=job.write_shard)
    elif point == "generate":  # before a chunk of continuations is generated (nothing of it on disk)
        replies.generate_replies = die_on_nth(replies.generate_replies)
    elif point == "replies-written":  # a chunk of continuations is on disk; its windows have not run
        replies.atomic_write = die_on_nth(replies.atomic_write, after=replies.atomic_write)
    elif point == "writer-holds":  # the writer thread holds shard nth, unwritten, while the forwards go on
        held = threading.Event()
        real_write, real_forward = job.write_shard, job.forward

        def write(store, index, tensors):
            if index == nth:
                held.set()
                threading.Event().wait()  # never writes it
            return real_write(store, index, tensors)

        def forward(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 2 * (nth + 1):  # a forward of a shard after the held one (two forwards a shard)
                assert held.wait(120), "the writer never took the shard"
                os.kill(os.getpid(), signal.SIGKILL)
            return real_forward(*args, **kwargs)

        job.write_shard, job.forward = write, forward
    harvest(model, source, HOOKS, out, **options)


def _kill_at(model_path, source, out, point: str, nth: int, options: dict | None = None) -> None:
    """`_harvest_dying_at` in a process of its own, forked from multiprocessing's fork server, which has vlens
    imported (a fresh interpreter would spend seconds importing it each time; the server is the one
    tensor-parallel groups start their workers from)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    options = {**OPTIONS, **(options or {})}
    args = (str(model_path), str(source), str(out), point, nth, options)
    child = context.Process(target=_harvest_dying_at, args=args)
    child.start()
    child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL, child.exitcode


def _run(model, source, out, **options):
    return harvest(model, source, HOOKS, out, **{**OPTIONS, **options})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("resume") / "docs.jsonl", documents(30, seed=5))


@pytest.fixture(scope="module")
def expected(smol4, source, tmp_path_factory):
    """The files of an uninterrupted run without the pipeline."""
    out = tmp_path_factory.mktemp("serial") / "out"
    _run(smol4, source, out, pipeline="off")
    assert len(read_manifest(out)["shards"]) >= 6
    return dir_bytes(out)


def test_resume_after_sigkill_is_byte_identical(smol4, smol4_path, source, expected, tmp_path):
    _run(smol4, source, tmp_path / "pipelined")
    assert dir_bytes(tmp_path / "pipelined") == expected

    out = tmp_path / "killed"
    _kill_at(smol4_path, source, out, "writer-holds", 1)
    assert len(read_manifest(out)["shards"]) == 1  # shard 0 committed; shard 1 held, never written
    assert not (out / "shard-00001.safetensors").exists() and not (out / ".tmp-shard-00001.safetensors").exists()

    _kill_at(smol4_path, source, out, "forward", 3)  # in the second shard's first forward of this run
    done = len(read_manifest(out)["shards"])  # the writer thread may or may not have committed the first
    assert done in (1, 2)

    _kill_at(smol4_path, source, out, "before-rename", 2)  # the second shard this run writes
    assert len(read_manifest(out)["shards"]) == done + 1
    assert (out / f".tmp-shard-{done + 1:05d}.safetensors").exists()

    _kill_at(smol4_path, source, out, "after-rename", 1)
    assert len(read_manifest(out)["shards"]) == done + 1
    assert (out / f"shard-{done + 1:05d}.safetensors").exists()  # on disk, but not in the manifest: redone

    summary = _run(smol4, source, out)
    assert summary.tokens_this_run == summary.tokens - (done + 1) * 3 * 16
    assert dir_bytes(out) == expected


def test_a_steered_harvest_of_one_roles_rows_resumes_byte_identical(smol4, smol4_path, tmp_path):
    """Conversations read through the chat template, the assistant's rows only, under a steering vector:
    killed mid-shard and run again, the files are those of an uninterrupted run."""
    import torch

    from vlens.steering import SteeringVector

    source = write_jsonl(tmp_path / "chats.jsonl", conversations(documents(30, seed=5)), field="messages")
    vector = tmp_path / "vector.safetensors"
    steer = torch.randn(576, generator=torch.Generator().manual_seed(0))
    SteeringVector({"blocks.0.hook_resid_post": steer}).save(vector)
    options = {"roles": ["assistant"], "steering_vector": str(vector), "multiplier": 2.0, "shard_bytes": 30_000}
    _run(smol4, source, tmp_path / "whole", pipeline="off", **options)
    manifest = read_manifest(tmp_path / "whole")
    assert len(manifest["shards"]) >= 4 and manifest["totals"]["rows_excluded"] > manifest["totals"]["rows"] / 2
    _kill_at(smol4_path, source, tmp_path / "out", "forward", 5, options)
    assert 0 < len(read_manifest(tmp_path / "out")["shards"]) < len(manifest["shards"])
    assert _run(smol4, source, tmp_path / "out", **options).tokens_this_run > 0
    assert dir_bytes(tmp_path / "out") == dir_bytes(tmp_path / "whole")


def test_a_generating_harvest_resumes_byte_identical(smol4, smol4_path, tmp_path, monkeypatch):
    """Texts continued by seeded samples before they are read: killed before a chunk of continuations is
    generated, right after one is written, and mid-shard, then run again (its source copied to another path):
    the directory (continuations and shards) is an uninterrupted run's, and no chunk on disk was generated twice."""
    from vlens.harvest import replies

    monkeypatch.setattr(replies, "CHUNK", 4)
    source = write_jsonl(tmp_path / "docs.jsonl", documents(14, seed=6))
    options = {"generate_tokens": 6, "temperature": 0.8}
    _run(smol4, source, tmp_path / "whole", **options)
    assert len(read_manifest(tmp_path / "whole")["shards"]) >= 6
    out = tmp_path / "out"
    _kill_at(smol4_path, source, out, "generate", 2, options)
    assert [p.name for p in out.glob("replies-*")] == ["replies-00000.json"]
    assert len(read_manifest(out)["shards"]) >= 1
    _kill_at(smol4_path, source, out, "replies-written", 1, options)
    assert sorted(p.name for p in out.glob("replies-*")) == ["replies-00000.json", "replies-00001.json"]
    _kill_at(smol4_path, source, out, "forward", 3, options)
    on_disk = len(list(out.glob("replies-*")))
    calls = []
    real = replies.generate_replies
    monkeypatch.setattr(replies, "generate_replies", lambda *args: calls.append(args[4]) or real(*args))
    moved = tmp_path / "moved.jsonl"  # (the same data at another path: the run's replies are still its own)
    moved.write_bytes(source.read_bytes())
    assert _run(smol4, moved, out, **options).tokens_this_run > 0
    assert calls == [4 * i for i in range(on_disk, 4)]  # (14 documents: four chunks)
    assert dir_bytes(out) == dir_bytes(tmp_path / "whole")


def test_a_failed_write_stops_the_run_and_the_rerun_completes_it(smol4, source, expected, tmp_path, monkeypatch):
    """An error in the writer thread (a full disk, say) is raised by `harvest` in the calling thread, after
    the shards before it are committed; the re-run does the rest and ends with the same bytes."""
    real = job.write_shard

    def full_at_the_third(store, index, tensors):
        if index == 2:
            raise OSError(28, "No space left on device")
        return real(store, index, tensors)

    monkeypatch.setattr(job, "write_shard", full_at_the_third)
    with pytest.raises(OSError, match="No space left"):
        _run(smol4, source, tmp_path / "out")
    assert len(read_manifest(tmp_path / "out")["shards"]) == 2
    monkeypatch.setattr(job, "write_shard", real)
    assert _run(smol4, source, tmp_path / "out").tokens_this_run > 0
    assert dir_bytes(tmp_path / "out") == expected


def test_what_a_killed_write_leaves_is_cleaned_on_resume(tmp_path):
    """A kill mid-write leaves our temporary, or (a run of an earlier version, which wrote shards with
    safetensors' save_file) safetensors' own (`.tmp` and six letters), or a shard not in the manifest: a
    resumed run removes them all. A file of
    another kind in a directory without a manifest makes it foreign."""
    from vlens.harvest.writer import Store, prepare_dir

    for name in (".tmp-shard-00003.safetensors", ".tmpLDWPGC", "shard-00004.safetensors"):
        (tmp_path / name).write_bytes(b"torn")
    prepare_dir(Store.open(tmp_path), {"shards": []})
    assert list(tmp_path.iterdir()) == []
    (tmp_path / ".tmpnotes").write_text("someone else's")
    with pytest.raises(ValueError, match="not empty"):
        prepare_dir(Store.open(tmp_path), None)
