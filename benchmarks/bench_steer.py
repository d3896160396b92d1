"""Steering cost: a 64-prompt batch where every request carries its own steering vector, against the
same batch unsteered, in one run.

    .venv/bin/python benchmarks/bench_steer.py [--prompts 64] [--tokens 32] [--repeats 2]

SmolLM2-135M float32 on this CPU, greedy, ignore_eos so both runs do the same work. Each request
steers blocks.10.hook_resid_post at every position with a different random vector. Target: the
steered batch takes at most 1.10x the time of the plain one.
"""

from __future__ import annotations

import argparse

import torch
from bench_generate import best, prompts

from vlens import LLM, SamplingParams, Steer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(dtype="float32", device="cpu")
    texts = prompts(args.prompts)
    g = torch.Generator().manual_seed(0)
    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    steered = [
        SamplingParams(
            max_tokens=args.tokens, temperature=0, ignore_eos=True,
            interventions=[Steer("blocks.10.hook_resid_post", torch.randn(llm.config.hidden_size, generator=g), scale=2.0)],
        )
        for _ in texts
    ]
    t_plain = best(lambda: llm.generate(texts, plain, use_tqdm=False), args.repeats)
    t_steer = best(lambda: llm.generate(texts, steered, use_tqdm=False), args.repeats)
    tokens = args.prompts * args.tokens
    print(f"\nSmolLM2-135M float32, CPU, {args.prompts} prompts x {args.tokens} new tokens")
    print(f"{'case':<40}{'tok/s':>10}{'time ratio':>12}  target")
    print(f"{'no steering':<40}{tokens / t_plain:>10.1f}{1.0:>11.2f}x")
    print(f"{'a different Steer per request':<40}{tokens / t_steer:>10.1f}{t_steer / t_plain:>11.2f}x  <= 1.10x")


if __name__ == "__main__":
    main()
