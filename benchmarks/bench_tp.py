"""Tensor parallelism on this machine's CPU: two ranks (gloo) against one process, in one run.

    .venv/bin/python benchmarks/bench_tp.py [--prompts 8] [--prompt-len 64] [--tokens 32] [--threads 1]

A random Llama (8 layers, d=512, 8 heads, 4 KV heads, MLP 1536, vocabulary 8192; float32) saved to a
temporary directory; every process gets --threads threads. Rows:
  prefill / decode step     ms per engine step with one process and with two ranks, and the ratio
  communication             ms per step that rank 0 spends inside collectives (all-reduce after each
                            row-parallel projection and the embedding, the LM head's gather to rank 0), which
                            includes waiting for the other rank, and its share of the two-rank step
  group start / stop        seconds to open an LLM (one process; two ranks: the first group of the process,
                            whose worker the fork server starts cold, then a later one) and to close it
On two cores the two ranks compete with each other and with nothing to gain: the split does not make a
step faster here; what the numbers show is what the collectives cost. On a machine with several GPUs
(NCCL), tokens/s against one GPU is the figure to read (`benchmarks/gpu_suite.py` style runs).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Self

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from vlens import LLM, SamplingParams
from vlens.engine.llm_engine import NewRequest

CONFIG = {
    "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
}  # fmt: skip


class CollectiveClock:
    """Wall time rank 0 spends in torch.distributed collectives while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: dict[str, Callable] = {}

    def _timed(self, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return run

    def __enter__(self) -> Self:
        for name in ("all_reduce", "all_gather", "gather", "broadcast"):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._timed(self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def steps(
    llm: LLM, prompts: list[list[int]], tokens: int, clock: CollectiveClock | None = None
) -> list[tuple[float, float]]:
    """(ms, ms inside collectives) of each engine step of one batch: the prefill first, then the decodes."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.add_requests([NewRequest(p, params) for p in prompts])
    out = []
    while engine.has_work():
        comm, start = clock.seconds if clock else 0.0, time.perf_counter()
        engine.step()
        out.append(((time.perf_counter() - start) * 1e3, ((clock.seconds if clock else 0.0) - comm) * 1e3))
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    vocab = CONFIG["vocab_size"]
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).save_pretrained(tmp)
        settings = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 256 << 20, "max_num_batched_tokens": 4096}
        start = time.perf_counter()
        one = LLM(tmp, **settings)
        opened = [(time.perf_counter() - start, 0.0)]
        for _ in range(2):  # the first group of this process, then a later one
            start = time.perf_counter()
            group = LLM(tmp, tensor_parallel_size=2, **settings)
            up = time.perf_counter()
            group.close()
            opened.append((up - start, time.perf_counter() - up))
        steps(one, prompts[:2], 2)  # warm-up
        single = steps(one, prompts, args.tokens)
        two = LLM(tmp, tensor_parallel_size=2, **settings)
        steps(two, prompts[:2], 2)
        with CollectiveClock() as clock:
            split = steps(two, prompts, args.tokens, clock)
        two.model.executor.close()
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.tokens} new, {args.threads} thread(s) per rank")
    print(f"{'':20}{'1 process':>12}{'2 ranks':>12}{'ratio':>8}{'comm ms':>10}{'comm share':>12}")
    for name, a, b in (("prefill step (ms)", single[:1], split[:1]), ("decode step (ms)", single[1:], split[1:])):
        t1, t2, comm = _mean([t for t, _ in a]), _mean([t for t, _ in b]), _mean([c for _, c in b])
        print(f"{name:20}{t1:12.2f}{t2:12.2f}{t2 / t1:8.2f}{comm:10.2f}{comm / t2:12.1%}")
    (alone, _), (first, first_stop), (later, later_stop) = opened
    print(f"group start (s): 1 process {alone:.2f}; 2 ranks, the process's first {first:.2f}, a later one {later:.2f} "
          f"({later / first:.2f}x the first); stop {first_stop:.2f} / {later_stop:.2f}")


if __name__ == "__main__":
    main()
