"""Gradients at hooks (HookedLM's backward hooks and run_with_cache(incl_bwd=True)) against TransformerLens's own
autograd on the same GPT-2 weights, and against HF's autograd through its own modules on a grouped-query Llama,
on Gemma 2 and on gpt-oss, each text run packed with texts of other lengths."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build, transformer_lens_gpt2
from hf_reference import family_of
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig

from vlens import HookedLM

TOL = 1e-5  # ‖a − b‖ / ‖b‖ of a gradient, float32


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    path, reference = transformer_lens_gpt2(tmp_path_factory.mktemp("gpt2"), initializer_range=0.1)
    return HookedLM(path, dtype="float32", device="cpu"), reference


TOKENS = torch.tensor([[5, 17, 99, 230, 3, 41, 7, 250, 12], [60, 22, 140, 33, 290, 11, 12, 8, 1]])


def test_run_with_cache_incl_bwd_gives_transformer_lens_s_gradients(gpt2_pair):
    """Every hook's "_grad" entry, attention scores and patterns included, equals TransformerLens's but where
    the two differ by design: TransformerLens runs ln1 three times (once for each of the query, key and value
    inputs), so its cached ln1 gradient is the last call's, the queries' share only; vlens's is the whole
    gradient at ln1, checked here by the chain rule through its scale. (TransformerLens's mlp.hook_pre and
    unembed.hook_in are taps vlens does not have.)"""
    hooked, reference = gpt2_pair
    loss_tl, theirs = reference.run_with_cache(TOKENS, return_type="loss", incl_bwd=True)
    loss, ours = hooked.run_with_cache(TOKENS, return_type="loss", incl_bwd=True)
    assert abs(loss.item() - loss_tl.item()) <= 1e-6 * loss_tl.item()
    grads = {k for k in ours if k.endswith("_grad")}
    assert grads == {f"{k}_grad" for k in ours if not k.endswith("_grad")}  # every hook has its gradient
    compared = 0
    for key in sorted(grads):
        if ".ln1." in key or key not in theirs.cache_dict:
            continue
        assert ours[key].shape == theirs[key].shape, key
        assert rel_err(ours[key], theirs[key]) <= TOL, key
        compared += 1
    # per layer: resid x3, q k v z scores pattern, attn and mlp out, ln2's scale and normalized, mlp post; then
    # embed, pos_embed, ln_final's scale and normalized, the logits
    assert compared == 3 * 14 + 5
    for layer in range(3):  # ln1: scale and normalized from the gradient at its output and each other
        p = f"blocks.{layer}.ln1."
        weight = reference.blocks[layer].ln1.w.detach()
        through_out = ours[p + "hook_out_grad"] * weight
        assert rel_err(ours[p + "hook_normalized_grad"], through_out) <= TOL
        scale = -(ours[p + "hook_normalized_grad"] * ours[p + "hook_normalized"]).sum(-1, keepdim=True) / ours[p + "hook_scale"]
        assert rel_err(ours[p + "hook_scale_grad"], scale) <= TOL


def test_backward_hooks_read_and_change_gradients_as_in_transformer_lens(gpt2_pair):
    """TransformerLens's attribution-patching idiom: forward and backward hooks added with add_hook, the model
    called, a metric of its logits backpropagated. The backward hooks see TransformerLens's gradients (patterns
    included); one that zeroes the gradient at layer 1's resid_mid changes the gradients before it as it does
    there; a steering vector added by a forward hook gets TransformerLens's gradient."""
    hooked, reference = gpt2_pair
    filter_ = lambda name: name.endswith(("hook_resid_pre", "hook_pattern", "hook_z"))  # noqa: E731
    seen: dict = {}
    for model in (reference, hooked):
        seen[model] = {}
        vector = torch.zeros(64, requires_grad=True)

        def save(grad, hook, store=seen[model]):
            store[hook.name] = grad.detach().clone()

        def cut(grad, hook):
            return torch.zeros_like(grad)

        model.reset_hooks()
        model.add_hook("blocks.0.hook_resid_post", lambda x, hook, v=vector: x + v)
        model.add_hook(filter_, save, "bwd")
        logits = model(TOKENS)
        (logits[:, -1, 7] - logits[:, -1, 9]).sum().backward()
        seen[model]["vector"] = vector.grad.clone()
        model.reset_hooks()
        cut_seen: dict = {}
        read = lambda g, hook, s=cut_seen: s.__setitem__("blocks.0.hook_resid_pre", g.clone())  # noqa: E731
        with model.hooks(bwd_hooks=[("blocks.1.hook_resid_mid", cut), ("blocks.0.hook_resid_pre", read)]):
            logits = model(TOKENS)
            (logits[:, -1, 7] - logits[:, -1, 9]).sum().backward()
        seen[model]["cut"] = cut_seen["blocks.0.hook_resid_pre"]
    ours, theirs = seen[hooked], seen[reference]
    assert len(ours) == len(theirs) == 3 * 3 + 2
    for key in theirs:
        assert rel_err(ours[key], theirs[key]) <= TOL, key
    assert rel_err(ours["cut"], ours["blocks.0.hook_resid_pre"]) > 0.1  # (the cut changed it)


