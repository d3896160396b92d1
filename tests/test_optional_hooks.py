"""TransformerLens's optional hooks — set_use_attn_result, set_use_split_qkv_input, set_use_attn_in,
set_use_hook_mlp_in — against TransformerLens with the same flags: their values, the logits after editing
them and the gradients at them, on a tiny GPT-2 and a tiny Llama with grouped-query attention; reading them
changes no number; the families without a TransformerLens twin here take the per-head path exactly. Then what
is built on them: patching at them, and edge attribution patching (vlens.edge_attribution), edge by edge."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build, transformer_lens_gpt2, transformer_lens_llama
from transformers import Gemma3TextConfig, GPTNeoXConfig

from vlens import Capture, HookedLM, SamplingParams, Steer
from vlens.capture.names import HookSpecError, resolve_hooks

TOL = 1e-5
TOKENS = torch.tensor([[5, 17, 99, 230, 3, 41, 7, 250, 12], [60, 22, 140, 33, 290, 11, 12, 8, 1]])
FLAGS = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
STREAM = "blocks.0.hook_resid_pre"
OPTIONAL = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "attn.hook_result", "hook_mlp_in")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path, reference = transformer_lens_gpt2(tmp_path_factory.mktemp("gpt2"), initializer_range=0.1)
    return HookedLM(path, dtype="float32", device="cpu"), reference


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path, reference = transformer_lens_llama(tmp_path_factory.mktemp("llama"))
    return HookedLM(path, dtype="float32", device="cpu"), reference


def _use(models, flags, on: bool = True) -> None:
    for model in models:
        for flag in flags:
            getattr(model, f"set_{flag}")(on)


@pytest.fixture
def flags(request):
    """Turn these flags on in both models of the pair the test names, and off after it."""
    pair = request.getfixturevalue(request.param[0])
    _use(pair, request.param[1])
    yield pair
    _use(pair, request.param[1], on=False)


def _names(model, layers=range(3)) -> list[str]:
    return [
        f"blocks.{layer}.{hook}" for layer in layers for hook in OPTIONAL if f"blocks.{layer}.{hook}" in model.hook_dict
    ]


@pytest.mark.parametrize("flags", [("gpt2", FLAGS), ("llama", FLAGS[:2] + FLAGS[3:])], indirect=True)
def test_values_equal_transformer_lens_s(flags):
    hooked, reference = flags
    names = _names(hooked)
    assert len(names) == 3 * (6 if hooked.cfg.n_key_value_heads == hooked.cfg.n_heads else 5)
    logits, cache = hooked.run_with_cache(TOKENS, names_filter=names)
    with torch.no_grad():
        ref_logits, ref = reference.run_with_cache(TOKENS, names_filter=names)
    for name in names:
        assert cache[name].shape == ref[name].shape, name
        assert rel_err(cache[name], ref[name]) <= TOL, name
    assert rel_err(logits, ref_logits) <= TOL
    # the short names, and per-head results read from the live hook rather than recomputed
    assert torch.equal(cache["result", 1], cache["blocks.1.attn.hook_result"])
    assert torch.equal(cache["q_input", 2], cache["blocks.2.hook_q_input"])
    heads = cache.stack_head_results(layer=2)
    assert torch.equal(heads[hooked.cfg.n_heads + 1], cache["blocks.1.attn.hook_result"][:, :, 1])


def test_reading_them_changes_no_number(gpt2):
    """A forward that only reads the optional hooks takes the ordinary path: its logits and every other hook are
    bit for bit those of a model with the flags off."""
    hooked, _ = gpt2
    plain_logits, plain = hooked.run_with_cache(TOKENS)
    _use([hooked], FLAGS)
    try:
        logits, cache = hooked.run_with_cache(TOKENS)
        optional = _names(hooked)
    finally:
        _use([hooked], FLAGS, on=False)
    assert len(optional) == 3 * 6 and sorted(set(cache) - set(plain)) == sorted(optional)
    assert torch.equal(logits, plain_logits)
    for name in plain:
        assert torch.equal(cache[name], plain[name]), name


def on_head(head: int, change) -> object:
    """A hook that replaces one head's slice: change(that slice) -> its new values."""

    def fn(value, hook):
        value[:, :, head] = change(value[:, :, head])

    return fn


