"""Steer SmolLM2 with a vector trained from contrastive pairs (contrastive activation addition), as the
steering-vectors library trains one, then save it for `vlens serve --steering-vector kind=kind.safetensors`.

    .venv/bin/python examples/steer_contrastive_pairs.py
"""

from vlens import LLM, SamplingParams
from vlens.steering import train_steering_vector

pairs = [  # (positive, negative): the same sentence, kind and unkind, read at its last token
    ("You did a wonderful job, thank you so much", "You did a terrible job, you useless fool"),
    ("I am so happy to see you again, my friend", "I am so annoyed to see you again, you pest"),
    ("What a lovely, thoughtful gift", "What a cheap, thoughtless gift"),
    ("Please take your time, I am glad to help", "Hurry up, I have no time for your nonsense"),
    ("Your idea is brilliant and kind", "Your idea is stupid and cruel"),
    ("We welcome everyone here with open arms", "We want nobody here, go away"),
]

llm = LLM(dtype="float32", device="cpu")
vector = train_steering_vector(llm, pairs, hooks="blocks.12.hook_resid_post")
prompt = "My neighbour knocked on the door and I said:"
for multiplier in (-0.6, 0.0, 0.6):
    params = SamplingParams(max_tokens=24, temperature=0, interventions=vector.steers(multiplier))
    [out] = llm.generate(prompt, params, use_tqdm=False)
    print(f"multiplier {multiplier:+.1f}: {prompt}{out.outputs[0].text!r}")
vector.save("kind.safetensors")
