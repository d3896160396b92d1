"""The engine on its own thread, fed by the asyncio front.

Every engine call (add_requests, step, abort, stats) happens on this one thread, so the engine
needs no locks and concurrent HTTP requests simply meet in its continuous batches. The front puts
commands on a thread-safe queue; after each step the thread sends every request's news (text deltas
of streamed requests, finished outputs) back to the event loop in one call_soon_threadsafe batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vlens.distributed.parallel import GroupError
from vlens.engine.llm_engine import LLMEngine, NewRequest
from vlens.outputs import RequestDelta
from vlens.server.protocol import APIError

log = logging.getLogger("vlens.server")


# -- what the engine thread reports back ---------------------------------------------------------


@dataclass
class Accepted:
    """Every request of the submission passed the engine's validation and is queued."""


@dataclass
class Rejected:
    error: Exception  # a ValueError naming the field at fault, unless the engine has a bug


@dataclass
class Progress:
    """A step's delta for request `index` of the submission (streamed submissions get every one,
    others only the last, which carries the whole output)."""

    index: int
    delta: RequestDelta


@dataclass
class Failed:
    message: str
    status: int = 500  # 503 when the server failed it to shut down


Event = Accepted | Rejected | Progress | Failed


class Submission:
    """One HTTP request's engine requests (one per prompt) and the queue its events arrive on."""

    def __init__(self, requests: list[NewRequest]):
        self.requests = requests
        self.stream = any(r.stream for r in requests)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False  # set on the loop thread once every request finished, failed or was aborted

    async def next(self) -> Event:
        return await self.events.get()


@dataclass
class _Stop:
    """Queue item that ends the engine thread."""


@dataclass
class _Abort:
    submission: Submission


@dataclass
class _FailAll:
    """Queue item that fails every unfinished submission (shutdown past its grace period)."""

    message: str
    status: int


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.stats = engine.stats()
        self._commands: queue.SimpleQueue[Submission | _Abort | _FailAll | _Stop] = queue.SimpleQueue()
        self._owner: dict[str, tuple[Submission, int]] = {}  # request id -> its submission and index there
        self._by_submission: dict[Submission, set[str]] = {}
        self._thread = threading.Thread(target=self._run, name="vlens-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set when the engine can never step again (a tensor-parallel rank died): every request then ends
        # with a 503, and `on_broken` (run on the event loop) stops the server.
        self.broken: str | None = None
        self.on_broken: Callable[[], None] | None = None

    # -- the asyncio side ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        if self.engine.runner.served_by is not None:
            raise RuntimeError("this LLM is being served already: stop that server first, or build another LLM")
        self.engine.runner.served_by = self._thread
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_Stop())
        self._thread.join()
        self.engine.runner.served_by = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, requests: list[NewRequest]) -> Submission:
        """Queue the requests; return once the engine accepted all of them. Raises the engine's
        ValueError (naming the field) if it refused any, in which case none of them runs."""
        if self.broken is not None:
            raise self._unavailable()
        submission = Submission(requests)
        self._commands.put(submission)
        first = await submission.next()
        if isinstance(first, Rejected):
            raise first.error
        return submission

    def abort(self, submission: Submission) -> None:
        """Stop the submission's unfinished requests and free their KV blocks (client gone)."""
        self._commands.put(_Abort(submission))

    def fail_all(self, message: str, status: int) -> None:
        """End every unfinished request with this error, freeing its KV blocks."""
        self._commands.put(_FailAll(message, status))

    def _deliver(self, batch: list[tuple[Submission, Event]]) -> None:
        for submission, event in batch:
            submission.events.put_nowait(event)

    def _send(self, batch: list[tuple[Submission, Event]]) -> None:
        if batch:
            self._loop.call_soon_threadsafe(self._deliver, batch)

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            command = self._commands.get() if not self.engine.has_work() else self._poll()
            while command is not None:
                if isinstance(command, _Stop):
                    return
                self._handle(command)
                command = self._poll()
            if self.engine.has_work():
                try:
                    self._step()
                except GroupError as e:  # the model is gone: nothing more can run here
                    self._break(str(e))
                    return
                except Exception as e:  # an engine bug must not hang every client: fail them, go on
                    log.exception("engine step failed")
                    self._fail_all(f"engine error: {type(e).__name__}: {e}")
            self.stats = self.engine.stats()

    def _break(self, why: str) -> None:
        log.error("engine stopped: %s", why)
        self.broken = why
        self._fail_all(f"the engine stopped: {why}", 503)
        while (command := self._poll()) is not None:  # submissions already queued get their answer too
            if isinstance(command, Submission):
                self._send([(command, Rejected(self._unavailable()))])
        if self.on_broken is not None:
            self._loop.call_soon_threadsafe(self.on_broken)

    def _unavailable(self) -> APIError:
        return APIError(503, f"the engine stopped: {self.broken}; the server is shutting down", code="engine_stopped")

    def _poll(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, command: Submission | _Abort | _FailAll) -> None:
        if isinstance(command, _FailAll):
            self._fail_all(command.message, command.status)
            return
        if isinstance(command, _Abort):
            for request_id in self._by_submission.pop(command.submission, ()):
                self._owner.pop(request_id, None)
                self.engine.abort(request_id)
            return
        submission = command
        try:
            ids = self.engine.add_requests(submission.requests)
        except Exception as e:  # whatever it is, it stays this request's problem, not the thread's
            self._send([(submission, Rejected(e))])
            return
        for i, request_id in enumerate(ids):
            self._owner[request_id] = (submission, i)
        self._by_submission[submission] = set(ids)
        self._send([(submission, Accepted())])

    def _step(self) -> None:
        batch: list[tuple[Submission, Event]] = []
        for delta in self.engine.step():
            owner = self._owner.get(delta.request_id)
            if owner is None:
                continue
            submission, index = owner
            if delta.finished:
                del self._owner[delta.request_id]
                remaining = self._by_submission[submission]
                remaining.discard(delta.request_id)
                if not remaining:
                    del self._by_submission[submission]
            if delta.finished or submission.stream:
                batch.append((submission, Progress(index, delta)))
        self._send(batch)

    def _fail_all(self, message: str, status: int = 500) -> None:
        batch = []
        for submission, ids in self._by_submission.items():
            for request_id in ids:
                try:
                    self.engine.abort(request_id)
                except Exception:
                    log.exception("abort after an engine error failed")
            batch.append((submission, Failed(message, status)))
        self._owner.clear()
        self._by_submission.clear()
        self._send(batch)
