"""vlens.harvest: values equal trace, packing and BOS rules, exclusions, manifest, refusal of mismatched re-runs,
bad input, and the CLI."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from harvest_helpers import dir_bytes, documents, read_shards, window_rows, write_jsonl
from safetensors.torch import load_file, save_file

from vlens import LLM, ActivationDataset, harvest
from vlens.harvest import difference_of_means, export
from vlens.harvest.cli import add_parser
from vlens.harvest.stats import BLOCK, HookStats, ShardStats
from vlens.harvest.windows import Packing, Window, document_ids, windows
from vlens.loader import LoadedModel

HOOKS = ["blocks.3.hook_resid_post", "blocks.1.attn.hook_q", "blocks.2.mlp.hook_post", "hidden_states.2"]
CTX = 32


@pytest.fixture(scope="module")
def f32_run(smol, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("f32") / "out"
    harvest(smol, corpus, HOOKS, out, context_size=CTX, dtype="float32", shard_bytes=200_000, batch_tokens=4 * CTX,
            progress=False)  # fmt: skip
    return out


def test_out_dir_may_be_an_fsspec_url(smol, corpus, f32_run):
    """Written through fsspec (here its in-memory filesystem), the files are those of a local run."""
    import fsspec

    url, fs = "memory://vlens-test/out", fsspec.filesystem("memory")
    options = {"context_size": CTX, "dtype": "float32", "shard_bytes": 200_000, "batch_tokens": 4 * CTX}
    try:
        summary = harvest(smol, corpus, HOOKS, url, progress=False, **options)
        assert summary.out_dir == url
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/vlens-test/out", detail=False))
        assert {name: fs.cat_file(f"/vlens-test/out/{name}") for name in names} == dir_bytes(f32_run)
        assert harvest(smol, corpus, HOOKS, url, progress=False, **options).tokens_this_run == 0  # complete
        with pytest.raises(ValueError, match="not on this machine's filesystem; reading memory-maps"):
            ActivationDataset(url, HOOKS[0])
    finally:
        fs.rm("/vlens-test", recursive=True)


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_values_equal_trace(smol, f32_run):
    manifest = _manifest(f32_run)
    shards = read_shards(f32_run)
    assert len(manifest["shards"]) > 1 and manifest["complete"]
    assert set(shards) == {*HOOKS, "token_ids", "window", "position", "document"}
    assert shards["token_ids"].dtype == torch.int32 and shards["window"].dtype == torch.int64
    assert shards["position"].dtype == torch.int64
    windows = manifest["totals"]["windows"]
    for w in (0, windows // 2, windows - 1):
        rows = window_rows(shards, w)
        assert rows["position"].tolist() == list(range(CTX))  # SmolLM2 uses no BOS: nothing left out
        traced = smol.trace([rows["token_ids"].tolist()], HOOKS)[0]
        for hook in HOOKS:
            assert rows[hook].shape == traced[hook].shape
            assert rel_err(rows[hook], traced[hook]) < 1e-5, (hook, w)


def test_manifest_describes_the_run(f32_run, corpus, smol_path):
    manifest = _manifest(f32_run)
    assert manifest["vlens_version"] and len(manifest["model"]["weights_sha256"]) == 64
    assert manifest["model"]["dtype"] == "float32" and manifest["dtype"] == "float32"
    assert manifest["hooks"]["blocks.1.attn.hook_q"] == {"tap": "blocks.1.attn.hook_q", "shape": [9, 64]}
    assert manifest["hooks"]["hidden_states.2"]["tap"] == "blocks.2.hook_resid_pre"
    assert manifest["tokenizer"]["vocab_size"] == 49152
    assert manifest["source"]["kind"] == "jsonl" and manifest["source"]["field"] == "text"
    assert manifest["packing"] == {"pack": True, "bos_token_id": None, "separator_token_id": 2}
    assert manifest["context_size"] == CTX and manifest["exclusions"] == {"token_ids": []}
    shards = read_shards(f32_run)
    assert manifest["totals"]["rows"] == len(shards["token_ids"]) == sum(s["rows"] for s in manifest["shards"])
    for hook in HOOKS:
        x = shards[hook].reshape(len(shards[hook]), -1).double()
        stats = manifest["stats"][hook]
        assert stats["rows"] == len(x)
        assert torch.allclose(torch.tensor(stats["mean"], dtype=torch.float64), x.mean(0), rtol=1e-9, atol=1e-9)
        assert stats["max_norm"] == pytest.approx(x.norm(dim=1).max().item(), rel=1e-12)
        assert stats["mean_norm"] == pytest.approx(x.norm(dim=1).mean().item(), rel=1e-9)


def test_bfloat16_rows_are_the_rounded_float32_rows(smol, corpus, f32_run, tmp_path):
    harvest(smol, corpus, HOOKS, tmp_path / "bf16", context_size=CTX, shard_bytes=200_000, batch_tokens=4 * CTX,
            progress=False)  # fmt: skip
    bf16, f32 = read_shards(tmp_path / "bf16"), read_shards(f32_run)
    assert bf16[HOOKS[0]].dtype == torch.bfloat16
    assert torch.equal(bf16["token_ids"], f32["token_ids"]) and torch.equal(bf16["window"], f32["window"])
    for hook in HOOKS:
        assert torch.equal(bf16[hook], f32[hook].to(torch.bfloat16)), hook


def test_packing_follows_saelens(smol, corpus, f32_run):
    """Documents end to end, EOS between two that share a window, none before one that opens a window."""
    tok = smol.tokenizer
    stream: list[int] = []
    for doc in documents(40):
        if len(stream) % CTX:
            stream.append(tok.eos_token_id)
        stream.extend(tok(doc, add_special_tokens=False)["input_ids"])
    shards = read_shards(f32_run)
    windows = _manifest(f32_run)["totals"]["windows"]
    assert windows == len(stream) // CTX  # the partial last window is dropped
    assert shards["token_ids"].tolist() == stream[: windows * CTX]


def test_documents_that_start_with_bos_get_no_second_one():
    """Pre-tokenized rows often open with BOS: windows hold it once, as SAELens's own packing does, with the
    BOS as separator and with EOS (no BOS) as separator; unpacked windows too."""
    from sae_lens.tokenization_and_batching import concat_and_batch_sequences

    docs = [[1, 5, 6, 7], [8, 9], [1, 10, 11, 12, 13, 14, 15], [1, 16], [17, 18, 19], [2, 20, 21, 22, 23]]
    for bos, separator in ((1, 1), (None, 2)):
        expected = concat_and_batch_sequences(
            iter(map(torch.tensor, docs)), 6, begin_batch_token_id=bos, sequence_separator_token_id=separator
        )
        got = [w.tokens for w in windows(docs, Packing(6, True, bos, separator, ()))]
        assert got == [w.tolist() for w in expected], (bos, separator)
    with_bos = [w.tokens for w in windows(docs, Packing(6, True, 1, 1, ()))]
    assert with_bos[:2] == [[1, 5, 6, 7, 1, 8], [1, 9, 1, 10, 11, 12]]  # the second window has BOS once
    assert [w.tokens for w in windows(docs[:2], Packing(4, False, 1, 1, ()))] == [[1, 5, 6, 7], [1, 8, 9]]


def test_windows_name_each_token_s_document():
    """Every token of a window belongs to a document, numbered as the records of the source (an empty one
    counted, and holding no token); a window's BOS, and the separator before a document, are that document's."""
    docs = [[5, 6, 7], [], [8, 9], [10, 11, 12, 13, 14, 15], [16]]
    packed = list(windows(docs, Packing(5, True, 1, 1, ())))
    assert [w.tokens for w in packed] == [[1, 5, 6, 7, 1], [1, 8, 9, 1, 10], [1, 11, 12, 13, 14]]
    assert document_ids(packed).tolist() == [0, 0, 0, 0, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]
    unpacked = list(windows(docs, Packing(4, False, 1, 1, ())))
    assert document_ids(unpacked).tolist() == [0, 0, 0, 0, 2, 2, 2, 3, 3, 3, 3, 4, 4]


def test_rows_name_their_record_in_the_source(smol, tmp_path):
    """A harvest's `document` key is each row's record in the source, blank lines counted: the rows of a
    document are its tokens (after the separator before it), in order."""
    lines = documents(12, seed=4)
    lines[3:3] = ["", "   "]  # blank records: no tokens, but numbered
    source = tmp_path / "docs.txt"
    source.write_text("\n".join(lines) + "\n")
    harvest(smol, source, "hook_embed", tmp_path / "out", context_size=CTX, progress=False)
    rows = read_shards(tmp_path / "out")
    assert ActivationDataset(tmp_path / "out", "document")[:].tolist() == rows["document"].tolist()
    got: dict[int, list[int]] = {}
    for document, token in zip(rows["document"].tolist(), rows["token_ids"].tolist()):
        got.setdefault(document, []).append(token)
    assert 3 not in got and 4 not in got and len(got) >= 8
    for document, tokens in got.items():
        expected = smol.tokenizer(lines[document], add_special_tokens=False)["input_ids"]
        body = tokens[1:] if document != min(got) else tokens  # (each later one's first row is its separator)
        assert body == expected[: len(body)] and body, document


def test_max_tokens_and_no_pack(smol, corpus, tmp_path):
    harvest(smol, corpus, "hook_embed", tmp_path / "a", context_size=CTX, max_tokens=100, progress=False)
    manifest = _manifest(tmp_path / "a")
    assert manifest["totals"]["tokens"] == 96 and manifest["totals"]["windows"] == 3

    harvest(smol, corpus, "hook_embed", tmp_path / "b", context_size=CTX, pack=False, progress=False)
    rows = read_shards(tmp_path / "b")
    docs = documents(40)
    lengths = torch.bincount(rows["window"]).tolist()
    assert lengths == [min(len(smol.tokenizer(d, add_special_tokens=False)["input_ids"]), CTX) for d in docs]
    first = smol.tokenizer(docs[0], add_special_tokens=False)["input_ids"][:CTX]
    assert window_rows(rows, 0)["token_ids"].tolist() == first


def test_excluded_tokens_are_left_out(smol, corpus, tmp_path):
    kwargs = {"context_size": CTX, "dtype": "float32", "batch_tokens": 4 * CTX, "progress": False}
    harvest(smol, corpus, HOOKS[:2], tmp_path / "all", **kwargs)
    harvest(smol, corpus, HOOKS[:2], tmp_path / "some", exclude_token_ids=[2, 13], **kwargs)
    full, some = read_shards(tmp_path / "all"), read_shards(tmp_path / "some")
    keep = ~torch.isin(full["token_ids"], torch.tensor([2, 13]))
    assert 0 < int((~keep).sum()) and len(some["token_ids"]) == int(keep.sum())
    for key in full:
        assert torch.equal(some[key], full[key][keep]), key
    manifest = _manifest(tmp_path / "some")
    assert manifest["exclusions"] == {"token_ids": [2, 13]}
    assert manifest["totals"]["rows_excluded"] == int((~keep).sum())


class _BosTokenizer:
    """SmolLM2's tokenizer made to put <|im_start|> (id 1) before every text, as Llama's does with its BOS."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __call__(self, text, add_special_tokens: bool = True, **kw):
        out = self.inner(text, add_special_tokens=False, **kw)
        if add_special_tokens:
            ids = out["input_ids"]
            out["input_ids"] = [1, *ids] if ids and isinstance(ids[0], int) else [[1, *i] for i in ids]
        return out


