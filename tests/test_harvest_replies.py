"""On-policy harvests (`generate_tokens`): the model continues each document first, and the harvest stores the
rows of the document with its continuation. The continuations are the engine's own (greedy, seeded samples,
steered), the rows are HF's over the model's own text, the continuations are kept in out_dir and read back
by a re-run (a stale file is written again), and bad options are refused before any work. Resuming after a
kill: tests/test_harvest_resume.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import rel_err
from harvest_helpers import conversations, documents, read_shards, window_rows, write_jsonl

from vlens import SamplingParams, harvest
from vlens.harvest import ActivationDataset, replies
from vlens.harvest.config import HarvestConfig
from vlens.harvest.windows import Packing, windows
from vlens.harvest.writer import Store, read_replies
from vlens.loader import LoadedModel
from vlens.steering import SteeringVector

HOOK = "blocks.2.hook_resid_post"


def _questions(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Conversations that end with the user's turn (the assistant's answer left off)."""
    return [conv[:-1] for conv in conversations(documents(n, seed))]


def test_replies_are_the_engine_s_and_their_rows_are_hf_s(smol, hf_smol, tmp_path):
    """Unpacked, with the assistant's rows only: each window stores exactly the model's greedy reply (as
    LLM.chat gives it, its end-of-turn token included), and its rows are HF's forward of the conversation
    rendered for a reply followed by the reply; pooled to the last row, each reply's last."""
    short = ["What is 2+2? Reply with the number only.", "Say yes or no: is the sky blue?"]  # (replies that end)
    convs = _questions(3) + [[{"role": "user", "content": q}] for q in short]
    source = write_jsonl(tmp_path / "chats.jsonl", convs, field="messages")
    out = tmp_path / "out"
    harvest(smol, source, [HOOK], out, context_size=128, pack=False, roles=["assistant"], generate_tokens=10,
            dtype="float32", progress=False)  # fmt: skip
    expected = smol.chat(convs, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    written = read_replies(Store.open(out))
    assert written == [list(o.outputs[0].token_ids) for o in expected]
    assert any(reply[-1] == smol.tokenizer.eos_token_id and len(reply) < 10 for reply in written)
    assert ActivationDataset(out, HOOK).replies() == written
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["generate"] == {"tokens": 10, "temperature": 0.0, "samples": 1}
    assert manifest["totals"]["rows"] == sum(map(len, written))
    shards = read_shards(out)
    for w, (conv, reply) in enumerate(zip(convs, written)):
        prompt = smol.tokenizer(
            smol.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]  # fmt: skip
        rows = window_rows(shards, w)
        assert rows["token_ids"].tolist() == reply
        assert rows["position"].tolist() == list(range(len(prompt), len(prompt) + len(reply)))
        with torch.no_grad():
            hidden = hf_smol(torch.tensor([prompt + reply]), output_hidden_states=True).hidden_states[3][0]
        assert rel_err(rows[HOOK], hidden[len(prompt) :]) < 1e-5, w
    harvest(smol, source, [HOOK], tmp_path / "last", context_size=128, pack=False, roles=["assistant"],
            generate_tokens=10, dtype="float32", pool="last", progress=False)  # fmt: skip
    last = read_shards(tmp_path / "last")  # each reply's last row: its end-of-turn token's where it wrote one
    assert last["token_ids"].tolist() == [reply[-1] for reply in written]
    assert all(torch.equal(last[HOOK][w], window_rows(shards, w)[HOOK][-1]) for w in range(len(convs)))


def test_sampled_continuations_of_texts_are_packed_with_them(smol4, tmp_path):
    """Texts continued by seeded samples (document i seeded by i, as the engine's requests would be): packed
    into windows with their continuations, every row stored and equal to a trace of its window; a second run
    samples the same continuations."""
    docs = documents(6, seed=3)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    options = {"context_size": 24, "generate_tokens": 7, "temperature": 0.9, "dtype": "float32", "progress": False}
    harvest(smol4, source, [HOOK], tmp_path / "a", **options)
    prompts = [smol4.tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    params = [SamplingParams(max_tokens=7, temperature=0.9, seed=i) for i in range(len(docs))]
    sampled = [list(o.outputs[0].token_ids) for o in smol4.generate(prompts, params, use_tqdm=False)]
    greedy = [list(o.outputs[0].token_ids) for o in smol4.generate(prompts, SamplingParams(max_tokens=7, temperature=0),
                                                                   use_tqdm=False)]  # fmt: skip
    assert read_replies(Store.open(tmp_path / "a")) == sampled != greedy
    eos = smol4.tokenizer.eos_token_id
    packed = list(windows([p + s for p, s in zip(prompts, sampled)], Packing(24, True, None, eos, ())))
    shards = read_shards(tmp_path / "a")
    assert shards["token_ids"].tolist() == [t for w in packed for t in w.tokens]
    for w in (0, len(packed) - 1):
        traced = smol4.trace([packed[w].tokens], HOOK)[0][HOOK]
        assert rel_err(window_rows(shards, w)[HOOK], traced) < 1e-5
    harvest(smol4, source, [HOOK], tmp_path / "b", **options)
    assert read_replies(Store.open(tmp_path / "b")) == sampled


def test_several_samples_of_a_document_are_documents_of_their_own(smol4, tmp_path):
    """`samples=3`: the engine's three seeded samples of each text (n=3, seed i), each harvested after its text
    as a window of its own, numbered 3 i + j by the `document` key, which indexes `replies()` too."""
    docs = documents(4, seed=7)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    harvest(smol4, source, [HOOK], tmp_path / "out", context_size=64, pack=False, generate_tokens=5, temperature=1.0,
            samples=3, progress=False)  # fmt: skip
    prompts = [smol4.tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    params = [SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=i) for i in range(len(docs))]
    sampled = [list(s.token_ids) for o in smol4.generate(prompts, params, use_tqdm=False) for s in o.outputs]
    written = ActivationDataset(tmp_path / "out", HOOK).replies()
    assert written == sampled and len({tuple(r) for r in written}) > len(docs)
    rows = read_shards(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["generate"]["samples"] == 3
    for w in range(3 * len(docs)):
        window = window_rows(rows, w)
        assert window["token_ids"].tolist() == prompts[w // 3] + written[w]
        assert set(window["document"].tolist()) == {w}


def test_a_steered_model_writes_the_continuations(smol4, tmp_path):
    """With a steering vector the continuations are the steered model's, as the engine's steered requests."""
    docs = documents(4, seed=1)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    vector = SteeringVector({"blocks.1.hook_resid_post": torch.randn(576, generator=torch.Generator().manual_seed(2))})
    harvest(smol4, source, [HOOK], tmp_path / "out", context_size=32, generate_tokens=6, steering_vector=vector,
            multiplier=6.0, progress=False)  # fmt: skip
    prompts = [smol4.tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    steered = smol4.generate(prompts, SamplingParams(max_tokens=6, temperature=0, interventions=vector.steers(6.0)),
                             use_tqdm=False)  # fmt: skip
    plain = smol4.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    written = read_replies(Store.open(tmp_path / "out"))
    assert written == [list(o.outputs[0].token_ids) for o in steered]
    assert written != [list(o.outputs[0].token_ids) for o in plain]


def test_a_rerun_reads_the_replies_it_wrote_and_rewrites_another_run_s(smol4, tmp_path, monkeypatch):
    """Chunks of documents grow to CHUNK; chunks on disk are read, not generated again: a finished run's
    directory, its manifest removed, is redone without one generation; a chunk left by a run with other options
    is generated anew. A re-run with another length is refused by name."""
    monkeypatch.setattr(replies, "FIRST_CHUNK", 1)
    monkeypatch.setattr(replies, "CHUNK", 2)  # chunks of 1, 2 and 2 documents
    source = write_jsonl(tmp_path / "docs.jsonl", documents(5, seed=2))
    options = {"context_size": 16, "generate_tokens": 5, "progress": False}
    harvest(smol4, source, [HOOK], tmp_path / "out", **options)
    chunks = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("replies-*"))]
    assert [c["documents"] for c in chunks] == [[0, 1], [1, 3], [3, 5]]
    whole = read_shards(tmp_path / "out")
    calls = []
    real = replies.generate_replies
    monkeypatch.setattr(replies, "generate_replies", lambda *args: calls.append(args[4]) or real(*args))
    (tmp_path / "out" / "manifest.json").unlink()
    for p in (tmp_path / "out").glob("shard-*"):
        p.unlink()
    harvest(smol4, source, [HOOK], tmp_path / "out", **options)
    assert calls == []
    assert all(torch.equal(v, whole[k]) for k, v in read_shards(tmp_path / "out").items())

    harvest(smol4, source, [HOOK], tmp_path / "other", **{**options, "temperature": 1.5})
    calls.clear()
    (tmp_path / "stale").mkdir()
    shutil.copy(tmp_path / "other" / "replies-00001.json", tmp_path / "stale" / "replies-00001.json")
    harvest(smol4, source, [HOOK], tmp_path / "stale", **options)
    assert calls == [0, 1, 3]  # every chunk generated; the stale one too
    assert read_replies(Store.open(tmp_path / "stale")) == read_replies(Store.open(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"generate\.tokens: 5 on disk, 4 now"):
        harvest(smol4, source, [HOOK], tmp_path / "out", **{**options, "generate_tokens": 4})


def test_reset_prefix_cache(smol4):
    """What a chunk's generation relies on: forgetting the prefix cache, refused while requests hold blocks."""
    engine = smol4.engine
    smol4.generate([[5, 6, 7] * 12], SamplingParams(max_tokens=2), use_tqdm=False)
    assert engine.blocks.cached
    assert smol4.reset_prefix_cache() is True
    assert not engine.blocks.cached and all(b.hash is None for b in engine.blocks.blocks)
    from vlens.engine.llm_engine import NewRequest

    (request,) = engine.add_requests([NewRequest([5, 6, 7] * 12, SamplingParams(max_tokens=4), None)])
    engine.step()
    assert smol4.reset_prefix_cache() is False and engine.blocks.cached
    engine.abort(request)
    assert smol4.reset_prefix_cache() is True


def test_bad_generation_options_are_refused_before_any_work(smol4, tmp_path):
    base = {"source": tmp_path / "none.jsonl", "hooks": (HOOK,), "out_dir": tmp_path / "out"}
    with pytest.raises(ValueError, match=r"temperature: samples the continuations of generate_tokens"):
        HarvestConfig(**base, temperature=0.7)
    with pytest.raises(ValueError, match=r"samples: 2 continuations of a document need a temperature"):
        HarvestConfig(**base, generate_tokens=8, samples=2)
    with pytest.raises(ValueError, match=r"generate_tokens: must be an integer >= 1, got 0"):
        HarvestConfig(**base, generate_tokens=0)
    source = write_jsonl(tmp_path / "docs.jsonl", documents(2))
    loaded = LoadedModel(smol4.model, smol4.config, smol4.tokenizer, smol4.model_path, smol4.model_name)
    with pytest.raises(ValueError, match=r"model: generate_tokens needs a generation engine"):
        harvest(loaded, source, [HOOK], tmp_path / "out", generate_tokens=4, progress=False)
    long = write_jsonl(tmp_path / "long.jsonl", [[7] * 4, [7] * smol4.engine.max_model_len], field="tokens")
    with pytest.raises(ValueError, match=r"generate_tokens: document 1 has \d+ tokens, which leave no room"):
        harvest(smol4, long, [HOOK], tmp_path / "long", context_size=16, generate_tokens=4, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "long").exists()
    harvest(smol4, source, [HOOK], tmp_path / "plain", context_size=16, progress=False)
    with pytest.raises(ValueError, match=r"generated no continuations \(generate_tokens\)"):
        ActivationDataset(tmp_path / "plain", HOOK).replies()
