"""LoRA adapters beside the base model, in one run: a random Llama of SmolLM2's widths (8 layers), two PEFT adapters
of rank 16 on every projection of every layer, 48 prompts of 16-128 tokens x 32 new tokens, greedy.

    .venv/bin/python benchmarks/bench_lora.py [--repeats 2]

Cases: vlens, the base model alone; vlens, a third of the prompts under each adapter and a third under none, in one
batch (LLM(enable_lora=True), generate's lora_request per prompt); HF + PEFT on the same mix: the prompts of each
adapter (and the base model's, adapters disabled) in their own left-padded `generate`; and HF + PEFT in one batch
with PEFT's mixed-adapter inference (`adapter_names` per row). Output tokens/s and ratios; the mixed runs' greedy
tokens are compared with PEFT's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from bench_generate import best_alternating, left_padded, random_prompts
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from vlens import LLM, LoRARequest, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")
    requests = []
    for i in range(2):
        torch.manual_seed(i + 1)
        hf = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(hf, lora).save_pretrained(root / f"adapter{i}")
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(root / f"adapter{i}")))
    hf = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(hf, requests[0].lora_path, adapter_name="adapter0")
    peft.load_adapter(requests[1].lora_path, adapter_name="adapter1")
    peft.eval()
    llm = LLM(str(root / "base"), dtype="float32", device="cpu", enable_prefix_caching=False, enable_lora=True,
              max_loras=2)  # fmt: skip
    prompts = random_prompts(48, 16, 128)
    loras = [[None, requests[0], requests[1]][i % 3] for i in range(len(prompts))]
    names = ["__base__" if r is None else r.lora_name for r in loras]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    steps = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)

    def hf_grouped() -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(prompts)
        for name in ("__base__", "adapter0", "adapter1"):
            rows = [i for i, n in enumerate(names) if n == name]
            ids, mask = left_padded([prompts[i] for i in rows])
            with torch.inference_mode():
                if name == "__base__":
                    with peft.disable_adapter():
                        got = peft.generate(input_ids=ids, attention_mask=mask, **steps)
                else:
                    peft.set_adapter(name)
                    got = peft.generate(input_ids=ids, attention_mask=mask, **steps)
            for row, i in enumerate(rows):
                out[i] = got[row, ids.shape[1] :].tolist()
        return out

    def hf_mixed() -> list[list[int]]:
        ids, mask = left_padded(prompts)
        with torch.inference_mode():
            got = peft.generate(input_ids=ids, attention_mask=mask, adapter_names=names, **steps)
        return [row[ids.shape[1] :].tolist() for row in got]

    def vlens_mixed() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]

    def vlens_base() -> None:
        llm.generate(prompts, params, use_tqdm=False)

    t_base, t_mixed, t_grouped, t_peft_mixed = best_alternating([vlens_base, vlens_mixed, hf_grouped, hf_mixed],
                                                                args.repeats)  # fmt: skip
    ours, grouped, mixed = vlens_mixed(), hf_grouped(), hf_mixed()
    equal = [sum(a == b for a, b in zip(ours, theirs)) for theirs in (grouped, mixed)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, grouped)]
    tokens = len(prompts) * args.tokens
    print(f"{len(prompts)} prompts of 16-128 tokens x {args.tokens} new tokens; two rank-16 adapters on every "
          "projection, a third of the prompts under each and a third under none")  # fmt: skip
    print(f"{'case':<52}{'tokens/s':>10}{'ratio':>10}")
    print(f"{'vlens, the base model alone':<52}{tokens / t_base:>10.1f}")
    print(f"{'vlens, adapters and none in one batch':<52}{tokens / t_mixed:>10.1f}{t_mixed / t_base:>9.2f}x  "
          "(time vs the base model)")  # fmt: skip
    print(f"{'HF + PEFT, a generate per adapter':<52}{tokens / t_grouped:>10.1f}{t_grouped / t_mixed:>9.2f}x  "
          f"(vlens's speed vs it; the same greedy tokens for {equal[0]} of {len(prompts)} prompts)")  # fmt: skip
    print(f"{'HF + PEFT, one batch (adapter_names)':<52}{tokens / t_peft_mixed:>10.1f}{t_peft_mixed / t_mixed:>9.2f}x"
          f"  (vlens's speed vs it; the same greedy tokens for {equal[1]})")
    print(f"where vlens's and PEFT's grouped tokens part (random weights: near ties), the first differing token of "
          f"each prompt: {sorted(first)}")


if __name__ == "__main__":
    main()
