"""Every data source harvest reads gives the same windows for the same documents; hashes pin the content."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import rel_err
from harvest_helpers import CHAT_KINDS, SOURCE_KINDS, conversations, documents, read_shards, write_jsonl, write_source

from vlens import harvest
from vlens.harvest import export
from vlens.harvest.cli import add_parser
from vlens.harvest.sources import open_source
from vlens.harvest.windows import make_packing, windows

CTX = 32
DOCS = documents(30, seed=2)


@pytest.fixture(scope="module")
def token_docs(smol):
    return [smol.tokenizer(d, add_special_tokens=False)["input_ids"] for d in DOCS]




@pytest.fixture(scope="module")
def reference(smol, tmp_path_factory, token_docs):
    path, kwargs = write_source("txt", tmp_path_factory.mktemp("ref"), DOCS, token_docs)
    out = path.parent / "out"
    harvest(smol, path, "hook_embed", out, context_size=CTX, progress=False, **kwargs)
    return read_shards(out)


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_every_source_gives_the_same_windows(smol, tmp_path, token_docs, reference, kind):
    path, kwargs = write_source(kind, tmp_path, DOCS, token_docs)
    harvest(smol, path, "hook_embed", tmp_path / "out", context_size=CTX, progress=False, **kwargs)
    rows = read_shards(tmp_path / "out")
    for key in reference:
        assert torch.equal(rows[key], reference[key]), key
    source = json.loads((tmp_path / "out" / "manifest.json").read_text())["source"]
    assert source["pretokenized"] == kind.startswith("tokens")
    if path.is_file():
        assert source["hash"] == hashlib.sha256(path.read_bytes()).hexdigest()
    else:
        import datasets

        loaded = datasets.load_from_disk(str(path))
        loaded = loaded[kwargs["split"]] if "split" in kwargs else loaded
        assert source["hash"] == loaded._fingerprint


@pytest.mark.parametrize("kind", CHAT_KINDS)
def test_conversations_are_read_through_the_chat_template(smol, tmp_path, token_docs, kind):
    """A column of conversations (found as "messages" when no text column is named) is each conversation
    rendered by the model's chat template and tokenized as LLM.chat does, packed as texts are; its rows are
    the model's on those tokens; the manifest pins the template."""
    path, kwargs = write_source(kind, tmp_path, DOCS, token_docs)
    harvest(smol, path, "blocks.2.hook_resid_post", tmp_path / "out", context_size=CTX, dtype="float32", progress=False,
            **kwargs)  # fmt: skip
    rows = read_shards(tmp_path / "out")
    tok = smol.tokenizer
    rendered = [tok.apply_chat_template(c, tokenize=False) for c in conversations(DOCS)]
    assert rendered[0].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n")
    docs = [tok(r, add_special_tokens=False)["input_ids"] for r in rendered]
    packing = make_packing(tok, smol.config, CTX, True, True, True, None)
    expected = [w.tokens for w in windows(docs, packing)]
    assert rows["token_ids"].tolist() == [t for w in expected for t in w]
    traced = smol.trace(expected[3:4], "blocks.2.hook_resid_post")[0]["blocks.2.hook_resid_post"]
    assert rel_err(rows["blocks.2.hook_resid_post"][3 * CTX : 4 * CTX], traced) < 1e-5
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"]["chat"] and manifest["source"]["field"] == "messages"
    template = hashlib.sha256(tok.chat_template.encode()).hexdigest()
    assert manifest["tokenizer"]["chat_template_sha256"] == template