def _gpt2_edits(delta: torch.Tensor) -> list[tuple[str, object]]:
    return [
        ("blocks.0.hook_k_input", on_head(3, lambda v: v + delta)),  # (a scale would not matter: ln1 comes after)
        ("blocks.0.hook_mlp_in", lambda value, hook: value + delta),
        ("blocks.1.hook_q_input", on_head(1, lambda v: torch.cat([v[:, :1], v[:, :-1]], 1))),  # a position late
        ("blocks.1.attn.hook_result", on_head(2, torch.zeros_like)),
        ("blocks.2.hook_v_input", on_head(0, torch.zeros_like)),
        ("blocks.2.attn.hook_result", on_head(0, lambda v: 3 * v)),
    ]


@pytest.mark.parametrize("flags", [("gpt2", FLAGS[:2] + FLAGS[3:])], indirect=True)
def test_edits_give_transformer_lens_s_logits_gpt2(flags):
    hooked, reference = flags
    delta = torch.randn(64, generator=torch.Generator().manual_seed(0))
    plain = hooked(TOKENS)
    for edit in _gpt2_edits(delta):  # each alone, then all together
        logits = hooked.run_with_hooks(TOKENS, fwd_hooks=[edit])
        with torch.no_grad():
            ref = reference.run_with_hooks(TOKENS, fwd_hooks=[edit])
        assert rel_err(logits, ref) <= TOL, edit[0]
        assert rel_err(logits, plain) > 1e-3, edit[0]  # (the edit matters)
    edits = _gpt2_edits(delta)
    with torch.no_grad():
        ref = reference.run_with_hooks(TOKENS, fwd_hooks=edits)
    assert rel_err(hooked.run_with_hooks(TOKENS, fwd_hooks=edits), ref) <= TOL
    # and in generate, each step's new token alone over the KV cache (its keys and values edited as they were made)
    settings = {"max_new_tokens": 6, "do_sample": False, "stop_at_eos": False, "verbose": False}
    with hooked.hooks(fwd_hooks=edits):
        tokens = hooked.generate(TOKENS, **settings)
    with reference.hooks(fwd_hooks=edits):
        assert torch.equal(tokens, reference.generate(TOKENS, use_past_kv_cache=True, **settings))
    assert not torch.equal(tokens, hooked.generate(TOKENS, **settings))


@pytest.mark.parametrize("flags", [("gpt2", ("use_attn_in",))], indirect=True)
def test_attn_in_edits_all_three_projections_of_one_head(flags):
    hooked, reference = flags
    edit = on_head(2, lambda v: v + torch.linspace(-2, 2, 64))
    for name in ("blocks.0.hook_attn_in", "blocks.2.hook_attn_in"):
        logits = hooked.run_with_hooks(TOKENS, fwd_hooks=[(name, edit)])
        with torch.no_grad():
            ref = reference.run_with_hooks(TOKENS, fwd_hooks=[(name, edit)])
        assert rel_err(logits, ref) <= TOL


@pytest.mark.parametrize("flags", [("llama", FLAGS[:2] + FLAGS[3:])], indirect=True)
def test_edits_under_grouped_query_attention(flags):
    """hook_k_input and hook_v_input have one slice per key-value head: an edit there reaches the keys (values) of
    the two query heads sharing it, one at hook_q_input the queries of one head."""
    hooked, reference = flags
    ramp = torch.linspace(-2, 2, 64)
    edits = [("blocks.0.hook_k_input", on_head(1, lambda v: v + ramp)), ("blocks.1.hook_v_input", on_head(0, torch.zeros_like)),
             ("blocks.2.hook_q_input", on_head(3, torch.neg)), ("blocks.1.attn.hook_result", on_head(1, lambda v: 4 * v)),
             ("blocks.2.hook_mlp_in", lambda value, hook: value + ramp)]  # fmt: skip
    plain = hooked(TOKENS)
    for edit in [*([e] for e in edits), edits]:
        logits = hooked.run_with_hooks(TOKENS, fwd_hooks=edit)
        with torch.no_grad():
            ref = reference.run_with_hooks(TOKENS, fwd_hooks=edit)
        assert rel_err(logits, ref) <= TOL, edit
        assert rel_err(logits, plain) > 1e-3, edit


