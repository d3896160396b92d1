"""The runner's step buffers: every field a view of one block, at an address that stays from step to step
(what a replayed CUDA graph reads), values as put (cast to the field's dtype), and a field that grows
mid-step leaves the fronts already handed out with their values."""

from __future__ import annotations

import numpy as np
import torch

from vlens.engine.buffers import StepBuffers

CPU = torch.device("cpu")


def test_put_writes_in_place_at_fixed_addresses():
    buffers = StepBuffers({"ids": ((8,), torch.long), "cu": ((5,), torch.int32), "p": ((2, 4), torch.float32)}, CPU)
    first = buffers.put("ids", np.array([3, 1, 4], np.int64))
    cu = buffers.put("cu", np.array([0, 2, 7], np.int64))  # cast to the field's int32
    floats = buffers.put("p", torch.tensor([[0.5, 1.5], [2.5, 3.5]]))
    buffers.flush()
    assert first.tolist() == [3, 1, 4] and cu.dtype == torch.int32 and cu.tolist() == [0, 2, 7]
    assert floats.shape == (2, 2) and floats.tolist() == [[0.5, 1.5], [2.5, 3.5]]
    second = buffers.put("ids", np.array([9, 2], np.int64))  # the next step: the same address
    buffers.flush()
    assert second.data_ptr() == first.data_ptr() and second.tolist() == [9, 2]
    blocks = {t.untyped_storage().data_ptr() for t in (first, cu, floats)}
    assert len(blocks) == 1  # one block: one copy a step sends all of it


def test_growth_mid_step_keeps_what_was_put():
    buffers = StepBuffers({"a": ((4,), torch.long), "b": ((4,), torch.long)}, CPU)
    generation = buffers.generation
    a = buffers.put("a", np.arange(4))
    b = buffers.put("b", np.arange(10, 20))  # larger than its field: every field moves to a new block
    buffers.flush()
    assert buffers.generation == generation + 1
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == list(range(10, 20))
    assert buffers.put("a", np.arange(4)).data_ptr() != a.data_ptr()
    buffers.reserve("tables", 6, torch.long)  # a new field joins the block
    assert buffers.put("tables", np.ones((2, 3), np.int64)).tolist() == [[1, 1, 1], [1, 1, 1]]