def test_a_hook_s_ctx_carries_a_value_from_its_forward_hook_to_its_backward_one(gpt2_pair):
    """TransformerLens's hook.ctx: a forward hook leaves the activation there, the backward hook at the same
    point multiplies it by the gradient (a saliency map, activation × gradient per position): the same
    numbers as TransformerLens's; reset_hooks empties ctx (clear_contexts=False keeps it), and hook_dict
    hands out the same points the hooks get."""
    hooked, reference = gpt2_pair
    names = ["blocks.0.hook_resid_post", "blocks.2.attn.hook_z"]
    saliency: dict = {}
    for model in (reference, hooked):
        saliency[model] = {}

        def keep(act, hook):
            hook.ctx["act"] = act.detach()

        def times(grad, hook, out=saliency[model]):
            out[hook.name] = (hook.ctx["act"] * grad).flatten(2).sum(-1)

        model.reset_hooks()
        model.add_hook(lambda name: name in names, keep)
        model.add_hook(lambda name: name in names, times, "bwd")
        model(TOKENS, return_type="loss").backward()
        point = model.hook_dict[names[1]]
        assert "act" in point.ctx
        model.reset_hooks(clear_contexts=False)
        assert "act" in point.ctx
        model.reset_hooks()
        assert point.ctx == {}
    assert sorted(saliency[hooked]) == names
    for name in names:
        assert saliency[hooked][name].shape == (2, 9)
        assert rel_err(saliency[hooked][name], saliency[reference][name]) <= TOL, name


def test_bfloat16_gradients_are_float32_s_to_its_precision(gpt2_pair):
    """The same weights loaded in bfloat16: gradients in the model's dtype (patterns' and scores' too), within
    bfloat16's few percent of float32's."""
    hooked, _ = gpt2_pair
    half = HookedLM(hooked.llm.model_path, dtype="bfloat16", device="cpu")
    names = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_pattern", "blocks.2.attn.hook_attn_scores",
             "blocks.1.ln1.hook_scale"]  # fmt: skip
    (_, full), (_, low) = (m.run_with_cache(TOKENS, names_filter=names, return_type="loss", incl_bwd=True)
                           for m in (hooked, half))  # fmt: skip
    for name in names:
        assert low[f"{name}_grad"].dtype == torch.bfloat16, name
        assert rel_err(low[f"{name}_grad"].float(), full[f"{name}_grad"]) <= 0.06, name


def test_transformer_lens_s_attribution_patching_runs_on_a_hooked_lm(gpt2_pair):
    """TransformerLens 3.9's tools.analysis.attribution_patching (written for its TransformerBridge: hook_dict,
    hooks(fwd_hooks, bwd_hooks), and torch.autograd.grad with respect to the tensors its forward hooks were
    handed) runs on a HookedLM as it is: every node's score (embeddings, each head's output, each MLP's, at
    each position) equals the module's on TransformerLens's own model, averaged over two prompt pairs."""
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    hooked, reference = gpt2_pair
    corrupt = TOKENS.clone()
    corrupt[:, 3] = 77
    metric = lambda logits: logits[0, -1, 7] - logits[0, -1, 9]  # noqa: E731
    theirs, ours = (attribution_patch(m, TOKENS, corrupt, metric).node_scores for m in (reference, hooked))
    assert set(ours) == set(theirs) and len(ours) == 9 * (1 + 3 * (4 + 1))
    nodes = sorted(theirs, key=str)
    assert rel_err(torch.tensor([ours[n] for n in nodes]), torch.tensor([theirs[n] for n in nodes])) <= TOL
    assert any(abs(theirs[n]) > 0.01 for n in nodes)


