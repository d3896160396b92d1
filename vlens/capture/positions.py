"""`Positions`: which rows of a sequence a capture or an intervention means, parsed once at every boundary.

Row p is the state computed at sequence position p (the one that predicts token p + 1); a request with
a P-token prompt and G generated tokens has rows 0 .. P+G-2. A spec may count from the end ("last",
negative ints, slices with negative bounds), which is only known once the sequence ends: such rows are
gathered as candidates while the sequence runs and chosen at the end (`tail`, `keep`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

KEYWORDS = ("all", "prompt", "generated", "last")
FORMS = (
    '"all", "prompt", "generated", "last", an int, a list of ints, or a slice '
    '(start:stop[:step] on the command line, {"start", "stop", "step"} in JSON); negative counts from the end'
)


def rows_of(prompt_len: int, generated: int) -> int:
    """Rows of a sequence with this prompt and this many generated tokens: one per token fed to the
    model, which is every token but the last generated one (prefill only, generated=0: every prompt token)."""
    return prompt_len + max(generated, 1) - 1


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Positions:
    kind: str  # one of KEYWORDS, "list" or "slice"
    indices: tuple[int, ...] = ()  # "list": in the order given (a Patch pairs them with its value rows)
    start: int | None = None  # "slice": Python's slice over the rows
    stop: int | None = None
    step: int | None = None

    @classmethod
    def parse(cls, value: Any, field: str = "positions") -> Positions:
        """Every form a user may write (Python, command-line string, JSON) -> Positions, or a ValueError
        naming `field` and the allowed forms."""
        if isinstance(value, Positions):
            return value
        if isinstance(value, str):
            return cls._parse_text(value.strip(), field)
        if _int(value):
            return cls("list", (value,))
        if isinstance(value, Mapping) and value and set(value) <= {"start", "stop", "step"}:
            value = slice(value.get("start"), value.get("stop"), value.get("step"))
        if isinstance(value, slice):
            bounds = (value.start, value.stop, value.step)
            if not all(b is None or _int(b) for b in bounds):
                raise ValueError(f"{field}: slice bounds must be ints or None, got {value!r}")
            if value.step is not None and value.step <= 0:
                raise ValueError(f"{field}: slice step must be positive, got {value.step}")
            return cls("slice", start=value.start, stop=value.stop, step=value.step)
        if isinstance(value, Sequence) and value and all(_int(i) for i in value):
            repeated = sorted({i for i in value if list(value).count(i) > 1})
            if repeated:
                raise ValueError(f"{field}: {repeated} appear more than once in {list(value)!r}")
            return cls("list", tuple(value))
        raise ValueError(f"{field}: {value!r} is not a position spec; expected {FORMS}")

    @classmethod
    def _parse_text(cls, text: str, field: str) -> Positions:
        if text in KEYWORDS:
            return cls(text)
        try:
            if ":" in text:
                parts = text.split(":")
                if len(parts) > 3:
                    raise ValueError
                return cls.parse(slice(*(int(p) if p.strip() else None for p in parts)), field)
            return cls.parse([int(p) for p in text.split(",")], field)
        except (TypeError, ValueError) as e:
            if str(e).startswith(field):
                raise
            raise ValueError(f"{field}: {text!r} is not a position spec; expected {FORMS}") from None

    def __str__(self) -> str:
        if self.kind == "list":
            return str(list(self.indices))
        if self.kind == "slice":
            bounds = (self.start, self.stop) if self.step is None else (self.start, self.stop, self.step)
            return ":".join("" if b is None else str(b) for b in bounds)  # (1: is not 1, nor : nothing)
        return self.kind

    # -- counting from the end --------------------------------------------------------------------

    @property
    def from_end(self) -> bool:
        """Whether the spec needs the sequence's end to know its rows."""
        if self.kind == "last":
            return True
        if self.kind == "list":
            return any(i < 0 for i in self.indices)
        return self.kind == "slice" and any(b is not None and b < 0 for b in (self.start, self.stop))

    @property
    def follows_prompt(self) -> bool:
        """Whether its rows depend on where the prompt ends ("prompt", "generated"), not on positions alone."""
        return self.kind in ("prompt", "generated")

    def online(self, field: str) -> Positions:
        """This spec, refused if it counts from the end (interventions change rows as they are computed)."""
        if self.from_end:
            raise ValueError(
                f"{field}: {self} counts from the end, which is unknown while the tokens are computed; "
                'use "all", "prompt", "generated", non-negative ints or a non-negative slice'
            )
        return self

    @property
    def _fixed(self) -> list[int]:
        return [i for i in self.indices if i >= 0]

    @cached_property  # (asked every step: computed once per spec)
    def tail(self) -> int:
        """How many of the newest rows stay candidates until the end ("last": 1, [-3]: 3)."""
        if self.kind == "last":
            return 1
        return max((-i for i in self.indices if i < 0), default=0)

    @cached_property
    def _every_row(self) -> bool:
        """Every row is a candidate: "all", or a slice bounded from the end."""
        return self.kind == "all" or (self.kind == "slice" and self.from_end)

    @property
    def exact(self) -> bool:
        """Whether `candidates` picks exactly the wanted rows, with nothing to drop at the end."""
        return self.kind in ("all", "prompt", "generated") or not (self.tail or self._every_row)

    # -- rows of a sequence with a `prompt_len`-token prompt ----------------------------------------

    def window(self, prompt_len: int) -> tuple[int, float] | None:
        """[lo, hi): the candidate rows as one run fixed by the prompt's length ("all", "prompt",
        "generated", a slice of step 1 or bounded from the end); None when they are not one run. A row
        stream keeps it, so a step's selection is one range."""
        if self._every_row:
            return 0, math.inf
        if self.kind == "prompt":
            return 0, prompt_len
        if self.kind == "generated":
            return prompt_len, math.inf
        if self.kind == "slice" and (self.step or 1) == 1:
            return self.start or 0, math.inf if self.stop is None else self.stop
        return None

    def candidates(self, start: int, end: int, prompt_len: int) -> Sequence[int]:
        """Rows in [start, end) that may be wanted: exact where the spec allows, else a superset."""
        if end <= start:
            return range(0)
        run = self.window(prompt_len)
        if run is not None:
            return range(max(start, run[0]), min(end, run[1]))
        if self.kind == "slice":
            first, step = self.start or 0, self.step or 1
            lo = max(start, first)
            lo += -(lo - first) % step
            return range(lo, end if self.stop is None else min(end, self.stop), step)
        tail_from = end - self.tail if self.tail else end
        return sorted({i for i in self._fixed if start <= i < end} | set(range(max(start, tail_from), end)))

    def first_needed(self, prompt_len: int) -> int:
        """No row before this can be wanted, so KV up to it may come from the prefix cache."""
        if self.kind == "generated":
            return prompt_len
        if self.kind in ("list", "last"):
            near_end = [max(0, prompt_len - self.tail)] if self.tail else []
            return min(self._fixed + near_end, default=0)
        if self.kind == "slice" and not self._every_row:
            return self.start or 0
        return 0

    def keep(self, positions: list[int], num_rows: int) -> torch.Tensor | None:
        """Mask over collected `positions` (ascending): those the spec selects once the sequence has `num_rows`
        rows; None when it selects them all."""
        if self.kind in ("all", "prompt", "generated"):  # chosen exactly as they were computed
            if not positions or positions[-1] < num_rows:  # (the usual case: no mask, no tensor op)
                return None
            return torch.tensor(positions) < num_rows
        at = torch.tensor(positions, dtype=torch.long)
        if self.kind == "last":
            keep = at == num_rows - 1
        elif self.kind == "slice":
            keep = torch.isin(at, torch.arange(num_rows)[slice(self.start, self.stop, self.step)])
        else:
            keep = torch.isin(at, torch.tensor([i if i >= 0 else num_rows + i for i in self.indices], dtype=torch.long))
        return None if bool(keep.all()) else keep

    def tail_obsolete(self, positions: Sequence[int], newest: int) -> bool:
        """True when none of these collected positions (ascending) can still be wanted: they were only
        tail candidates, and newer rows have pushed them out of the tail."""
        if not self.tail or self._every_row:
            return False
        return positions[-1] <= newest - self.tail and not any(i in positions for i in self._fixed)

    def max_rows(self, prompt_len: int, max_tokens: int) -> int:
        """The most rows this spec can select from a request of at most rows_of(P, max_tokens) rows."""
        most = rows_of(prompt_len, max_tokens)
        if self.kind == "all":
            return most
        if self.kind == "prompt":
            return min(prompt_len, most)
        if self.kind == "generated":
            return max(0, max_tokens - 1)
        if self.kind == "last":
            return 1
        if self.kind == "slice":  # negative bounds select more from a shorter sequence: try each length
            return max(len(range(n)[slice(self.start, self.stop, self.step)]) for n in range(1, most + 1))
        return min(len(self.indices), most)

    def check_range(self, max_rows: int, field: str, prompt_len: int, max_tokens: int) -> None:
        """A list naming rows the request can never have is an error before it runs."""
        bad = [i for i in self.indices if not -max_rows <= i < max_rows]
        if bad:
            raise ValueError(
                f"{field}: {bad} out of range; a {prompt_len}-token prompt with max_tokens={max_tokens} has at "
                f"most {max_rows} rows (positions 0..{max_rows - 1}, or -{max_rows}..-1 from the end)"
            )

    def explicit_rows(self, prompt_len: int) -> list[int] | None:
        """The rows in the spec's own order when it names a fixed set ("prompt", a list, a bounded
        non-negative slice); None when open-ended. A multi-row Patch pairs its value rows with these."""
        if self.kind == "list":
            return list(self.indices)
        if self.kind == "prompt":
            return list(range(prompt_len))
        if self.kind == "slice" and self.stop is not None and not self.from_end:
            return list(range(self.start or 0, self.stop, self.step or 1))
        return None
