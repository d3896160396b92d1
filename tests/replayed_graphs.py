"""CUDA graphs' semantics on the CPU, for the runner's graph path: what a capture bakes in is the tensors
it read, and a replay reads whatever the host has written into those very tensors since. A step whose
inputs are not where its graph reads them (a buffer that moved, a view that changed) then replays stale
inputs here as it would on a GPU, where the tests cannot run graphs."""

from __future__ import annotations

import copy
from functools import partial

from vlens.engine.model_runner import ModelRunner


class ReplayedCall:
    """Stands in for a captured torch.cuda.CUDAGraph: `replay` runs the captured forward again on the
    captured tensors and updates its output in place."""

    def __init__(self, runner: ModelRunner, meta, ids, taps, lora):
        frozen = {name: copy.copy(t) for name, t in taps.items()}  # the views each tap read when captured
        self.run = partial(runner._forward, meta, ids, frozen, None, slice(None), runner.decode_backend, lora=lora)
        self.logits = self.run()[1].clone()

    def replay(self) -> None:
        self.logits.copy_(self.run()[1])


def replay_graphs(runner: ModelRunner) -> None:
    """Turn the runner's graph path on, with ReplayedCall for CUDA's capture."""

    def capture(meta, ids, taps, lora):
        graph = ReplayedCall(runner, meta, ids, taps, lora)
        runner.graph_stats.graphs_captured += 1
        return graph, graph.logits

    runner._capture = capture
    runner.graphs = runner.static_decode = runner.pad_decode = True
