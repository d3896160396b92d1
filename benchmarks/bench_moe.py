"""Benchmark: routed experts, vlens against HF Transformers in the same run, on random-weight MoE models of two
shapes (no download): Mixtral's (8 experts, top 2) and gpt-oss's (32 experts, top 4, biases, sinks), 4 layers,
d_model 512, expert width 512.

  prefill   a packed trace of 8 prompts x 256 tokens to the logits (vlens.LLM.trace) against HF's forward of the
            same 8 x 256 batch (no padding: every prompt has the same length, HF's best case)
  decode    greedy generation of 32 tokens for 8 prompts of 64 tokens through the engine against HF generate
For each, vlens's experts both ways: torch's grouped GEMM (the default where it runs) and every expert on every
token (what a compiled float32 forward takes). The script checks the logits agree and prints times and ratios.

Run:  .venv/bin/python benchmarks/bench_moe.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from bench_generate import best
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig

from vlens import LLM, SamplingParams
from vlens.layers import moe

SIZES = dict(vocab_size=4096, hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
MODELS = {
    "mixtral 8 x top-2": lambda: MixtralConfig(**SIZES, num_local_experts=8, num_experts_per_tok=2),
    "gpt-oss 32 x top-4": lambda: GptOssConfig(**SIZES, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                               sliding_window=128),  # fmt: skip
}


def run(name: str, config, root: Path, repeats: int) -> None:
    path = root / name.split()[0]
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=8)
    g = torch.Generator().manual_seed(0)
    long = torch.randint(0, SIZES["vocab_size"], (8, 256), generator=g)
    short = torch.randint(0, SIZES["vocab_size"], (8, 64), generator=g)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with torch.inference_mode():
        ref = hf(long[:1]).logits[0]
        hf_prefill = best(lambda: hf(long), repeats)
        hf_decode = best(lambda: hf.generate(short, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                             pad_token_id=0), repeats)  # fmt: skip
    got = llm.trace([long[0].tolist()], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    err = ((got - ref).norm() / ref.norm()).item()
    rows = {}
    grouped = moe.grouped_gemm_runs
    for way, runs in (("grouped GEMM", grouped), ("every expert", lambda x, n: False)):
        moe.grouped_gemm_runs = runs
        try:
            prefill = best(lambda: llm.trace(long.tolist(), hooks="unembed.hook_out"), repeats)
            decode = best(lambda: llm.generate(short.tolist(), greedy, use_tqdm=False), repeats)
        finally:
            moe.grouped_gemm_runs = grouped
        rows[way] = (prefill, decode)
    print(f"\n{name}: logits within {err:.1e} of HF's")
    print(f"  HF                  prefill {hf_prefill:6.2f} s              decode {hf_decode:6.2f} s")
    for way, (prefill, decode) in rows.items():
        print(f"  vlens {way:<12}  prefill {prefill:6.2f} s ({prefill / hf_prefill:.2f}x HF)   "
              f"decode {decode:6.2f} s ({decode / hf_decode:.2f}x HF)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        for name, config in MODELS.items():
            run(name, config(), Path(root), args.repeats)


if __name__ == "__main__":
    main()