def test_bos_opens_windows_and_is_left_out(smol, corpus, tmp_path):
    bos_model = LoadedModel(smol.model, smol.config, _BosTokenizer(smol.tokenizer), smol.model_path, "bos-smol")
    kwargs = {"context_size": CTX, "dtype": "float32", "progress": False, "max_tokens": 8 * CTX}
    harvest(bos_model, corpus, HOOKS[0], tmp_path / "bos", **kwargs)
    harvest(bos_model, corpus, HOOKS[0], tmp_path / "kept", exclude_bos=False, **kwargs)
    harvest(bos_model, corpus, HOOKS[0], tmp_path / "nobos", prepend_bos=False, **kwargs)
    assert _manifest(tmp_path / "bos")["packing"] == {"pack": True, "bos_token_id": 1, "separator_token_id": 1}
    assert _manifest(tmp_path / "bos")["exclusions"] == {"token_ids": [1]}
    kept, dropped = read_shards(tmp_path / "kept"), read_shards(tmp_path / "bos")
    assert (kept["token_ids"][kept["position"] == 0] == 1).all()
    assert not (dropped["position"] == 0).any() and not (dropped["token_ids"] == 1).any()
    assert torch.equal(dropped[HOOKS[0]], kept[HOOKS[0]][kept["token_ids"] != 1])
    window = window_rows(kept, 3)
    traced = smol.trace([window["token_ids"].tolist()], HOOKS[0])[0][HOOKS[0]]
    assert rel_err(window[HOOKS[0]], traced) < 1e-5
    nobos = read_shards(tmp_path / "nobos")
    assert _manifest(tmp_path / "nobos")["packing"]["separator_token_id"] == 2
    assert not (nobos["token_ids"] == 1).any()


