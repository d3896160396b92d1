"""Per-request row collection: which positions a Capture wants, and the rows gathered so far."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlens.engine.capture import Readout


@dataclass(frozen=True)
class RowSelector:
    """Which rows (sequence positions) a Capture wants, decided in two stages.

    Online, `candidates` picks from the rows a step computes a superset of what may be wanted
    (negative indices are unknowable until the sequence ends, so the last `tail` rows of each step
    stay candidates); at the end, `keep` says which of the collected positions the spec means."""

    spec: object  # "all" | "prompt" | "generated" | list[int] | slice, as validated by Capture
    prompt_len: int

    @property
    def tail(self) -> int:
        if self.spec == "last":
            return 1
        if isinstance(self.spec, list):
            return max([-p for p in self.spec if p < 0], default=0)
        return 0

    def _online_all(self) -> bool:
        s = self.spec
        return s == "all" or (isinstance(s, slice) and any(v is not None and v < 0 for v in (s.start, s.stop)))

    def candidates(self, start: int, end: int) -> torch.Tensor:
        """Positions in [start, end) to gather now."""
        s, p = self.spec, self.prompt_len
        span = torch.arange(start, max(start, end))
        if self._online_all():
            return span
        if s == "prompt":
            return span[span < p]
        if s == "generated":
            return span[span >= p]
        if isinstance(s, slice):
            first, step = s.start or 0, s.step or 1
            hit = (span >= first) & ((span - first) % step == 0)
            return span[hit & (span < s.stop)] if s.stop is not None else span[hit]
        fixed = torch.tensor([q for q in s if q >= 0] if isinstance(s, list) else [], dtype=torch.long)
        return span[torch.isin(span, fixed) | (span >= end - self.tail)]

    @property
    def exact(self) -> bool:
        """Whether candidates() picks exactly the wanted rows, with nothing to drop at the end."""
        return self.spec in ("all", "prompt", "generated") or (not self.tail and not self._online_all())

    def first_needed(self) -> int:
        """No row before this position can be wanted: KV up to it may come from the prefix cache."""
        s = self.spec
        if s == "generated":
            return self.prompt_len
        if isinstance(s, list):
            fixed = [q for q in s if q >= 0]
            return min(fixed + ([max(0, self.prompt_len - self.tail)] if self.tail else []), default=0)
        if isinstance(s, slice) and not self._online_all():
            return s.start or 0
        return 0

    def keep(self, positions: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Mask over collected `positions`: those the spec selects among rows 0 .. num_rows-1."""
        s = self.spec
        if s in ("all", "prompt", "generated"):
            return positions < num_rows  # online selection was already exact
        if s == "last":
            return positions == num_rows - 1
        if isinstance(s, slice):
            wanted = torch.arange(num_rows)[s]
        else:
            wanted = torch.tensor([q if q >= 0 else num_rows + q for q in s], dtype=torch.long)
        return torch.isin(positions, wanted)

    def tail_obsolete(self, positions: torch.Tensor, newest: int) -> bool:
        """True when none of these collected positions can still be wanted (only tail candidates that
        newer rows have pushed out of the tail)."""
        if not self.tail or self._online_all():
            return False
        fixed = torch.tensor([q for q in self.spec if q >= 0] if isinstance(self.spec, list) else [], dtype=torch.long)
        return bool((positions <= newest - self.tail).all()) and not bool(torch.isin(positions, fixed).any())


@dataclass
class RowStream:
    """One set of taps collected at one position spec (a Capture, or the hidden-states shortcut)."""

    kind: str  # "capture" | "hidden_states"
    hooks: dict[str, str]  # requested name -> canonical tap
    selector: RowSelector
    shapes: dict[str, tuple[int, ...]]  # canonical tap -> per-row shape of what is returned
    exclude: frozenset[int] = frozenset()
    dtype: torch.dtype | None = None
    readout: Readout | None = None  # on-device transform of each step's rows (probe, logit lens)
    reduce: str = "none"  # "mean": one row, the mean over the selected rows
    logit_lens: int | None = None  # top-k of the logit lens: rows are (token ids, log-probabilities)
    captured_upto: int = 0  # rows below this position were offered to capture already
    positions: list[torch.Tensor] = field(default_factory=list)
    rows: dict[str, list] = field(default_factory=dict)

    @property
    def taps(self) -> list[str]:
        return sorted(set(self.hooks.values()))

    @property
    def sums_on_device(self) -> bool:
        """Mean readouts add up each step's rows on the device when no row can be dropped later."""
        return self.reduce == "mean" and self.selector.exact

    def select(self, token_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Positions of a step's rows [start, end) to gather: wanted, new, and not excluded."""
        pos = self.selector.candidates(max(start, self.captured_upto), end)
        if self.exclude and len(pos):
            tokens = torch.tensor(token_ids[start:end], dtype=torch.long)[pos - start]
            pos = pos[~torch.isin(tokens, torch.tensor(sorted(self.exclude), dtype=torch.long))]
        return pos

    def add(self, positions: torch.Tensor, tap_rows: dict[str, object]) -> None:
        self.positions.append(positions)
        for tap, rows in tap_rows.items():
            self.rows.setdefault(tap, []).append(rows)
        newest = int(positions[-1])
        while len(self.positions) > 1 and self.selector.tail_obsolete(self.positions[0], newest):
            self.positions.pop(0)
            for pieces in self.rows.values():
                pieces.pop(0)

    def result(self, num_rows: int, model_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, object]]:
        """(positions, {requested name: rows or (ids, logprobs)}) per the spec, once the sequence has
        `num_rows` rows."""
        positions = torch.cat(self.positions) if self.positions else torch.empty(0, dtype=torch.long)
        keep = self.selector.keep(positions, num_rows)
        dtype = self.dtype or model_dtype
        out: dict[str, object] = {}
        for tap in self.taps:
            pieces = self.rows.get(tap)
            shape = self.shapes[tap]  # per-row shape of what is returned (after any projection)
            if not pieces and self.logit_lens:
                out[tap] = (torch.empty(0, self.logit_lens, dtype=torch.long), torch.empty(0, self.logit_lens))
            elif not pieces:
                out[tap] = torch.empty(0, *shape, dtype=dtype)
            elif self.sums_on_device:
                out[tap] = (sum(p.double() for p in pieces) / len(positions)).to(dtype)
            elif isinstance(pieces[0], tuple):
                out[tap] = tuple(torch.cat(parts)[keep] for parts in zip(*pieces))
            else:
                rows = torch.cat(pieces)[keep]
                out[tap] = rows.mean(0, keepdim=True) if self.reduce == "mean" and len(rows) else rows
        return positions[keep], {name: out[tap] for name, tap in self.hooks.items()}
