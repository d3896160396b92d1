"""Benchmark: one mean row per document (sequence embeddings, probing datasets) at layer 15 of SmolLM2, to disk,
against HF Transformers in the same run.

Documents: the paragraphs of the `shakespeare` corpus of bench_harvest.py (its first N of 20 characters or more,
which run from a few tokens to a few hundred), each cut to CONTEXT tokens.
  vlens          vlens.harvest(..., pack=False, pool="mean"): the documents packed end to end in each forward
                 (no padding), the mean of each one's rows taken on the device, one bf16 row per document
  HF             batches of B documents in source order, right-padded, a forward stopped by a hook at layer 15,
                 the masked mean in float32, bf16 rows written per batch
  HF sorted      the same with the documents sorted by length first (less padding: what a careful user does)
The script checks the rows agree and prints the times and ratios.

Run:  .venv/bin/python benchmarks/bench_embeddings.py [--documents 1024] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_harvest import HOOK, LAYER, corpus, stopped_at
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from vlens import LLM, ActivationDataset, harvest

CONTEXT = 256


def paragraphs(n: int) -> list[str]:
    out = []
    for line in corpus().read_text().splitlines():
        for paragraph in json.loads(line)["text"].split("\n\n"):
            if len(paragraph.strip()) >= 20:
                out.append(" ".join(paragraph.split()))
                if len(out) == n:
                    return out
    return out


def tokenized_paragraphs(n: int, tokenizer) -> list[list[int]]:
    """paragraphs(n), tokenized and cut to CONTEXT tokens; their lengths printed."""
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"][:CONTEXT] for t in paragraphs(n)]
    lengths = torch.tensor([len(d) for d in docs]).float()
    print(f"{len(docs)} documents of {lengths.min():.0f}-{lengths.max():.0f} tokens (mean {lengths.mean():.0f}), "
          f"{int(lengths.sum()):,} tokens; {torch.get_num_threads()} torch threads")  # fmt: skip
    return docs


def report(seconds: dict[str, float], tokens: int) -> None:
    """Each way's time and speed, and vlens's against HF's two orders."""
    for name, s in seconds.items():
        print(f"{name:<10} {s:7.2f} s   {tokens / s:8,.0f} tokens/s")
    print(f"vlens speed: {seconds['HF'] / seconds['vlens']:.2f}x HF, {seconds['HF sorted'] / seconds['vlens']:.2f}x "
          "HF sorted by length")  # fmt: skip


def hf_means(model, docs: list[list[int]], batch: int, out: Path, order: list[int]) -> torch.Tensor:
    """HF's way, batches taken in `order`; the rows come back in document order."""
    rows = [None] * len(docs)
    for i, start in enumerate(range(0, len(docs), batch)):
        picked = order[start : start + batch]
        width = max(len(docs[j]) for j in picked)
        ids = torch.tensor([docs[j] + [0] * (width - len(docs[j])) for j in picked])
        mask = torch.tensor([[1] * len(docs[j]) + [0] * (width - len(docs[j])) for j in picked])
        x = stopped_at(model, LAYER, input_ids=ids, attention_mask=mask)
        means = (x.float() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        save_file({HOOK: means.to(torch.bfloat16)}, out / f"{i:05d}.st")
        for j, row in zip(picked, means):
            rows[j] = row
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="HF's documents per forward")
    parser.add_argument("--batch-tokens", type=int, default=None, help="vlens's tokens per forward (default: its own)")
    args = parser.parse_args()
    llm = LLM(dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32).eval()
    texts = paragraphs(args.documents)
    docs = tokenized_paragraphs(args.documents, llm.tokenizer)
    by_length = sorted(range(len(docs)), key=lambda j: len(docs[j]))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = root / "paragraphs.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        hf_means(hf, docs[: args.batch], args.batch, root, list(range(args.batch)))  # warm-ups (and the weights'
        harvest(llm, source, HOOK, root / "warm", context_size=CONTEXT, pack=False, pool="mean", max_tokens=2000,
                progress=False)  # fmt: skip  (hash, which a harvest takes once a process)
        seconds = {}
        for name in ("vlens", "HF", "HF sorted"):
            (root / name).mkdir()
            start = time.perf_counter()
            if name == "vlens":
                harvest(llm, source, HOOK, root / name / "out", context_size=CONTEXT, pack=False, pool="mean",
                        batch_tokens=args.batch_tokens, progress=False)  # fmt: skip
            else:
                order = by_length if name == "HF sorted" else list(range(len(docs)))
                reference = hf_means(hf, docs, args.batch, root / name, order)
            seconds[name] = time.perf_counter() - start
        ours = ActivationDataset(root / "vlens" / "out", HOOK)[:].float()
    gap = ((ours - reference.to(torch.bfloat16).float()).norm(dim=1) / reference.norm(dim=1)).max()
    print(f"rows agree: worst relative gap {gap:.1e} (bf16 storage)")
    report(seconds, sum(map(len, docs)))


if __name__ == "__main__":
    main()