def test_seed_shuffles_rows_within_shards(smol, corpus, tmp_path):
    kwargs = {"context_size": CTX, "max_tokens": 12 * CTX, "shard_bytes": 20_000, "progress": False}
    harvest(smol, corpus, "hook_embed", tmp_path / "plain", **kwargs)
    harvest(smol, corpus, "hook_embed", tmp_path / "s1", seed=1, **kwargs)
    harvest(smol, corpus, "hook_embed", tmp_path / "s1b", seed=1, **kwargs)
    assert dir_bytes(tmp_path / "s1") == dir_bytes(tmp_path / "s1b")
    plain, shuffled = read_shards(tmp_path / "plain"), read_shards(tmp_path / "s1")
    key = shuffled["window"] * CTX + shuffled["position"]
    assert not torch.equal(key, plain["window"] * CTX + plain["position"])
    order = torch.argsort(key)
    for name in plain:
        assert torch.equal(shuffled[name][order], plain[name]), name


def test_rerun_with_other_options_is_refused(smol, corpus, tmp_path):
    out = tmp_path / "out"
    kwargs = {"context_size": CTX, "max_tokens": 4 * CTX, "progress": False}
    harvest(smol, corpus, "hook_embed", out, **kwargs)
    before = dir_bytes(out)
    again = harvest(smol, corpus, "hook_embed", out, **kwargs)  # same options: already complete
    assert again.tokens_this_run == 0 and dir_bytes(out) == before
    with pytest.raises(ValueError, match=r"context_size: 32 on disk, 16 now"):
        harvest(smol, corpus, "hook_embed", out, **{**kwargs, "context_size": 16})
    # the batch size is the run's own: left out it is the one on disk, given otherwise it is refused
    kept = harvest(smol, corpus, "hook_embed", tmp_path / "b32", batch_tokens=CTX, **kwargs)
    assert harvest(smol, corpus, "hook_embed", tmp_path / "b32", **kwargs).tokens_this_run == 0 < kept.tokens
    with pytest.raises(ValueError, match=r"batch_tokens: 32 on disk, 64 now"):
        harvest(smol, corpus, "hook_embed", tmp_path / "b32", batch_tokens=2 * CTX, **kwargs)
    with pytest.raises(ValueError, match=r"hooks.*dtype|dtype.*hooks"):
        harvest(smol, corpus, "blocks.0.hook_resid_post", out, dtype="float16", **kwargs)
    other = write_jsonl(tmp_path / "other.jsonl", documents(40, seed=1))
    with pytest.raises(ValueError, match=r"source\.hash"):
        harvest(smol, other, "hook_embed", out, **kwargs)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out_dir: .* not empty"):
        harvest(smol, corpus, "hook_embed", tmp_path / "foreign", **kwargs)
    with pytest.raises(ValueError, match=r"out_dir: .*notes\.txt' is a file; give a directory"):
        harvest(smol, corpus, "hook_embed", tmp_path / "foreign" / "notes.txt", **kwargs)


