"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and hash-chained prefix caching.

A full block is identified by the hash of (previous block's hash, its tokens, the sequence's cache
salt), so a block is reused only behind an identical prefix computed under identical conditions.
Freed blocks keep their hash until handed out again, so a preempted or repeated prompt finds them.

A model with layers that keep a state per sequence (Qwen 3.5's linear attention, LFM2's short convolutions;
vlens.layers.slot_states) keeps it in one of `num_states` state slots: each block table holds one from its first
block on (`state_of`: first block -> slot) until that block is freed. Such a state is of a whole prefix and cannot
be rebuilt from blocks, so such models cache no prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from vlens.engine.sequence import Sequence


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
        self.enable_prefix_caching = enable_prefix_caching and not num_states
        self.num_states = num_states
        self.free_states = list(range(num_states))[::-1]  # (popped from the end: slot 0 first)
        self.state_of: dict[int, int] = {}  # a block table's first block -> the table's state slot

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
        prev = None
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = self._chain_hash(prev, tokens, seq.salt_until((i + 1) * self.block_size))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed = len(seq.block_table) * self.block_size

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
        first = need > 0 and not seq.block_table and self.num_states
        if need > len(self.free) or (first and not self.free_states):
            return False
        for _ in range(need):
            seq.block_table.append(self._fresh())
        if first:
            self.state_of[seq.block_table[0]] = self.free_states.pop()
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
        if sum(need) > len(self.free) or (self.num_states and len(need) > len(self.free_states)):
            return None
        tables = [[self._fresh() for _ in range(k)] for k in need]
        if self.num_states:
            for table in tables:
                self.state_of[table[0]] = self.free_states.pop()
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
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        return True

    def release(self, seq: Sequence) -> None:
        self.give_back(seq.block_table)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0
