"""Nothing lost: a harvest SIGKILLed at any point and run again ends byte-identical to an uninterrupted run.

The child processes kill themselves with SIGKILL at exact points (mid-shard forward, shard written but
not renamed, shard renamed but not in the manifest), chained on one
directory, so that each resume starts from the wreck the previous kill left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
from harvest_helpers import dir_bytes, documents, write_jsonl

from vlens import harvest
from vlens.harvest.writer import read_manifest

OPTIONS = {
    "context_size": 16,
    "shard_bytes": 80_000,  # three windows of 16 rows per shard
    "batch_tokens": 32,  # two windows per forward: shards take two forwards
    "progress": False,
}
HOOKS = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_v"]

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from vlens import harvest
    from vlens.harvest import job, writer

    model, source, out, point, nth, hooks, options = sys.argv[1:8]
    nth = int(nth)
    calls = {"n": 0}

    def die_on_nth(before=None, after=None):
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
        real = job.packed_forward
        job.packed_forward = die_on_nth()
    elif point == "before-rename":  # the shard is whole and fsynced under its temporary name
        real = os.replace
        os.replace = die_on_nth(before=lambda src, dst: "shard-" in str(dst))
    elif point == "after-rename":  # the shard has its name but the manifest does not list it yet
        real = job.write_shard
        job.write_shard = die_on_nth(after=real)
    harvest(model, source, json.loads(hooks), out, **json.loads(options))
    """
)


def _kill_at(tmp_path, model_path, source, out, point: str, nth: int) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run = subprocess.run(
        [sys.executable, str(script), str(model_path), str(source), str(out), point, str(nth),
         json.dumps(HOOKS), json.dumps(OPTIONS)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]


def _run(model, source, out):
    return harvest(model, source, HOOKS, out, **OPTIONS)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("resume") / "docs.jsonl", documents(30, seed=5))


def test_resume_after_sigkill_is_byte_identical(smol4, smol4_path, source, tmp_path):
    _run(smol4, source, tmp_path / "whole")
    expected = dir_bytes(tmp_path / "whole")
    assert len(read_manifest(tmp_path / "whole")["shards"]) >= 6

    out = tmp_path / "killed"
    _kill_at(tmp_path, smol4_path, source, out, "forward", 3)  # in the second shard's first forward
    assert len(read_manifest(out)["shards"]) == 1

    _kill_at(tmp_path, smol4_path, source, out, "before-rename", 2)
    assert len(read_manifest(out)["shards"]) == 2
    assert (out / ".tmp-shard-00002.safetensors").exists()

    _kill_at(tmp_path, smol4_path, source, out, "after-rename", 1)
    assert len(read_manifest(out)["shards"]) == 2
    assert (out / "shard-00002.safetensors").exists()  # on disk, but not in the manifest: redone

    summary = _run(smol4, source, out)
    assert summary.tokens_this_run == summary.tokens - 2 * 3 * 16
    assert dir_bytes(out) == expected
