"""A linear probe, end to end on SmolLM2: labeled texts harvested at one layer as one mean row each (`pool="mean"`;
each row names its source record, `document`, which is how the labels join the rows), a logistic-regression
probe trained on some words and tested on others, then run inside the engine on new prompts
(`Capture(project=(W, b), reduce="mean")`: the probe of the mean row, computed on the device).

    .venv/bin/python examples/probe_from_harvest.py
"""

import json
import tempfile
from pathlib import Path

import torch

from vlens import LLM, ActivationDataset, Capture, SamplingParams, harvest

HOOK = "blocks.12.hook_resid_post"
subjects = ["The film", "Our dinner", "The hotel", "This book", "The concert", "My new phone", "The museum visit",
            "Her speech", "The hike", "The service"]  # fmt: skip
positive = ["wonderful", "delightful", "excellent", "lovely", "fantastic", "superb", "charming", "pleasant",
            "brilliant", "marvelous", "great", "amazing"]  # fmt: skip
negative = ["awful", "dreadful", "terrible", "horrible", "miserable", "dull", "disappointing", "nasty",
            "boring", "painful", "bad", "poor"]  # fmt: skip
# Trained on the first eight words of each side, tested on texts with the other four: words the probe never saw.
texts = [(f"{s} was {word}.", label, i >= 8) for s in subjects for words, label in ((positive, 1), (negative, 0))
         for i, word in enumerate(words)]  # fmt: skip

llm = LLM(dtype="float32", device="cpu")
with tempfile.TemporaryDirectory() as tmp:
    source = Path(tmp) / "labeled.jsonl"
    source.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y, _ in texts))
    harvest(llm, source, HOOK, Path(tmp) / "acts", context_size=32, pack=False, pool="mean", dtype="float32",
            progress=False)  # fmt: skip
    pooled = ActivationDataset(Path(tmp) / "acts", HOOK)[:]  # a text's mean row each
    document = ActivationDataset(Path(tmp) / "acts", "document")[:]  # whose: the labels join by it

labels = torch.tensor([texts[d][1] for d in document], dtype=torch.float32)
test = torch.tensor([texts[d][2] for d in document])
train = ~test

mean, std = pooled[train].mean(0), pooled[train].std(0) + 1e-6
w = torch.zeros(pooled.shape[1], requires_grad=True)
b = torch.zeros((), requires_grad=True)
optimizer = torch.optim.LBFGS([w, b], max_iter=200)


def loss() -> torch.Tensor:
    optimizer.zero_grad()
    logits = ((pooled[train] - mean) / std) @ w + b
    value = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[train]) + 1e-3 * w.square().sum()
    value.backward()
    return value


optimizer.step(loss)
with torch.no_grad():
    accuracy = ((((pooled[test] - mean) / std) @ w + b > 0).float() == labels[test]).float().mean()
    print(f"accuracy on {int(test.sum())} texts with words it was not trained on: {accuracy:.2f}")
    # The probe on raw rows: x @ W + bias, with the standardisation folded in.
    W = (w / std)[:, None]
    bias = (b - (mean / std) @ w).reshape(1)

probe = Capture(hooks=HOOK, positions="prompt", project=(W, bias), reduce="mean")
outs = llm.generate([texts[d][0] for d in document[:4]], SamplingParams(max_tokens=1, capture=probe), use_tqdm=False)
engine = torch.stack([o.activations[HOOK][0, 0] for o in outs])
gap = (engine - (pooled[:4] @ W + bias)[:, 0]).abs().max()
print(f"the probe in the engine vs on the harvest's pooled rows: {gap:.1e}")
prompts = ["The weekend trip was a delight and we laughed all day.", "The meeting was tedious and nobody enjoyed it.",
           "I hated the food.", "What a lovely garden!"]  # fmt: skip
for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=1, capture=probe), use_tqdm=False)):
    score = torch.sigmoid(out.activations[HOOK][0, 0]).item()
    print(f"p(positive) {score:.2f}: {prompt!r}")
