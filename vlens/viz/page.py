"""The views of vlens.viz, and the whole page for a prompt (`vlens lens`), from an LLM's outputs."""

from __future__ import annotations

from typing import Any

from vlens.capture import Capture, TunedLens
from vlens.outputs import RequestOutput
from vlens.sae.model import SAE
from vlens.sampling_params import SamplingParams
from vlens.viz.html import View
from vlens.viz.payload import attention_part, empty, lens_ids, lens_part, name_tokens, sae_part


def logit_lens(output: RequestOutput, tokenizer: Any = None, tuned: bool = False) -> View:
    """The logit-lens heatmap (layer x position, top token and probability; top-k on hover or focus) of
    an output captured with Capture(hooks='blocks.*.hook_resid_post', logit_lens=k) (`tuned`: with tuned_lens=,
    which the view's title says). Without a tokenizer (llm.tokenizer) tokens are named by id."""
    payload = empty(output, tokenizer)
    payload["lens"] = {**lens_part(output), "tuned": tuned}
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


def lens_page(
    llm, prompt: str, max_tokens: int = 0, top_k: int = 5, sae: SAE | None = None,
    attention_layers: list[int] | None = None, tuned_lens: TunedLens | None = None,
) -> View:  # fmt: skip
    """Everything the server's /lens shows for a prompt, as one static view: the logit lens at every
    layer's residual stream, the attention patterns of `attention_layers` (None: every layer that attends; the page
    carries all their heads, [layers, heads, tokens, tokens / 2] weights, so a long prompt on a deep model
    may want a few) and, with an SAE, its top latents; with a tuned lens, the lens read through it. The prompt is
    generated from greedily first; the other views read the prompt and its completion."""
    layers = range(llm.config.num_layers)
    attending = [layer for layer in layers if llm.config.attends(layer)]  # (a hybrid's others have no patterns)
    for layer in attention_layers or []:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in layers:
            raise ValueError(f"attention_layers: {layer!r} is not a layer of this model (0 .. {len(layers) - 1})")
        if layer not in attending:
            raise ValueError(f"attention_layers: layer {layer} of {llm.config.architecture} does not attend (it has "
                             f"no attention pattern); the layers that do: {attending}")  # fmt: skip
    [first] = llm.generate(
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0,
                       capture=Capture(hooks="blocks.*.hook_resid_post", logit_lens=top_k, tuned_lens=tuned_lens)),
        use_tqdm=False,
    )  # fmt: skip
    payload = logit_lens(first, llm.tokenizer, tuned_lens is not None).payload
    payload["model"] = llm.model_name
    tokens = payload["token_ids"]
    chosen = attending if attention_layers is None else sorted(set(attention_layers))
    patterns = [f"blocks.{layer}.attn.hook_pattern" for layer in chosen]
    captures = [Capture(hooks=patterns, dtype="float32")] if chosen else []
    if sae is not None:
        captures.append(Capture(sae=sae, top_k=top_k))
    params = [SamplingParams(max_tokens=0, capture=c) for c in captures]
    outputs = llm.generate([tokens] * len(captures), params, use_tqdm=False) if captures else []
    payload["attention"] = [attention_part(outputs[0], layer) for layer in chosen]
    if sae is not None:
        payload["sae"] = sae_part(outputs[-1])
    return View(payload, f"vlens lens: {prompt}")
