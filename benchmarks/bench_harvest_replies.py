"""Benchmark: an on-policy harvest (the model answers questions, the rows of its answers are stored) on SmolLM2,
against the same done with HF Transformers, in one run.

  vlens   vlens.harvest(..., generate_tokens=G, roles=["assistant"], pack=False): every reply generated in one
          continuous batch, then the packed forward of each conversation with its reply, up to the hook's layer,
          the reply's rows kept
  HF      model.generate over left-padded batches (greedy, max_new_tokens=G), each reply cut after its end-of-turn
          token; then a forward of each batch of prompt + reply (right-padded), stopped by a hook at the layer,
          the reply's rows gathered and written as safetensors
Both write bf16 rows of HOOK; the script reports how many replies the two wrote alike (float32 sums in another
order can flip a near tie) and prints the times and their ratio.

Run:  .venv/bin/python benchmarks/bench_harvest_replies.py [--questions 64] [--tokens 48] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_harvest import HOOK, LAYER, stopped_at
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from vlens import LLM, harvest
from vlens.harvest import ActivationDataset

TOPICS = ["rivers", "bread", "chess", "volcanoes", "bees", "the moon", "trains", "glass", "tea", "maps", "snow",
          "violins", "salt", "owls", "bridges", "paper"]  # fmt: skip
ASKS = ["What are {} and why do they matter?", "Tell me one surprising fact about {}.",
        "How would you explain {} to a child?", "Write two sentences about {}."]  # fmt: skip


def questions(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": ASKS[i // len(TOPICS) % len(ASKS)].format(TOPICS[i % len(TOPICS)])}]
            for i in range(n)]  # fmt: skip


def hf_on_policy(model, tokenizer, convs, tokens: int, batch: int, out: Path) -> list[list[int]]:
    """HF's way: generate in left-padded batches, then a stopped forward of prompt + reply, reply rows saved."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or tokenizer.eos_token_id
    rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    prompts = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]
    replies = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            group = prompts[start : start + batch]
            width = max(map(len, group))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out_ids = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=pad)  # fmt: skip
            for row in out_ids[:, width:].tolist():
                replies.append(row[: row.index(eos) + 1] if eos in row else row)
    for i, start in enumerate(range(0, len(prompts), batch)):
        seqs = [p + r for p, r in zip(prompts[start : start + batch], replies[start : start + batch])]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        x = stopped_at(model, LAYER, input_ids=ids, attention_mask=mask)
        rows = [x[j, len(p) : len(s)] for j, (p, s) in enumerate(zip(prompts[start:], seqs))]
        save_file({HOOK: torch.cat(rows).to(torch.bfloat16)}, out / f"{i:05d}.st")
    return replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per reply at most")
    parser.add_argument("--batch", type=int, default=16, help="HF's batch size, for generate and the forward")
    args = parser.parse_args()
    torch.manual_seed(0)
    llm = LLM(dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32).eval()
    convs = questions(args.questions)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "questions.jsonl"
        source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
        started = time.perf_counter()
        harvest(llm, source, HOOK, Path(tmp) / "vlens", generate_tokens=args.tokens, roles=["assistant"],
                context_size=256, pack=False, progress=False)  # fmt: skip
        vlens_s = time.perf_counter() - started
        ours = ActivationDataset(Path(tmp) / "vlens", HOOK).replies()
        (Path(tmp) / "hf").mkdir()
        started = time.perf_counter()
        theirs = hf_on_policy(hf, llm.tokenizer, convs, args.tokens, args.batch, Path(tmp) / "hf")
        hf_s = time.perf_counter() - started
    rows = sum(map(len, ours))
    alike = sum(a == b for a, b in zip(ours, theirs))
    print(f"{args.questions} questions, replies of up to {args.tokens} tokens ({rows:,} rows of {HOOK}), "
          f"{alike}/{len(ours)} replies alike")  # fmt: skip
    print(f"vlens on-policy harvest   {vlens_s:7.2f} s")
    print(f"HF generate + hook-stop   {hf_s:7.2f} s   (batches of {args.batch})")
    print(f"vlens / HF time: {vlens_s / hf_s:.2f}x   ({hf_s / vlens_s:.2f}x HF's speed)")


if __name__ == "__main__":
    main()