def test_attn_in_needs_a_key_value_head_per_query_head(llama):
    hooked, _ = llama
    with pytest.raises(ValueError, match="grouped-query attention.*set_use_split_qkv_input"):
        hooked.set_use_attn_in(True)
    assert not hooked.cfg.use_attn_in
    with pytest.raises(TypeError, match="use_attn_result: expected True or False"):
        hooked.set_use_attn_result("yes")


def test_a_name_of_a_flag_that_is_off_says_which_turns_it_on(gpt2):
    hooked, _ = gpt2
    with pytest.raises(HookSpecError, match=r"blocks\.1\.attn\.hook_result.*set_use_attn_result\(True\)"):
        hooked.run_with_cache(TOKENS, names_filter="blocks.1.attn.hook_result")
    with pytest.raises(HookSpecError, match=r"set_use_hook_mlp_in\(True\)"):
        hooked.add_hook("blocks.0.hook_mlp_in", lambda value, hook: None)
    assert "blocks.0.hook_q_input" not in hooked.llm.hook_names()  # (the engine's requests name them in full)


@pytest.mark.parametrize("pair", ["gpt2", "llama"])
def test_engine_requests_name_them_in_full(pair, request):
    """LLM.trace and generate's captures and interventions take them by their full names (a glob spelling one out
    too; `blocks.1.*` leaves them out): values equal HookedLM's with the flags on (TransformerLens's, above), heads
    chosen; a steer of one head's result equals that edit as a HookedLM hook, a plain request beside it as alone."""
    hooked, _ = request.getfixturevalue(pair)
    llm, cfg = hooked.llm, hooked.llm.config
    flags = FLAGS if pair == "gpt2" else FLAGS[:2] + FLAGS[3:]
    _use([hooked], flags)
    try:
        names = _names(hooked)
        _, cache = hooked.run_with_cache(TOKENS, names_filter=names)
    finally:
        _use([hooked], flags, on=False)
    traced = llm.trace(TOKENS.tolist(), hooks=names)
    for i, row in enumerate(traced):
        assert sorted(row) == sorted(names)
        for name in names:
            assert rel_err(row[name], cache[name][i]) <= TOL, name
    assert not [n for n in resolve_hooks("blocks.1.*", cfg) if n.split(".", 2)[-1] in OPTIONAL]
    assert list(resolve_hooks("blocks.*.attn.hook_result", cfg)) == [f"blocks.{i}.attn.hook_result" for i in range(3)]
    if pair == "llama":  # (no hook_attn_in under grouped-query attention)
        with pytest.raises(HookSpecError, match=r"'blocks\.0\.hook_attn_in' matches no hook"):
            llm.trace([[1, 2, 3]], hooks="blocks.0.hook_attn_in")
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    result, watch = "blocks.1.attn.hook_result", "blocks.2.hook_resid_post"
    [heads] = llm.generate(TOKENS.tolist()[:1], SamplingParams(**greedy, capture=Capture(hooks=result, heads=[2, 0],
                                                                                           positions="prompt")),
                           use_tqdm=False)  # fmt: skip
    assert rel_err(heads.activations[result], cache[result][0][:, [2, 0]]) <= TOL
    vector = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    steer = Steer(result, vector, heads=[2])
    capture = Capture(hooks=watch, positions="prompt")
    outs = llm.generate(TOKENS.tolist(), [SamplingParams(**greedy, capture=capture, interventions=[steer]),
                                          SamplingParams(**greedy, capture=capture)], use_tqdm=False)  # fmt: skip
    _use([hooked], ("use_attn_result",))
    try:
        edit = [(result, on_head(2, lambda v: v + vector))]
        with hooked.hooks(fwd_hooks=edit):
            _, ref = hooked.run_with_cache(TOKENS, names_filter=watch)
            tokens = hooked.generate(TOKENS[:1], max_new_tokens=4, do_sample=False, stop_at_eos=False, verbose=False)
    finally:
        _use([hooked], ("use_attn_result",), on=False)
    assert rel_err(outs[0].activations[watch], ref[watch][0]) <= TOL
    assert outs[0].outputs[0].token_ids == tokens[0, TOKENS.shape[1] :].tolist()
    [alone] = llm.generate(TOKENS.tolist()[1:], SamplingParams(**greedy, capture=capture), use_tqdm=False)
    assert rel_err(outs[1].activations[watch], alone.activations[watch]) <= TOL
    _, plain = hooked.run_with_cache(TOKENS, names_filter=watch)
    assert rel_err(outs[0].activations[watch], plain[watch][0]) > 1e-3  # (the steer mattered)


