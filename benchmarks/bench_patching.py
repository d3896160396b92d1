"""Activation patching sweeps: vlens.patching (many patches to a packed forward) against the same sweep one
forward per patch — TransformerLens's `patching` module looping over vlens's HookedLM, and an HF forward per
patch with the clean row put in by a forward pre-hook — in one run; and attribution patching's estimate of
the sweep (one forward and one backward of the corrupted run, gradients at vlens's backward hooks). Then path
patching from every head to the logits (ARENA's get_path_patch_head_to_final_resid_post: the clean run with one
sender head's output from the corrupted run and every other head frozen): vlens.patching (a layer's senders
packed into forwards) against ARENA's loop over vlens's HookedLM and an HF forward per sender (forward pre-hooks
on each o_proj put the frozen and patched head outputs in). Then edge attribution patching (EAP, and EAP-IG with 5
steps) over every edge of the model, timed against one HF forward of the batch; which heads its strongest edges
to the logits name, beside path patching's.

    .venv/bin/python benchmarks/bench_patching.py [--repeats 2]

SmolLM2-135M float32 on this CPU; a clean/corrupted prompt pair of one batch; resid_pre by (layer, position),
every layer and position (30 x positions patches); the metric is the logit difference of two answers at the
last position. The three give the same numbers (printed: the largest difference).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from bench_generate import best_alternating
from transformers import AutoModelForCausalLM

from vlens import HookedLM, patching
from vlens.edge_attribution import edge_attribution_patching
from vlens.loader import resolve_model_path

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


def repeats_and_models(doc: str) -> tuple[int, HookedLM, torch.nn.Module]:
    """--repeats from the command line (a script documented by `doc`), and SmolLM2 float32 as vlens's HookedLM
    and as HF's model."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    repeats = ap.parse_args().repeats
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32).eval()
    return repeats, HookedLM(dtype="float32", device="cpu"), hf


def main() -> None:
    repeats, hooked, hf = repeats_and_models(__doc__)
    clean, corrupted = hooked.to_tokens(CLEAN), hooked.to_tokens(CORRUPTED)
    assert clean.shape == corrupted.shape
    mary, john = hooked.to_single_token(" Mary"), hooked.to_single_token(" John")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, mary] - logits[:, -1, john]).mean()

    _, cache = hooked.run_with_cache(clean, names_filter="blocks.*.hook_resid_pre")
    results = {}

    def ours():
        results["vlens"] = patching.get_act_patch_resid_pre(hooked, corrupted, cache, metric)

    def transformer_lens_loop():
        from transformer_lens import patching as theirs

        results["tl"] = theirs.get_act_patch_resid_pre(hooked, corrupted, cache, metric)

    def hf_loop():
        with torch.inference_mode():
            hidden = hf(clean, output_hidden_states=True).hidden_states  # hidden_states[L]: block L's input
            out = torch.zeros(hooked.cfg.n_layers, clean.shape[1])
            for layer in range(hooked.cfg.n_layers):
                for pos in range(clean.shape[1]):
                    def put(module, args, layer=layer, pos=pos):
                        args[0][:, pos] = hidden[layer][:, pos]

                    handle = hf.model.layers[layer].register_forward_pre_hook(put)
                    try:
                        out[layer, pos] = metric(hf(corrupted).logits)
                    finally:
                        handle.remove()
        results["hf"] = out

    def attribution():
        """The sweep estimated from one forward and backward of the corrupted run (the clean run's cache is
        the sweep's too): (clean - corrupted) . gradient of the metric, at every layer and position."""
        grads = {}
        with hooked.hooks(bwd_hooks=[("blocks.*.hook_resid_pre", lambda g, hook: grads.__setitem__(hook.name, g))]):
            logits, corrupted_cache = hooked.run_with_cache(corrupted, names_filter="blocks.*.hook_resid_pre")
            value = metric(logits)
            value.backward()
        results["attribution"] = value.detach() + torch.stack([
            ((cache["resid_pre", L] - corrupted_cache["resid_pre", L]) * grads[f"blocks.{L}.hook_resid_pre"]).sum(-1)[0]
            for L in range(hooked.cfg.n_layers)
        ])  # fmt: skip

    t_vlens, t_tl, t_hf, t_attr = best_alternating([ours, transformer_lens_loop, hf_loop, attribution], repeats)
    patches = hooked.cfg.n_layers * clean.shape[1]
    differs = max((results[k] - results["hf"]).abs().max().item() for k in ("vlens", "tl"))
    print(f"\nresid_pre patching sweep, SmolLM2-135M float32, {patches} patches of a {clean.shape[1]}-token prompt; "
          f"largest difference from HF's numbers {differs:.1e} (metric range {results['hf'].min():.2f}.."
          f"{results['hf'].max():.2f})")  # fmt: skip
    print(f"{'case':<58}{'s':>8}{'vs HF':>10}")
    print(f"{'HF, a forward per patch (a pre-hook puts the clean row in)':<58}{t_hf:>8.2f}{1.0:>9.2f}x")
    print(f"{'TransformerLens patching over vlens HookedLM (a forward each)':<58}{t_tl:>8.2f}{t_tl / t_hf:>9.2f}x")
    print(f"{'vlens.patching (patches packed into forwards)':<58}{t_vlens:>8.2f}{t_vlens / t_hf:>9.2f}x")
    r = torch.corrcoef(torch.stack([results["attribution"].flatten(), results["hf"].flatten()]))[0, 1].item()
    print(f"{f'attribution patching, its estimate (r = {r:.2f} with the sweep)':<58}{t_attr:>8.2f}{t_attr / t_hf:>9.3f}x")
    path_patching(hooked, hf, clean, corrupted, metric, repeats)


