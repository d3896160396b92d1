"""Attribution patching: activation patching estimated from one forward and one backward pass. For each
layer and position, (clean − corrupted) · ∂metric/∂activation on the corrupted run, the first-order change
of the metric if that activation were patched in (Nanda's attribution patching, with TransformerLens's calls:
a backward hook keeps the gradients). Printed beside the real patching sweep it estimates (examples/patching_ioi.py),
a forward per patch, and how well the two agree.

    .venv/bin/python examples/attribution_patching_ioi.py
"""

import torch

from vlens import HookedLM, patching

model = HookedLM(dtype="float32", device="cpu")
clean = model.to_tokens("When Mary and John went to the store, John gave a drink to")
corrupted = model.to_tokens("When Mary and John went to the store, Mary gave a drink to")
mary, john = model.to_single_token(" Mary"), model.to_single_token(" John")
names = "blocks.*.hook_resid_pre"


def logit_diff(logits):
    return (logits[:, -1, mary] - logits[:, -1, john]).mean()


clean_logits, clean_cache = model.run_with_cache(clean, names_filter=names)
grads = {}
with model.hooks(bwd_hooks=[(names, lambda grad, hook: grads.__setitem__(hook.name, grad))]):
    corrupted_logits, corrupted_cache = model.run_with_cache(corrupted, names_filter=names)
    corrupted_diff = logit_diff(corrupted_logits)
    corrupted_diff.backward()
clean_diff = logit_diff(clean_logits)
layers = range(model.cfg.n_layers)
estimate = torch.stack([
    ((clean_cache["resid_pre", L] - corrupted_cache["resid_pre", L]) * grads[f"blocks.{L}.hook_resid_pre"]).sum(-1)[0]
    for L in layers
])  # fmt: skip
actual = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, logit_diff) - corrupted_diff.detach()
scale = (clean_diff - corrupted_diff).detach()  # 1: the patch restores the clean answer's lead; 0: it changes nothing
estimate, actual = estimate / scale, actual / scale
correlation = torch.corrcoef(torch.stack([estimate.flatten(), actual.flatten()]))[0, 1].item()
tokens = model.to_str_tokens(clean)
shown = [(clean != corrupted)[0].nonzero()[0, 0].item(), len(tokens) - 2, len(tokens) - 1]  # the name; the end
print(f"logit difference Mary - John: clean {clean_diff:.2f}, corrupted {corrupted_diff:.2f}")
print(f"attribution vs activation patching over {estimate.numel()} (layer, position) pairs: r = {correlation:.3f}")
print("layer  " + " ".join(f"{tokens[p].strip():>11}" for p in shown) + "   (estimate / patched)")
for layer in range(0, model.cfg.n_layers, 3):
    print(f"{layer:>5}  " + " ".join(f"{estimate[layer, p]:5.2f}/{actual[layer, p]:5.2f}" for p in shown))
