"""A causal LM read as a reranker, and why it ranks as it does: SmolLM2 scores documents for a question by
Qwen3-Reranker's recipe (vLLM's hf_overrides: its head is the unembedding's "yes" row less its "no" row, so a
pair's score is P(yes) at its last token), then direct logit attribution splits the best document's yes-less-no
into the direct shares of the model's parts (`cache.logit_attrs` of the class "yes") and of its heads. SmolLM2-135M is
no trained reranker, so the ranking is its own; a Qwen3-Reranker checkpoint runs the same code (with its recipe's
Qwen3ForSequenceClassification and its prompt).

    .venv/bin/python examples/reranker_attribution.py
"""

from __future__ import annotations

import torch

from vlens import HookedLM

RERANKER = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "method": "from_2_way_softmax"}  # fmt: skip
QUERY = ("<|im_start|>system\nJudge whether the Document answers the Query. Answer only \"yes\" or \"no\".<|im_end|>\n"
         "<|im_start|>user\n<Query>: What is the capital of France?\n<Document>: ")  # fmt: skip
DOCUMENTS = ["Paris is the capital and largest city of France.", "The Nile is the longest river in Africa.",
             "France borders Spain, Italy and Germany."]  # fmt: skip
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


def rank_and_attribute(model: HookedLM, query: str, documents: list[str], top: int = 5) -> dict:
    """Each document's P(yes), best first; the best one's yes-less-no at its last token, and its `top` largest direct
    shares by part (embedding, each layer's attention and MLP) and by head (every layer's)."""
    scores = [s.outputs.score for s in model.llm.score(query, [d + SUFFIX for d in documents], use_tqdm=False)]
    best = max(range(len(documents)), key=scores.__getitem__)
    tokens = torch.tensor([model.tokenizer(query + documents[best] + SUFFIX)["input_ids"]])
    _, cache = model.run_with_cache(tokens, return_type=None)
    parts, part_labels = cache.decompose_resid(return_labels=True)
    shares = cache.logit_attrs(parts, "yes")[:, 0, -1]
    heads, head_labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    head_shares = cache.logit_attrs(heads, "yes", pos_slice=-1)[:, 0]

    def largest(labels: list[str], values: torch.Tensor) -> list[tuple[str, float]]:
        return sorted(zip(labels, values.tolist()), key=lambda pair: -abs(pair[1]))[:top]

    return {"ranked": sorted(zip(documents, scores), key=lambda pair: -pair[1]), "yes_less_no": shares.sum().item(),
            "parts": largest(part_labels, shares), "heads": largest(head_labels, head_shares)}  # fmt: skip


if __name__ == "__main__":
    found = rank_and_attribute(HookedLM(hf_overrides=RERANKER, dtype="float32", device="cpu"), QUERY, DOCUMENTS)
    for document, score in found["ranked"]:
        print(f"P(yes) {score:.3f}  {document}")
    print(f"the best document's yes less no at its last token: {found['yes_less_no']:+.3f}; its largest shares")
    for label, share in found["parts"] + found["heads"]:
        print(f"  {label:<12} {share:+.3f}")