def _get_cache_fwd_and_bwd(model, tokens, metric, cache_class):
    """The attribution-patching notebook's helper (Nanda), as it is written there: forward and backward hooks
    that keep every non-input activation and its gradient, and both wrapped in the library's ActivationCache."""
    filter_not_qkv_input = lambda name: "_input" not in name  # noqa: E731
    model.reset_hooks()
    cache = {}

    def forward_cache_hook(act, hook):
        cache[hook.name] = act.detach()

    model.add_hook(filter_not_qkv_input, forward_cache_hook, "fwd")
    grad_cache = {}

    def backward_cache_hook(act, hook):
        grad_cache[hook.name] = act.detach()

    model.add_hook(filter_not_qkv_input, backward_cache_hook, "bwd")
    value = metric(model(tokens))
    value.backward()
    model.reset_hooks()
    return value.item(), cache_class(cache, model), cache_class(grad_cache, model)


def test_the_attribution_patching_notebook_s_helper_ports_by_its_imports(gpt2_pair):
    """The notebook's get_cache_fwd_and_bwd with vlens's ActivationCache (TransformerLens's constructor:
    cache_dict, model) on a HookedLM: the metric, and the attribution of each layer's residual stream and of
    each head's output, from the caches' own stack_activation and ["z", L], equal TransformerLens's."""
    from transformer_lens import ActivationCache as TLActivationCache

    from vlens import ActivationCache

    hooked, reference = gpt2_pair
    corrupt = TOKENS.clone()
    corrupt[:, 3] = 77
    metric = lambda logits: (logits[:, -1, 7] - logits[:, -1, 9]).mean()  # noqa: E731
    got = {}
    for model, cache_class in ((reference, TLActivationCache), (hooked, ActivationCache)):
        if model is reference:  # (the notebook's set-up: TransformerLens refuses hooks at its gated points else)
            flags = (model.set_use_attn_result, model.set_use_attn_in, model.set_use_hook_mlp_in)
            for flag in flags:
                flag(True)
        try:
            _, clean, _ = _get_cache_fwd_and_bwd(model, TOKENS, metric, cache_class)
            value, corrupted, grads = _get_cache_fwd_and_bwd(model, corrupt, metric, cache_class)
        finally:
            if model is reference:
                for flag in flags:
                    flag(False)
        resid = ((clean.stack_activation("resid_pre") - corrupted.stack_activation("resid_pre"))
                 * grads.stack_activation("resid_pre")).sum(-1)  # fmt: skip
        heads = torch.stack([((clean["z", L] - corrupted["z", L]) * grads["z", L]).sum(-1) for L in range(3)])
        got[model] = value, resid, heads
    (value, resid, heads), (value_tl, resid_tl, heads_tl) = got[hooked], got[reference]
    assert abs(value - value_tl) <= 1e-5 * abs(value_tl)
    assert resid.shape == resid_tl.shape == (3, 2, 9) and rel_err(resid, resid_tl) <= TOL
    assert heads.shape == heads_tl.shape == (3, 2, 9, 4) and rel_err(heads, heads_tl) <= TOL


