"""The harvest pipeline: the source read ahead, the forwards, and the shard writes, each in its own thread.

    source thread     tokenize, pack into windows, cut shards (up to AHEAD shards ahead)
    calling thread    launch each shard's forwards (vlens.harvest.rows); its rows travel to host buffers
    writer thread     wait for a shard's rows, write it (atomically) and commit it in the manifest

The writer takes shards in order through a queue of one, and the host buffers come from a pool of two
sets, so at most two shards' rows are in host memory (one filling, one being written). A shard reaches
the manifest exactly as in a serial run: written whole under a temporary name, renamed, then listed,
in shard order, by the one thread that writes the manifest. So a kill at any moment leaves what a serial
run leaves at some moment, and the re-run ends with the same bytes. `pipeline="off"` (the default on a
CPU, where the forward takes every core) runs the same steps one after the other in the calling thread
(same files; the tests compare them).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from vlens.harvest.job import Job, store_shard
from vlens.harvest.rows import DeviceRows, Shard
from vlens.harvest.windows import Window

T = TypeVar("T")
AHEAD = 2  # shards the source thread cuts ahead of the forwards
_POLL = 0.1  # seconds between looks at whether the other side of a queue has stopped


def ahead(items: Iterator[T], depth: int) -> Iterator[T]:
    """`items`, produced by a thread of their own up to `depth` ahead of the consumer. An exception in
    the producer is raised in the consumer where the item would have been; closing the iterator stops
    the producer."""
    box: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                if not _put(box, (item, None), stop):
                    return
            _put(box, (done, None), stop)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            _put(box, (done, e), stop)

    thread = threading.Thread(target=produce, name="harvest-source", daemon=True)
    thread.start()
    try:
        while True:
            item, error = box.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()


def _put(box: queue.Queue, item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            box.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


class Writer:
    """Stores and commits shards in order: in a thread of its own (`threaded`), else at once in `put`.

    A failure in the thread is raised by the next `put` or by `close`; shards queued after it are not
    written (their buffers go back to the pool, so the forwards never wait on a dead writer)."""

    def __init__(self, store: Callable[[Shard], None], give_back: Callable[[Shard], None], threaded: bool) -> None:
        self.store, self.give_back = store, give_back
        self.error: BaseException | None = None
        self.queue: queue.Queue[Shard | None] = queue.Queue(maxsize=1)
        self.thread = threading.Thread(target=self._run, name="harvest-writer", daemon=True) if threaded else None
        if self.thread is not None:
            self.thread.start()

    def put(self, shard: Shard) -> None:
        self._raise()
        if self.thread is None:
            self._store(shard)
            self._raise()
            return
        while True:
            try:
                self.queue.put(shard, timeout=_POLL)
                return
            except queue.Full:
                self._raise()

    def close(self, check: bool = True) -> None:
        """Wait for every queued shard to be committed (and raise a failure, unless `check` is False)."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
        if check:
            self._raise()

    def _run(self) -> None:
        while (shard := self.queue.get()) is not None:
            self._store(shard)

    def _store(self, shard: Shard) -> None:
        try:
            if self.error is None:
                self.store(shard)
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread
            self.error = e
        finally:
            self.give_back(shard)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


def run_shards(
    job: Job, stage: DeviceRows, tasks: Iterator[tuple[int, int, list[Window]]], seed: int | None, bar,
    pipeline: bool,
) -> None:  # fmt: skip
    """Run, write and commit every shard of `tasks`, pipelined or one step after the other."""

    def store(shard: Shard) -> None:
        shard.ready()
        started = time.perf_counter()
        entry = store_shard(job.store, shard.index, shard.first, shard.windows, shard.tensors, seed)
        job.commit(entry, shard.stats, bar)
        job.write_seconds += time.perf_counter() - started
        job.device_seconds += shard.forward_seconds

    writer = Writer(store, lambda shard: stage.buffers.give(shard.buffers), threaded=pipeline)
    if pipeline:
        tasks = ahead(tasks, AHEAD)
    try:
        for task in tasks:
            writer.put(stage.shard(*task))
    except BaseException:
        writer.close(check=False)  # what is queued is whole: let it reach the disk, then raise the cause
        raise
    writer.close()
