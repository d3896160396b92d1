"""On-policy harvests (`generate_tokens`): the model first continues each document — a conversation gets the
assistant's reply, after the chat template's generation prompt — and the harvest reads the document with its
continuation, so the rows stored are those of the model's own text (under the harvest's edits, which the
generation applies too: a steered model's rows over what the steered model wrote).

A document's prompt is what an unpacked window of it holds: BOS where the model uses one, then its tokens;
edits count positions from there. So with `pack=False` and windows long enough for prompt and reply, each
stored row is the row the model computed as it wrote (the tests check it against HF). A continuation ends with
the model's end-of-sequence token, kept (the model wrote it), or after `generate_tokens` tokens; document i
(the source's record i) samples with seed i; with `samples` k, it is continued k times, each continuation a
document of the harvest after it, numbered k i + j. A blank document gets none. With `roles`, a reply is the
assistant's.

Resuming. Continuations are generated in chunks of documents (64, 128, then CHUNK; one `LLM.generate`
call each, so a run stopped early by `max_tokens` generates at most one chunk in vain) and kept in out_dir
as replies-NNNNN.json, written whole or not at all. A re-run reads the chunks on disk rather than generating
them again, so the harvest's bytes do not hang on a generation being repeatable; and each chunk is generated
from an empty prefix cache, so one lost to a kill comes out as it did in the uninterrupted run.
A file records the run it belongs to (a digest of the manifest's header as the run first wrote it): one left
by a run with other options is generated anew, not read.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import count, islice
from typing import Any

from vlens.harvest.edits import HarvestEdits
from vlens.harvest.job import Job
from vlens.harvest.windows import Marked, Packing, TokenDoc, opening
from vlens.harvest.writer import Store, atomic_write, manifest_bytes, replies_name
from vlens.llm import LLM
from vlens.sampling_params import SamplingParams

CHUNK = 256  # documents per generate call, at most: enough to keep a continuous batch full
# The first call's; each next one doubles up to CHUNK: a run that max_tokens stops early waits on fewer replies,
# and one call still takes 64 documents (16 to start measured 1.5x the time on 64 questions: three smaller batches).
FIRST_CHUNK = 64
REPLY_ROLE = "assistant"  # whose rows a conversation's continuation is, for `roles`


@dataclass(frozen=True)
class Generation:
    """How a harvest's continuations are generated (the manifest's record of it)."""

    tokens: int  # at most, per document
    temperature: float  # 0: greedy; else document i's samples are seeded by i
    samples: int = 1  # continuations per document, each a document of the harvest

    def describe(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "temperature": self.temperature, "samples": self.samples}


def with_replies(
    prompts: Iterable[TokenDoc], llm: LLM, generation: Generation, packing: Packing, edits: HarvestEdits | None,
    job: Job,
) -> Iterator[TokenDoc]:  # fmt: skip
    """`prompts` each followed by the model's continuation: read from the job's directory where this run wrote
    it, else generated (timed in the job) and written there (see the module doc)."""
    docs, store, first = iter(prompts), job.store, 0
    run = hashlib.sha256(manifest_bytes(job.run_header())).hexdigest()  # (what the run's replies files name)
    for index in count():
        chunk = list(islice(docs, min(CHUNK, FIRST_CHUNK << index)))
        if not chunk:
            return
        replies = _read(store, index, run, len(chunk) * generation.samples)
        if replies is None:
            started = time.perf_counter()
            replies = _generate(llm, chunk, first, generation, packing, edits)
            job.generate_seconds += time.perf_counter() - started
            store.fs.makedirs(store.root, exist_ok=True)  # (the first chunk comes before the run's manifest)
            record = {"run": run, "documents": [first, first + len(chunk)], "replies": replies}
            atomic_write(store, replies_name(index), json.dumps(record, separators=(",", ":")).encode())
        first += len(chunk)
        for doc, reply in zip((doc for doc in chunk for _ in range(generation.samples)), replies):
            if isinstance(doc, Marked):
                yield Marked(doc.tokens + reply, doc.stored + [REPLY_ROLE in packing.roles] * len(reply))
            else:
                yield doc + reply


def _read(store: Store, index: int, run: str, documents: int) -> list[list[int]] | None:
    path = store.path(replies_name(index))
    if not store.fs.exists(path):
        return None
    record = json.loads(store.fs.cat_file(path))
    if record.get("run") != run or len(record.get("replies", ())) != documents:
        return None  # another run's (or a run over other data): generated again
    return record["replies"]


def _generate(
    llm: LLM, chunk: list[TokenDoc], first: int, generation: Generation, packing: Packing, edits: HarvestEdits | None
) -> list[list[int]]:  # fmt: skip
    prompts, numbers = [], []  # (of the documents with tokens: a blank one gets no continuation)
    limit = llm.engine.max_model_len
    for i, doc in enumerate(chunk, first):
        tokens = doc.tokens if isinstance(doc, Marked) else doc
        if not tokens:
            continue
        prompt = opening(packing, tokens[0]) + tokens
        if len(prompt) >= limit:
            raise ValueError(
                f"generate_tokens: document {i} has {len(prompt)} tokens, which leave no room for a continuation "
                f"within the model's {limit}; shorten or leave out such documents"
            )
        prompts.append(prompt)
        numbers.append(i)
    params = [
        SamplingParams(
            max_tokens=generation.tokens, temperature=generation.temperature, n=generation.samples,
            seed=i if generation.temperature else None, interventions=edits.given if edits is not None else None,
        )
        for i in numbers
    ]  # fmt: skip
    llm.reset_prefix_cache()  # (a chunk computes what it computed in the uninterrupted run)
    k = generation.samples
    replies: list[list[int]] = [[] for _ in range(len(chunk) * k)]  # (document-major: a document's k samples)
    for i, out in zip(numbers, llm.generate(prompts, params, use_tqdm=False) if prompts else []):
        replies[(i - first) * k : (i - first + 1) * k] = [list(sample.token_ids) for sample in out.outputs]
    return replies
