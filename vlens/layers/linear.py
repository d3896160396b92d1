"""Linear layers that know how their checkpoint stores them, and projections of one input fused
into one GEMM (q/k/v, gate/up): fewer, larger matmuls per layer.

Llama-style checkpoints keep the fused parts apart (q_proj, k_proj, ...): each part loads into its
row range. Phi-3, GPT-2 and GPT-NeoX store them fused; GPT-2 stores weights transposed (Conv1D) and
NeoX interleaves q/k/v per head, which `transforms` undo at load time so the forward stays plain.

Under tensor parallelism (`parallel`, vlens.distributed) they are Megatron's pair: a `FusedLinear`
(or `ColumnLinear`) holds this rank's output rows of every part, in units (heads) so a part with
fewer heads than ranks is replicated; a `RowLinear` holds the matching input columns and sums its
output over the ranks, once, before its bias. Each loads only its rows or columns of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from vlens.distributed.parallel import SINGLE, Parallel, all_reduce
from vlens.layers.checkpoint import Slot, Transform
from vlens.layers.lora import LoraWeights


class StoredLinear(nn.Linear):
    """nn.Linear whose checkpoint tensors need a transform per leaf ("weight", "bias") to load; and which LoRA
    adapters may update (`lora`, set by vlens.engine.lora once an adapter adapts this projection)."""

    lora: LoraWeights | None = None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, transforms: Mapping[str, Transform] | None = None
    ):
        super().__init__(in_features, out_features, bias=bias)
        self.transforms = dict(transforms or {})

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        return {f"{path}.{leaf}": Slot(p, None, self.transforms.get(leaf)) for leaf, p in self.named_parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)


class FusedLinear(StoredLinear):
    """Several projections of one input as one GEMM; `split` cuts the output back into the parts.

    `stored_fused`: the checkpoint holds one tensor under this module's own name (Phi-3, GPT-2,
    NeoX); otherwise one tensor per part, named by the keys of `parts` next to this module.
    `units`: how many heads each part has (default: one per row), the grain of the tensor-parallel split."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        bias: bool,
        stored_fused: bool = False,
        transforms: Mapping[str, Transform] | None = None,
        parallel: Parallel = SINGLE,
        units: Mapping[str, int] | None = None,
    ):
        # part name -> this rank's rows of the part, counted from the part's first row
        self.shards: dict[str, range] = {}
        for name, size in parts.items():
            n = (units or {}).get(name, size)
            mine, per = parallel.units(n), size // n
            self.shards[name] = range(mine.start * per, mine.stop * per)
        self.global_parts = dict(parts)
        self.parts = {name: len(rows) for name, rows in self.shards.items()}  # part name -> local rows, in order
        super().__init__(in_features, sum(self.parts.values()), bias, transforms)
        self.stored_fused = stored_fused
        self.parallel = parallel

    def part_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, size in self.parts.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        sharded = self.parallel.size > 1
        if self.stored_fused:
            source = None
            if sharded:  # this rank's rows of every part, in the fused (vlens-layout) tensor
                starts = accumulate(self.global_parts.values(), initial=0)
                rows = [start + r for start, shard in zip(starts, self.shards.values()) for r in shard]
                source = (torch.tensor(rows),)
            params = self.named_parameters()
            return {f"{path}.{leaf}": Slot(p, None, self.transforms.get(leaf), source) for leaf, p in params}
        parent, slots = path.rpartition(".")[0], {}
        for part, rows in self.part_rows().items():
            shard = self.shards[part]
            source = (slice(shard.start, shard.stop),) if sharded else None  # this rank's rows of the part's tensor
            for leaf, p in self.named_parameters():
                slots[f"{parent}.{part}.{leaf}"] = Slot(p, rows, self.transforms.get(leaf), source)
        return slots

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.parts.values()), dim=-1)


class ColumnLinear(FusedLinear):
    """One projection whose output rows are split across ranks (GPT-2's c_fc, NeoX's dense_h_to_4h); `units`: its
    heads, where it projects heads (default: one per row)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, parallel: Parallel = SINGLE,
        transforms: Mapping[str, Transform] | None = None, units: int | None = None,
    ):  # fmt: skip
        units_of = None if units is None else {"out": units}
        super().__init__(in_features, {"out": out_features}, bias, True, transforms, parallel, units_of)


class RowLinear(StoredLinear):
    """The projection after a column-split one (o_proj, down_proj): this rank's input columns, its
    partial output summed over the ranks, then the bias once. `units`: heads of the input (default:
    one per column). In one process it is nn.Linear, bias fused as before."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, parallel: Parallel = SINGLE,
        units: int | None = None, transforms: Mapping[str, Transform] | None = None,
    ):  # fmt: skip
        n = units or in_features
        mine = parallel.units(n)
        per = in_features // n
        self.columns = slice(mine.start * per, mine.stop * per)
        super().__init__(self.columns.stop - self.columns.start, out_features, bias, transforms)
        self.parallel = parallel

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        slots = super().checkpoint_slots(path)
        if self.parallel.size > 1:
            w = slots[f"{path}.weight"]
            slots[f"{path}.weight"] = Slot(w.param, None, w.transform, (slice(None), self.columns))
        return slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return super().forward(x)
        y = F.linear(x, self.weight)
        if self.lora is not None:  # (this rank's columns of A: a partial update, summed over the ranks with y)
            y = self.lora(x, y)
        y = all_reduce(y, self.parallel)
        return y if self.bias is None else y + self.bias