@pytest.mark.parametrize(
    "case, message",
    [
        ("field", r"text_field: 'body' not found in .* \(fields: text, id\)"),
        ("empty_txt", r"source: .*empty"),
        ("empty_jsonl", r"source: .*empty"),
        ("blank_txt", r"source: .* yields no window"),
        ("budget", r"source: .* yields no window: .* a first window longer than max_tokens=3"),
        ("hook", r"hooks: 'blocks\.3\.hook_resid_postt' matches no hook"),
        ("context", r"context_size: must be an integer >= 2, got 1"),
        ("dtype", r"dtype: 'float8' is not one of"),
        ("suffix", r"source: .* unknown suffix '\.csv'"),
        ("missing", r"source: .* does not exist"),
        ("split", r"split: 'test' given, but .*\.jsonl' is a file, which has no splits"),
    ],
)
def test_bad_input_is_a_clear_error(smol, corpus, tmp_path, case, message):
    source, hooks, kwargs = corpus, "hook_embed", {}
    if case == "field":
        kwargs["text_field"] = "body"
    elif case == "empty_txt":
        source = tmp_path / "empty.txt"
        source.write_text("")
    elif case == "empty_jsonl":
        source = tmp_path / "empty.jsonl"
        source.write_text("\n\n")
    elif case == "blank_txt":
        source = tmp_path / "blank.txt"
        source.write_text("  \n\t\n")
    elif case == "budget":  # unpacked, the first document is longer than the whole budget
        kwargs.update(pack=False, max_tokens=3)
    elif case == "hook":
        hooks = "blocks.3.hook_resid_postt"
    elif case == "context":
        kwargs["context_size"] = 1
    elif case == "dtype":
        kwargs["dtype"] = "float8"
    elif case == "suffix":
        source = tmp_path / "data.csv"
        source.write_text("a,b\n")
    elif case == "missing":
        source = tmp_path / "nowhere.jsonl"
    elif case == "split":  # (it was ignored)
        kwargs["split"] = "test"
    with pytest.raises(ValueError, match=message):
        harvest(smol, source, hooks, tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_cli_harvest_then_export(smol_path, corpus, tmp_path):
    parser = argparse.ArgumentParser(prog="vlens")
    add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    args = parser.parse_args(
        ["harvest", "--model", str(smol_path), "--source", str(corpus), "--hooks", "blocks.1.hook_resid_post",
         "hook_embed", "--out", str(out), "--context-size", "16", "--dtype", "float16", "--max-tokens", "64",
         "--shard-bytes", "50000", "--no-bos", "--text-field", "text", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    manifest = _manifest(out)
    assert manifest["dtype"] == "float16" and manifest["totals"]["tokens"] == 64 and len(manifest["shards"]) > 1
    assert set(manifest["hooks"]) == {"hook_embed", "blocks.1.hook_resid_post"}
    args = parser.parse_args(["export", str(out), "--format", "saelens", "--to", str(tmp_path / "sae")])
    assert args.func(args) == 0
    assert (tmp_path / "sae" / "dataset_info.json").exists()


def test_the_summary_says_where_the_time_went(smol, corpus, tmp_path, capsys):
    """`vlens harvest` ends with tokens/s, the device's busy share and the write throughput; the flags of
    the batch size and the pipeline parse."""
    parser = argparse.ArgumentParser(prog="vlens")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["harvest", "--source", "s", "--hooks", "h", "--out", "o", "--batch-tokens", "32",
                              "--pipeline", "on"])  # fmt: skip
    assert (args.batch_tokens, args.pipeline) == (32, "on")
    summary = harvest(smol, corpus, "blocks.1.hook_resid_post", tmp_path / "out", context_size=16, max_tokens=64,
                      batch_tokens=32, shard_bytes=50_000)  # fmt: skip
    assert 0 < summary.device_seconds < summary.seconds and 0 < summary.write_seconds < summary.seconds
    assert summary.bytes_this_run == summary.bytes > 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"this run 64 tokens in [\d.]+ s: [\d,]+ tokens/s, device busy \d+% of the time, writes "
                     r"[\d,]+ MB/s \([\d.]+ kB in [\d.]+ s\)$", line), line  # fmt: skip


def test_statistics_do_not_depend_on_the_batch_split():
    """A shard's statistics, fed its rows in any batches, are the same bits: blocks are cut by the shard.
    Folded shard after shard they are the float64 mean and norms of all the rows."""
    torch.manual_seed(0)
    shards = [torch.randn(BLOCK + 1234, 2, 4).to(torch.bfloat16), torch.randn(300, 2, 4).to(torch.bfloat16)]
    folded = HookStats.empty(8)
    for x in shards:
        pieces = []
        for cuts in ([len(x)], [1, 7, len(x) - 8], list(range(0, len(x), 97))[1:]):
            stats = ShardStats(8, torch.device("cpu"))
            for part in torch.tensor_split(x, cuts):
                stats.add(part)
            pieces.append(stats.finish())
        assert all(torch.equal(p.values, pieces[0].values) and p.rows == pieces[0].rows for p in pieces)
        folded.fold(pieces[0])
    rows = torch.cat(shards).reshape(-1, 8).double()
    data = folded.to_json()
    assert data["rows"] == len(rows)
    assert torch.allclose(torch.tensor(data["mean"], dtype=torch.float64), rows.mean(0), rtol=0, atol=1e-12)
    assert abs(data["mean_norm"] - rows.norm(dim=1).mean().item()) < 1e-12
    assert data["max_norm"] == rows.norm(dim=1).max().item()
    assert HookStats.from_json(data).to_json() == data


def test_integer_hooks_keep_their_ids(tmp_path):
    """MoE expert ids are int64 taps: stored as int64 whatever --dtype (bfloat16 rounds ids past 256), as
    `Capture` keeps them; the shard budget and ActivationDataset count them at that width."""
    llm, source = _tiny_moe(tmp_path)
    hooks = ["blocks.0.mlp.hook_expert_ids", "blocks.0.hook_resid_post"]
    harvest(llm, source, hooks, tmp_path / "out", context_size=16, dtype="bfloat16", shard_bytes=3000, progress=False)
    shards, manifest = read_shards(tmp_path / "out"), _manifest(tmp_path / "out")
    ids = shards[hooks[0]]
    assert ids.dtype == torch.int64 and shards[hooks[1]].dtype == torch.bfloat16
    traced = llm.trace([window_rows(shards, 0)["token_ids"].tolist()], hooks[0])[0][hooks[0]]
    assert torch.equal(window_rows(shards, 0)[hooks[0]], traced)
    assert {s["rows"] for s in manifest["shards"]} == {16}  # 3000 B hold 30 rows of 100 B: one window a shard
    dataset = ActivationDataset(tmp_path / "out", hooks[0])
    assert dataset.dtype == torch.int64 and torch.equal(dataset[:], ids) and torch.equal(dataset[[0, 3]], ids[[0, 3]])
    vector = difference_of_means(tmp_path / "out", tmp_path / "out")  # ids are no direction: the residual's alone
    assert list(vector.vectors) == [hooks[1]] and not vector.vectors[hooks[1]].any()
    with pytest.raises(ValueError, match=r"hooks: \['blocks\.0\.mlp\.hook_expert_ids'\] not stored by both"):
        difference_of_means(tmp_path / "out", tmp_path / "out", hooks[:1])


def test_rows_that_overflow_the_dtype_are_a_clear_error(tmp_path):
    """float16 rows past its range are inf: the run stops at that shard naming the dtype, the shard unlisted."""
    llm, source = _tiny_moe(tmp_path)
    with torch.no_grad():
        llm.model.embed_tokens.weight.mul_(1e7)
    with pytest.raises(ValueError, match=r"dtype: rows of 'hook_embed' in shard-00000\.safetensors are not finite "
                                         r"as float16 .* bfloat16 or float32"):  # fmt: skip
        harvest(llm, source, "hook_embed", tmp_path / "out", context_size=16, dtype="float16", progress=False)
    assert _manifest(tmp_path / "out")["shards"] == []


def test_any_integer_seed_shuffles(tmp_path):
    """A seed past 64 bits once overflowed torch's generator after the first shard's forwards; it is taken
    modulo 2**64, as torch takes a negative one, so 2**64 - 1 shuffles as -1 does."""
    llm, source = _tiny_moe(tmp_path)
    kwargs = {"context_size": 16, "shard_bytes": 3000, "progress": False}
    for seed in (-1, 2**64 - 1):
        harvest(llm, source, "hook_embed", tmp_path / str(seed), seed=seed, **kwargs)
    shards = {seed: {k: v for k, v in dir_bytes(tmp_path / str(seed)).items() if k.startswith("shard-")}
              for seed in (-1, 2**64 - 1)}  # fmt: skip
    assert len(shards[-1]) > 1 and shards[-1] == shards[2**64 - 1]
    assert not torch.equal(read_shards(tmp_path / "-1")["position"][:16], torch.arange(16))


def _tiny_moe(tmp_path: Path) -> tuple:
    """A one-layer random Mixtral (no tokenizer) and a pre-tokenized source of 12 documents for it."""
    from conftest import save_tiny
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    llm = LLM(model=save_tiny(config, tmp_path / "mixtral"), dtype="float32", device="cpu")
    docs = [[(7 * i + j) % 300 for j in range(5 + i)] for i in range(12)]
    return llm, write_jsonl(tmp_path / "tokens.jsonl", docs, field="tokens")


def test_an_edited_config_or_an_older_format_is_not_resumed(tmp_path):
    """The same weights under another config.json (RoPE scaling, norms, windows) give other activations, and
    a manifest of an older format was written with other rules: neither is resumed into."""
    llm, source = _tiny_moe(tmp_path)
    kwargs = dict(context_size=16, max_tokens=32, progress=False)
    harvest(llm, source, "hook_embed", tmp_path / "out", **kwargs)
    config = tmp_path / "mixtral" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"rope_theta": 123.0}))
    edited = LLM(model=str(tmp_path / "mixtral"), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"model\.config_sha256: '[0-9a-f]{64}' on disk, '[0-9a-f]{64}' now"):
        harvest(edited, source, "hook_embed", tmp_path / "out", **kwargs)
    manifest = _manifest(tmp_path / "out") | {"format": "vlens-harvest/1"}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"out_dir: .* a manifest of another format \('vlens-harvest/1'\)"):
        harvest(llm, source, "hook_embed", tmp_path / "out", **kwargs)