@pytest.mark.parametrize(
    "flags", [("gpt2", ("use_split_qkv_input", "use_attn_result", "use_hook_mlp_in"))], indirect=True
)
def test_gradients_at_them_equal_transformer_lens_s(flags):
    hooked, reference = flags
    names = [n for n in _names(hooked) if "attn_in" not in n]
    _, cache = hooked.run_with_cache(TOKENS, names_filter=names, return_type="loss", incl_bwd=True)
    _, ref = reference.run_with_cache(TOKENS, names_filter=names, return_type="loss", incl_bwd=True)
    for name in names:
        assert rel_err(cache[f"{name}_grad"], ref[f"{name}_grad"]) <= TOL, name


@pytest.mark.parametrize(
    "config",
    [
        Gemma3TextConfig(**COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        GPTNeoXConfig(**COMMON, rotary_pct=0.5, use_parallel_residual=True),
    ],
    ids=["gemma3", "neox"],
)  # fmt: skip
def test_every_family_takes_the_per_head_path_exactly(config, tmp_path):
    """An edit that gives back the values it got still sends the forward through the per-head path (each head's
    own ln1 and projection, the heads summed apart from the output projection): the logits stay those of the
    plain forward. Under NeoX's parallel residual the MLP's input is the layer's."""
    hooked = HookedLM(build(config, tmp_path, "m"), dtype="float32", device="cpu")
    for flag in ("use_split_qkv_input", "use_attn_result", "use_hook_mlp_in"):
        getattr(hooked, f"set_{flag}")(True)
    mlp_reads = "blocks.1.hook_resid_pre" if config.model_type == "gpt_neox" else "blocks.1.hook_resid_mid"
    plain, cache = hooked.run_with_cache(TOKENS, names_filter=["blocks.1.hook_mlp_in", mlp_reads])
    assert torch.equal(cache["blocks.1.hook_mlp_in"], cache[mlp_reads])
    same = lambda value, hook: value.clone()
    names = [n for n in _names(hooked) if not n.endswith("mlp_in")]
    logits = hooked.run_with_hooks(TOKENS, fwd_hooks=[(n, same) for n in names])
    assert rel_err(logits, plain) <= TOL


@pytest.mark.parametrize("flags", [("gpt2", ("use_attn_result", "use_split_qkv_input"))], indirect=True)
def test_patching_them_equals_transformer_lens_s(flags):
    """vlens.patching at the optional hooks (each head's result, each head's query input, by layer, position and
    head), many patches to a forward, gives TransformerLens's patching module's metric on its own model."""
    from transformer_lens import patching as theirs

    from vlens import patching as ours

    hooked, reference = flags
    clean, corrupted = TOKENS, TOKENS.clone()
    corrupted[0, 2], corrupted[1, 5] = 98, 40
    weights = torch.randn(*TOKENS.shape, hooked.cfg.d_vocab, generator=torch.Generator().manual_seed(0))

    def metric(logits):
        return (logits * weights).sum()

    with torch.no_grad():
        base = metric(reference(corrupted))
        for name in ("result", "q_input"):
            axes = ["layer", "pos", "head"]
            caches = [m.run_with_cache(clean, names_filter=lambda n, name=name: n.endswith(name))[1] for m in flags]
            want = theirs.generic_activation_patch(reference, corrupted, caches[1], metric,
                                                   theirs.layer_pos_head_vector_patch_setter, name, axes)  # fmt: skip
            got = ours.generic_activation_patch(hooked, corrupted, caches[0], metric,
                                                ours.layer_pos_head_vector_patch_setter, name, axes)  # fmt: skip
            assert got.shape == want.shape == (3, TOKENS.shape[1], 4)
            assert (want - base).abs().max() > 1e-3, name  # (the patches move the metric)
            assert rel_err(got, want) <= TOL, name


@pytest.mark.parametrize("flags", [("llama", ("use_split_qkv_input",))], indirect=True)
def test_patching_key_inputs_counts_key_value_heads(flags):
    """Under grouped-query attention hook_k_input has a slice per key-value head, and a sweep over its heads
    counts those (TransformerLens's axis would count query heads: its own sweep is given the indices)."""
    import pandas as pd
    from transformer_lens import patching as theirs

    from vlens import patching as ours

    hooked, reference = flags
    corrupted = TOKENS.clone()
    corrupted[0, 2], corrupted[1, 5] = 98, 40
    weights = torch.randn(*TOKENS.shape, hooked.cfg.d_vocab, generator=torch.Generator().manual_seed(0))

    def metric(logits):
        return (logits * weights).sum()

    with torch.no_grad():
        caches = [m.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("k_input"))[1] for m in flags]
        got = ours.generic_activation_patch(hooked, corrupted, caches[0], metric, ours.layer_head_vector_patch_setter,
                                            "k_input", ["layer", "head"])  # fmt: skip
        index_df = pd.DataFrame({"layer": [0, 0, 1, 1, 2, 2], "head": [0, 1, 0, 1, 0, 1]})
        want = theirs.generic_activation_patch(reference, corrupted, caches[1], metric,
                                               theirs.layer_head_vector_patch_setter, "k_input", index_df=index_df)  # fmt: skip
    assert got.shape == (3, 2) and rel_err(got.flatten(), want) <= TOL
    assert (want - metric(reference(corrupted))).abs().max() > 1e-3


