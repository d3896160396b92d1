"""Benchmark: scoring documents with a reward model (a sequence classifier with one class), vlens against HF Transformers
in the same run.

The model: SmolLM2 as a `LlamaForSequenceClassification` with one label, its head seeded at random (a reward model's
shape: what is timed is the decoder, and the head's one row). Documents: the paragraphs of bench_harvest.py's
`shakespeare` corpus (its first N of 20 characters or more), each cut to CONTEXT tokens.
  vlens          LLM.classify: the documents packed end to end in each forward (no padding), the final norm's last
                 row of each taken on the device, the head applied to those rows alone
  HF             batches of B documents in source order, right-padded, the classifier's forward (its head over every
                 position, the last non-pad row's logit kept)
  HF sorted      the same with the documents sorted by length first (less padding: what a careful user does)
With --per-token, a score at every token of each document (where in it the reward model's score moves):
  vlens          LLM.reward: every final-norm row captured on the device, the head applied to them
  HF             the classifier's decoder and its head, every non-pad position kept
With --reranker, SmolLM2 itself (its causal LM) as a yes/no reranker, Qwen3-Reranker's recipe: each prompt a query's
instruction then a document, its score P(yes), the softmax of the "no" and "yes" logits at its last token:
  vlens          LLM(..., hf_overrides=Qwen3-Reranker's): a classifier whose head is the unembedding's yes row less
                 its no row, on the packed documents' last rows
  HF             the causal LM's decoder on right-padded batches, the unembedding on each document's last row, the
                 softmax of its two tokens' logits (the model card's way less its logits at every position)
The script checks the scores agree and prints the times and ratios.

Run:  .venv/bin/python benchmarks/bench_classify.py [--documents 512] [--batch 32] [--per-token | --reranker]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from bench_embeddings import report, tokenized_paragraphs
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from vlens import LLM, PoolingParams
from vlens.loader import resolve_model_path

RAW = PoolingParams(use_activation=False)  # (a reward model's scores are its logits)
RERANKER = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "method": "from_2_way_softmax"}  # fmt: skip
QUERY = "<Instruct>: Given a question, judge whether the passage answers it\n<Query>: Who loves whom?\n<Document>: "


def reward_model(smol: Path, out: Path) -> LlamaForSequenceClassification:
    """SmolLM2's decoder under a one-label head (seeded), saved with its tokenizer to `out`."""
    torch.manual_seed(0)
    hf = LlamaForSequenceClassification.from_pretrained(smol, num_labels=1, id2label={0: "reward"},
                                                        dtype=torch.float32)  # fmt: skip
    hf.config.pad_token_id = hf.config.eos_token_id  # (HF finds a document's last token by it; no paragraph has it)
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, out / name)
    return hf.eval()


def causal_lm(smol: Path, out: Path) -> LlamaForCausalLM:
    """SmolLM2's causal LM, saved with its tokenizer to `out` (a reranker's checkpoint is its causal LM's)."""
    hf = LlamaForCausalLM.from_pretrained(smol, dtype=torch.float32)
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, out / name)
    return hf.eval()


def hf_relevance(model, docs: list[list[int]], batch: int, order: list[int], no_yes: list[int]) -> torch.Tensor:
    """HF's yes/no reranker, batches taken in `order`: P(yes) of each document, in document order."""
    scores = torch.empty(len(docs))
    with torch.inference_mode():
        for start in range(0, len(docs), batch):
            picked = order[start : start + batch]
            width = max(len(docs[j]) for j in picked)
            ids = torch.tensor([docs[j] + [0] * (width - len(docs[j])) for j in picked])
            mask = torch.tensor([[1] * len(docs[j]) + [0] * (width - len(docs[j])) for j in picked])
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(picked)), mask.sum(1) - 1]
            scores[picked] = model.lm_head(last)[:, no_yes].float().softmax(-1)[:, 1]
    return scores


def hf_scores(model, docs: list[list[int]], batch: int, order: list[int], per_token: bool) -> torch.Tensor:
    """HF's way, batches taken in `order`; the scores come back in document order, each document's one score or (per
    token) its scores at every token, end to end."""
    pad = model.config.pad_token_id
    scores: list[torch.Tensor] = [torch.empty(0)] * len(docs)
    with torch.inference_mode():
        for start in range(0, len(docs), batch):
            picked = order[start : start + batch]
            width = max(len(docs[j]) for j in picked)
            ids = torch.tensor([docs[j] + [pad] * (width - len(docs[j])) for j in picked])
            mask = torch.tensor([[1] * len(docs[j]) + [0] * (width - len(docs[j])) for j in picked])
            if per_token:
                rows = model.score(model.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0].float()
                for k, j in enumerate(picked):
                    scores[j] = rows[k, : len(docs[j])]
            else:
                logits = model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
                for k, j in enumerate(picked):
                    scores[j] = logits[k : k + 1]
    return torch.cat(scores)


def vlens_scores(llm: LLM, docs: list[list[int]], per_token: bool) -> torch.Tensor:
    if per_token:
        return torch.cat([o.outputs.data[:, 0] for o in llm.reward(docs, pooling_params=RAW, use_tqdm=False)])
    return torch.tensor([o.outputs.logits[0] for o in llm.classify(docs, use_tqdm=False)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="HF's documents per forward")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--per-token", action="store_true", help="a score at every token (LLM.reward)")
    how.add_argument("--reranker", action="store_true", help="SmolLM2's causal LM as a yes/no reranker")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        smol = resolve_model_path(None)  # (the default model's converted checkpoint)
        hf = causal_lm(smol, Path(tmp)) if args.reranker else reward_model(smol, Path(tmp))
        llm = LLM(tmp, dtype="float32", device="cpu", hf_overrides=RERANKER if args.reranker else None)
    docs = tokenized_paragraphs(args.documents, llm.tokenizer)
    if args.reranker:  # (each document after the query's instruction)
        docs = [llm.tokenizer(QUERY, add_special_tokens=False)["input_ids"] + doc for doc in docs]
        no_yes = llm.tokenizer.convert_tokens_to_ids(["no", "yes"])

    def run_hf(docs: list[list[int]], order: list[int]) -> torch.Tensor:
        if args.reranker:
            return hf_relevance(hf, docs, args.batch, order, no_yes)
        return hf_scores(hf, docs, args.batch, order, args.per_token)

    def run_vlens(docs: list[list[int]]) -> torch.Tensor:
        if args.reranker:
            return torch.tensor([o.outputs.probs[0] for o in llm.classify(docs, use_tqdm=False)])
        return vlens_scores(llm, docs, args.per_token)

    by_length = sorted(range(len(docs)), key=lambda j: len(docs[j]))
    warm = docs[: args.batch]
    run_hf(warm, list(range(len(warm))))  # warm-ups
    run_vlens(warm)
    seconds, scores = {}, {}
    for name in ("vlens", "HF", "HF sorted"):
        start = time.perf_counter()
        if name == "vlens":
            scores[name] = run_vlens(docs)
        else:
            scores[name] = run_hf(docs, by_length if name == "HF sorted" else list(range(len(docs))))
        seconds[name] = time.perf_counter() - start
    gap = (scores["vlens"] - scores["HF"]).norm() / scores["HF"].norm()
    worst = (scores["vlens"] - scores["HF"]).abs().max() / scores["HF"].abs().max()
    print(f"scores agree: relative gap {gap:.1e}, worst score's {worst:.1e} of the largest (float32)")
    report(seconds, sum(map(len, docs)))


if __name__ == "__main__":
    main()