def test_caching_hooks_and_hook_bookkeeping_as_transformer_lens_has_them(gpt2_pair):
    """add_caching_hooks (forward values and, incl_bwd, gradients, patterns among them; filled by the forward and
    the backward after it), add_perma_hook, remove_all_hook_fns, forward and all_head_labels: TransformerLens's
    calls and numbers."""
    hooked, reference = gpt2_pair
    wanted = lambda name: name.endswith(("hook_resid_mid", "hook_pattern"))  # noqa: E731
    caches = {}
    for model in (reference, hooked):
        model.reset_hooks(including_permanent=True)
        caches[model] = model.add_caching_hooks(wanted, incl_bwd=True)
        model.forward(TOKENS)[:, -1, 7].sum().backward()
        model.reset_hooks()
    ours, theirs = caches[hooked], caches[reference]
    assert sorted(ours) == sorted(theirs) and len(ours) == 3 * 2 * 2
    assert all(rel_err(ours[k], theirs[k]) <= TOL for k in theirs)
    assert hooked.all_head_labels() == reference.all_head_labels()
    calls = []
    hooked.add_perma_hook("blocks.0.hook_resid_pre", lambda x, hook: calls.append(hook.name))
    hooked.reset_hooks()
    hooked(TOKENS)
    hooked.remove_all_hook_fns(including_permanent=True)
    hooked(TOKENS)
    assert calls == ["blocks.0.hook_resid_pre"] and torch.equal(hooked.forward(TOKENS), hooked(TOKENS))
    logits = hooked(TOKENS)
    mask = torch.ones_like(TOKENS).bool()
    mask[1, 6:] = False
    for kwargs in ({}, {"per_token": True}, {"attention_mask": mask}, {"attention_mask": mask, "per_token": True}):
        ours, theirs = hooked.loss_fn(logits, TOKENS, **kwargs), reference.loss_fn(logits, TOKENS, **kwargs)
        assert ours.shape == theirs.shape and rel_err(ours, theirs) <= 1e-6, kwargs
    assert hooked.to("cpu") is hooked.cpu() is hooked
    with pytest.raises(ValueError, match=r"^device: this model is on cpu; vlens loads a model onto one device"):
        hooked.cuda(0)


def _hf_grads(hf, ids: list[int], metric) -> dict[str, torch.Tensor]:
    """vlens hook name -> d metric / d value through HF's own modules (eager attention) for one text: each
    layer's input and output (the residual stream), and the taps hf_reference's table finds as a module's
    output (ln1.hook_out, hook_attn_out, hook_mlp_out, ...) or input (hook_resid_mid, attn.hook_z,
    mlp.hook_post), and the attention scores (the softmax's input) and pattern of each layer."""
    _, family = family_of(hf)
    seen: dict[str, torch.Tensor] = {}
    handles = []

    def keep(module, key, output: bool):
        def hook(m, args, out):
            value = out if output else args[0]
            seen[key] = value[0] if isinstance(value, tuple) else value

        handles.append(module.register_forward_hook(hook))

    for layer, block in enumerate(hf.get_submodule(family.layers)):
        p = f"blocks.{layer}."
        keep(block, p + "hook_resid_post", True)
        for kind, path in family.outputs.items():
            keep(block.get_submodule(path), p + kind, True)
        for kind, path in family.inputs.items():
            if not (kind == "mlp.hook_post" and hasattr(block.mlp, "experts")):  # (routed experts: no one MLP)
                keep(block.get_submodule(path), p + kind, False)
    scores = []
    softmax = torch.nn.functional.softmax

    def recording(x, dim=None, *args, **kwargs):
        if x.dim() == 4:  # (attention's; an MoE router's softmax is 2-d)
            scores.append(x)
        return softmax(x, dim, *args, **kwargs)

    hf.set_attn_implementation("eager")
    embedded = hf.get_submodule(family.embed)(torch.tensor([ids])).detach().requires_grad_()
    torch.nn.functional.softmax = recording
    try:
        out = hf(inputs_embeds=embedded, output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        torch.nn.functional.softmax = softmax
        for h in handles:
            h.remove()
    for layer, (s, a) in enumerate(zip(scores, out.attentions, strict=True)):
        seen[f"blocks.{layer}.hook_resid_pre"] = out.hidden_states[layer]  # (the very tensor each layer is given)
        seen[f"blocks.{layer}.attn.hook_attn_scores"], seen[f"blocks.{layer}.attn.hook_pattern"] = s, a
    names = list(seen)
    grads = torch.autograd.grad(metric(out.logits[0]), [seen[n] for n in names])
    # (gpt-oss's softmax reads [scores, sink] less their maximum, which moves no gradient: the scores' are its first)
    width = out.attentions[0].shape[-1]
    return {n: g[0][..., :width] if n.endswith("hook_attn_scores") else g[0] for n, g in zip(names, grads)}


GRADIENT_FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "gemma2": lambda: Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                   query_pre_attn_scalar=16, attn_logit_softcapping=30.0,
                                   final_logit_softcapping=20.0),
    # attention sinks, routed experts (through the grouped GEMM's backward)
    "gpt_oss": lambda: GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=6),
}  # fmt: skip


