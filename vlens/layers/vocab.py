"""The vocabulary ends of the model, split by rows across tensor-parallel ranks (vlens.distributed).

`VocabEmbedding` holds rows [start, stop) of the table: a token outside them looks up zeros and the
ranks' lookups are summed, which adds exact zeros, so hook_embed is the unsharded value bit for bit.
`LMHead` computes this rank's logits and joins the ranks' pieces into the whole vocabulary on rank 0,
where every consumer of logits (sampling, the logits hook, the logit lens) runs and sees all of it; the
other ranks send their piece and receive nothing. Each rank allocates
ceil(V / size) rows; the last rank's rows past V are never read. In one process both are the plain
nn.Embedding / nn.Linear they replace (the head's bias, where the model has one, split by rows too: Phi's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlens.distributed.parallel import SINGLE, Parallel, all_reduce, gather_to_first
from vlens.layers.checkpoint import Slot


class _VocabRows(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel):
        super().__init__()
        self.vocab_size, self.parallel = vocab_size, parallel
        self.rows, allocated = parallel.rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(allocated, hidden_size))

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        params = {name: p for name, p in self.named_parameters(recurse=False)}  # weight (and the head's bias)
        if self.parallel.size == 1:
            return {f"{path}.{name}": Slot(p) for name, p in params.items()}
        rows = slice(self.rows.start, self.rows.stop)
        return {f"{path}.{name}": Slot(p, slice(0, len(self.rows)), None, (rows,)) for name, p in params.items()}


class VocabEmbedding(_VocabRows):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        mine = (local >= 0) & (local < len(self.rows))
        x = F.embedding(local.clamp(0, len(self.rows) - 1), self.weight)
        return all_reduce(x.masked_fill(~mine[:, None], 0.0), self.parallel)


class LMHead(_VocabRows):
    def __init__(self, hidden_size: int, vocab_size: int, parallel: Parallel = SINGLE, bias: bool = False):
        super().__init__(vocab_size, hidden_size, parallel)
        self.bias = nn.Parameter(torch.empty(self.weight.shape[0])) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight, self.bias)
        if self.parallel.size == 1:
            return logits
        return gather_to_first(logits, -1, self.parallel)[..., : self.vocab_size]
