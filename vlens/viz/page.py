"""The views of vlens.viz, and the whole page for a prompt (`vlens lens`), from an LLM's outputs."""

from __future__ import annotations

from typing import Any

from vlens.capture import Capture
from vlens.outputs import RequestOutput
from vlens.sae.model import SAE
from vlens.sampling_params import SamplingParams
from vlens.viz.html import View
from vlens.viz.payload import attention_part, empty, layer_of, lens_ids, lens_part, name_tokens, sae_part


def logit_lens(output: RequestOutput, tokenizer: Any = None) -> View:
    """The logit-lens heatmap (layer x position, top token and probability; top-k on hover or focus) of
    an output captured with Capture(hooks='blocks.*.hook_resid_post', logit_lens=k). Without a tokenizer
    (llm.tokenizer) tokens are named by id."""
    payload = empty(output, tokenizer)
    payload["lens"] = lens_part(output)
    name_tokens(payload, lens_ids(payload["lens"]), tokenizer)
    return View(payload, "vlens logit lens")


def attention(output: RequestOutput, layer: int, head: int | None = None, tokenizer: Any = None) -> View:
    """Query x key attention weights of one layer (every head, as thumbnails to choose the one drawn from; or
    only the head at index `head`), from an output captured with Capture(hooks=f'blocks.{layer}.attn.hook_pattern')."""
    payload = empty(output, tokenizer)
    payload["attention"] = [attention_part(output, layer, head)]
    return View(payload, f"vlens attention, layer {layer}")


def sae_features(output: RequestOutput, tokenizer: Any = None, name: str = "sae") -> View:
    """Each row's top SAE latents and their activations, from an output captured with
    Capture(sae=sae, top_k=k)."""
    payload = empty(output, tokenizer)
    payload["sae"] = sae_part(output, name)
    return View(payload, "vlens SAE features")


def lens_page(llm, prompt: str, max_tokens: int = 0, top_k: int = 5, sae: SAE | None = None) -> View:
    """Everything the server's /lens shows for a prompt, as one static view: the logit lens at every
    layer's residual stream, every layer's attention patterns and, with an SAE, its top latents. The
    prompt is generated from greedily first; the other views read the prompt and its completion."""
    [first] = llm.generate(
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0,
                       capture=Capture(hooks="blocks.*.hook_resid_post", logit_lens=top_k)),
        use_tqdm=False,
    )  # fmt: skip
    payload = logit_lens(first, llm.tokenizer).payload
    payload["model"] = llm.model_name
    tokens = payload["token_ids"]
    captures = [Capture(hooks="blocks.*.attn.hook_pattern", dtype="float32")]
    if sae is not None:
        captures.append(Capture(sae=sae, top_k=top_k))
    outputs = llm.generate([tokens] * len(captures), [SamplingParams(max_tokens=0, capture=c) for c in captures],
                           use_tqdm=False)  # fmt: skip
    patterns = outputs[0]
    layers = sorted(layer_of(hook) for hook in patterns.activations)
    payload["attention"] = [attention_part(patterns, layer) for layer in layers]
    if sae is not None:
        payload["sae"] = sae_part(outputs[1])
    return View(payload, f"vlens lens: {prompt}")
