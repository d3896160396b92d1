"""Steer SmolLM2 with a direction found as the difference of mean activations on two sets of prompts.

    .venv/bin/python examples/steer_diff_of_means.py
"""

from vlens import LLM, Capture, SamplingParams, Steer

HOOK = "blocks.10.hook_resid_post"
happy = ["I love this, it is wonderful", "What a great and happy day", "This is fantastic news", "I feel so joyful"]
sad = ["I hate this, it is awful", "What a terrible and sad day", "This is horrible news", "I feel so miserable"]

llm = LLM(dtype="float32", device="cpu")
mean_of = SamplingParams(max_tokens=1, capture=Capture(hooks=HOOK, positions="prompt", reduce="mean"))
means = [o.activations[HOOK][0] for o in llm.generate(happy + sad, mean_of, use_tqdm=False)]
direction = sum(means[:4]) / 4 - sum(means[4:]) / 4  # happy minus sad

prompt = "My day at work was"
for scale in (-3.0, 0.0, 3.0):
    params = SamplingParams(max_tokens=20, temperature=0, interventions=[Steer(HOOK, direction, scale=scale)])
    [out] = llm.generate(prompt, params, use_tqdm=False)
    print(f"scale {scale:+.0f}: {prompt}{out.outputs[0].text!r}")
