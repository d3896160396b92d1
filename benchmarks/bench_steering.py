"""Training a steering vector from contrastive pairs: vlens.steering.train_steering_vector against the
steering-vectors library's train_steering_vector on HF's model (its default batch_size=1, and batches of 32,
which it pads), in one run, with the vectors compared.

    .venv/bin/python benchmarks/bench_steering.py [--pairs 256] [--repeats 1]

SmolLM2-135M float32 on this CPU, three layers' residual stream read at each prompt's last token. vlens runs the
2N prompts as one batch of prefill-only requests, each capturing its one row, which stops after the deepest layer
read (no later layer, no unembedding: the library runs whole forwards); the prefix cache is off (a pair's prompts
share a prefix, which the cache would compute once: work of another kind). Timings are the best of --repeats runs
after a warm-up, the cases taking turns.
"""

from __future__ import annotations

import argparse

import torch
from bench_generate import best_alternating, prompts
from steering_vectors import train_steering_vector as library_train
from transformers import AutoModelForCausalLM

from vlens import LLM
from vlens.loader import resolve_model_path
from vlens.steering import train_steering_vector

LAYERS = [6, 10, 14]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    path = resolve_model_path(None)
    llm = LLM(model=str(path), dtype="float32", device="cpu", enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pairs = [(f"{text} I loved every minute of it.", f"{text} I hated it.") for text in prompts(args.pairs)]
    hooks = [f"blocks.{layer}.hook_resid_post" for layer in LAYERS]
    vectors = {}

    def ours():
        vectors["vlens"] = [v for v in train_steering_vector(llm, pairs, hooks).vectors.values()]

    def library(batch_size: int):
        def run():
            trained = library_train(hf, llm.tokenizer, pairs, layers=LAYERS, batch_size=batch_size)
            vectors[f"library, batch {batch_size}"] = [trained.layer_activations[layer] for layer in LAYERS]

        return run

    cases = {"vlens": ours, "library, batch 1": library(1), "library, batch 32": library(32)}
    times = dict(zip(cases, best_alternating(list(cases.values()), args.repeats)))
    tokens = sum(len(llm.tokenizer(p)["input_ids"]) for pair in pairs for p in pair)
    print(f"{args.pairs} pairs ({tokens} prompt tokens), SmolLM2 float32, layers {LAYERS}, last token")
    print(f"{'case':<22}{'seconds':>9}{'pairs/s':>9}{'vs vlens':>10}  vectors vs vlens (max rel. error)")
    for name, seconds in times.items():
        errors = [((a - b).norm() / b.norm()).item() for a, b in zip(vectors[name], vectors["vlens"])]
        ratio = "" if name == "vlens" else f"{seconds / times['vlens']:>9.2f}x"
        print(f"{name:<22}{seconds:>9.2f}{args.pairs / seconds:>9.1f}{ratio:>10}  {max(errors):.1e}")


if __name__ == "__main__":
    main()