def path_patching(hooked: HookedLM, hf: torch.nn.Module, orig: torch.Tensor, new: torch.Tensor, metric, repeats: int):
    """Every head to the logits: the orig (clean) run, one sender's output from the new (corrupted) run, every
    other head's frozen at the orig run's."""
    n, heads, d_head = hooked.cfg.n_layers, hooked.cfg.n_heads, hooked.cfg.d_head
    new_cache = hooked.run_with_cache(new, names_filter="blocks.*.attn.hook_z")[1]
    orig_cache = hooked.run_with_cache(orig, names_filter="blocks.*.attn.hook_z")[1]
    results = {}

    def ours():
        results["vlens"] = patching.get_path_patch_head_to_final_resid_post(hooked, orig, new_cache, metric)

    def arena_loop():
        out = torch.zeros(n, heads)
        for sender in range(n):
            for head in range(heads):
                def patch_or_freeze(z, hook, sender=sender, head=head):
                    z[...] = orig_cache[hook.name]
                    if hook.layer() == sender:
                        z[:, :, head] = new_cache[hook.name][:, :, head]

                out[sender, head] = metric(hooked.run_with_hooks(orig, fwd_hooks=[("blocks.*.attn.hook_z", patch_or_freeze)]))
        results["arena"] = out

    def hf_loop():
        with torch.inference_mode():
            zs = {}
            for name, tokens in (("orig", orig), ("new", new)):
                handles = [layer.self_attn.o_proj.register_forward_pre_hook(
                    lambda m, args, i=i, name=name: zs.__setitem__((name, i), args[0].clone()))
                    for i, layer in enumerate(hf.model.layers)]  # fmt: skip
                hf(tokens)
                for h in handles:
                    h.remove()
            out = torch.zeros(n, heads)
            for sender in range(n):
                for head in range(heads):
                    def put(module, args, layer, sender=sender, head=head):
                        z = zs[("orig", layer)].clone()
                        if layer == sender:
                            cols = slice(head * d_head, (head + 1) * d_head)
                            z[..., cols] = zs[("new", layer)][..., cols]
                        return (z,)

                    handles = [layer.self_attn.o_proj.register_forward_pre_hook(partial(put, layer=i))
                               for i, layer in enumerate(hf.model.layers)]  # fmt: skip
                    try:
                        out[sender, head] = metric(hf(orig).logits)
                    finally:
                        for h in handles:
                            h.remove()
        results["hf"] = out

    t_vlens, t_arena, t_hf = best_alternating([ours, arena_loop, hf_loop], repeats)
    differs = max((results[k] - results["hf"]).abs().max().item() for k in ("vlens", "arena"))
    print(f"\npath patching, every head to the logits: {n * heads} senders; largest difference from HF's numbers "
          f"{differs:.1e} (metric range {results['hf'].min():.2f}..{results['hf'].max():.2f})")  # fmt: skip
    print(f"{'case':<58}{'s':>8}{'vs HF':>10}")
    print(f"{'HF, a forward per sender (o_proj pre-hooks)':<58}{t_hf:>8.2f}{1.0:>9.2f}x")
    print(f"{'ARENA loop over vlens HookedLM (a forward per sender)':<58}{t_arena:>8.2f}{t_arena / t_hf:>9.2f}x")
    print(f"{'vlens.patching (senders packed into forwards)':<58}{t_vlens:>8.2f}{t_vlens / t_hf:>9.2f}x")
    edge_attribution(hooked, hf, orig, new, metric, results["vlens"], repeats)


def edge_attribution(hooked: HookedLM, hf: torch.nn.Module, orig: torch.Tensor, new: torch.Tensor, metric,
                     path: torch.Tensor, repeats: int) -> None:  # fmt: skip
    """Every edge scored from the orig (clean) and new (corrupted) runs, timed against an HF forward."""
    out = {}

    def hf_forward():
        with torch.inference_mode():
            hf(new)

    def eap(steps: int):
        out[steps] = edge_attribution_patching(hooked, orig, new, metric, steps)

    t_hf, t_eap, t_ig = best_alternating([hf_forward, partial(eap, 1), partial(eap, 5)], repeats)
    scores, upstream, downstream = out[1]
    heads = [i for i, label in enumerate(upstream) if label.startswith("L")]
    direct = scores[heads, downstream.index("logits")].abs()
    top = {upstream[heads[i]] for i in direct.argsort(descending=True)[:5].tolist()}
    moved = {f"L{i // path.shape[1]}H{i % path.shape[1]}" for i in path.flatten().sub(path.median()).abs().argsort(
        descending=True)[:5].tolist()}  # fmt: skip
    print(f"\nedge attribution patching: {scores.numel()} node pairs ({int((scores != 0).sum())} edges scored); "
          f"its five strongest head -> logits edges, {len(top & moved)} of path patching's five heads")
    print(f"{'case':<58}{'s':>8}{'vs HF':>10}")
    print(f"{'HF, one forward of the batch':<58}{t_hf:>8.2f}{1.0:>9.2f}x")
    print(f"{'vlens EAP (a clean forward, a corrupted forward and backward)':<58}{t_eap:>8.2f}{t_eap / t_hf:>9.2f}x")
    print(f"{'vlens EAP-IG, 5 steps':<58}{t_ig:>8.2f}{t_ig / t_hf:>9.2f}x")


if __name__ == "__main__":
    main()
