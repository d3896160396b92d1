"""Which of SmolLM2's heads move the indirect object's name to the logits, and which heads tell them where to
look? Path patching, as ARENA's IOI exercises do it (the same two functions), every sender of a layer at once;
then edge attribution patching, every edge of the graph from one forward and backward.

    .venv/bin/python examples/path_patching_ioi.py

The orig run is an IOI prompt; the new run (ARENA's "ABC" prompt) names three other people, so it carries no
information about which name to say. A head's path effect: the change of the answer's lead when that head's
output comes from the new run and every other head is frozen (-1: the lead gone, 0: no change).
"""

from vlens import HookedLM, patching
from vlens.edge_attribution import edge_attribution_patching

model = HookedLM(dtype="float32", device="cpu")
orig = model.to_tokens("When Mary and John went to the store, John gave a drink to")
new = model.to_tokens("When Alice and Bob went to the store, Charlie gave a drink to")
mary, john = model.to_single_token(" Mary"), model.to_single_token(" John")


def logit_diff(logits):
    return (logits[:, -1, mary] - logits[:, -1, john]).mean()


orig_diff, new_diff = logit_diff(model(orig)), logit_diff(model(new))


def effect(logits):
    """0: the orig run's lead of Mary over John; -1: the new run's."""
    return (logit_diff(logits) - orig_diff) / (orig_diff - new_diff)


new_cache = model.run_with_cache(new, names_filter="blocks.*.attn.hook_z")[1]
to_logits = patching.get_path_patch_head_to_final_resid_post(model, orig, new_cache, effect)
print(f"logit difference Mary - John: orig {orig_diff:.2f}, new {new_diff:.2f}")
order = to_logits.flatten().abs().argsort(descending=True)[:5].tolist()
movers = [divmod(i, model.cfg.n_heads) for i in order]
print("heads -> logits:  " + "  ".join(f"L{layer}H{head} {to_logits[layer, head]:+.3f}" for layer, head in movers))
# the three heads writing the most to the logits: which heads' outputs change what their queries ask for?
receivers = movers[:3]
to_queries = patching.get_path_patch_head_to_heads(model, orig, new_cache, effect, receivers, "q")
order = to_queries.flatten().abs().argsort(descending=True)[:5].tolist()
senders = [divmod(i, model.cfg.n_heads) for i in order]
print("heads -> queries: " + "  ".join(f"L{layer}H{head} {to_queries[layer, head]:+.3f}" for layer, head in senders))
# every edge at once, to first order: the heads' edges to the logits it ranks first are the heads above
scores, upstream, downstream = edge_attribution_patching(model, orig, new, logit_diff)
direct = scores[:, downstream.index("logits")]
heads = [i for i, label in enumerate(upstream) if label.startswith("L")]
order = sorted(heads, key=lambda i: -abs(direct[i]))[:5]
print("edges -> logits:  " + "  ".join(f"{upstream[i]} {direct[i]:+.3f}" for i in order))
