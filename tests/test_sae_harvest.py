"""Feature datasets: harvest with an SAE stores each kept row's top latents beside (or instead of) its
dense rows, exactly the SAE's top-k of those rows; max_activating finds a latent's strongest rows with
their context; options and resumes are checked like the rest of a harvest."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import rel_err
from harvest_helpers import documents, read_shards, window_rows, write_jsonl
from sae_helpers import HOOK, save_saelens

from vlens import SAE, ActivationDataset, harvest
from vlens.harvest import export
from vlens.harvest.cli import add_parser

CTX, K = 16, 8


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("docs") / "docs.jsonl", documents(30, seed=5))


@pytest.fixture(scope="module")
def sae_path(tmp_path_factory):
    return save_saelens(tmp_path_factory.mktemp("sae") / "jumprelu", architecture="jumprelu", d_sae=512, seed=3)[0]


@pytest.fixture(scope="module")
def run(smol, texts, sae_path, tmp_path_factory):
    """Dense rows and latents side by side, rows shuffled in their shards, one common token left out."""
    out = tmp_path_factory.mktemp("run") / "out"
    period = smol.tokenizer(".", add_special_tokens=False)["input_ids"][0]
    harvest(smol, texts, [HOOK], out, context_size=CTX, dtype="float32", sae=str(sae_path), top_k=K,
            shard_bytes=150_000, seed=4, exclude_token_ids=[period], max_tokens=20 * CTX, progress=False)  # fmt: skip
    return out, read_shards(out)


def test_shards_hold_the_top_latents_of_their_rows(run, sae_path):
    out, rows = run
    sae = SAE.load(sae_path)
    expected = sae.encode(rows[HOOK]).topk(K)
    assert rows["sae_ids"].dtype == torch.int32 and rows["sae_ids"].shape == (len(rows[HOOK]), K)
    assert torch.equal(rows["sae_ids"].long(), expected.indices) and rel_err(rows["sae_values"], expected.values) < 1e-6
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) > 1 and manifest["totals"]["rows_excluded"] > 0
    assert manifest["sae"] == {"path": str(sae_path), "sha256": sae.sha256, "hook": HOOK, "tap": HOOK,
                               "architecture": "jumprelu", "d_in": 576, "d_sae": 512, "top_k": K}  # fmt: skip
    values = ActivationDataset(out, "sae_values")
    assert values.shape == (K,) and values.dtype == torch.float32 and torch.equal(values[:], rows["sae_values"])
    assert torch.equal(ActivationDataset(out, "sae_ids")[3:9], rows["sae_ids"][3:9])


def test_a_pooled_row_carries_the_latents_of_the_pooled_row(smol, texts, sae_path, tmp_path):
    """`pool="mean"` with an SAE: each document's latents are the SAE's top k of its mean row."""
    harvest(smol, texts, [HOOK], tmp_path / "out", context_size=CTX, pack=False, pool="mean", dtype="float32",
            sae=str(sae_path), top_k=K, progress=False)  # fmt: skip
    rows = read_shards(tmp_path / "out")
    expected = SAE.load(sae_path).encode(rows[HOOK]).topk(K)
    assert len(rows[HOOK]) == 30 and torch.equal(rows["sae_ids"].long(), expected.indices)
    assert rel_err(rows["sae_values"], expected.values) < 1e-6


def test_max_activating_finds_a_latents_strongest_rows_with_context(run):
    out, rows = run
    ds = ActivationDataset(out, HOOK)
    feature = int(rows["sae_ids"][:, 0].mode().values)  # a latent that is often the top one
    hits = rows["sae_ids"] == feature
    strength = torch.where(hits, rows["sae_values"], torch.zeros(())).sum(1)
    fired = hits.any(1).nonzero().squeeze(1)
    order = fired[torch.sort(strength[fired], descending=True, stable=True).indices][:5]
    examples = ds.max_activating(feature, n=5, context=2)
    assert [e.row for e in examples] == order.tolist()
    assert [e.value for e in examples] == strength[order].tolist()
    for e in examples:
        assert (e.window, e.position, e.token_id) == (
            int(rows["window"][e.row]),
            int(rows["position"][e.row]),
            int(rows["token_ids"][e.row]),
        )
        window = window_rows(rows, e.window)
        near = (window["position"] - e.position).abs() <= 2
        assert (
            e.context_positions == window["position"][near].tolist()
            and e.context_ids == window["token_ids"][near].tolist()
        )
    silent = next(f for f in range(512) if not (rows["sae_ids"] == f).any())
    assert ds.max_activating(silent) == []
    with pytest.raises(
        ValueError, match=r"feature: 512 is not a latent of the harvest's SAE; expected an int in 0..511"
    ):
        ds.max_activating(512)


def test_latents_only_from_the_command_line_and_what_is_refused(smol, smol_path, texts, sae_path, tmp_path):
    parser = argparse.ArgumentParser(prog="vlens")
    add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    argv = ["harvest", "--model", str(smol_path), "--source", str(texts), "--out", str(out), "--context-size", str(CTX),
            "--max-tokens", str(2 * CTX), "--sae", str(sae_path), "--top-k", "4", "--quiet"]  # fmt: skip
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    rows = read_shards(out)
    assert set(rows) == {"sae_ids", "sae_values", "token_ids", "window", "position", "document"}
    assert rows["sae_ids"].shape[1] == 4
    with pytest.raises(ValueError, match="stored SAE latents only"):
        export(out, tmp_path / "sae")
    other = save_saelens(tmp_path / "other", architecture="jumprelu", d_sae=512, seed=9)[0]
    with pytest.raises(ValueError, match=r"other options \(sae\.sha256: "):
        harvest(smol, texts, None, out, context_size=CTX, max_tokens=2 * CTX, sae=str(other), top_k=4, progress=False)
    cases = {
        "hooks: give at least one hook name or glob": {},
        "top_k: give it with sae": {"sae": str(sae_path)},
        "top_k: 600 is more than the SAE's d_sae=512": {"sae": str(sae_path), "top_k": 600},
        "sae: .* does not exist": {"sae": str(tmp_path / "nowhere"), "top_k": 4},
    }
    for message, options in cases.items():
        with pytest.raises(ValueError, match=message):
            harvest(smol, texts, None, tmp_path / "refused", context_size=CTX, progress=False, **options)
    assert not (tmp_path / "refused").exists()
