"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and hash-chained prefix caching.

A full block is identified by the hash of (previous block's hash, its tokens, the sequence's cache
salt), so a block is reused only behind an identical prefix computed under identical conditions.
Freed blocks keep their hash until handed out again, so a preempted or repeated prompt finds them.

A model with layers that keep a state per sequence (Qwen 3.5's linear attention, LFM2's short convolutions, Mamba's
scans; vlens.layers.slot_states) keeps it in one of `num_states` state slots, which a sequence holds from its first
block on (`Sequence.state_slot`; a lent table: `state_of`). Such a state is of a whole prefix and cannot be rebuilt
from blocks, so a prefix is cached with its state: a prompt's chunk that ends at its last block boundary (before its
last token, which must run for its logits) keeps the state there in a slot of its own too (`snapshot_point`), under
that block's hash (`snapshots`). A later sequence takes cached blocks up to the last one with such a state, and its
first chunk starts from that state (`Sequence.state_source`); where more of its blocks were cached (a prompt that
shares only its start with an earlier one: a system prompt), its chunk also ends at their end, its state kept there
for the prompts after it (`Sequence.uncached_state_at`). A running sequence also copies its state to a second
slot of its own at each block boundary a step of it starts at (`Sequence.state_mark`), and leaves that state, kept
likewise, when it ends or is preempted: a chat's next turn starts after the reply. Slots that no sequence holds keep
these states, the least recently used given up first when a sequence needs a slot, then running sequences' marks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from vlens.engine.sequence import Sequence