@pytest.mark.parametrize("family", list(GRADIENT_FAMILIES))
def test_gradients_of_packed_texts_equal_hf_s_autograd_text_by_text(family, tmp_path):
    """A grouped-query Llama (rotary, 2 KV heads for 4) and Gemma 2 (a sliding window of 6, soft-capped scores
    and logits, norms after attention and MLP) run on three texts of different lengths in one packed forward:
    the gradient of a metric summed over the texts at each hook equals, for each text, HF's autograd of its
    own metric through its own modules (a text's gradient depends on nothing of the others'), at its positions;
    zeros past its end. Scores are compared where a key is visible (elsewhere both are 0)."""
    path = build(GRADIENT_FAMILIES[family](), tmp_path, family)
    hooked = HookedLM(path, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (11, 4, 7)]
    metric = lambda logits: logits[-1, 5] - logits[-1, 6] + logits[:, 8].mean()  # noqa: E731
    grads: dict[str, torch.Tensor] = {}

    def save(grad, hook):
        grads[hook.name] = grad.detach().clone()

    names = [f"blocks.{L}.{k}" for L in range(3) for k in (
        "hook_resid_pre", "ln1.hook_out", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
        "hook_attn_out", "hook_resid_mid", "mlp.hook_post", "hook_mlp_out", "hook_resid_post")]  # fmt: skip
    names = [name for name in names if name in hooked.llm.hook_names()]  # (routed experts: no mlp.hook_post)
    widths = torch.tensor([len(t) for t in texts])
    tokens = torch.zeros(3, 11, dtype=torch.long)
    for i, t in enumerate(texts):
        tokens[i, : len(t)] = torch.tensor(t)
    mask = torch.arange(11)[None, :] < widths[:, None]
    _, plain = hooked.run_with_cache(tokens, attention_mask=mask, names_filter=names)  # (in inference mode)
    with hooked.hooks(bwd_hooks=[(names, save)]):  # the same taps captured again, in a forward with a graph
        logits, cache = hooked.run_with_cache(tokens, attention_mask=mask, names_filter=names)
        sum(metric(logits[i, : len(t)]) for i, t in enumerate(texts)).backward()
    assert all(torch.equal(cache[n], plain[n]) for n in names)
    assert sorted(grads) == sorted(names)
    for i, text in enumerate(texts):
        n = len(text)
        reference = _hf_grads(hf, text, metric)
        for name in names:
            ours, theirs = grads[name][i], reference[name]
            if name.endswith(("hook_attn_scores", "hook_pattern")):  # [heads, q, k]
                assert not ours[:, :n, n:].any() and not ours[:, n:].any(), name
                ours = ours[:, :n, :n]
                if name.endswith("hook_attn_scores"):
                    visible = torch.ones(n, n).tril().bool()
                    ours, theirs = ours[:, visible], theirs[:, visible]
            else:
                assert not ours[n:].any(), name
                ours = ours[:n].reshape(theirs.shape)
            assert rel_err(ours, theirs) <= TOL, (i, name, rel_err(ours, theirs))


