"""Rows captured through the plan, the taps and the streams, step by step as the engine runs them, with
known values: a decode step's single rows of many streams travel as one segment (a batch), and every
stream still gets exactly its own rows, bit for bit, in order, whatever mix of specs shares the steps."""

from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import numpy as np
import torch

from vlens.capture import rows as rows_module
from vlens.capture.bind import RequestTaps
from vlens.capture.names import LOGITS, Part, tap_dtype
from vlens.capture.plan import Chunk, plan_decode, plan_step
from vlens.capture.positions import Positions, rows_of
from vlens.capture.rows import DecodePages, RowStream
from vlens.capture.runtime import TapRuntime

A, B = "blocks.1.hook_resid_post", "blocks.0.attn.hook_z"
SHAPES = {A: (4,), B: (2, 3), LOGITS: (5,)}  # taps of other shapes and dtypes (logits stay float32)
MODEL_DTYPE = torch.bfloat16


def _value(request: int, position: int, tap: str) -> torch.Tensor:
    """The row a request's position has at a tap (float32): distinct for every (request, position, tap)."""
    base = 1000.0 * request + position + list(SHAPES).index(tap) / 4
    return base + torch.arange(math.prod(SHAPES[tap]), dtype=torch.float32).view(SHAPES[tap]) / 8


def _stream(taps: list[str], positions, prompt_len: int, **kw) -> RowStream:
    parts = {t: (Part(SHAPES[t], tap_dtype(t, MODEL_DTYPE)),) for t in taps}
    return RowStream("capture", {t: t for t in taps}, Positions.parse(positions), prompt_len, parts, **kw)


def _put(name: str, values) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _deliver_after_the_next_forward(runtime: TapRuntime, plan) -> None:
    """Collect a step's rows, let the next forward overwrite the gather buffers (the engine delivers a step
    after the next one ran: async scheduling), then deliver."""
    collection = runtime.collect(plan)
    for buffer in runtime._out.values():
        buffer.fill_(-1)  # (no row's value: they are all >= 0)
    plan.deliver(collection.ready())


