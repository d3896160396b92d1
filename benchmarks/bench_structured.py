"""Structured outputs, in one run, on SmolLM2-135M-Instruct (float32, the CPU): 16 chat prompts asking for a person as
JSON, greedy, held to a JSON schema.

    .venv/bin/python benchmarks/bench_structured.py [--repeats 2] [--prompts 16]

Cases: vlens with `structured_outputs=StructuredOutputsParams(json=schema)`; HF `generate` of the same prompts in one
left-padded batch under xgrammar's own logits processor for the same compiled grammar; and vlens without a structure,
each prompt generating as many tokens as its structured run did (ignore_eos): the cost of the structure itself (the
host fills each row's bitmask of allowed tokens every step, the device unpacks it; a step with such a row is not
queued ahead of the host). Prints output tokens/s, the ratios, and how many prompts' tokens equal HF's.
"""

from __future__ import annotations

import argparse
import json

import torch
import xgrammar
from bench_generate import best_alternating, left_padded
from transformers import AutoModelForCausalLM

from vlens import LLM, SamplingParams, StructuredOutputsParams
from vlens.loader import resolve_model_path

SCHEMA = {"type": "object", "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
PEOPLE = ["Ann", "Bob", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Mateo",
          "Nora", "Omar", "Priya"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens")
    args = ap.parse_args()
    path = resolve_model_path(None)
    llm = LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chats = [[{"role": "user", "content": f"Describe a person named {PEOPLE[i % len(PEOPLE)]}, aged {20 + 3 * i}, "
                                          "living in a city of your choice, as JSON."}] for i in range(args.prompts)]
    structured = SamplingParams(max_tokens=args.tokens, temperature=0,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))  # fmt: skip
    outs = llm.chat(chats, structured, use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outs]
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    same_length = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    compiled = llm.engine.grammars.compile(structured.structured_outputs)
    eos = sorted(llm.engine.eos_ids)
    ids, mask = left_padded(prompts)  # (no SmolLM2 chat prompt holds token 0)

    def hf_structured() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0], logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)])
        return [[t for t in row if t not in eos] for row in out[:, ids.shape[1] :].tolist()]

    hf_tokens = hf_structured()
    mine = [[t for t in o.outputs[0].token_ids if t not in eos] for o in outs]
    equal = sum(a == b for a, b in zip(mine, hf_tokens, strict=True))
    valid = sum(set(json.loads(o.outputs[0].text)) == {"name", "age", "city"} for o in outs)
    times = best_alternating([lambda: llm.generate(prompts, structured, use_tqdm=False),
                              lambda: llm.generate(prompts, same_length, use_tqdm=False), hf_structured],
                             args.repeats)  # fmt: skip
    tokens = sum(lengths)
    print(f"SmolLM2-135M float32, {args.prompts} chat prompts, JSON schema of 3 fields, greedy, {tokens} tokens "
          f"({min(lengths)}-{max(lengths)} a prompt); best of {args.repeats}")
    for name, seconds in zip(["vlens, structured", "vlens, no structure (same tokens)", "HF + xgrammar processor"],
                             times, strict=True):  # fmt: skip
        print(f"  {name:<36}{seconds:8.2f} s {tokens / seconds:8.0f} tokens/s")
    print(f"vlens structured: {times[2] / times[0]:.2f}x HF + xgrammar's speed; {times[0] / times[1]:.2f}x the time "
          f"of the same tokens without a structure")
    print(f"greedy tokens equal to HF's: {equal}/{len(outs)}; texts that parse as the schema's objects: {valid}")


if __name__ == "__main__":
    main()
