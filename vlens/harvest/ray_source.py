"""A harvest source read and tokenized by Ray Data on the cluster, handed to the driver in source order.

Reading and tokenizing are what scale with the corpus, so they run as Ray Data tasks on any node;
packing stays on the driver because a window may span two documents from different blocks, and one
ordered pass over the token lists is what makes the windows (and so every shard) identical to the
single-machine run's. Ray Data preserves order here (`preserve_order`), and each format is parsed by
the same functions as `sources`, so the documents are the same ones, with the same errors.

Read tasks take pieces of the source: a text or JSON-lines file whole (split by `sources`' own line
rules), runs of Parquet row groups, row ranges of a `datasets` directory; a hub dataset is streamed
by one task. The source's path must be readable from every node (shared storage).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from vlens.harvest.sources import Source, document, jsonl_documents, text_documents
from vlens.harvest.windows import Marked, TokenDoc, token_documents

_BATCH_ROWS = 1024  # documents a tokenizing task takes at once
_PIECE_ROWS = 1 << 16  # rows one reading task takes, about


def ray_token_documents(
    src: Source, tokenizer: Any, vocab_size: int, roles: tuple[str, ...] | None, concurrency: int,
    generation_prompt: bool = False,
) -> Iterator[TokenDoc]:  # fmt: skip
    """The token ids of `src`'s documents, in order, as `token_documents(src.documents(), ...)` gives them
    (with `roles`, Marked; with `generation_prompt`, conversations end in the template's opening of a reply).

    Its tasks ask for no CPU of their own: on a CPU cluster the forward actors hold every core, and a
    task waiting for a free one would never run. `concurrency` caps the tokenizing tasks instead."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # the harvest's own bar counts the tokens
    # One file is one read task, so the tokenizing tasks may be fewer than allowed: expected, not news.
    warnings.filterwarnings("ignore", message=r"The maximum number of concurrent tasks for 'MapBatches\(_tokenize\)'")
    where = f"{src.location!r}" + (f" column {src.field!r}" if src.field else "")
    tokens = _read(src).map_batches(
        _tokenize,
        batch_format="pyarrow",
        batch_size=_BATCH_ROWS,
        num_cpus=0,
        compute=ray.data.TaskPoolStrategy(size=concurrency),
        fn_kwargs={"form": src.form, "where": where, "tokenizer": tokenizer, "vocab_size": vocab_size, "roles": roles,
                   "generation_prompt": generation_prompt},  # fmt: skip
    )
    for batch in tokens.iter_batches(batch_format="pyarrow", batch_size=None):
        ids = batch.column("ids").to_pylist()
        if roles is None:
            yield from ids
        else:
            yield from map(Marked, ids, batch.column("stored").to_pylist())


def _read(src: Source) -> Any:
    """A Ray dataset with one column, `doc`: the raw value of each document, in source order.

    Each read task takes one piece of the source (a file, a run of Parquet row groups, a row range
    of a `datasets` directory) and parses it with `sources`' own functions."""
    import ray.data

    pieces = _pieces(src)
    return ray.data.from_items(pieces, override_num_blocks=len(pieces)).map_batches(
        _read_piece, batch_format="pyarrow", batch_size=1, num_cpus=0, fn_kwargs={"src": src}
    )


def _pieces(src: Source) -> list[dict[str, int]]:
    """The source cut into [start, stop) ranges of rows (`datasets`) or row groups (Parquet), in order."""
    if src.kind == "datasets":
        rows = len(_load_split(src))
        return [{"start": a, "stop": min(a + _PIECE_ROWS, rows)} for a in range(0, rows, _PIECE_ROWS)]
    if src.kind != "parquet":  # a text or JSON-lines file is parsed whole; a hub dataset is streamed
        return [{"start": 0, "stop": 1}]
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(src.location).metadata
    pieces, start, rows = [], 0, 0
    for i in range(meta.num_row_groups):  # whole row groups, about _PIECE_ROWS rows a piece
        rows += meta.row_group(i).num_rows
        if rows >= _PIECE_ROWS or i == meta.num_row_groups - 1:
            pieces.append({"start": start, "stop": i + 1})
            start, rows = i + 1, 0
    return pieces


def _read_piece(piece: pa.Table, src: Source) -> Iterator[pa.Table]:
    start, stop = piece.column("start")[0].as_py(), piece.column("stop")[0].as_py()
    if src.kind in ("txt", "jsonl"):
        with open(src.location, "rb") as raw:
            if src.kind == "txt":
                docs = text_documents(raw, src.whole_file)
            else:
                docs = jsonl_documents(raw, src.field, src.form, repr(src.location))
            yield from _tables(docs)
    elif src.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(src.location).read_row_groups(range(start, stop), columns=[src.field])
        yield table.rename_columns(["doc"])
    elif src.kind == "datasets":
        rows = _load_split(src).select_columns([src.field]).select(range(start, stop))
        for batch in rows.with_format("arrow").iter(batch_size=_BATCH_ROWS):
            yield batch.rename_columns(["doc"])
    else:
        import datasets

        streamed = datasets.load_dataset(src.location, split=src.split, streaming=True)
        yield from _tables(record[src.field] for record in streamed)


def _tables(docs: Iterator[Any]) -> Iterator[pa.Table]:
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == _BATCH_ROWS:
            yield pa.table({"doc": batch})
            batch = []
    if batch:
        yield pa.table({"doc": batch})


def _load_split(src: Source) -> Any:
    import datasets

    loaded = datasets.load_from_disk(src.location)
    return loaded[src.split] if src.split is not None else loaded


def _tokenize(
    batch: pa.Table, form: str, where: str, tokenizer: Any, vocab_size: int, roles: tuple[str, ...] | None,
    generation_prompt: bool,
) -> pa.Table:  # fmt: skip
    docs = [document(value, form, where) for value in batch.column("doc").to_pylist()]
    token_docs = list(token_documents(docs, tokenizer, vocab_size, roles, generation_prompt))
    if roles is None:
        return pa.table({"ids": pa.array(token_docs, type=pa.list_(pa.int64()))})
    ids, stored = [d.tokens for d in token_docs], [d.stored for d in token_docs]
    return pa.table({"ids": pa.array(ids, type=pa.list_(pa.int64())), "stored": pa.array(stored, pa.list_(pa.bool_()))})
