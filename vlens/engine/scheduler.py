"""Which sequences run in the next step, and how many of their tokens.

One rule covers prefill, chunked prefill, decode and recompute: a sequence runs its next
min(uncomputed tokens, budget left) tokens. Running sequences go first (oldest first); waiting ones
are admitted while the token budget, `max_num_seqs` and free KV blocks allow. When blocks run out,
the newest running sequence is preempted: its blocks are freed and it recomputes from the start
later (its full blocks usually come back from the prefix cache). Under the priority policy (vLLM's)
the waiting queue is kept in the order of (priority, arrival), lower first, and the running sequence
last in that order is the one preempted.

Prompts admitted in one step that start alike (the choices of an lm-eval question, requests behind
one system prompt) compute their shared prefix once: a later one borrows it from an earlier one, which
the prefix cache cannot do, as neither has computed it yet (and one that wants prompt log-probabilities
takes nothing from the cache). A model whose layers keep a state per sequence cannot borrow a state that
its lender has only at the end of its chunk: there the lender's chunk ends at the last block boundary of
the prefix they share, its state kept, and the later prompt waits a step to start from it (`_defer`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from vlens.engine.block_manager import SNAPSHOT_BLOCKS, BlockManager
from vlens.engine.sequence import Borrow, Sequence, Status

if TYPE_CHECKING:
    from vlens.engine.lora import LoraSlots

# A prompt borrows from one of the last _CANDIDATES admitted in its step that start with its _KEY_TOKENS
# tokens: the siblings of an lm-eval question come together, and behind one system prompt any will do.
_KEY_TOKENS, _CANDIDATES = 4, 8


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        loras: LoraSlots | None = None, by_priority: bool = False,
    ):  # fmt: skip
        self.blocks = block_manager
        self.by_priority = by_priority  # (scheduling_policy="priority": Sequence.order ranks them)
        self.loras = loras  # (the engine's LoRA adapters: a sequence under one is admitted with its slot)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.tokens_computed = 0  # fed to the model so far, recomputed ones included
        # prompt tokens of admitted sequences, and of those the prefix cache gave (vLLM's prefix cache queries, hits)
        self.prefix_queries = self.prefix_hits = 0

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.append(seq)

    def add_first(self, seqs: list[Sequence]) -> None:
        """Queue `seqs` ahead of every waiting sequence, in their order (samples a request releases; by priority,
        ahead of those that come after their request)."""
        if self.by_priority:
            for seq in seqs:
                self._queue(seq)
        else:
            self.waiting.extendleft(reversed(seqs))

    def _queue(self, seq: Sequence) -> None:
        """Wait behind every sequence that comes before it or with it by (priority, arrival)."""
        at = next((i for i, other in enumerate(self.waiting) if other.order > seq.order), len(self.waiting))
        self.waiting.insert(at, seq)

    def computed(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """A step ran: its tokens' KV is in the cache, and full blocks go into the prefix cache."""
        for seq, n in scheduled:
            seq.num_computed += n
        self.blocks.commit(seq for seq, _ in scheduled)

    def recompute(self, seq: Sequence) -> None:
        """Free a running sequence's blocks: it computes its KV again from the start in later steps."""
        self.blocks.release(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is, freeing its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or no budget left
            n = self._chunk(seq, budget)
            if n == 0:  # (an image whose tokens attend both ways does not fit what is left of the budget)
                continue
            while not self.blocks.reserve(seq, seq.num_computed + n):
                preempted = True
                victim = max(self.running, key=lambda s: s.order) if self.by_priority else self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
                # (by priority the victim may be one scheduled earlier in this loop: out of the step again)
                for k, (taken, m) in enumerate(scheduled):
                    if taken is victim:
                        del scheduled[k]
                        budget += m
                        self.tokens_computed -= m
                        break
            else:
                self._keep_state(seq, n)
                scheduled.append((seq, n))
                budget -= n
                self.tokens_computed += n
        lenders: dict[tuple[int, ...], list[tuple[Sequence, int]]] = {}  # admitted in this step, by their first
        # tokens, with how many tokens they cover by its end
        deferred: list[Sequence] = []  # (a model that keeps states) waiting a step for a prefix's kept state
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and seq.lora_slot is None:
                seq.lora_slot = self.loras.acquire(seq.lora.lora_int_id)
                if seq.lora_slot is None:  # (every slot holds an adapter running sequences hold: it waits, first)
                    break
            if seq.prefix_of is not None:
                _take_prompt_logprobs(seq)
            self.blocks.admit(seq)
            hit = seq.num_computed
            lender = self._lender(seq, lenders)
            if lender is not None and self.blocks.num_states:
                freed = self._defer(seq, *lender, lenders, scheduled)
                if freed is not None:
                    self.blocks.release(seq)
                    deferred.append(self.waiting.popleft())
                    budget += freed
                    self.tokens_computed -= freed
                    continue
                lender = None
            if lender is not None:
                self.blocks.share(seq, *lender)
            n = self._chunk(seq, budget)
            if n == 0 or not self.blocks.reserve(seq, seq.num_computed + n):
                self.blocks.release(seq)
                break
            self._keep_state(seq, n)
            if lender is not None:
                seq.borrow = self._borrow(seq, *lender)
            if _fresh(seq):
                lenders.setdefault(_key(seq), []).append((seq, seq.num_computed + n))
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:  # (RequestOutput.metrics: the end of its first wait)
                seq.first_scheduled_time = time.time()
            self.running.append(seq)
            scheduled.append((seq, n))
            self.prefix_queries += len(seq.token_ids)
            self.prefix_hits += hit
            seq.num_cached = hit
            budget -= n
            self.tokens_computed += n
        self.waiting.extendleft(reversed(deferred))  # (first in the next step, in their order)
        return scheduled

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens `seq` computes this step: all it has left, within the budget, ending in the middle of no image
        whose tokens attend both ways (Gemma 3's: vlens.images.PromptImages.chunk), and, for a model that keeps
        states, not past the point where its state is kept for later prompts (BlockManager.snapshot_point)."""
        n = min(len(seq.token_ids) - seq.num_computed, budget)
        at = self.blocks.snapshot_point(seq)
        if at is not None:
            n = min(n, at - seq.num_computed)
        return n if seq.images is None else seq.images.chunk(seq.num_computed, n)

    def _keep_state(self, seq: Sequence, n: int) -> None:
        """Where a sequence's chunk ends at its snapshot point, a slot to keep the state there in."""
        if seq.num_computed + n == self.blocks.snapshot_point(seq):
            self.blocks.keep_state(seq)

    def _lender(
        self, seq: Sequence, lenders: dict[tuple[int, ...], list[tuple[Sequence, int]]]
    ) -> tuple[Sequence, int] | None:
        """A sequence admitted in this step whose prompt starts like this one's, and how many leading tokens
        this one can take from it (more than the prefix cache gave): the choices of one lm-eval question,
        prompts behind one system prompt. Its last shared token is left to compute, whose logits give
        the first differing token's log-probability. It takes what a prefix-cache hit on the lender's
        blocks would give: their cache salts must agree (the same interventions, the same layers run, so
        the same keys; or no intervention yet, before the first row either's change), and rows it captures
        it computes itself; one that wants prompt log-probabilities borrows only from one that computes
        the same ones."""
        if not _fresh(seq):
            return None
        best, length = None, seq.num_computed
        wanted_from = seq.taps.reusable_prefix(len(seq.token_ids))
        for lender, covered in lenders.get(_key(seq), [])[-_CANDIDATES:]:
            alike = lender.cache_salt == seq.cache_salt
            if not (alike or lender.plain_salt == seq.plain_salt) or (
                seq.prompt_logprobs is not None
                and (lender.prompt_logprobs is None or lender.params.prompt_logprobs != seq.params.prompt_logprobs)
            ):
                continue
            if not alike:  # the keys are the same only before the first row either's interventions change
                covered = min(covered, seq.edits_from, lender.edits_from)
            shared = min(_common_prefix(seq.token_ids, lender.token_ids) - 1, covered, wanted_from)
            if shared > length:
                best, length = lender, shared
        return None if best is None else (best, length)

    def _defer(
        self, seq: Sequence, lender: Sequence, length: int, lenders: dict[tuple[int, ...], list[tuple[Sequence, int]]],
        scheduled: list[tuple[Sequence, int]],
    ) -> int | None:  # fmt: skip
        """For a model that keeps states: where `seq` shares `length` tokens with a lender admitted in this step, the
        lender's chunk ends at the last block boundary of those (past SNAPSHOT_BLOCKS blocks) with its state kept,
        so that `seq` can start there in the next step (taking the lender's prompt log-probabilities of those tokens,
        where it wants them: `_take_prompt_logprobs`); the budget that cut frees (None: `seq` runs now, from what the
        cache gave it)."""
        if not self.blocks.enable_prefix_caching:  # (nothing kept: each computes its own)
            return None
        bs = self.blocks.block_size
        at = length // bs * bs
        i = next(i for i, (s, _) in enumerate(scheduled) if s is lender)
        end = lender.num_computed + scheduled[i][1]
        if at < SNAPSHOT_BLOCKS * bs or at <= seq.num_computed or not lender.num_computed < at <= end:
            return None
        if lender.state_save is None:
            self.blocks.keep_state(lender)
            if lender.state_save is None:  # (no slot to keep it in)
                return None
        scheduled[i] = (lender, at - lender.num_computed)
        entries = lenders[_key(lender)]
        entries[next(j for j, (s, _) in enumerate(entries) if s is lender)] = (lender, at)
        if seq.prompt_logprobs is not None:  # (`_lender` lends to it only from one that computes the same ones)
            seq.prefix_of = (lender, at)
        return end - at

    def _borrow(self, seq: Sequence, lender: Sequence, length: int) -> Borrow:
        """The slots of the shared partial block, once `seq` has a block of its own for it. A lender may
        itself borrow: a slot it gets by copy in this step is read where it is copied from (the copies
        of a layer all read before any writes)."""
        bs = self.blocks.block_size
        positions = range(length - length % bs, length)
        src = [_slot(lender, p, bs) for p in positions]
        dst = [seq.block_table[p // bs] * bs + p % bs for p in positions]
        return Borrow(lender, length, src, dst)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.release(seq)


def _take_prompt_logprobs(seq: Sequence) -> None:
    """A sequence that waited a step for a prefix another computed (Scheduler._defer) takes that one's prompt
    log-probabilities of it, now delivered: the prefix cache then serves those tokens, whose rows it no longer needs
    (Sequence.reusable_prefix)."""
    lender, at = seq.prefix_of
    seq.prefix_of = None
    if len(seq.prompt_logprobs) == 1 and len(lender.prompt_logprobs) > at:
        seq.prompt_logprobs = lender.prompt_logprobs[: at + 1]


def _fresh(seq: Sequence) -> bool:
    """Whether a sequence may share a prompt prefix computed in its step: nothing generated or delivered
    yet (what else its keys depend on is in its cache salt, which lender and borrower share)."""
    return seq.num_generated == 0 and (seq.prompt_logprobs is None or len(seq.prompt_logprobs) == 1)


def _slot(seq: Sequence, position: int, block_size: int) -> int:
    """The cache slot that holds a position's keys once the step has written its new ones."""
    while seq.borrow is not None and position < seq.borrow.length:
        seq = seq.borrow.lender
    return seq.block_table[position // block_size] * block_size + position % block_size


def _key(seq: Sequence) -> tuple[int, ...]:
    """What a borrower and its lender have in common at least: their first tokens."""
    return tuple(seq.token_ids[:_KEY_TOKENS])


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists, in time proportional to it: slices of doubling
    length compare in C until one differs, then halving ones find where."""
    lo, step, n = 0, 1, min(len(a), len(b))
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
            return lo
        lo, step = hi, step * 2
    return lo
