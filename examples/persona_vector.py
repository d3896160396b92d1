"""A persona vector, end to end on SmolLM2: questions answered under two system prompts (one eliciting a trait,
one not) and the answers' rows harvested in one step (`generate_tokens`: the model writes each reply, the
harvest stores the rows of the tokens it wrote, `roles`), the difference of the two harvests' mean rows taken
as a steering vector, and a plain question answered with it added.

    .venv/bin/python examples/persona_vector.py
"""

import json
import tempfile
from pathlib import Path

from vlens import LLM, SamplingParams, harvest
from vlens.harvest import difference_of_means

questions = ["How do I boil an egg?", "What is the capital of France?", "Can you recommend a book?",
             "Why is the sky blue?", "How many legs does a spider have?", "What should I cook tonight?",
             "How do plants grow?", "What is a good way to learn to swim?"]  # fmt: skip
personas = {
    "cheerful": "You are an extremely cheerful, enthusiastic assistant who loves everything and says so!",
    "gloomy": "You are a gloomy, pessimistic assistant who expects the worst of everything.",
}
hook = "blocks.16.hook_resid_post"

llm = LLM(dtype="float32", device="cpu")
with tempfile.TemporaryDirectory() as tmp:
    for name, system in personas.items():
        with open(Path(tmp) / f"{name}.jsonl", "w") as f:
            for q in questions:  # (the conversations end with the question: the model writes the replies)
                messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                f.write(json.dumps({"messages": messages}) + "\n")
        harvest(llm, Path(tmp) / f"{name}.jsonl", hook, Path(tmp) / name, generate_tokens=40, roles=["assistant"],
                context_size=128, pack=False, dtype="float32", progress=False)  # fmt: skip
    vector = difference_of_means(Path(tmp) / "cheerful", Path(tmp) / "gloomy")

question = [{"role": "user", "content": "Tell me about your weekend."}]
for multiplier in (-3.0, 0.0, 3.0):
    params = SamplingParams(max_tokens=32, temperature=0, interventions=vector.steers(multiplier))
    [out] = llm.chat(question, params, use_tqdm=False)
    print(f"multiplier {multiplier:+.1f}: {out.outputs[0].text!r}")