def test_batched_decode_rows_equal_the_spec_bit_for_bit():
    rng = np.random.default_rng(0)
    # (positions, taps, extra RowStream fields, prefill chunk sizes, tokens generated)
    specs = [
        ("generated", [A], {}, [7], 6),
        ("all", [A], {}, [3, 5], 5),  # chunked prefill, then decode rows in the batch of [A]
        ("last", [A], {}, [6], 4),  # a tail: never batched
        (slice(1, None, 2), [A], {}, [9], 7),  # not one run: never batched
        ("all", [A], {"exclude": torch.tensor([5, 9])}, [8], 6),  # excluded tokens: never batched
        ("generated", [A, B, LOGITS], {}, [5], 8),  # other taps: a batch of its own
        None,  # no capture: not among the chunks
        ("all", [A], {"dtype": torch.bfloat16}, [6], 5),  # cast on the device: a readout
        (slice(-3, None), [A, B], {}, [6, 1], 6),  # one-row prefill chunk joins a batch; kept at the end
        ("all", [A], {}, [4], 1),  # ends after its prefill
    ]
    requests = []
    for r, spec in enumerate(specs):
        prefill, generated = (spec[3], spec[4]) if spec else ([5], 4)
        prompt_len = sum(prefill)
        tokens = rng.integers(0, 12, prompt_len + generated).tolist()
        streams = [_stream(spec[1], spec[0], prompt_len, **spec[2])] if spec else []
        sizes = prefill + [1] * (rows_of(prompt_len, generated) - prompt_len)
        requests.append({"id": r, "taps": RequestTaps(streams), "tokens": tokens, "sizes": sizes, "done": 0})
    runtime = TapRuntime(SHAPES, torch.device("cpu"), MODEL_DTYPE, _put)
    pages = DecodePages()
    results = {}
    while any(q["sizes"] for q in requests):
        chunks, owners = [], []  # owners: (request, position) of each packed row
        for q in requests:
            if not q["sizes"]:
                continue
            n = q["sizes"].pop(0)
            if q["taps"].streams:
                chunks.append(Chunk(q["taps"], q["tokens"], q["done"], n, len(owners)))
            owners += [(q["id"], q["done"] + j) for j in range(n)]
            q["done"] += n
        plan = plan_step(chunks, 16, pages)
        # the single rows of batched streams: one segment (owner None) per set of taps, a row per stream
        keys = [c.taps.streams[0].tap_key for c in chunks if c.count == 1 and c.taps.streams[0].batched]
        batches = sorted(len(s.positions) for s in plan.segments if s.owner is None)
        assert batches == sorted(keys.count(k) for k in set(keys))
        taps = runtime.arm(plan) if plan else {}
        for tap, t in taps.items():
            t(torch.stack([_value(r, p, tap) for r, p in owners]).to(t.gather_out.dtype))
        if plan.gathers:
            _deliver_after_the_next_forward(runtime, plan)
        for q in requests:
            if not q["sizes"] and q["taps"].streams and q["id"] not in results:
                [stream] = q["taps"].streams
                results[q["id"]] = stream.result(q["done"], MODEL_DTYPE)
    for q, spec in zip(requests, specs):
        if spec is None:
            continue
        positions_spec, taps, extra = spec[0], spec[1], spec[2]
        num_rows = q["done"]
        wanted = list(range(num_rows))[positions_spec] if isinstance(positions_spec, slice) else {
            "all": list(range(num_rows)),
            "generated": list(range(sum(spec[3]), num_rows)),
            "last": [num_rows - 1],
        }[positions_spec]  # fmt: skip
        if "exclude" in extra:
            wanted = [p for p in wanted if q["tokens"][p] not in extra["exclude"].tolist()]
        positions, rows = results[q["id"]]
        assert positions.tolist() == wanted, q["id"]
        for tap in taps:
            dtype = extra.get("dtype", tap_dtype(tap, MODEL_DTYPE))
            expected = torch.stack([_value(q["id"], p, tap) for p in wanted]).to(tap_dtype(tap, MODEL_DTYPE)).to(dtype)
            assert rows[tap].dtype == dtype and torch.equal(rows[tap], expected), (q["id"], tap)