def _transformer_lens_edges(reference, clean, corrupted, metric, steps: int = 1) -> dict[tuple[str, str], float]:
    """Edge attribution patching on TransformerLens's own model, edge by edge (its optional hooks, its backward
    hooks; EAP-IG's steps as its authors' code takes them, at blocks.0.hook_resid_pre): the reference."""
    cfg, saved, grads, flags = reference.cfg, {}, {}, FLAGS[:2] + FLAGS[3:]
    _use([reference], flags)
    try:
        up = lambda name: name == "hook_embed" or name.endswith(("hook_pos_embed", "hook_result", "hook_mlp_out"))  # noqa: E731
        down = lambda name: name.endswith(("_input", "hook_mlp_in", f"{cfg.n_layers - 1}.hook_resid_post"))  # noqa: E731
        _, clean_cache = reference.run_with_cache(clean, names_filter=lambda name: up(name) or name == STREAM)
        bwd = [(down, lambda grad, hook: grads.__setitem__(hook.name, grads.get(hook.name, 0) + grad.detach() / steps))]
        for k in range(steps):
            fwd = [(up, lambda value, hook: saved.__setitem__(hook.name, value.detach()))] if k == 0 else []
            if k:
                fwd.append((STREAM, lambda value, hook, k=k: value + k / steps * (clean_cache[STREAM] - value)))
            with reference.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
                metric(reference(corrupted)).backward()
    finally:
        _use([reference], flags, on=False)
    delta = {name: clean_cache[name] - saved[name] for name in saved if name != STREAM}
    writes = {"embed": (sum(v for k, v in delta.items() if "embed" in k), -1, 9)}
    reads = {"logits": (grads[f"blocks.{cfg.n_layers - 1}.hook_resid_post"], cfg.n_layers, 0)}
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            writes[f"L{layer}H{h}"] = (delta[f"blocks.{layer}.attn.hook_result"][:, :, h], layer, 0)
            reads[f"L{layer}H{h}.q"] = (grads[f"blocks.{layer}.hook_q_input"][:, :, h], layer, 0)
        for h in range(grads[f"blocks.{layer}.hook_k_input"].shape[2]):
            for part in "kv":
                reads[f"L{layer}H{h}.{part}"] = (grads[f"blocks.{layer}.hook_{part}_input"][:, :, h], layer, 0)
        writes[f"M{layer}"] = (delta[f"blocks.{layer}.hook_mlp_out"], layer, 1)
        reads[f"M{layer}"] = (grads[f"blocks.{layer}.hook_mlp_in"], layer, 1)
    return {
        (u, d): float((value * grad).sum()) if (at, after) < (layer, stage) else 0.0
        for u, (value, at, after) in writes.items()
        for d, (grad, layer, stage) in reads.items()
    }