# A prompt keeps its state for later prompts only past this many blocks: its chunk is cut there, so its last tokens
# take a step of their own (a short prompt would pay a step to keep a state that saves little).
SNAPSHOT_BLOCKS = 4


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_states: int = 0):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.enable_prefix_caching = enable_prefix_caching
        self.num_states = num_states
        self.free_states = list(range(num_states))[::-1]  # (popped from the end: slot 0 first)
        self.state_of: dict[int, int] = {}  # a lent table's first block -> the table's state slot (`lend`)
        # block hash -> the slot holding the state after the tokens up to that block's end (least recently used first)
        self.snapshots: OrderedDict[int, int] = OrderedDict()
        self.pinned: Counter[int] = Counter()  # snapshot slots that scheduled chunks start from (not given up)
        self.marks: dict[int, Sequence] = {}  # a running sequence's mark slot -> the sequence

    def usage(self) -> float:
        return 1 - len(self.free) / len(self.blocks)

    def _chain_hash(self, prev: int | None, tokens: tuple[int, ...], salt: object) -> int:
        return hash((prev, tokens, salt))

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def admit(self, seq: Sequence) -> None:
        """Attach cached blocks for the longest reusable prefix of a sequence that holds no blocks.

        At most `seq.reusable_prefix()` tokens are taken from the cache (rows a request still wants must be
        computed), and always one fewer than the sequence has, so its last token yields logits."""
        assert not seq.block_table
        seq.num_computed = 0
        if not self.enable_prefix_caching:
            return
        reusable = seq.reusable_prefix()
        limit = len(seq.token_ids) - 1 if reusable is None else min(reusable, len(seq.token_ids) - 1)
        limit //= self.block_size
        prev, found = None, []
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = self._chain_hash(prev, tokens, seq.salt_until((i + 1) * self.block_size))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append((block_id, h))
            prev = h
        if self.num_states:
            found = self._with_state(seq, found)
        for block_id, h in found:
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        seq.num_computed = len(seq.block_table) * self.block_size

    def _with_state(self, seq: Sequence, found: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Of the cached blocks found, those up to the last after which a state is kept, which the sequence's
        first chunk starts from (in a slot of its own, taken now); none where there is no such state or slot. Where
        more were found, the sequence keeps its state at their end (`Sequence.uncached_state_at`)."""
        seq.uncached_state_at = len(found) * self.block_size
        while found and found[-1][1] not in self.snapshots:
            found.pop()
        if not found:
            return found
        source = self.snapshots[found[-1][1]]
        self.snapshots.move_to_end(found[-1][1])
        self.pinned[source] += 1  # (before a slot is taken: the one to start from is not given up for it)
        seq.state_slot = self._state()
        if seq.state_slot is None:
            self._unpin(source)
            return []
        seq.state_source = source
        self._mark_slot(seq)
        return found

    def _state(self) -> int | None:
        """A state slot: a free one, else the one of the least recently used kept state no chunk starts from, else a
        running sequence's mark (which then leaves no state when it ends); None where every slot is a sequence's."""
        if self.free_states:
            return self.free_states.pop()
        for h, slot in self.snapshots.items():
            if not self.pinned[slot]:
                del self.snapshots[h]
                return slot
        if self.marks:  # (a running sequence's mark: it leaves no state when it ends)
            slot, seq = self.marks.popitem()
            seq.state_mark = None
            return slot
        return None

    def _mark_slot(self, seq: Sequence) -> None:
        """A free slot, if there is one, for the sequence's state at block boundaries (`Sequence.state_mark`)."""
        if self.free_states and self.enable_prefix_caching:
            seq.state_mark, seq.marked_at = self.free_states.pop(), 0
            self.marks[seq.state_mark] = seq

    def states_free(self) -> int:
        """State slots that sequences may take: the free ones, those of kept states no chunk starts from and those of
        running sequences' marks."""
        kept = sum(1 for slot in self.snapshots.values() if not self.pinned[slot])
        return len(self.free_states) + kept + len(self.marks)

    def _unpin(self, slot: int) -> None:
        self.pinned[slot] -= 1
        if not self.pinned[slot]:
            del self.pinned[slot]

    def snapshot_point(self, seq: Sequence) -> int | None:
        """Where a sequence's state is kept next for later sequences: the end of its prefix whose blocks are cached
        without a state, then its tokens' last block boundary before its last token; the first it has yet to compute
        that is far enough (SNAPSHOT_BLOCKS), else None."""
        if not (self.num_states and self.enable_prefix_caching) or len(seq.token_ids) - seq.num_computed < 2:
            return None  # (a decode's one token is past every point: most calls, every step)
        last = (len(seq.token_ids) - 1) // self.block_size * self.block_size
        points = [at for at in (seq.uncached_state_at, last) if at >= SNAPSHOT_BLOCKS * self.block_size]
        return next((at for at in points if seq.num_computed < at), None)

    def keep_state(self, seq: Sequence) -> None:
        """The sequence's chunk this step ends at its snapshot point: a slot to keep its state in (none, and no
        state kept, when every slot is a sequence's)."""
        seq.state_save = self._state()

    def share(self, seq: Sequence, lender: Sequence, length: int) -> None:
        """Give `seq` (holding only blocks from the cache) the lender's full blocks up to token `length`,
        whose contents the two share; the partial block after them stays to be reserved and copied."""
        for i in range(len(seq.block_table), length // self.block_size):
            self._take(lender.block_table[i])
            seq.block_table.append(lender.block_table[i])
        seq.num_computed = length

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence's blocks cover `num_tokens` tokens; False (nothing taken) if too few are free (or,
        for a sequence's first block, no state slot)."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        first = need > 0 and seq.state_slot is None and self.num_states
        if need > len(self.free) or (first and not (self.free_states or self.states_free())):
            return False
        for _ in range(need):
            seq.block_table.append(self._fresh())
        if first:
            seq.state_slot = self._state()
            self._mark_slot(seq)
        return True

    def reserve_next(self, seqs: list[Sequence]) -> bool:
        """Make each sequence's blocks cover one token past those it holds (a decode step queued before its
        last token reaches the host); False when blocks run short. One call a step: most sequences need
        no block, and the check is inline."""
        bs = self.block_size
        for seq in seqs:
            if len(seq.block_table) * bs <= len(seq.token_ids) and not self.reserve(seq, len(seq.token_ids) + 1):
                return False
        return True

    def commit(self, seqs: Iterable[Sequence]) -> None:
        """Publish the blocks that became full and computed, so later sequences can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for seq in seqs:
            full = min(seq.num_computed, len(seq.token_ids)) // bs
            if full > len(seq.block_hashes):  # (most steps fill none)
                self._publish(seq, full)
            if seq.state_source is not None:  # (its chunk read the kept state: it may be given up again)
                self._unpin(seq.state_source)
                seq.state_source = None
            if seq.state_save is not None:  # its chunk ended at its snapshot point: a state after a published block
                h = seq.block_hashes[seq.num_computed // bs - 1]
                if h in self.snapshots:  # (kept already, by a sequence that ran beside it)
                    self.free_states.append(seq.state_save)
                else:
                    self.snapshots[h] = seq.state_save
                seq.state_save = None

    def _publish(self, seq: Sequence, full: int) -> None:
        """Hash and publish the sequence's blocks before block `full`."""
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            h = self._chain_hash(prev, tokens, seq.salt_until((i + 1) * self.block_size))
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                # The newest copy: an older one with the same content is evicted first (and would take
                # the hash's entry with it, though this block still holds the content).
                self.cached[h] = block.id
            seq.block_hashes.append(h)

    def lend(self, num_tokens: list[int]) -> list[list[int]] | None:
        """Fresh block tables for caches of `num_tokens[i]` tokens that no sequence owns, for calls that run the
        model beside an idle engine (HookedLM.generate's steps with hook functions, vlens.patching's copies);
        None, taking nothing, when too few are free."""
        need = [-(-n // self.block_size) for n in num_tokens]
        if sum(need) > len(self.free) or (self.num_states and len(need) > self.states_free()):
            return None
        tables = [[self._fresh() for _ in range(k)] for k in need]
        if self.num_states:
            for table in tables:
                self.state_of[table[0]] = self._state()
        return tables

    def give_back(self, table: list[int]) -> None:
        """Drop one reference to each block of `table` (last first: the oldest freed is handed out first)."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block_id in self.state_of:
                    self.free_states.append(self.state_of.pop(block_id))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so later prompts are computed from scratch; False (and nothing forgotten)
        while a sequence holds blocks."""
        if len(self.free) < len(self.blocks):
            return False
        self.free_states.extend(self.snapshots.values())
        self.snapshots.clear()
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        return True

    def release(self, seq: Sequence) -> None:
        if seq.state_mark is not None:
            self._leave_mark(seq)
        self.give_back(seq.block_table)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0
        for slot in (seq.state_slot, seq.state_save):
            if slot is not None:
                self.free_states.append(slot)
        if seq.state_source is not None:
            self._unpin(seq.state_source)
        seq.state_slot = seq.state_source = seq.state_save = seq.state_mark = None

    def _leave_mark(self, seq: Sequence) -> None:
        """An ending sequence's state at its last block boundary kept for later prompts, where its blocks up to there
        are published (else its slot goes free)."""
        del self.marks[seq.state_mark]
        full = seq.marked_at // self.block_size
        h = seq.block_hashes[full - 1] if 0 < full <= len(seq.block_hashes) else None
        if h is None or h in self.snapshots:
            self.free_states.append(seq.state_mark)
        else:
            self.snapshots[h] = seq.state_mark
