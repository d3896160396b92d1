"""Harvest SmolLM2's residual stream over chat conversations (read through its chat template), plain and
steered by a steering vector, and see where the steer goes: the rows' change along the vector, layer by layer.

    .venv/bin/python examples/harvest_steered_chat.py
"""

import json
import tempfile
from pathlib import Path

from vlens import LLM, ActivationDataset, harvest
from vlens.steering import train_steering_vector

pairs = [  # (positive, negative), as in examples/steer_contrastive_pairs.py
    ("You did a wonderful job, thank you so much", "You did a terrible job, you useless fool"),
    ("I am so happy to see you again, my friend", "I am so annoyed to see you again, you pest"),
    ("What a lovely, thoughtful gift", "What a cheap, thoughtless gift"),
    ("Please take your time, I am glad to help", "Hurry up, I have no time for your nonsense"),
]
questions = ["How do I boil an egg?", "What is the capital of France?", "Can you recommend a book?",
             "Why is the sky blue?", "How many legs does a spider have?", "What should I cook tonight?"]  # fmt: skip
answers = ["Put it in boiling water for nine minutes.", "Paris.", "Try a mystery novel.",
           "Sunlight scatters off the air.", "Eight.", "A simple pasta with tomatoes."]  # fmt: skip
hooks = [f"blocks.{layer}.hook_resid_post" for layer in (8, 12, 16, 20, 24)]

llm = LLM(dtype="float32", device="cpu")
vector = train_steering_vector(llm, pairs, hooks="blocks.12.hook_resid_post")
direction = vector.vectors["blocks.12.hook_resid_post"]
direction = direction / direction.norm()
with tempfile.TemporaryDirectory() as tmp:
    chats = Path(tmp) / "chats.jsonl"  # a "messages" column: each line one conversation
    chats.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in zip(questions, answers)
    ))  # fmt: skip
    options = {"context_size": 64, "pack": False, "dtype": "float32", "progress": False}
    harvest(llm, chats, hooks, Path(tmp) / "plain", **options)
    harvest(llm, chats, hooks, Path(tmp) / "kind", steering_vector=vector, multiplier=0.6, **options)
    tokens = ActivationDataset(Path(tmp) / "plain", "token_ids")[:]
    print(f"{len(tokens)} rows of {len(questions)} conversations; the first: {llm.tokenizer.decode(tokens[:40])!r}")
    print("layer  mean change along the vector  its share of the change's norm")
    for hook in hooks:
        change = ActivationDataset(Path(tmp) / "kind", hook)[:] - ActivationDataset(Path(tmp) / "plain", hook)[:]
        along = change @ direction
        share = f"{along.norm() / change.norm():.3f}" if change.any() else "- (before the steer)"
        print(f"{hook.split('.')[1]:>5}  {along.mean():28.3f}  {share:>29}")
