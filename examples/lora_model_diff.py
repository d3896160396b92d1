"""Where does a LoRA fine-tune change the model? The base model and the adapter read the same prompts in one batch
(requests under an adapter run beside requests without one), and, layer by layer, the residual stream's change at the
last prompt position, relative to the base model's, shows where the fine-tune acts; then how far apart the two
next-token distributions are (KL).

    .venv/bin/python examples/lora_model_diff.py path/to/adapter   # a PEFT adapter of SmolLM2-135M-Instruct
"""

import sys

import torch

from vlens import LLM, Capture, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "My favourite food is",
           "Explain photosynthesis to a child.", "The best way to learn a language is"]  # fmt: skip


def model_diff(llm: LLM, adapter: LoRARequest, prompts: list[str]) -> tuple[list[float], float]:
    """(per layer, the mean over prompts of |fine-tuned - base| / |base| of the residual stream after it at the last
    prompt position; the mean KL(base || fine-tuned) of the next token, in nats)."""
    hooks = [f"blocks.{i}.hook_resid_post" for i in range(llm.config.num_layers)] + ["unembed.hook_out"]
    params = SamplingParams(max_tokens=1, temperature=0, capture=Capture(hooks, positions="last"))
    loras = [None] * len(prompts) + [adapter] * len(prompts)  # (each prompt twice: the base model's, the adapter's)
    outs = llm.generate(prompts * 2, params, use_tqdm=False, lora_request=loras)
    base, tuned = outs[: len(prompts)], outs[len(prompts) :]

    def rows(outputs, hook: str) -> torch.Tensor:
        return torch.cat([o.activations[hook] for o in outputs]).double()

    change = [((rows(tuned, h) - rows(base, h)).norm(dim=-1) / rows(base, h).norm(dim=-1)).mean().item()
              for h in hooks[:-1]]  # fmt: skip
    p, q = rows(base, hooks[-1]).log_softmax(-1), rows(tuned, hooks[-1]).log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return change, kl


def main(path: str) -> None:
    llm = LLM(dtype="float32", device="cpu", enable_lora=True, max_lora_rank=64)
    change, kl = model_diff(llm, LoRARequest("fine-tune", 1, path), PROMPTS)
    top = max(change) or 1.0
    for layer, value in enumerate(change):
        print(f"layer {layer:2d}  {value:8.4f}  {'#' * round(40 * value / top)}")
    print(f"KL(base || fine-tune) of the next token: {kl:.4f} nats")


if __name__ == "__main__":
    main(sys.argv[1])
