"""The Ray backend of vlens.harvest on a local 2-CPU cluster: the same files as the single-machine run,
also when an actor is SIGKILLed mid-shard (Ray restarts it and retries the task), when the driver
stops after some shards and is run again, and when the actors generate the continuations of an on-policy run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from harvest_helpers import SOURCE_KINDS, dir_bytes, documents, read_shards, write_jsonl, write_source

from vlens import Steer, harvest
from vlens.harvest import job, ray_source, replies
from vlens.harvest.cli import add_parser
from vlens.harvest.sources import open_source
from vlens.harvest.windows import Marked, token_documents
from vlens.harvest.writer import read_manifest

ray = pytest.importorskip("ray")

# The model is SmolLM2 cut to four layers (conftest.smol4_path): every actor (re)start loads it again, and
# what the tests check, the bytes of the single-machine run, holds for any model.
HOOKS = ["blocks.2.hook_resid_post", "blocks.0.attn.hook_v"]
# 24 windows of 32 tokens; 400 kB is 4 windows a shard (3092 B a row): 6 shards of 2 forwards each.
OPTIONS = {"context_size": 32, "dtype": "float32", "shard_bytes": 400_000, "batch_tokens": 64, "progress": False}
WINDOWS = 24


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """A local cluster of two CPUs, and one torch thread here: an actor of one CPU runs one (Ray's OMP_NUM_THREADS),
    and the single-machine runs whose bytes the actors' must equal take as many (a GEMM's sums may group otherwise
    on two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def local_run(smol4_path, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "out"
    harvest(str(smol4_path), corpus, HOOKS, out, max_tokens=WINDOWS * 32, **OPTIONS)
    return out


def _ray_harvest(model_path, corpus, out: Path | str):
    return harvest(str(model_path), corpus, HOOKS, out, max_tokens=WINDOWS * 32, backend="ray", workers=2, **OPTIONS)


def _each_window_once(out: Path) -> None:
    windows = read_shards(out)["window"]
    assert torch.equal(torch.unique(windows), torch.arange(WINDOWS))
    assert len(windows) == WINDOWS * 32


DOCS = documents(30, seed=2)


@pytest.mark.parametrize("kind", [*SOURCE_KINDS, "chat_parquet", "txt_whole_file", "txt_odd_newlines"])
def test_ray_data_reads_the_documents_the_local_reader_reads(smol, tmp_path, monkeypatch, kind):
    """Read and tokenized by Ray Data tasks, each taking a piece of the source, the token lists come in
    source order and equal the local reader's, newline rules and blank records included; conversations (as
    Parquet structs, whose other forms are read by the same functions as texts) also with their role marks."""
    monkeypatch.setattr(ray_source, "_PIECE_ROWS", 10)  # parquet and datasets sources in three pieces each
    options: dict = {}
    if kind.startswith("txt_"):
        path = tmp_path / "docs.txt"
        path.write_bytes("\r\n".join(DOCS[:10]).encode() + "\rcarriage\u2028separated\n\n \nend".encode())
        options["whole_file"] = kind == "txt_whole_file"
    else:
        token_docs = [smol.tokenizer(d, add_special_tokens=False)["input_ids"] for d in DOCS]
        path, options = write_source(kind, tmp_path, DOCS, token_docs)
    src = open_source(path, **options)
    local = list(token_documents(src.documents(), smol.tokenizer, smol.config.vocab_size))
    with_tokens = {"txt_whole_file": 1, "txt_odd_newlines": 12}.get(kind, len(DOCS))  # (blank records: empty)
    assert sum(1 for d in local if d) == with_tokens
    read = ray_source.ray_token_documents(src, smol.tokenizer, smol.config.vocab_size, None, concurrency=2)
    assert list(read) == local
    if kind.startswith("chat_"):
        roles = ("assistant",)
        local = list(token_documents(src.documents(), smol.tokenizer, smol.config.vocab_size, roles))
        assert all(isinstance(d, Marked) and any(d.stored) and not all(d.stored) for d in local)
        read = ray_source.ray_token_documents(src, smol.tokenizer, smol.config.vocab_size, roles, concurrency=2)
        assert list(read) == local


def test_ray_data_errors_name_the_field_and_line(smol, tmp_path):
    path = tmp_path / "ragged.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 7}) + "\n")
    src = open_source(path)
    with pytest.raises(ValueError, match=r"text_field: expected text in .*ragged.jsonl' line 2"):
        list(ray_source.ray_token_documents(src, smol.tokenizer, smol.config.vocab_size, None, concurrency=1))


def _busy_workers() -> list[int]:
    """Pids of Ray actor processes running a shard task (Ray names the process after the task)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"ShardWorker.run_shard" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


class _DriverDied(Exception):
    """Raised by the test to stop a driver mid-run."""


def _harvest_killing_an_actor(model_path, corpus, out: Path | str):
    """A Ray harvest during which the first actor caught running a shard task is SIGKILLed."""
    killed: list[int] = []
    stop = threading.Event()

    def kill_first_busy_worker() -> None:
        while not stop.is_set() and not killed:
            for pid in _busy_workers():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            time.sleep(0.005)

    killer = threading.Thread(target=kill_first_busy_worker)
    killer.start()
    try:
        summary = _ray_harvest(model_path, corpus, out)
    finally:
        stop.set()
        killer.join()
    assert killed, "no shard task was caught running"
    return summary


def test_same_files_as_single_machine_after_a_driver_stop_and_an_actor_kill(
    smol4_path, corpus, local_run, tmp_path, monkeypatch
):
    """One Ray harvest into a plain path whose driver stops after two shards, then its re-run through a
    file:// URL to the same directory, during which an actor is killed mid-shard (Ray restarts it and
    retries the task): the re-run does only the rest, and the files are the single-machine run's."""
    real = job.write_manifest

    def die_after_two_shards(out_dir, manifest):
        if len(manifest["shards"]) == 3:
            raise _DriverDied
        real(out_dir, manifest)

    monkeypatch.setattr(job, "write_manifest", die_after_two_shards)
    with pytest.raises(_DriverDied):
        _ray_harvest(smol4_path, corpus, tmp_path / "out")
    monkeypatch.setattr(job, "write_manifest", real)
    manifest = read_manifest(tmp_path / "out")
    assert len(manifest["shards"]) == 2 and not manifest["complete"]
    summary = _harvest_killing_an_actor(smol4_path, corpus, f"file://{tmp_path}/out")
    assert summary.out_dir == f"{tmp_path}/out"
    assert summary.tokens_this_run == (WINDOWS - 8) * 32  # the two committed shards are not redone
    assert summary.shards == len(read_manifest(local_run)["shards"]) == 6
    assert dir_bytes(tmp_path / "out") == dir_bytes(local_run)  # shards and manifest, byte for byte
    _each_window_once(tmp_path / "out")


def test_a_generating_harvest_writes_the_single_machine_files(smol4_path, tmp_path, monkeypatch):
    """generate_tokens on Ray: the actors write the replies to questions, a chunk each in turn (Ray Data's tasks
    render the template's generation prompt; sampled, seeded by document, two samples each, under the run's steer,
    the assistant's rows stored), and the replies files, shards and manifest are the single-machine run's, byte
    for byte."""
    monkeypatch.setattr(replies, "FIRST_CHUNK", 2)
    monkeypatch.setattr(replies, "CHUNK", 4)  # chunks of 2, 4, 4 documents: on both actors
    questions = [[{"role": "user", "content": doc}] for doc in documents(10, seed=4)]
    source = write_jsonl(tmp_path / "chats.jsonl", questions, field="messages")
    steer = Steer("blocks.1.hook_resid_post", torch.randn(576, generator=torch.Generator().manual_seed(0)))
    options = OPTIONS | {"generate_tokens": 6, "temperature": 0.9, "samples": 2, "interventions": [steer],
                         "roles": ["assistant"]}  # fmt: skip
    local = harvest(str(smol4_path), source, HOOKS, tmp_path / "local", **options)
    on_ray = harvest(str(smol4_path), source, HOOKS, tmp_path / "ray", backend="ray", workers=2, **options)
    assert sorted(p.name for p in (tmp_path / "ray").glob("replies-*")) == [f"replies-0000{i}.json" for i in range(3)]
    assert dir_bytes(tmp_path / "ray") == dir_bytes(tmp_path / "local")
    assert on_ray.rows == local.rows > 0 and on_ray.generate_seconds > 0


def test_cli_flags_and_no_ray_import_in_core():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["harvest", "--source", "s", "--hooks", "h", "--out", "o", "--ray", "--workers", "3", "--ray-address", "auto",
         "--cpus-per-worker", "2"]
    )  # fmt: skip
    assert (args.backend, args.workers, args.ray_address, args.cpus_per_worker) == ("ray", 3, "auto", 2.0)
    code = "import sys, vlens, vlens.harvest, vlens.harvest.cli, vlens.cli; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_backend_is_refused(smol4_path, corpus, tmp_path):
    with pytest.raises(ValueError, match="backend"):
        harvest(str(smol4_path), corpus, HOOKS, tmp_path / "out", backend="dask", **OPTIONS)


def test_records_with_images_write_the_single_machine_files(smol_path, tmp_path):
    """Records of a text and its images (LLaVA's tiny checkpoint, tests/test_harvest_images.py's records): the driver
    expands their placeholders, each actor runs the vision tower beside its model, and the files are the
    single-machine run's, byte for byte."""
    from test_harvest_images import OPTIONS as IMAGES
    from test_harvest_images import records
    from test_harvest_images import write_jsonl as write_records
    from test_images import checkpoint

    path = checkpoint("llava", smol_path, tmp_path / "llava")
    source = write_records(tmp_path, records("llava", tmp_path) * 3)
    hooks = ["blocks.0.hook_resid_post", "ln_final.hook_out"]
    options = dict(IMAGES, shard_bytes=40_000, batch_tokens=128)
    harvest(path, source, hooks, tmp_path / "local", **options)
    summary = harvest(path, source, hooks, tmp_path / "ray", backend="ray", workers=2, **options)
    assert summary.windows == 12 and len(read_manifest(tmp_path / "ray")["shards"]) > 2
    assert dir_bytes(tmp_path / "ray") == dir_bytes(tmp_path / "local")
