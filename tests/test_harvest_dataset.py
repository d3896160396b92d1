"""Reading a harvest: ActivationDataset (indexing, shuffled batches, DataLoader, the mean row), the SAELens
export, and a steering vector from two harvests' means."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import rel_err
from harvest_helpers import documents, read_shards, window_rows, write_jsonl
from torch.utils.data import DataLoader

from vlens import ActivationDataset, harvest
from vlens.cli import main
from vlens.harvest import difference_of_means, export
from vlens.steering import SteeringVector

HOOKS = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_k"]
CTX = 16


@pytest.fixture(scope="module")
def out(smol, tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    source = write_jsonl(root / "docs.jsonl", documents(40, seed=3))
    harvest(smol, source, HOOKS, root / "out", context_size=CTX, shard_bytes=60_000, progress=False)
    return root / "out"


@pytest.fixture(scope="module")
def rows(out):
    return read_shards(out)


def test_len_and_indexing_match_the_shards(out, rows):
    ds = ActivationDataset(out, HOOKS[0])
    full = rows[HOOKS[0]]
    assert len(ds) == len(full) and ds.shape == (576,) and ds.dtype == torch.bfloat16
    assert torch.equal(ds[0], full[0]) and torch.equal(ds[-1], full[-1]) and torch.equal(ds[np.int64(7)], full[7])
    assert torch.equal(ds[5 : len(full) - 3], full[5:-3])  # spans shards
    assert torch.equal(ds[::7], full[::7])
    index = torch.tensor([len(full) - 1, 0, 3, 3, -2])
    assert torch.equal(ds[index], full[index]) and torch.equal(ds[index.tolist()], full[index])
    mask = torch.arange(len(full)) % 3 == 0
    assert torch.equal(ds[mask], full[mask])
    heads = ActivationDataset(out, HOOKS[1])
    assert heads.shape == (3, 64) and torch.equal(heads[10:20], rows[HOOKS[1]][10:20])
    assert torch.equal(ActivationDataset(out, "token_ids")[:], rows["token_ids"])
    with pytest.raises(IndexError):
        ds[len(full)]
    with pytest.raises(ValueError, match=r"hook: 'blocks\.9\.hook_resid_post' is not in the harvest"):
        ActivationDataset(out, "blocks.9.hook_resid_post")
    with pytest.raises(ValueError, match=r"^batch_size: must be >= 1, got 0"):
        next(ds.batches(batch_size=0))


def _epoch(out, key, **kw):
    return list(ActivationDataset(out, key, **kw))


def test_batches_are_a_seeded_shuffle_of_every_row(out, rows):
    kw = {"batch_size": 50, "seed": 4, "shuffle_buffer": 200}
    acts, windows, positions = (_epoch(out, key, **kw) for key in (HOOKS[0], "window", "position"))
    assert [len(b) for b in acts][:-1] == [50] * (len(acts) - 1)
    key = torch.cat(windows) * CTX + torch.cat(positions)
    assert torch.equal(torch.sort(key).values, rows["window"] * CTX + rows["position"])  # each row once
    assert not torch.equal(key, rows["window"] * CTX + rows["position"])
    stacked = torch.cat(acts)
    position_of = {int(k): i for i, k in enumerate(rows["window"] * CTX + rows["position"])}
    same_rows = torch.tensor([position_of[int(k)] for k in key])
    assert torch.equal(stacked, rows[HOOKS[0]][same_rows])  # same seed: keys stay aligned with activations
    again = torch.cat(_epoch(out, HOOKS[0], **kw))
    other = torch.cat(_epoch(out, HOOKS[0], **{**kw, "seed": 5}))
    assert torch.equal(again, stacked) and not torch.equal(other, stacked)
    dropped = _epoch(out, HOOKS[0], drop_last=True, **kw)
    assert all(len(b) == 50 for b in dropped) and len(dropped) == len(stacked) // 50


def test_dataloader_workers_split_the_shards(out, rows):
    ds = ActivationDataset(out, "window", batch_size=64, seed=1)
    seen = torch.cat(list(DataLoader(ds, batch_size=None, num_workers=2)))
    assert torch.equal(torch.sort(seen).values, torch.sort(rows["window"]).values)


def test_saelens_export_round_trips(out, rows, tmp_path):
    import datasets

    target = export(out, tmp_path / "sae")
    loaded = datasets.load_from_disk(str(target))
    features = loaded.features
    assert features[HOOKS[0]] == datasets.Array2D(shape=(CTX, 576), dtype="float32")
    assert features[HOOKS[1]] == datasets.Array2D(shape=(CTX, 192), dtype="float32")
    assert features["token_ids"] == datasets.List(datasets.Value("int32"), length=CTX)
    assert len(loaded) == int(rows["window"].max()) + 1
    loaded.set_format("torch")
    for w in (0, len(loaded) - 1):
        expect = window_rows(rows, w)
        assert torch.equal(loaded[w]["token_ids"], expect["token_ids"])
        for hook in HOOKS:
            assert torch.equal(loaded[w][hook], expect[hook].float().reshape(CTX, -1)), hook


def test_export_refuses_a_harvest_with_rows_left_out(smol, tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", documents(10))
    harvest(smol, source, "hook_embed", tmp_path / "out", context_size=CTX, exclude_token_ids=[2], progress=False)
    with pytest.raises(ValueError, match=r"left out \d+ rows .*--keep-bos"):
        export(tmp_path / "out", tmp_path / "sae")


def test_saelens_reads_the_export_as_cached_activations(out, rows, tmp_path):
    """SAELens's own loader of cached activations (ActivationsStore with cached_activations_path, as its
    training runner builds it) reads the export: every hook's rows and token ids, window by window."""
    from sae_lens.training.activations_store import ActivationsStore

    target = export(out, tmp_path / "sae")
    windows = int(rows["window"].max()) + 1
    for hook, d_in in ((HOOKS[0], 576), (HOOKS[1], 192)):
        store = ActivationsStore(
            model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None, context_size=CTX,
            d_in=d_in, n_batches_in_buffer=2, total_training_tokens=windows * CTX, store_batch_size_prompts=windows,
            train_batch_size_tokens=CTX, prepend_bos=True, normalize_activations="none", device=torch.device("cpu"),
            dtype="float32", cached_activations_path=str(target),
        )  # fmt: skip
        acts, token_ids = store.get_raw_llm_batch()
        expect = [window_rows(rows, w) for w in range(windows)]
        assert torch.equal(acts, torch.cat([e[hook].float().reshape(CTX, -1) for e in expect]))
        assert torch.equal(token_ids.long(), torch.cat([e["token_ids"] for e in expect]).long())


