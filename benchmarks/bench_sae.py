"""SAE features in the batch: every request asks the top-32 latents of a 16k-latent SAE at one layer at
all its generated positions, against the same batch asking nothing, in one run; and the peer, HF
`generate` with a forward hook that encodes each decode step's new rows and keeps their top latents.

    .venv/bin/python benchmarks/bench_sae.py [--prompts 64] [--tokens 64] [--d-sae 16384] [--top-k 32] [--repeats 1]

SmolLM2-135M float32 on this CPU, greedy, ignore_eos (HF: min_new_tokens) so every run does the same
work. The SAE is a random standard (ReLU) SAE at blocks.10.hook_resid_post, d_in 576. vlens encodes
each step's gathered rows of all requests in one matmul on the device and copies off only ids and
values; the HF hook encodes the step's rows the same way (`SAE.encode`, the same formula) and copies
its top latents to the host every step. Target: vlens with features takes at most 1.15x the time of
vlens without. Timings are the best of --repeats runs after a warm-up.
"""

from __future__ import annotations

import argparse

import torch
from bench_generate import HFGreedy, best, print_versus, prompts

from vlens import LLM, SAE, Capture, SamplingParams
from vlens.loader import resolve_model_path

LAYER = 10


def random_sae(d_in: int, d_sae: int, hook: str = f"blocks.{LAYER}.hook_resid_post", **config) -> SAE:
    """A random standard SAE (`config`: SAE's other fields, e.g. hook_out= for a transcoder)."""
    g = torch.Generator().manual_seed(0)
    return SAE(
        W_enc=torch.randn(d_in, d_sae, generator=g) / d_in**0.5, b_enc=torch.randn(d_sae, generator=g) * 0.1,
        W_dec=torch.randn(d_sae, d_in, generator=g) / d_sae**0.5, b_dec=torch.randn(d_in, generator=g) * 0.1,
        hook=hook, **config,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    path = resolve_model_path(None)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    sae = random_sae(llm.config.hidden_size, args.d_sae)
    texts = prompts(args.prompts)

    def sp(capture=None):
        return SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, capture=capture)

    features = sp(Capture(sae=sae, top_k=args.top_k, positions="generated"))
    t_plain = best(lambda: llm.generate(texts, sp(), use_tqdm=False), args.repeats)
    t_sae = best(lambda: llm.generate(texts, features, use_tqdm=False), args.repeats)

    hf = HFGreedy(path, texts, args.tokens)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def encode_step(module, args_, output):
        if output.shape[1] == 1:  # a decode step: its one row per sequence is a generated position
            values, ids = sae.encode(output[:, 0]).topk(args.top_k, dim=-1)
            kept.append((ids.to(torch.int32).cpu(), values.cpu()))

    def encoding(model):
        kept.clear()
        return model.model.layers[LAYER].register_forward_hook(encode_step)

    t_hf = best(hf, args.repeats)
    t_hf_sae = best(lambda: hf(encoding), args.repeats)
    print(f"\nSmolLM2-135M float32, CPU ({torch.get_num_threads()} threads), {args.prompts} prompts x {args.tokens} "
          f"new tokens; SAE d_sae={args.d_sae} at blocks.{LAYER}.hook_resid_post, top-{args.top_k} at generated rows")  # fmt: skip
    cases = ("vlens, no features", "vlens, top-k features (time vs no features)", "HF generate, no hook",
             "HF generate + per-step encoding hook (time)", "vlens features vs HF hook (speed)")  # fmt: skip
    print_versus(args.prompts * args.tokens, (t_plain, t_sae, t_hf, t_hf_sae), cases, "<= 1.15x")


if __name__ == "__main__":
    main()