@pytest.mark.parametrize("pair, steps", [("gpt2", 1), ("llama", 1), ("gpt2", 3), ("llama", 3)])
def test_edge_attribution_equals_transformer_lens_s_edge_by_edge(pair, steps, request):
    """Every edge's score (embeddings, heads and MLPs to later heads' q/k/v inputs, MLP inputs and the logits;
    key-value heads under grouped-query attention), by EAP and by EAP-IG, equals the dot product TransformerLens's
    own hooks give, and the flags are as they were after."""
    from vlens.edge_attribution import edge_attribution_patching

    hooked, reference = request.getfixturevalue(pair)
    corrupted = TOKENS.clone()
    corrupted[0, 2], corrupted[1, 5] = 98, 40
    weights = torch.randn(*TOKENS.shape, hooked.cfg.d_vocab, generator=torch.Generator().manual_seed(0))

    def metric(logits):
        return (logits * weights).sum()

    scores, upstream, downstream = edge_attribution_patching(hooked, TOKENS, corrupted, metric, steps)
    want = _transformer_lens_edges(reference, TOKENS, corrupted, metric, steps)
    got = {(u, d): float(scores[i, j]) for i, u in enumerate(upstream) for j, d in enumerate(downstream)}
    assert got.keys() == want.keys() and len(upstream) == 1 + 3 * 5
    ref = torch.tensor(list(want.values()))
    assert rel_err(torch.tensor([got[k] for k in want]), ref) <= TOL and (ref != 0).sum() > 0.4 * len(ref)
    assert not any(getattr(hooked.cfg, flag) for flag in FLAGS)
    if steps > 1:  # (the interpolation moved the gradients: not plain EAP's)
        plain, _, _ = edge_attribution_patching(hooked, TOKENS, corrupted, metric)
        assert rel_err(scores, plain) > 1e-3
    with pytest.raises(ValueError, match=r"^steps: 0 is not an int >= 1"):
        edge_attribution_patching(hooked, TOKENS, corrupted, metric, 0)


def test_edge_attribution_under_a_parallel_residual_and_its_refusal_for_post_norms(tmp_path):
    """GPT-NeoX's MLP reads the layer's input: no edge from a layer's heads to its own MLP, one to the next layer's.
    Gemma's post-norms stand between every node and the stream: refused by name."""
    from vlens.edge_attribution import edge_attribution_patching

    neox = HookedLM(build(GPTNeoXConfig(**COMMON, rotary_pct=0.5, use_parallel_residual=True), tmp_path, "neox"),
                    dtype="float32", device="cpu")  # fmt: skip
    corrupted = TOKENS.clone()
    corrupted[:, 1] = 7
    scores, upstream, downstream = edge_attribution_patching(neox, TOKENS, corrupted, lambda logits: logits[:, -1].sum())
    at = lambda u, d: float(scores[upstream.index(u), downstream.index(d)])  # noqa: E731
    assert at("L0H1", "M0") == 0.0 and at("L0H1", "M1") != 0.0 and at("M0", "L1H2.k") != 0.0 and at("M1", "L1H2.q") == 0.0
    gemma = HookedLM(build(Gemma3TextConfig(**COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16),
                           tmp_path, "gemma"), dtype="float32", device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match=r"^Gemma3ForCausalLM: a norm stands between each head"):
        edge_attribution_patching(gemma, TOKENS, corrupted, lambda logits: logits.sum())
