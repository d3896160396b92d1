"""Where harvest's documents come from: text files, JSON lines, Parquet, `datasets` directories, the hub.

Every source streams its documents (a text, a list of token ids for pre-tokenized data, a
conversation: a list of {"role", "content"} messages, which the model's chat template renders, or with an
`image_field` a text or a conversation and its images, for a vision-language checkpoint) in a fixed order, so the same
source always yields the same windows and a resumed run can skip exactly
the windows already on disk. Each source also has a content hash, recorded in the manifest, so that
a re-run over changed data is refused instead of silently mixing two corpora.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from vlens.images import load_image
from vlens.loader import hash_file


@dataclass(frozen=True)
class Pictures:
    """A record's text and its images (PIL images, read by `pictures`); `where` names the record in errors. The
    text may be a conversation, whose {"type": "image"} parts stand for the images, in order (TRL's and Hugging
    Face's multimodal chat datasets), for the processor's chat template to render."""

    text: str | list[dict[str, Any]]
    images: list[Any]
    where: str


Document = str | list[int] | list[dict[str, Any]] | Pictures  # a text, token ids, a conversation's messages, images
FORMS = ("text", "tokens", "chat")  # what a source's documents are

# SAELens reads pre-tokenized data from these columns when the default text column is missing; a
# conversation's messages are in "messages" in Hugging Face's chat datasets.
FALLBACK_FIELDS = ("tokens", "input_ids", "messages")
DEFAULT_FIELD = "text"
_BATCH = 1024  # rows read per step from columnar sources
_MESSAGE = {"role", "content"}  # the keys of a conversation's messages


@dataclass(frozen=True)
class Source:
    """An opened data source: what it is (for the manifest) and how to stream its documents."""

    kind: str  # txt | jsonl | parquet | datasets | hub
    location: str  # absolute path, or the hub dataset id
    field: str | None  # the column read (None for .txt)
    form: str  # one of FORMS
    whole_file: bool
    split: str | None
    content_hash: str  # sha256 of the file bytes, or the dataset's own fingerprint (not the image files it names)
    _documents: Callable[[], Iterator[Document]]
    image_field: str | None = None  # the column of each record's images (its documents are then Pictures)

    def documents(self) -> Iterator[Document]:
        """The documents, in order, one per record: blank texts and empty token lists too (they make no tokens,
        and numbering every record lets a row name its document as the source's record index)."""
        return self._documents()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "location": self.location,
            "field": self.field,
            "pretokenized": self.form == "tokens",
            **({"chat": True} if self.form == "chat" else {}),  # (only then: text runs' manifests stay as they were)
            "whole_file": self.whole_file,
            "split": self.split,
            "hash": self.content_hash,
            **({"image_field": self.image_field} if self.image_field else {}),  # (only then: older manifests match)
        }


def open_source(
    source: str | os.PathLike, text_field: str = DEFAULT_FIELD, whole_file: bool = False, split: str | None = None,
    image_field: str | None = None,
) -> Source:  # fmt: skip
    """Recognise `source` by what it is on disk (file suffix, `datasets` directory) or else as a hub id.
    `split` (default train) is for a `datasets` directory or a hub dataset; a file has none to choose.
    `image_field`: each record's text comes with the images of that column (its documents are Pictures)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _datasets_dir(path.resolve(), text_field, split or "train", image_field)
    if path.is_file():
        if split is not None:
            raise ValueError(f"split: {split!r} given, but {str(path)!r} is a file, which has no splits "
                             "(a split is for a datasets directory or a hub dataset)")  # fmt: skip
        suffix = path.suffix.lower()
        if suffix == ".txt":
            if image_field is not None:
                raise ValueError(f"image_field: {image_field!r} names a column, and a .txt file has none; give "
                                 ".jsonl, .parquet, a `datasets` directory or a hub dataset")  # fmt: skip
            return _txt(path.resolve(), whole_file)
        if whole_file:
            raise ValueError(f"whole_file: only for .txt sources, not {str(path)!r}")
        if suffix == ".jsonl":
            return _jsonl(path.resolve(), text_field, image_field)
        if suffix == ".parquet":
            return _parquet(path.resolve(), text_field, image_field)
        raise ValueError(
            f"source: {str(path)!r} has an unknown suffix {suffix!r}; expected .txt, .jsonl, .parquet, "
            "a `datasets` directory (save_to_disk) or a hub dataset id"
        )
    looks_local = str(source).startswith((".", "/", "~")) or str(source).count("/") > 1
    if path.exists() or looks_local or path.suffix.lower() in (".txt", ".jsonl", ".parquet"):
        raise ValueError(f"source: {str(source)!r} does not exist (expected a file, a directory or a hub dataset id)")
    return _hub(str(source), text_field, split or "train", image_field)


def _empty(path: Path) -> ValueError:
    return ValueError(f"source: {str(path)!r} is empty (no documents)")


def text_documents(raw: IO[bytes], whole_file: bool) -> Iterator[str]:
    """The lines of a .txt file (universal newlines), or the whole file as one document."""
    f = io.TextIOWrapper(raw, encoding="utf-8")
    if whole_file:  # one document: its tokens must be cut into windows in one piece anyway
        yield f.read()
        return
    for line in f:
        yield line.rstrip("\r\n")


def jsonl_documents(
    raw: IO[bytes], field: str, form: str, where: str, image_field: str | None = None, base: Path | None = None
) -> Iterator[Document]:  # fmt: skip
    """The `field` of each JSON line (with `image_field`'s images, their relative paths from `base`); `where`
    names the file in errors."""
    for number, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8"), 1):
        if line.strip():
            record = _json_record(line, where, number)
            for name, flag in ((field, "text_field"), (image_field, "image_field")):
                if name is not None and name not in record:
                    raise ValueError(f"{flag}: {name!r} missing from {where} line {number} ({', '.join(record)})")
            value = document(record[field], form, f"{where} line {number}", image_field is not None)
            yield value if image_field is None else pictures(value, record[image_field], base, f"{where} line {number}")


def _txt(path: Path, whole_file: bool) -> Source:
    if path.stat().st_size == 0:
        raise _empty(path)

    def documents() -> Iterator[str]:
        with open(path, "rb") as raw:
            yield from text_documents(raw, whole_file)

    return Source("txt", str(path), None, "text", whole_file, None, hash_file(path).hexdigest(), documents)


def _jsonl(path: Path, field: str, image_field: str | None) -> Source:
    first = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                first = _json_record(line, repr(str(path)), number)
                break
    if first is None:
        raise _empty(path)
    field = _pick_field(field, list(first), f"{str(path)!r} line {number}")
    form = _image_form(_form_of(first[field]), field, image_field)

    def documents() -> Iterator[Document]:
        with open(path, "rb") as raw:
            yield from jsonl_documents(raw, field, form, repr(str(path)), image_field, path.parent)

    return Source("jsonl", str(path), field, form, False, None, hash_file(path).hexdigest(), documents, image_field)


def _json_record(line: str, where: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"source: {where} line {number} is not valid JSON ({e})") from e
    if not isinstance(record, dict):
        raise ValueError(f"source: {where} line {number} is not a JSON object")  # noqa: TRY004 (data)
    return record


def _parquet(path: Path, field: str, image_field: str | None) -> Source:
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path)
    if meta.metadata.num_rows == 0:
        raise _empty(path)
    field = _pick_field(field, meta.schema_arrow.names, repr(str(path)))
    kind = meta.schema_arrow.field(field).type
    form = "text"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        item = kind.value_type
        keys = {item.field(i).name for i in range(item.num_fields)} if pa.types.is_struct(item) else set()
        form = "chat" if _MESSAGE <= keys else "tokens"
    form = _image_form(form, field, image_field)
    columns = [field, *_image_column(image_field, meta.schema_arrow.names, repr(str(path)))]
    where = f"{str(path)!r} column {field!r}"

    def documents() -> Iterator[Document]:
        read = 0  # (rows before the batch: a record's number in errors)
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH, columns=columns):
            texts = (document(value, form, where, image_field is not None) for value in batch.column(0).to_pylist())
            if image_field is None:
                yield from texts
            else:
                yield from _with_pictures(texts, batch.column(1).to_pylist(), path.parent, where, read)
            read += batch.num_rows

    return Source("parquet", str(path), field, form, False, None, hash_file(path).hexdigest(), documents, image_field)


def _datasets_dir(path: Path, field: str, split: str, image_field: str | None) -> Source:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"source: {str(path)!r} is a directory but not a `datasets` save_to_disk directory") from e
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"split: {split!r} not in {str(path)!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    else:
        split = None
    if len(loaded) == 0:
        raise _empty(path)
    field = _pick_field(field, loaded.column_names, repr(str(path)))
    feature = loaded.features[field]
    item = getattr(feature, "feature", None)  # a list's items
    chat = isinstance(item, dict) and _MESSAGE <= set(item)
    form = _image_form("text" if _is_text_feature(feature) else "chat" if chat else "tokens", field, image_field)
    column = loaded.select_columns([field, *_image_column(image_field, loaded.column_names, repr(str(path)))])
    where = f"{str(path)!r} column {field!r}"

    def documents() -> Iterator[Document]:
        read = 0  # (rows before the batch: a record's number in errors)
        for batch in column.iter(batch_size=_BATCH):
            texts = (document(value, form, where, image_field is not None) for value in batch[field])
            if image_field is None:
                yield from texts
            else:
                yield from _with_pictures(texts, batch[image_field], None, where, read)
            read += len(batch[field])

    return Source("datasets", str(path), field, form, False, split, loaded._fingerprint, documents, image_field)


def _hub(repo_id: str, field: str, split: str, image_field: str | None) -> Source:
    """A hub dataset, streamed (SAE corpora are far larger than a disk cache should hold)."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(repo_id)
        streamed = builder.as_streaming_dataset(split=split)
        first = next(iter(streamed))
    except StopIteration:
        raise ValueError(f"source: hub dataset {repo_id!r} split {split!r} is empty") from None
    except Exception as e:  # offline, not cached, no such repo, no such split: all end here
        raise ValueError(
            f"source: hub dataset {repo_id!r} could not be opened ({type(e).__name__}: {e}); when offline, fetch "
            "it where there is a network and save it with `save_to_disk`, then pass that directory"
        ) from e
    field = _pick_field(field, list(first), f"hub dataset {repo_id!r}")
    form = _image_form(_form_of(first[field]), field, image_field)
    _image_column(image_field, list(first), f"hub dataset {repo_id!r}")
    where = f"hub dataset {repo_id!r} column {field!r}"

    def documents() -> Iterator[Document]:
        for record in streamed:
            value = document(record[field], form, where, image_field is not None)
            yield value if image_field is None else pictures(value, record[image_field], None, where)

    return Source("hub", repo_id, field, form, False, split, builder.hash, documents, image_field)


def _image_form(form: str, field: str, image_field: str | None) -> str:
    """The form of a source of images: text, which holds their placeholders, or conversations, which hold
    {"type": "image"} parts."""
    if image_field is not None and form == "tokens":
        raise ValueError(f"image_field: goes with a column of text that holds the images' placeholders or of "
                         f"conversations; {field!r} holds token ids")  # fmt: skip
    return form


def _image_column(image_field: str | None, fields: list[str], where: str) -> list[str]:
    if image_field is not None and image_field not in fields:
        raise ValueError(f"image_field: {image_field!r} not found in {where} (fields: {', '.join(map(str, fields))})")
    return [] if image_field is None else [image_field]


def _with_pictures(
    texts: Iterator[Document], images: list[Any], base: Path | None, where: str, first: int
) -> Iterator[Pictures]:  # fmt: skip
    """A batch of records, numbered from `first` (the rows before it)."""
    for number, (text, value) in enumerate(zip(texts, images), first):
        yield pictures(text, value, base, f"{where} row {number}")


def pictures(text: str | list[dict[str, Any]], value: Any, base: Path | None, where: str) -> Pictures:
    """A record's text and its images: `value` one image or a list (None or []: none). An image is a PIL image (a
    `datasets` Image column), a {"bytes", "path"} dict (the same column in Parquet), bytes, a data: URL, or a file
    path (relative ones from `base`, the source file's directory)."""
    values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    return Pictures(text, [_picture(v, base, f"image_field of {where}") for v in values], where)


def _picture(value: Any, base: Path | None, where: str) -> Any:
    if isinstance(value, dict) and value.get("bytes") is not None:
        value = value["bytes"]
    elif isinstance(value, dict) and value.get("path"):
        value = value["path"]
    if isinstance(value, str) and not value.startswith("data:") and base is not None:
        value = str(base / Path(value).expanduser())
    if hasattr(value, "convert") and hasattr(value, "size"):  # (a PIL image)
        return value
    return load_image(value, where, local_files=True)


def _pick_field(field: str, fields: list[str], where: str) -> str:
    """The column to read: `field`, or for the default one a token column as SAELens would pick, or messages."""
    if field in fields:
        return field
    if field == DEFAULT_FIELD:
        for candidate in FALLBACK_FIELDS:
            if candidate in fields:
                return candidate
    raise ValueError(
        f"text_field: {field!r} not found in {where} (fields: {', '.join(map(str, fields)) or 'none'}); "
        "name the column with --text-field"
    )


def _is_text_feature(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value[:8])


def _is_conversation(value: Any) -> bool:
    """Messages of a role and a content: text, or a list of parts ({"type": "text", "text"}, {"type": "image"}, ...:
    the multimodal datasets' form)."""
    return (
        isinstance(value, (list, tuple)) and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content"))
                for m in value)
    )  # fmt: skip


def _is_content(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str)
        and (p["type"] != "text" or isinstance(p.get("text"), str))
        for p in value
    )  # fmt: skip