def test_mean_is_the_mean_stored_row_without_reading_a_shard(out, rows, monkeypatch):
    expected = {hook: rows[hook].double().mean(0).float() for hook in HOOKS}
    monkeypatch.setattr(ActivationDataset, "mapped", None)  # (no shard is read)
    for hook in HOOKS:
        mean = ActivationDataset(out, hook).mean
        assert mean.dtype == torch.float32 and mean.shape == rows[hook].shape[1:]
        assert rel_err(mean, expected[hook]) < 1e-6
    with pytest.raises(ValueError, match=r"holds no rows of 'token_ids' to average"):
        ActivationDataset(out, "token_ids").mean


def test_difference_of_means_of_two_harvests_is_a_steering_vector(smol, smol4, out, rows, tmp_path):
    """The positive harvest's mean row minus the negative's, at every hook both stored or at those named (also
    as `vlens steering-vector --from-harvests`); the harvests must be of one model and hold the hooks."""
    other = tmp_path / "other"
    source = write_jsonl(tmp_path / "docs.jsonl", documents(20, seed=9))
    harvest(smol, source, [HOOKS[0], "blocks.2.hook_resid_post"], other, context_size=CTX, progress=False)
    theirs = read_shards(other)
    vector = difference_of_means(out, other)
    assert list(vector.vectors) == [HOOKS[0]]
    expected = rows[HOOKS[0]].double().mean(0) - theirs[HOOKS[0]].double().mean(0)
    assert rel_err(vector.vectors[HOOKS[0]], expected) < 1e-5
    assert torch.equal(difference_of_means(out, other, [HOOKS[0]]).vectors[HOOKS[0]], vector.vectors[HOOKS[0]])
    with pytest.raises(ValueError, match=r"hooks: \['blocks\.2\.hook_resid_post'\] not stored by both harvests as rows a vector can steer"):
        difference_of_means(out, other, ["blocks.2.hook_resid_post"])
    assert main(["steering-vector", "--from-harvests", str(out), str(other), "--out", str(tmp_path / "v.st")]) == 0
    assert torch.equal(SteeringVector.load(tmp_path / "v.st").vectors[HOOKS[0]], vector.vectors[HOOKS[0]])
    harvest(smol4, source, [HOOKS[0]], tmp_path / "smol4", context_size=CTX, progress=False)
    with pytest.raises(ValueError, match=r"negative: the harvests are of different models"):
        difference_of_means(out, tmp_path / "smol4")


def test_the_probe_example_joins_labels_by_document():
    """examples/probe_from_harvest.py: labels joined to pooled harvested rows by `document`, a probe trained on
    some words generalises to words it never saw, and the same probe run in the engine equals it on those rows."""
    script = Path(__file__).parent.parent / "examples" / "probe_from_harvest.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True)
    lines = run.stdout.splitlines()
    assert lines[0] == "accuracy on 80 texts with words it was not trained on: 1.00"
    assert float(lines[1].rsplit(" ", 1)[1]) < 1e-4
    scores = [float(line.split()[1].rstrip(":")) for line in lines[2:]]
    assert scores[0] > 0.5 > max(scores[1:3]) and scores[3] > 0.5
