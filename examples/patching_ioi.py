"""Where does SmolLM2 carry the indirect object? Activation patching of the residual stream, layer by position,
as TransformerLens's patching module does it (the same calls), every patch of the sweep run at once.

    .venv/bin/python examples/patching_ioi.py
"""

from vlens import HookedLM, patching

model = HookedLM(dtype="float32", device="cpu")
clean = model.to_tokens("When Mary and John went to the store, John gave a drink to")
corrupted = model.to_tokens("When Mary and John went to the store, Mary gave a drink to")
mary, john = model.to_single_token(" Mary"), model.to_single_token(" John")


def logit_diff(logits):
    return (logits[:, -1, mary] - logits[:, -1, john]).mean()


clean_logits, clean_cache = model.run_with_cache(clean, names_filter="blocks.*.hook_resid_pre")
clean_diff, corrupted_diff = logit_diff(clean_logits), logit_diff(model(corrupted))
# 1: the patch restores the clean answer's lead; 0: it changes nothing
recovered = (patching.get_act_patch_resid_pre(model, corrupted, clean_cache, logit_diff) - corrupted_diff) / (
    clean_diff - corrupted_diff
)
tokens = model.to_str_tokens(clean)
print(f"logit difference Mary - John: clean {clean_diff:.2f}, corrupted {corrupted_diff:.2f}")
print("layer  " + " ".join(f"{t.strip()[:6]:>6}" for t in tokens[-6:]))
for layer in range(0, model.cfg.n_layers, 3):
    print(f"{layer:>5}  " + " ".join(f"{v:6.2f}" for v in recovered[layer, -6:].tolist()))