def test_repeated_decode_steps_give_each_stream_its_rows(monkeypatch):
    """Decode steps planned as repeats of the step before (`DecodePages.repeat`: no work per stream) give
    the same rows as steps planned stream by stream: across pages that fill up (a few rows each here) and
    then go, the running streams keeping copies of their own rows, sequences that end or are preempted and
    recomputed in between, a bounded window that ends mid-run, a step queued ahead of a sequence's end, and
    a sequence whose rows are gathered apart (a tail spec)."""
    monkeypatch.setattr(rows_module, "PAGE_BYTES", 512)  # a page of A holds 64 rows: it fills every ~10 steps
    rng = np.random.default_rng(1)
    specs = [  # (positions, taps, prompt length, tokens generated)
        ("generated", [A], 5, 30),
        ("all", [A], 3, 24),
        (slice(0, 14), [A], 4, 20),  # its window ends while the others repeat
        ("generated", [A, B], 6, 26),  # a batch of its own, in pages of its own
        ("generated", [A], 4, 9),  # ends early: the steps after it are new repeats
        None,  # captures nothing
        ("all", [A], 7, 18),  # preempted after step 7, then recomputed with a prefill
        ("last", [A], 5, 4),  # a tail: gathered apart, so no step repeats while it runs
    ]
    requests = []
    for r, spec in enumerate(specs):
        prompt_len, generated = (spec[2], spec[3]) if spec else (5, 22)
        tokens = rng.integers(0, 12, prompt_len + generated).tolist()
        streams = [_stream(spec[1], spec[0], prompt_len)] if spec else []
        seq = SimpleNamespace(taps=RequestTaps(streams), token_ids=tokens, block_table=None, id=r)
        requests.append({"seq": seq, "prompt": prompt_len, "rows": rows_of(prompt_len, generated), "done": 0})
    runtime = TapRuntime(SHAPES, torch.device("cpu"), MODEL_DTYPE, _put)
    pages, living, made = DecodePages(), weakref.WeakSet(), []  # the pages alive; one entry per page made
    results, repeats = {}, 0

    def batch(taps, room, make=pages.batch):
        new = make(taps, room)
        if new.page not in living:  # (a page made now)
            made.append(taps)
            living.add(new.page)
        return new

    pages.batch = batch

    def run(plan, owners):
        """The forward of a step whose packed row i is (request, position) owners[i]: each tap's value there."""
        taps = runtime.arm(plan) if plan else {}
        for tap, t in taps.items():
            t(torch.stack([_value(r, p, tap) for r, p in owners]).to(t.gather_out.dtype))
        if plan.gathers:
            _deliver_after_the_next_forward(runtime, plan)

    def prefill(qs):
        chunks, owners = [], []
        for q in qs:
            n = q["prompt"] if q["done"] == 0 else q["done"] + 1  # a recompute: every token it has, again
            chunks.append(Chunk(q["seq"].taps, q["seq"].token_ids, 0, n, len(owners)))
            owners += [(q["seq"].id, p) for p in range(n)]
            q["done"] = n
        run(plan_step(chunks, 16, pages), owners)

    prefill(requests)
    preempted, step = requests[6], 0
    while any(q["done"] < q["rows"] for q in requests):
        if step == 12:  # preempted after step 7 (a repeat), back now: its prefill computes every position it had again
            prefill([preempted])
            preempted = None
        live = [q for q in requests if q["done"] < q["rows"] and (q is not preempted or step <= 7)]
        seqs, positions = [q["seq"] for q in live], [q["done"] for q in live]
        before = pages._last
        plan = plan_decode(seqs, positions, 16, pages)
        repeats += before is not None and pages._last is before
        if live[0]["seq"].id == 0 and live[0]["done"] + 1 == live[0]["rows"]:
            # request 0 ended a step ago and this step was queued ahead of its end: its result is built now,
            # before the step has run
            results[0] = live[0]["seq"].taps.streams[0].result(live[0]["done"], MODEL_DTYPE)
        run(plan, [(q["seq"].id, q["done"]) for q in live])
        for q in live:
            q["done"] += 1
        step += 1
    # Full pages let their rows go once they all arrived: the running streams copied theirs out, so only each
    # set of taps' current page is left (the others' memory went to the pages after them)
    assert len(made) > 2 and len(living) == 2
    for q in requests:
        if q["seq"].taps.streams and q["seq"].id not in results:
            [stream] = q["seq"].taps.streams
            results[q["seq"].id] = stream.result(q["rows"], MODEL_DTYPE)
    assert repeats >= 15  # of 29 decode steps: those after one that changed the batch or filled a page
    for q, spec in zip(requests, specs):
        if spec is None:
            continue
        r, (positions_spec, taps, prompt_len, generated) = q["seq"].id, spec
        num_rows = q["rows"] if r else q["rows"] - 1  # request 0's result was built a step early
        wanted = list(range(num_rows))[positions_spec] if isinstance(positions_spec, slice) else {
            "all": list(range(num_rows)), "generated": list(range(prompt_len, num_rows)), "last": [num_rows - 1],
        }[positions_spec]  # fmt: skip
        positions, rows = results[r]
        assert positions.tolist() == wanted, r
        for tap in taps:
            expected = torch.stack([_value(r, p, tap) for p in wanted]).to(tap_dtype(tap, MODEL_DTYPE))
            assert torch.equal(rows[tap], expected), (r, tap)