def _present(value: Any) -> Any:
    """A content with each part's missing keys (None) dropped."""
    if isinstance(value, list):
        return [{k: v for k, v in part.items() if v is not None} for part in value]
    return value


def _joined(content: str | list[dict[str, Any]]) -> str:
    """A content of text parts as one text, joined by newlines: as vLLM and vlens's server give a text model's
    template such a message."""
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def _form_of(value: Any) -> str:
    """The form of a source's documents, from its first: token ids, a conversation, or (else) text."""
    return "tokens" if _is_token_list(value) else "chat" if _is_conversation(value) else "text"


def document(value: Any, form: str, where: str, images: bool = False) -> Document:
    """`value` checked to be what the column holds: a text, a list of token ids, or a conversation (with `images`,
    one whose image parts the record's images fill)."""
    if form == "tokens":
        if not _is_token_list(value):
            raise ValueError(f"text_field: expected a list of token ids in {where}, got {type(value).__name__}")
        return list(value)
    if form == "chat":
        if not _is_conversation(value):
            raise ValueError(f"text_field: expected a conversation in {where} (a list of messages, each a "
                             f"{{'role', 'content'}} object, its content text or a list of {{'type', ...}} parts), "
                             f"got {str(value)[:80]}")  # fmt: skip
        # (keys a message or a part lacks come back as None from columnar storage, where each has every key)
        conversation = [{k: _present(v) for k, v in message.items() if v is not None} for message in value]
        kinds = {p["type"] for m in conversation if isinstance(m["content"], list) for p in m["content"]}
        if "image" in kinds and not images:
            raise ValueError(f"text_field: a message in {where} holds an image part; a source of images needs "
                             "image_field (--image-field), the column of each record's images")  # fmt: skip
        if kinds - {"text", "image"}:
            kind = min(kinds - {"text", "image"})
            raise ValueError(f"text_field: a message in {where} holds a part of type {kind!r}; parts are of type text "
                             "or image")  # fmt: skip
        if images:  # (the processor's template renders parts, its images' among them)
            return conversation
        return [{**m, "content": _joined(m["content"])} for m in conversation]
    if not isinstance(value, str):
        raise ValueError(f"text_field: expected text in {where}, got {type(value).__name__}")  # noqa: TRY004
    return value
