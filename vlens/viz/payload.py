"""The lens payload: what the page's renderer (static/lens.js) draws, as JSON-ready dicts built from
RequestOutputs. The server page builds the same dicts in the browser from the API's responses, so one
renderer serves both; this module is the payload's Python half and its reference:

    {"model": str | None, "prompt": str | None,
     "token_ids": [int],            # prompt then generated tokens
     "prompt_tokens": int, "completion": str | None,
     "texts": {"<id>": str},        # each token id the views name -> its text
     "lens": None | {"k": int, "layers": [{"layer", "hook", "positions": [int],
                                          "ids": [[int]], "logprobs": [[float]]}]},   # [rows][k]
     "attention": [{"layer": int, "heads": [int], "positions": [int],
                    "weights": [str]}],                      # per head: its lower triangle, see attention_part
     "sae": None | {"name": str, "hook": str, "positions": [int],
                    "ids": [[int]], "values": [[float]]},                          # [rows][top_k]
     "feature": None | {"feature": int, "positions": [int], "values": [float]}}   # one latent at every row

Floats are float32 values written as the doubles they equal, so a view's numbers read back bit for bit;
attention weights, n² per head, are the float32 bytes themselves (base64), a quarter of the text as doubles.
"""

from __future__ import annotations

import base64
import re
from typing import Any

import torch

from vlens.outputs import RequestOutput

_LAYER = re.compile(r"^blocks\.(\d+)\.")


def layer_of(hook: str) -> int:
    """The block index in a hook's name (blocks.3.hook_resid_post -> 3)."""
    match = _LAYER.match(hook)
    if match is None:
        raise ValueError(f"hook: {hook!r} is not a per-layer hook (blocks.N....)")
    return int(match.group(1))


def empty(output: RequestOutput, tokenizer: Any = None) -> dict[str, Any]:
    """The payload of an output with no view yet: its tokens, their texts, and the completion."""
    token_ids = output.prompt_token_ids + output.outputs[0].token_ids
    payload = {
        "model": None,
        "prompt": output.prompt,
        "token_ids": token_ids,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion": output.outputs[0].text if output.outputs[0].token_ids else None,
        "texts": {},
        "lens": None,
        "attention": [],
        "sae": None,
        "feature": None,
    }
    name_tokens(payload, token_ids, tokenizer)
    return payload


def name_tokens(payload: dict[str, Any], ids: list[int], tokenizer: Any) -> None:
    """Add the texts of `ids` to the payload (without a tokenizer the page names them by id)."""
    if tokenizer is not None:
        for i in ids:
            payload["texts"].setdefault(str(i), tokenizer.decode([i]))


def lens_part(output: RequestOutput) -> dict[str, Any]:
    """The logit lens of every hook the output read it at (Capture(..., logit_lens=k)), by layer."""
    if not output.logit_lens:
        raise ValueError(
            "output: no logit lens captured; generate with Capture(hooks='blocks.*.hook_resid_post', logit_lens=5)"
        )
    positions = output.activation_positions.tolist()
    layers, k = [], 0
    for hook, (ids, logprobs) in sorted(output.logit_lens.items(), key=lambda item: layer_of(item[0])):
        layers.append(
            {"layer": layer_of(hook), "hook": hook, "positions": positions, "ids": ids.tolist(),
             "logprobs": _doubles(logprobs)}
        )  # fmt: skip
        k = ids.shape[1]
    return {"k": k, "layers": layers}


def attention_part(output: RequestOutput, layer: int, head: int | None = None) -> dict[str, Any]:
    """One layer's attention pattern (all its captured heads, or the one at index `head`).

    Each head's weights are its lower triangle only: row r (the query at positions[r]) holds keys 0 ..
    positions[r], rows one after the other, as base64 of little-endian float32. The keys after a query
    are masked (hook_pattern is 0 there), so nothing is lost, and the page, which draws them as masked,
    gets half the bytes of the square."""
    hook = f"blocks.{layer}.attn.hook_pattern"
    if hook not in output.activations:
        captured = ", ".join(h for h in output.activations if h.endswith("hook_pattern")) or "none"
        raise ValueError(f"layer: {hook} was not captured (captured patterns: {captured}); capture it with "
                         f"Capture(hooks='{hook}')")  # fmt: skip
    weights = output.activations[hook].float()  # [rows, heads, keys]
    heads = list(range(weights.shape[1]))
    if head is not None:
        if head not in heads:
            raise ValueError(f"head: {head} does not exist; {hook} has heads 0..{len(heads) - 1}")
        weights, heads = weights[:, head : head + 1], [head]
    positions = output.activation_positions
    causal = torch.arange(weights.shape[2]) <= positions[:, None]  # [rows, keys]: the keys each query sees
    triangles = weights.permute(1, 0, 2)[:, causal]  # [heads, cells], row after row
    return {"layer": layer, "heads": heads, "positions": positions.tolist(), "weights": [_base64(t) for t in triangles]}


def sae_part(output: RequestOutput, name: str = "sae") -> dict[str, Any]:
    """The top SAE latents of each captured row (Capture(sae=..., top_k=k))."""
    top = {hook: f for hook, f in output.sae_features.items() if isinstance(f, tuple)}
    if not top:
        raise ValueError("output: no top-k SAE features captured; generate with Capture(sae=sae, top_k=8)")
    hook, (ids, values) = next(iter(top.items()))
    positions = output.activation_positions.tolist()
    return {"name": name, "hook": hook, "positions": positions, "ids": ids.tolist(), "values": _doubles(values)}


def lens_ids(lens: dict[str, Any]) -> list[int]:
    """Every token id a logit lens names (its cells' texts)."""
    return sorted({i for layer in lens["layers"] for row in layer["ids"] for i in row})


def _base64(t: torch.Tensor) -> str:
    """float32 values as base64 of their little-endian bytes (the page reads them as a Float32Array)."""
    return base64.b64encode(t.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")


def _doubles(t: torch.Tensor) -> list:
    """float32 values as the doubles they equal (JSON's numbers), so they read back exactly."""
    return t.double().tolist()