def test_messages_read_alike_from_every_form(tmp_path):
    """Columnar storage gives every message every key (None where it had none): the messages are what the
    JSON lines hold, whichever form the conversations come in, so the template renders the same text."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = conversations(DOCS[:4])
    convs[1][0]["name"] = "Ada"  # one message with a key the others lack
    write_jsonl(tmp_path / "c.jsonl", convs, field="messages")
    pq.write_table(pa.table({"messages": convs}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"messages": convs}).save_to_disk(str(tmp_path / "c"))
    for path in ("c.jsonl", "c.parquet", "c"):
        src = open_source(tmp_path / path)
        assert src.form == "chat" and list(src.documents()) == convs, path


def test_contents_of_text_parts_read_as_their_texts_joined(tmp_path):
    """A message's content as a list of text parts (OpenAI's form) is its texts joined by newlines, as vLLM and vlens's
    server give a text model's template such a message; an image part (without image_field) or a part of another
    type is refused by name."""
    convs = conversations(DOCS[:3])
    parted = [[dict(m, content=[{"type": "text", "text": t} for t in m["content"].split(" ", 1)]) for m in c]
              for c in convs]  # fmt: skip
    write_jsonl(tmp_path / "parts.jsonl", parted, field="messages")
    joined = [[dict(m, content=m["content"].replace(" ", "\n", 1)) for m in c] for c in convs]
    assert list(open_source(tmp_path / "parts.jsonl").documents()) == joined
    for part, message in (({"type": "image"}, r"holds an image part; a source of images needs image_field"),
                          ({"type": "audio"}, r"holds a part of type 'audio'; parts are of type text or image")):
        parted[2][0]["content"].append(part)
        write_jsonl(tmp_path / "bad.jsonl", parted, field="messages")
        with pytest.raises(ValueError, match=r"^text_field: a message in .*bad\.jsonl' line 3 " + message):
            list(open_source(tmp_path / "bad.jsonl").documents())
        parted[2][0]["content"].pop()


def test_conversations_need_a_template_and_messages_and_a_rerun_their_template(smol, tmp_path, monkeypatch):
    convs = conversations(DOCS[:6])
    path = write_jsonl(tmp_path / "chats.jsonl", convs, field="messages")
    options = {"context_size": CTX, "progress": False}
    harvest(smol, path, "hook_embed", tmp_path / "out", **options)
    monkeypatch.setattr(smol.tokenizer, "chat_template", smol.tokenizer.chat_template + " ")
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template_sha256: '\w{64}' on disk, '\w{64}' now"):
        harvest(smol, path, "hook_embed", tmp_path / "out", **options)
    monkeypatch.setattr(smol.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match=r"source: its documents are conversations, but this model's tokenizer has "
                                         r"no chat template"):  # fmt: skip
        harvest(smol, path, "hook_embed", tmp_path / "none", **options)
    assert not (tmp_path / "none").exists()
    monkeypatch.undo()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": convs[0]}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match=r"text_field: expected a conversation in .*bad\.jsonl' line 2 \(a list "
                                         r"of messages, each a \{'role', 'content'\} object, its content text or a "
                                         r"list of \{'type', \.\.\.\} parts\)"):
        harvest(smol, bad, "hook_embed", tmp_path / "bad", **options)


def _content_tokens(tok, conversation: list[dict], roles: set[str]) -> list[int]:
    """The rendered conversation's tokens whose characters overlap the content of a message of `roles`."""
    text = tok.apply_chat_template(conversation, tokenize=False)
    spans, at = [], 0
    for m in conversation:
        at = text.index(m["content"], at)
        if m["role"] in roles:
            spans.append((at, at + len(m["content"])))
        at += len(m["content"])
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return [t for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]) if any(a < e and s < b for a, b in spans)]


def test_roles_store_the_rows_of_those_roles_only(smol, tmp_path):
    """With roles, a conversation's rows are those of its messages' contents in those roles, in order; each is the
    row of the whole-conversation forward (the dense run's, bit for bit); the manifest records the roles, and
    the SAELens export, which needs whole windows, says why it cannot take them."""
    convs = conversations(DOCS[:12])
    path = write_jsonl(tmp_path / "chats.jsonl", convs, field="messages")
    options = {"context_size": CTX, "dtype": "float32", "progress": False}
    harvest(smol, path, "blocks.2.hook_resid_post", tmp_path / "all", **options)
    dense = read_shards(tmp_path / "all")
    at = {(int(w), int(p)): i for i, (w, p) in enumerate(zip(dense["window"], dense["position"]))}
    for roles in (["assistant"], ["user", "system"]):
        out = tmp_path / "_".join(roles)
        harvest(smol, path, "blocks.2.hook_resid_post", out, roles=roles, **options)
        rows = read_shards(out)
        expected = [t for c in convs for t in _content_tokens(smol.tokenizer, c, set(roles))]
        stored = rows["token_ids"].tolist()
        assert len(stored) > 3 * CTX and stored == expected[: len(stored)]  # (the last, partial window is dropped)
        same = [at[int(w), int(p)] for w, p in zip(rows["window"], rows["position"])]
        assert torch.equal(rows["blocks.2.hook_resid_post"], dense["blocks.2.hook_resid_post"][same])
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["packing"]["roles"] == roles and manifest["totals"]["rows"] == len(stored)
    assert "roles" not in json.loads((tmp_path / "all" / "manifest.json").read_text())["packing"]
    with pytest.raises(ValueError, match=r"packing\.roles: \['assistant'\] on disk, \['user'\] now"):
        harvest(smol, path, "blocks.2.hook_resid_post", tmp_path / "assistant", roles=["user"], **options)
    with pytest.raises(ValueError, match=r"rows not of roles \['assistant'\]\); the SAELens layout needs whole "
                                         r"windows: harvest with --keep-bos and no --exclude-token-ids or --roles"):
        export(tmp_path / "assistant", tmp_path / "saelens", format="saelens")


