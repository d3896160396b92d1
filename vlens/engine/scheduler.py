"""Which sequences run in the next step, and how many of their tokens.

One rule covers prefill, chunked prefill, decode and recompute: a sequence runs its next
min(uncomputed tokens, budget left) tokens. Running sequences go first (oldest first); waiting ones
are admitted while the token budget, `max_num_seqs` and free KV blocks allow. When blocks run out,
the newest running sequence is preempted: its blocks are freed and it recomputes from the start
later (its full blocks usually come back from the prefix cache).
"""

from __future__ import annotations

from collections import deque

from vlens.engine.block_manager import BlockManager
from vlens.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.tokens_computed = 0  # fed to the model so far, recomputed ones included

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or no budget left
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            while not self.blocks.reserve(seq, seq.num_computed + n):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                self.tokens_computed += n
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.admit(seq)
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if not self.blocks.reserve(seq, seq.num_computed + n):
                self.blocks.release(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            self.tokens_computed += n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.release(seq)