def test_a_run_begun_before_rows_had_documents_resumes_without_them(tmp_path):
    """A manifest without `row_keys` (vlens before rows named their documents) resumes as it was begun: its
    shards keep three row keys, cut at its own row size, and the rows are the new format's less `document`."""
    llm, source = _tiny_moe(tmp_path)
    kwargs = dict(context_size=16, shard_bytes=4100, progress=False)  # (48 rows a shard without documents, 44 with)
    harvest(llm, source, "hook_embed", tmp_path / "new", **kwargs)
    harvest(llm, source, "hook_embed", tmp_path / "old", max_tokens=32, **kwargs)  # (its first shards)
    manifest = _manifest(tmp_path / "old")
    del manifest["row_keys"]
    for entry in manifest["shards"]:
        shard = load_file(tmp_path / "old" / entry["file"])
        del shard["document"]
        save_file(shard, tmp_path / "old" / entry["file"])
        entry["bytes"] = (tmp_path / "old" / entry["file"]).stat().st_size
    manifest["totals"]["bytes"] = sum(entry["bytes"] for entry in manifest["shards"])
    manifest["max_tokens"], manifest["complete"] = None, False
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(manifest))
    assert harvest(llm, source, "hook_embed", tmp_path / "old", **kwargs).tokens_this_run > 0
    old, new = read_shards(tmp_path / "old"), read_shards(tmp_path / "new")
    assert set(old) == set(new) - {"document"} and all(torch.equal(old[k], new[k]) for k in old)
    assert "row_keys" not in _manifest(tmp_path / "old")
    assert len(_manifest(tmp_path / "old")["shards"]) < len(_manifest(tmp_path / "new")["shards"])  # (smaller rows)