def test_gradients_ask_for_what_they_need_and_cost_nothing_otherwise(gpt2_pair):
    """Errors name the field and the way out, before any work; a forward with no hooks builds no graph; a
    backward hook at a pattern may read but not replace; forwards and generation after a backward run as before."""
    hooked, _ = gpt2_pair
    before = hooked.generate(TOKENS[:1], max_new_tokens=4, do_sample=False, return_type="tokens", verbose=False)
    with pytest.raises(ValueError, match=r"^incl_bwd: backpropagates a scalar, so it needs return_type='loss' \(got 'logits'\)"):
        hooked.run_with_cache(TOKENS, incl_bwd=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^incl_bwd: gradients are off here"):
        hooked.run_with_cache(TOKENS, return_type="loss", incl_bwd=True)
    with pytest.raises(ValueError, match=r"^fwd_hooks: the function at blocks.1.attn.hook_pattern returned a tensor"):
        hooked.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda x, hook: x)])
    assert not hooked(TOKENS).requires_grad  # no hooks: inference mode, as ever
    logits = hooked.run_with_hooks(TOKENS, bwd_hooks=[("blocks.1.attn.hook_pattern", lambda g, hook: g * 2)])
    with pytest.raises(ValueError, match=r"^bwd_hooks: the function at blocks.1.attn.hook_pattern returned a tensor"):
        logits[0, -1, 3].backward()
    with torch.no_grad():  # hooks in force but gradients off: nothing to differentiate, nothing recorded
        assert not hooked.run_with_hooks(TOKENS, bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, hook: g)]).requires_grad
    after = hooked.generate(TOKENS[:1], max_new_tokens=4, do_sample=False, return_type="tokens", verbose=False)
    assert after.tolist() == before.tolist()
    _, cache = hooked.run_with_cache(TOKENS, names_filter="blocks.1.hook_resid_post")
    _, again = hooked.run_with_cache(TOKENS, names_filter="blocks.1.hook_resid_post", return_type="loss", incl_bwd=True)
    assert torch.equal(cache["blocks.1.hook_resid_post"], again["blocks.1.hook_resid_post"])
    names = ["blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern"]  # positions kept of gradients as of values
    _, whole = hooked.run_with_cache(TOKENS, names_filter=names, return_type="loss", incl_bwd=True)
    _, last = hooked.run_with_cache(TOKENS, names_filter=names, return_type="loss", incl_bwd=True, pos_slice=-1)
    assert torch.equal(last["blocks.1.hook_resid_post_grad"], whole["blocks.1.hook_resid_post_grad"][:, -1])
    assert torch.equal(last["blocks.1.attn.hook_pattern_grad"], whole["blocks.1.attn.hook_pattern_grad"][:, :, -1])


def test_a_forward_with_a_graph_runs_the_reference_attention_whatever_the_engine_s(gpt2_pair, tmp_path):
    """An engine on FlexAttention (or FlashInfer, which has no backward) differentiates through sdpa: the same
    gradients, bit for bit, as an engine on sdpa."""
    hooked, _ = gpt2_pair
    flex = HookedLM(hooked.llm.model_path, dtype="float32", device="cpu", attention_backend="flex", enforce_eager=True)
    assert flex.llm.stats().attention_backend == "flex"
    names = ["blocks.0.hook_resid_pre", "blocks.2.attn.hook_pattern"]
    (_, a), (_, b) = (m.run_with_cache(TOKENS, names_filter=names, return_type="loss", incl_bwd=True) for m in (hooked, flex))
    assert all(torch.equal(a[f"{n}_grad"], b[f"{n}_grad"]) for n in names)


def test_the_attribution_patching_example_estimates_the_patching_sweep(smol_path, capsys):
    """examples/attribution_patching_ioi.py on SmolLM2: one forward and backward of the corrupted run estimate
    the 420 patches of the resid_pre sweep (r ≥ 0.8 with the sweep itself); late at the last position the
    estimate is within 0.15 of the patch's effect, and at the name, where the patch replaces the whole token
    (far from linear), it has the sign and the layers of the patch but falls short of it."""
    import runpy
    from pathlib import Path

    ran = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "attribution_patching_ioi.py"), run_name="__main__")
    estimate, actual, name = ran["estimate"], ran["actual"], ran["shown"][0]
    assert ran["correlation"] >= 0.8 and estimate.shape == actual.shape == (30, 14)
    assert (estimate[24:, -1] - actual[24:, -1]).abs().max() < 0.15 and actual[24:, -1].min() > 0.9
    assert (estimate[:20, name] > 0.1).all() and (actual[:20, name] > 0.95).all()
    assert "r = 0.8" in capsys.readouterr().out
