"""Harvests of an edited model: a steering vector (`steering_vector=`, `--steering-vector`) or any
interventions in every window. The rows equal HF's with the vector added by a forward hook, and the engine's
own requests with the same interventions; a hook read where an edit writes sees the edited value; the
manifest records the edits, so a re-run with others is refused and one with the same resumes; bad edits are
refused before any work."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import rel_err
from harvest_helpers import dir_bytes, read_shards, window_rows
from sae_helpers import save_saelens

from vlens import SAE, Ablate, Capture, Clamp, Patch, SamplingParams, Steer, harvest
from vlens.harvest.cli import add_parser
from vlens.harvest.config import HarvestConfig
from vlens.harvest.ray_backend import ShardWorker
from vlens.harvest.windows import Window
from vlens.steering import SteeringVector

CTX = 24
STEERED = "blocks.3.hook_resid_post"
HOOKS = [STEERED, "blocks.6.hook_resid_post"]
OPTIONS = {"context_size": CTX, "dtype": "float32", "max_tokens": 6 * CTX, "shard_bytes": 60_000, "progress": False}


@pytest.fixture(scope="module")
def vector_file(smol, tmp_path_factory):
    """A steering vector at layer 3 of SmolLM2, of the residual's typical size."""
    vector = torch.randn(smol.config.hidden_size, generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("vector") / "kind.safetensors"
    SteeringVector({STEERED: vector}).save(path)
    return path


@pytest.fixture(scope="module")
def steered(smol, corpus, vector_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("steered") / "out"
    harvest(smol, corpus, HOOKS, out, steering_vector=str(vector_file), multiplier=4.0, **OPTIONS)
    return out


def test_rows_are_hf_with_the_vector_added(smol, hf_smol, steered, vector_file):
    """Each window's rows are HF's forward of the window with 4 x the vector added to layer 3's output, at
    layer 3 itself (read after the edit) and three layers on; the vector moved them."""
    shards = read_shards(steered)
    assert len(json.loads((steered / "manifest.json").read_text())["shards"]) > 1
    added = 4.0 * SteeringVector.load(vector_file).vectors[STEERED]
    # (prepended: before transformers' own hook that records the layer's output for output_hidden_states)
    handle = hf_smol.model.layers[3].register_forward_hook(lambda module, args, out: out + added, prepend=True)
    try:
        for w in (0, 3, 5):
            rows = window_rows(shards, w)
            with torch.no_grad():
                hidden = hf_smol(rows["token_ids"][None].long(), output_hidden_states=True).hidden_states
            for hook, layer in zip(HOOKS, (4, 7)):
                assert rel_err(rows[hook], hidden[layer][0]) < 1e-5, (hook, w)
    finally:
        handle.remove()
    plain = smol.trace([window_rows(shards, 0)["token_ids"].tolist()], HOOKS[1])[0][HOOKS[1]]
    assert rel_err(window_rows(shards, 0)[HOOKS[1]], plain) > 0.05


def test_manifest_records_the_edits_and_resumes_only_with_them(smol, corpus, steered, vector_file, tmp_path):
    manifest = json.loads((steered / "manifest.json").read_text())
    record = manifest["interventions"]
    assert record["edits"] == [{"kind": "Steer", "hooks": [STEERED], "positions": "all"}]
    assert record["steering_vector"] == {"path": str(vector_file), "multiplier": 4.0}
    assert len(record["sha256"]) == 64
    vector = SteeringVector.load(vector_file)  # the same vector, given as an object: the run is complete
    summary = harvest(smol, corpus, HOOKS, steered, steering_vector=vector, multiplier=4.0, **OPTIONS)
    assert summary.tokens_this_run == 0
    with pytest.raises(ValueError, match=r"interventions\.sha256: .* on disk.*interventions\.steering_vector\."
                                         r"multiplier: 4\.0 on disk, 2\.0 now"):  # fmt: skip
        harvest(smol, corpus, HOOKS, steered, steering_vector=vector, multiplier=2.0, **OPTIONS)
    with pytest.raises(ValueError, match=r"interventions\.edits: \[.*\] on disk, None now"):
        harvest(smol, corpus, HOOKS, steered, **OPTIONS)
    plain = tmp_path / "plain"
    harvest(smol, corpus, HOOKS, plain, **OPTIONS)
    assert json.loads((plain / "manifest.json").read_text())["interventions"] is None


def test_cli_steering_vector_writes_the_same_files(smol_path, corpus, steered, vector_file, tmp_path):
    """`vlens harvest --steering-vector --multiplier`, here with its reading and writing in threads, writes the
    shards `harvest(steering_vector=, multiplier=)` wrote."""
    parser = argparse.ArgumentParser(prog="vlens")
    add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    args = parser.parse_args(
        ["harvest", "--model", str(smol_path), "--source", str(corpus), "--hooks", *HOOKS, "--out", str(out),
         "--context-size", str(CTX), "--dtype", "float32", "--max-tokens", str(6 * CTX), "--shard-bytes", "60000",
         "--steering-vector", str(vector_file), "--multiplier", "4", "--pipeline", "on", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    ours, theirs = dir_bytes(out), dir_bytes(steered)
    assert ours.keys() == theirs.keys()
    assert all(ours[name] == theirs[name] for name in ours if name != "manifest.json")  # (its model id differs)


@pytest.fixture(scope="module")
def sae(tmp_path_factory):
    return SAE.load(save_saelens(tmp_path_factory.mktemp("sae") / "sae", "jumprelu", d_sae=256, seed=2,
                                 hook="blocks.2.hook_resid_post")[0])  # fmt: skip


def test_interventions_equal_the_engines_requests(smol, corpus, sae, tmp_path):
    """A steer from position 5, a head ablation, a patched position and an SAE clamp, applied in every window
    in order (positions counted from its start), give each window the rows the engine gives a request of its
    tokens with the same interventions; rows read where the ablation and the clamp write see them (the engine's
    Capture does, and the heads ablated are zeros)."""
    g = torch.Generator().manual_seed(1)
    d, d_head = smol.config.hidden_size, smol.config.head_dim
    interventions = [
        Steer("blocks.1.hook_resid_post", torch.randn(d, generator=g), scale=3.0, positions="5:"),
        Ablate("blocks.2.attn.hook_z", heads=[0, 4]),
        Patch("blocks.1.hook_resid_post", torch.randn(d, generator=g), positions=[2]),
        Clamp("blocks.2.hook_resid_post", sae, feature=7, value=5.0),
    ]
    hooks = ["blocks.2.attn.hook_z", "blocks.2.hook_resid_post", "blocks.4.hook_resid_post"]
    out = tmp_path / "out"
    harvest(smol, corpus, hooks, out, interventions=interventions, **OPTIONS)
    shards = read_shards(out)
    for w in (0, 4):
        rows = window_rows(shards, w)
        params = SamplingParams(max_tokens=1, capture=Capture(hooks, positions="prompt"), interventions=interventions)
        (served,) = smol.generate([rows["token_ids"].tolist()], params, use_tqdm=False)
        for hook in hooks:
            assert rel_err(rows[hook], served.activations[hook]) < 1e-6, (hook, w)
        assert torch.equal(rows["blocks.2.attn.hook_z"][:, [0, 4]], torch.zeros(CTX, 2, d_head))


def test_a_ray_actor_applies_the_edits(smol_path, corpus, vector_file, tmp_path):
    """The Ray backend's actor (run here as a plain object) binds and applies the run's edits itself: its
    shard is the local run's, byte for byte."""
    options = {**OPTIONS, "model_dtype": "float32", "device": "cpu"}
    harvest(str(smol_path), corpus, HOOKS, tmp_path / "local", steering_vector=str(vector_file), multiplier=4.0,
            **options)  # fmt: skip
    first = read_shards(tmp_path / "local")
    manifest = json.loads((tmp_path / "local" / "manifest.json").read_text())
    start, end = manifest["shards"][0]["windows"]
    windows = [_window(window_rows(first, w)) for w in range(start, end)]
    config = HarvestConfig(model=str(smol_path), source=corpus, hooks=tuple(HOOKS), out_dir=tmp_path / "ray",
                           steering_vector=str(vector_file), multiplier=4.0, **options)  # fmt: skip
    (tmp_path / "ray").mkdir()
    worker = ShardWorker(config, {hook: hook for hook in HOOKS}, [])
    worker.run_shard(manifest["batch_tokens"], tuple(manifest["row_keys"]), 0, start, windows)
    name = manifest["shards"][0]["file"]
    assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


def _window(rows: dict[str, torch.Tensor]) -> Window:
    """The window whose every row is `rows` (in position order), with its documents."""
    documents = rows["document"].tolist()
    starts = tuple((p, d) for p, d in enumerate(documents) if p == 0 or d != documents[p - 1])
    return Window(rows["token_ids"].tolist(), (), starts)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"multiplier": 2.0}, r"multiplier: scales steering_vector; give one"),
        ({"interventions": [{"hook": STEERED}]},
         r"interventions\[0\]: expected vlens\.Steer, Ablate, Patch or Clamp, got dict"),
        ({"steering_vector": SteeringVector({STEERED: torch.ones(7)})},
         r"steering_vector: the vector at blocks\.3\.hook_resid_post has shape \(7,\), its rows \(576,\)"),
        ({"steering_vector": SteeringVector({"unembed.hook_out": torch.ones(49152)})},
         r"steering_vector: \['unembed\.hook_out'\] cannot be steered"),
        ({"steering_vector": "/nonexistent.safetensors"}, r"steering_vector: '/nonexistent\.safetensors' is not"),
        ({"interventions": [Patch(STEERED, torch.ones(576), positions=[30])]},
         r"interventions\[0\]\.positions: \[30\] out of range"),
        ({"interventions": [Steer("blocks.99.hook_resid_post", torch.ones(576))]},
         r"interventions\[0\]\.hook: 'blocks\.99\.hook_resid_post' matches no hook"),
    ],
)  # fmt: skip
def test_bad_edits_are_refused_before_any_work(smol, corpus, tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        harvest(smol, corpus, HOOKS, tmp_path / "out", **{**OPTIONS, **options})
    assert not (tmp_path / "out").exists()
