"""TransformerLens's optional hooks — set_use_attn_result, set_use_split_qkv_input, set_use_attn_in,
set_use_hook_mlp_in — against TransformerLens with the same flags: their values, the logits after editing
them and the gradients at them, on a tiny GPT-2 and a tiny Llama with grouped-query attention; reading them
changes no number; the families without a TransformerLens twin here take the per-head path exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build, transformer_lens_gpt2, transformer_lens_llama
from transformers import Gemma3TextConfig, GPTNeoXConfig

from vlens import HookedLM
from vlens.capture.names import HookSpecError

TOL = 1e-5
TOKENS = torch.tensor([[5, 17, 99, 230, 3, 41, 7, 250, 12], [60, 22, 140, 33, 290, 11, 12, 8, 1]])
FLAGS = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
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
    # the engine's requests do not name them
    with pytest.raises(HookSpecError, match=r"set_use_split_qkv_input\(True\)"):
        hooked.llm.trace([[1, 2, 3]], hooks=["blocks.0.hook_q_input"])
    assert "blocks.0.hook_q_input" not in hooked.llm.hook_names()


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