def test_roles_need_conversations_whose_contents_the_template_writes(smol, tmp_path, monkeypatch):
    """A template that trims contents is met with the trimmed ones; one that changes them is refused by name, as
    roles for a source of text are, and for a tokenizer without character offsets."""
    convs = [[{"role": "user", "content": "  Hello there "}, {"role": "assistant", "content": "Hi! How are you?"}]] * 4
    path = write_jsonl(tmp_path / "chats.jsonl", convs, field="messages")
    options = {"context_size": 8, "progress": False, "roles": ["user"]}
    monkeypatch.setattr(smol.tokenizer, "chat_template",
                        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}")  # fmt: skip
    harvest(smol, path, "hook_embed", tmp_path / "trimmed", **options)
    stored = read_shards(tmp_path / "trimmed")["token_ids"].tolist()
    hello_there = smol.tokenizer(" Hello there", add_special_tokens=False)["input_ids"]  # (" Hello": a space, too)
    assert len(hello_there) == 2 and stored == hello_there * (len(stored) // 2) and len(stored) >= 6
    monkeypatch.setattr(smol.tokenizer, "chat_template",
                        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}")  # fmt: skip
    with pytest.raises(ValueError, match=r"roles: the chat template does not write each message's content as given"):
        harvest(smol, path, "hook_embed", tmp_path / "upper", **options)
    parser = argparse.ArgumentParser(prog="vlens")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["harvest", "--source", "s", "--hooks", "h", "--out", "o", "--roles", "assistant", "user"])
    assert args.roles == ["assistant", "user"]
    with pytest.raises(ValueError, match=r"roles: give at least one role \(e\.g\. assistant\)"):
        harvest(smol, path, "hook_embed", tmp_path / "none", **{**options, "roles": []})
    text = write_jsonl(tmp_path / "docs.jsonl", DOCS[:4])
    with pytest.raises(ValueError, match=r"roles: for a source of conversations .* column 'text' holds text"):
        harvest(smol, text, "hook_embed", tmp_path / "text", **options)
    monkeypatch.setattr(type(smol.tokenizer), "is_fast", property(lambda self: False))
    with pytest.raises(ValueError, match=r"roles: a token's role is found through its character offsets, which only"):
        harvest(smol, path, "hook_embed", tmp_path / "slow", **options)


def test_whole_file_is_one_document(smol, tmp_path):
    text = "\n".join(DOCS[:12])
    path = tmp_path / "book.txt"
    path.write_text(text)
    harvest(smol, path, "hook_embed", tmp_path / "out", context_size=CTX, whole_file=True, progress=False)
    ids = smol.tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = read_shards(tmp_path / "out")
    assert rows["token_ids"].tolist() == ids[: len(ids) // CTX * CTX]  # no separators: one document


def test_token_ids_outside_the_vocabulary_are_refused(smol, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [[5, 6, 49152]], field="tokens")
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        harvest(smol, path, "hook_embed", tmp_path / "out", context_size=CTX, progress=False)


def test_a_config_whose_eos_is_outside_the_vocabulary_is_refused_before_a_forward(tmp_path):
    """A tiny checkpoint keeping its family's real eos id (Cohere's 255001 in a vocabulary of 300): the separator
    of packed documents would fail in the embedding mid-run; the harvest says why before it starts."""
    from family_parity import COMMON, build
    from transformers import CohereConfig

    from vlens import LLM

    llm = LLM(model=build(CohereConfig(**COMMON, eos_token_id=255001), tmp_path, "cohere"), dtype="float32",
              device="cpu")  # fmt: skip
    path = write_jsonl(tmp_path / "ids.jsonl", [[5, 6, 7], [8, 9]], field="tokens")
    with pytest.raises(ValueError, match=r"model: its eos_token_id 255001 is outside its vocabulary \[0, 300\)"):
        harvest(llm, path, "hook_embed", tmp_path / "out", context_size=CTX, progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_field_in_a_later_row_names_the_line(smol, tmp_path):
    path = tmp_path / "ragged.jsonl"
    path.write_text(json.dumps({"text": DOCS[0] * 3}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"text_field: 'text' missing from .* line 2"):
        harvest(smol, path, "hook_embed", tmp_path / "out", context_size=CTX, progress=False)


def test_hub_dataset_offline_and_not_cached_is_a_clear_error(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}
    code = (
        "from vlens.harvest.sources import open_source\n"
        "try:\n    open_source('someone/missing-corpus')\n"
        "except ValueError as e:\n    print('ERR', e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert "ERR source: hub dataset 'someone/missing-corpus' could not be opened" in run.stdout, run.stderr
    assert "save_to_disk" in run.stdout