def test_a_missing_source_fails_before_the_model_loads(tmp_path):
    """The source is opened first: a typo in its path is reported at once, not after a long load (here the
    model does not exist either, and is never looked at)."""
    with pytest.raises(ValueError, match=r"^source: .*corpus\.jsonl' does not exist"):
        harvest(str(tmp_path / "no-model"), tmp_path / "corpus.jsonl", "hook_embed", tmp_path / "out", progress=False)


def test_an_export_past_float16s_range_is_refused(tmp_path):
    """bfloat16 rows past 65,504 would be inf as float16: the export says so instead of writing them."""
    llm, source = _tiny_moe(tmp_path)
    with torch.no_grad():
        llm.model.embed_tokens.weight.mul_(1e7)
    harvest(llm, source, "hook_embed", tmp_path / "out", context_size=16, dtype="bfloat16", progress=False)
    with pytest.raises(ValueError, match=r"dtype: rows of 'hook_embed' in shard-00000\.safetensors are past float16"):
        export(tmp_path / "out", tmp_path / "sae", dtype="float16")
    assert export(tmp_path / "out", tmp_path / "sae32").exists()  # float32 holds them


def test_pooled_rows_are_each_document_s_last_or_mean_row(smol, smol_path, corpus, tmp_path):
    """`pool="last"` stores each unpacked document's last row, bit for bit the row of a harvest of every row
    batched alike; `pool="mean"` the mean of its rows (float32, within 1e-6), with the last row's token and
    position; shards are cut at one row a window; a Ray actor's shard (run as a plain object) is the local one,
    byte for byte; the SAELens export refuses it."""
    from vlens.harvest.config import HarvestConfig
    from vlens.harvest.ray_backend import ShardWorker

    hooks = ["blocks.3.hook_resid_post", "blocks.1.attn.hook_z"]
    options = dict(context_size=CTX, pack=False, dtype="float32", batch_tokens=CTX, progress=False)  # (a window a forward)
    harvest(smol, corpus, hooks, tmp_path / "all", **options)
    every = read_shards(tmp_path / "all")
    for pool in ("last", "mean"):
        harvest(smol, corpus, hooks, tmp_path / pool, pool=pool, shard_bytes=40_000, **options)
        rows, manifest = read_shards(tmp_path / pool), _manifest(tmp_path / pool)
        assert manifest["pool"] == pool and len(manifest["shards"]) > 1
        assert rows["window"].tolist() == list(range(40)) == rows["document"].tolist()
        for w in range(40):
            window = window_rows(every, w)
            assert rows["position"][w] == window["position"][-1] and rows["token_ids"][w] == window["token_ids"][-1]
            for hook in hooks:
                if pool == "last":
                    assert torch.equal(rows[hook][w], window[hook][-1])
                else:
                    assert rel_err(rows[hook][w], window[hook].double().mean(0)) < 1e-6, (hook, w)
    config = HarvestConfig(model=str(smol_path), source=corpus, hooks=tuple(hooks), out_dir=tmp_path / "ray",
                           pool="mean", shard_bytes=40_000, model_dtype="float32", device="cpu", **options)  # fmt: skip
    (tmp_path / "ray").mkdir()
    manifest = _manifest(tmp_path / "mean")
    start, end = manifest["shards"][1]["windows"]
    docs = [smol.tokenizer(d, add_special_tokens=False)["input_ids"][:CTX] for d in documents(40)]
    windows_ = [Window(docs[w], (), ((0, w),)) for w in range(start, end)]
    ShardWorker(config, {hook: hook for hook in hooks}, []).run_shard(
        manifest["batch_tokens"], tuple(manifest["row_keys"]), 1, start, windows_
    )  # fmt: skip
    name = manifest["shards"][1]["file"]
    assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "mean" / name).read_bytes()
    with pytest.raises(ValueError, match=r"stored one row per document \(pool='mean'\); the SAELens layout"):
        export(tmp_path / "mean", tmp_path / "exported")


def test_pooling_needs_unpacked_documents_and_a_mean_real_rows(smol, corpus, tmp_path):
    with pytest.raises(ValueError, match=r"pool: 'last' takes one row per document, which needs pack=False"):
        harvest(smol, corpus, "hook_embed", tmp_path / "out", pool="last", progress=False)
    with pytest.raises(ValueError, match=r"pool: 'max' is not allowed|pool: .*last, mean"):
        harvest(smol, corpus, "hook_embed", tmp_path / "out", pool="max", pack=False, progress=False)
    llm, source = _tiny_moe(tmp_path)
    ids = r"\['blocks\.0\.mlp\.hook_expert_ids', 'blocks\.0\.mlp\.hook_expert_indices'\]"  # (the latter: TL's name)
    with pytest.raises(ValueError, match=r"pool: 'mean' of " + ids):
        harvest(llm, source, "blocks.0.mlp.*", tmp_path / "out", pool="mean", pack=False, progress=False)
    assert not (tmp_path / "out").exists()
