"""Small corpora and shard readers shared by the harvest tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file

WORDS = [
    *[
        "the",
        "river",
        "ran",
        "past",
        "an",
        "old",
        "mill",
        "where",
        "children",
        "played",
        "each",
        "summer",
        "while",
        "their",
        "parents",
        "worked",
    ],
    *[
        "in",
        "fields",
        "of",
        "wheat",
        "and",
        "barley",
        "under",
        "a",
        "wide",
        "sky",
        "that",
        "turned",
        "gold",
        "before",
        "storms",
        "rolled",
        "in",
    ],
]


def documents(n: int = 40, seed: int = 0) -> list[str]:
    """Plain English-like documents of varied length (a few words to a few sentences)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        sentences = [
            " ".join(rng.choices(WORDS, k=rng.randint(4, 14))).capitalize() + "." for _ in range(rng.randint(1, 4))
        ]
        docs.append(f"Note {i}: " + " ".join(sentences))
    return docs


def write_jsonl(path: Path, docs: list, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def read_shards(out_dir: Path) -> dict[str, torch.Tensor]:
    """Every shard the manifest lists, read with safetensors itself and concatenated."""
    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    parts = [load_file(Path(out_dir) / s["file"]) for s in manifest["shards"]]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def window_rows(shards: dict[str, torch.Tensor], window: int) -> dict[str, torch.Tensor]:
    """The rows of one window, in position order."""
    index = (shards["window"] == window).nonzero().squeeze(1)
    index = index[torch.argsort(shards["position"][index])]
    return {key: value[index] for key, value in shards.items()}


def dir_bytes(out_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(out_dir).iterdir())}


SOURCE_KINDS = ["txt", "jsonl", "parquet", "datasets", "datasets_dict", "tokens_jsonl", "tokens_parquet", "tokens_datasets"]
CHAT_KINDS = ["chat_jsonl", "chat_parquet", "chat_datasets"]  # a "messages" column of conversations


def conversations(docs: list[str]) -> list[list[dict[str, str]]]:
    """Each document as a conversation: its first sentence the user's, the rest the assistant's answer; every
    third opened by a system message."""
    convs = []
    for i, doc in enumerate(docs):
        head, _, rest = doc.partition(".")
        conv = [{"role": "user", "content": head + "?"}, {"role": "assistant", "content": rest.strip() or "Yes."}]
        convs.append(([{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []) + conv)
    return convs


def write_source(kind: str, tmp_path: Path, docs: list[str], token_docs: list[list[int]]) -> tuple[Path, dict]:
    """`docs` (or their token ids, or conversations made of them) as a source of `kind`, and the harvest
    options that read it."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind.startswith("chat_"):  # (the default text field falls back to "messages")
        return _write_conversations(kind.removeprefix("chat_"), tmp_path, conversations(docs)), {}
    if kind == "txt":
        path = tmp_path / "docs.txt"
        path.write_text("\n".join(docs) + "\n\n")  # a blank line is not a document
        return path, {}
    if kind == "jsonl":
        return write_jsonl(tmp_path / "docs.jsonl", docs, field="body"), {"text_field": "body"}
    if kind == "parquet":
        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=7)
        return path, {}
    if kind == "datasets":
        path = tmp_path / "ds"
        datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(str(path))
        return path, {}
    if kind == "datasets_dict":
        path = tmp_path / "dd"
        split = datasets.Dataset.from_dict({"text": docs})
        datasets.DatasetDict({"train": split.select([0]), "validation": split}).save_to_disk(str(path))
        return path, {"split": "validation"}
    if kind == "tokens_jsonl":  # the default field falls back to a "tokens" column, as in SAELens
        return write_jsonl(tmp_path / "tok.jsonl", token_docs, field="tokens"), {}
    if kind == "tokens_parquet":
        path = tmp_path / "tok.parquet"
        pq.write_table(pa.table({"input_ids": pa.array(token_docs, pa.list_(pa.int32()))}), path)
        return path, {"text_field": "input_ids"}
    if kind == "tokens_datasets":
        path = tmp_path / "tokds"
        datasets.Dataset.from_dict({"input_ids": token_docs}).save_to_disk(str(path))
        return path, {}
    raise AssertionError(kind)


def _write_conversations(form: str, tmp_path: Path, convs: list[list[dict[str, str]]]) -> Path:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    if form == "jsonl":
        return write_jsonl(tmp_path / "chats.jsonl", convs, field="messages")
    if form == "parquet":
        path = tmp_path / "chats.parquet"
        pq.write_table(pa.table({"messages": convs}), path, row_group_size=7)
        return path
    path = tmp_path / "chats"
    datasets.Dataset.from_dict({"messages": convs}).save_to_disk(str(path))
    return path
