"""The engine on its own thread, fed by the asyncio front.

Every engine call (validation, add, step, abort, result) happens on this one thread, so the engine
needs no locks and concurrent HTTP requests simply meet in its continuous batches. The front puts
commands on a thread-safe queue; after each step the thread sends every request's news (text deltas
of streaming requests, finished outputs) back to the event loop in one call_soon_threadsafe batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from vlens.engine.llm_engine import LLMEngine
from vlens.engine.sequence import Sequence
from vlens.outputs import Logprob, RequestOutput
from vlens.sampling_params import SamplingParams
from vlens.server.deltas import TextStream

log = logging.getLogger("vlens.server")


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


# -- what the engine thread reports back ---------------------------------------------------------


@dataclass
class Accepted:
    """Every sequence of the submission passed the engine's validation and is queued."""


@dataclass
class Rejected:
    error: Exception  # a ValueError naming the field at fault, unless the engine has a bug


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class Finished:
    index: int
    output: RequestOutput
    text: str  # streaming: the remaining text; otherwise the whole completion
    token_ids: list[int]  # streaming: the tokens not yet reported; otherwise all of them
    logprobs: list[dict[int, Logprob]]


@dataclass
class Failed:
    message: str


Event = Accepted | Rejected | Delta | Finished | Failed


@dataclass
class EngineStats:
    """A snapshot the engine thread publishes after each step, read by /metrics from the loop thread."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0


class Submission:
    """One HTTP request's sequences (one per prompt) and the queue its events arrive on."""

    def __init__(self, requests: list[EngineRequest], stream: bool):
        self.requests, self.stream = requests, stream
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False  # set on the loop thread once every sequence finished, failed or was aborted

    async def next(self) -> Event:
        return await self.events.get()


@dataclass
class _Tracked:
    """Engine-thread state of one sequence."""

    submission: Submission
    index: int
    text: TextStream | None  # streaming only
    tokens_sent: int = 0
    logprobs_sent: int = 0


@dataclass
class _Stop:
    """Queue item that ends the engine thread."""


@dataclass
class _Abort:
    submission: Submission


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[Submission | _Abort | _Stop] = queue.SimpleQueue()
        self._tracked: dict[Sequence, _Tracked] = {}
        self._by_submission: dict[Submission, list[Sequence]] = {}
        self._thread = threading.Thread(target=self._run, name="vlens-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the asyncio side ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_Stop())
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, requests: list[EngineRequest], stream: bool) -> Submission:
        """Queue the requests; return once the engine accepted all of them. Raises the engine's
        ValueError (naming the field) if it refused any, in which case none of them runs."""
        submission = Submission(requests, stream)
        self._commands.put(submission)
        first = await submission.next()
        if isinstance(first, Rejected):
            raise first.error
        return submission

    def abort(self, submission: Submission) -> None:
        """Stop the submission's unfinished sequences and free their KV blocks (client gone)."""
        self._commands.put(_Abort(submission))

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
                except Exception as e:  # an engine bug must not hang every client: fail them, go on
                    log.exception("engine step failed")
                    self._fail_all(f"engine error: {type(e).__name__}: {e}")
            self._publish_stats()

    def _poll(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, command: Submission | _Abort) -> None:
        if isinstance(command, _Abort):
            for seq in self._by_submission.pop(command.submission, []):
                if self._tracked.pop(seq, None) is not None:
                    self.engine.abort(seq)
            return
        submission = command
        try:
            seqs = [
                self.engine.make_sequence(r.prompt_ids, r.params, i, r.prompt)
                for i, r in enumerate(submission.requests)
            ]
        except Exception as e:  # whatever it is, it stays this request's problem, not the thread's
            self._send([(submission, Rejected(e))])
            return
        for i, (seq, request) in enumerate(zip(seqs, submission.requests)):
            stream = (
                TextStream(self.tokenizer, request.prompt_ids, request.params.stop_list) if submission.stream else None
            )
            self._tracked[seq] = _Tracked(submission, i, stream)
            self.engine.add(seq)
        self._by_submission[submission] = seqs
        self._send([(submission, Accepted())])

    def _step(self) -> None:
        finished = set(self.engine.step())
        batch: list[tuple[Submission, Event]] = []
        for seq, t in list(self._tracked.items()):
            if seq in finished:
                batch.append((t.submission, self._finished(seq, t)))
                del self._tracked[seq]
                remaining = self._by_submission[t.submission]
                remaining.remove(seq)
                if not remaining:
                    del self._by_submission[t.submission]
            elif t.text is not None and seq.num_generated > t.tokens_sent:
                generated = seq.generated
                delta = Delta(
                    t.index, t.text.advance(generated), generated[t.tokens_sent :], seq.logprobs[t.logprobs_sent :]
                )
                t.tokens_sent, t.logprobs_sent = len(generated), len(seq.logprobs)
                batch.append((t.submission, delta))
        self._send(batch)

    def _finished(self, seq: Sequence, t: _Tracked) -> Finished:
        out = self.engine.result(seq)
        completion = out.outputs[0]
        logprobs = completion.logprobs or []
        if t.text is None:
            return Finished(t.index, out, completion.text, completion.token_ids, logprobs)
        text = t.text.finish(completion.token_ids, completion.stop_reason)
        return Finished(t.index, out, text, completion.token_ids[t.tokens_sent :], logprobs[t.logprobs_sent :])

    def _fail_all(self, message: str) -> None:
        batch = []
        for submission, seqs in self._by_submission.items():
            for seq in seqs:
                try:
                    self.engine.abort(seq)
                except Exception:
                    log.exception("abort after an engine error failed")
            batch.append((submission, Failed(message)))
        self._tracked.clear()
        self._by_submission.clear()
        self._send(batch)

    def _publish_stats(self) -> None:
        scheduler = self.engine.scheduler
        self.stats = EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_cache_usage=self.engine.blocks.usage(),
            num_preemptions=scheduler.num_preemptions,
        )
