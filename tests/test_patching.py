"""Activation patching (vlens.patching) against TransformerLens's own `patching` module: the same metric at
every index, whether TransformerLens loops over its HookedTransformer (GPT-2 weights) or over vlens's HookedLM
(a grouped-query Llama), with many patches to each packed forward."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build, transformer_lens_gpt2, transformer_lens_llama
from transformers import GptOssConfig, LlamaConfig

from vlens import HookedLM
from vlens import patching as ours

CLEAN = torch.tensor([[5, 17, 99, 230, 3, 41, 7], [60, 22, 140, 33, 290, 11, 12]])
CORRUPTED = torch.tensor([[5, 17, 98, 230, 3, 40, 7], [61, 22, 140, 33, 290, 11, 12]])


WEIGHTS = torch.randn(*CLEAN.shape, COMMON["vocab_size"], generator=torch.Generator().manual_seed(0))


def weighted(logits: torch.Tensor) -> torch.Tensor:
    """A metric that every position's logits move (a last-position logit difference hardly moves on random
    weights), so that a patch put in at the wrong place shows."""
    return (logits * WEIGHTS).sum()


def assert_same_effects(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor, tolerance: float, name: str):
    """The same metric, and the same change from the unpatched run's (`base`), which is what patching measures:
    every difference small beside the largest change (a patch put in at the wrong place would be as large)."""
    effects = (want - base).abs().max()
    assert effects > 1e-4, name  # (the patches move the metric)
    assert got.shape == want.shape and rel_err(got, want) <= 1e-5, name
    assert (got - want).abs().max() <= tolerance * effects, name


def test_patching_equals_transformer_lens_on_its_own_model(tmp_path):
    """resid_pre by (layer, pos), the heads' outputs by (layer, pos, head) and by (layer, head), mlp_out, the
    attention patterns by (layer, head, dest) and by (layer, head, dest, src) (put in as the heads' outputs
    they make), the five kinds of head patch together, and an explicit DataFrame of indices: vlens and
    TransformerLens's HookedTransformer on the same GPT-2 weights give the same metric at every index."""
    from transformer_lens import patching as theirs

    path, reference = transformer_lens_gpt2(tmp_path)
    hooked = HookedLM(path, dtype="float32", device="cpu")
    caches = {m: m.run_with_cache(CLEAN)[1] for m in (reference, hooked)}
    base = weighted(reference(CORRUPTED))
    for name in ("get_act_patch_resid_pre", "get_act_patch_attn_head_out_by_pos", "get_act_patch_attn_head_out_all_pos",
                 "get_act_patch_mlp_out", "get_act_patch_attn_head_pattern_by_pos",
                 "get_act_patch_attn_head_pattern_dest_src_pos", "get_act_patch_attn_head_all_pos_every"):  # fmt: skip
        want = getattr(theirs, name)(reference, CORRUPTED, caches[reference], weighted)
        got = getattr(ours, name)(hooked, CORRUPTED, caches[hooked], weighted)
        assert_same_effects(got, want, base, 1e-2, name)  # (two libraries' float32 sums: ~5e-3 at worst)
        if name == "get_act_patch_resid_pre":  # layer 0's stream is the embedding: unchanged where the tokens are
            same = (CLEAN == CORRUPTED).all(0)
            assert torch.allclose(got[0, same], weighted(hooked(CORRUPTED)).expand(int(same.sum())), rtol=1e-6)
    import pandas as pd

    index_df = pd.DataFrame({"layer": [2, 0, 1], "pos": [5, 2, 0]})
    want = theirs.generic_activation_patch(reference, CORRUPTED, caches[reference], weighted,
                                           theirs.layer_pos_patch_setter, "resid_post", index_df=index_df)  # fmt: skip
    got, df = ours.generic_activation_patch(hooked, CORRUPTED, caches[hooked], weighted, ours.layer_pos_patch_setter,
                                            "resid_post", index_df=index_df, return_index_df=True)  # fmt: skip
    assert df is index_df
    assert_same_effects(got, want, base, 1e-2, "index_df")


def test_score_patches_equal_transformer_lens_s(tmp_path):
    """Attention scores patched by (layer, head) and by (layer, head, dest) go in as the pattern their changed
    rows make (their softmax) times the corrupted run's values: TransformerLens's generic_activation_patch on
    its own model gives the same metric (weights of a wider init, so attention is far from uniform and a
    score patch moves the metric)."""
    from transformer_lens import patching as theirs

    path, reference = transformer_lens_gpt2(tmp_path, initializer_range=0.1)
    hooked = HookedLM(path, dtype="float32", device="cpu")
    caches = {m: m.run_with_cache(CLEAN)[1] for m in (reference, hooked)}
    base = weighted(reference(CORRUPTED))
    for setter, axes in (("layer_head_pattern_patch_setter", ["layer", "head_index"]),
                         ("layer_head_pos_pattern_patch_setter", ["layer", "head_index", "dest_pos"])):  # fmt: skip
        want = theirs.generic_activation_patch(reference, CORRUPTED, caches[reference], weighted,
                                               getattr(theirs, setter), "attn_scores", index_axis_names=axes)  # fmt: skip
        got = ours.generic_activation_patch(hooked, CORRUPTED, caches[hooked], weighted, getattr(ours, setter),
                                            "attn_scores", index_axis_names=axes)  # fmt: skip
        assert_same_effects(got, want, base, 1e-2, f"scores {axes}")


def test_a_score_patch_softmaxes_over_the_sinks(tmp_path):
    """gpt-oss: a head's patched scores make the pattern a softmax over its sink too, so patching whole score
    rows from the clean run has the very effect of patching the clean run's pattern rows."""
    config = GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=5)  # fmt: skip
    hooked = HookedLM(build(config, tmp_path, "gpt_oss"), dtype="float32", device="cpu")
    assert hooked.blocks[1].attn.sinks.shape == (COMMON["num_attention_heads"],)
    _, clean = hooked.run_with_cache(CLEAN)
    axes = ["layer", "head_index"]
    scores = ours.generic_activation_patch(hooked, CORRUPTED, clean, weighted, ours.layer_head_pattern_patch_setter,
                                           "attn_scores", index_axis_names=axes)  # fmt: skip
    patterns = ours.generic_activation_patch(hooked, CORRUPTED, clean, weighted, ours.layer_head_pattern_patch_setter,
                                             "pattern", index_axis_names=axes)  # fmt: skip
    assert rel_err(scores, patterns) <= 1e-5
    assert (patterns - weighted(hooked(CORRUPTED))).abs().max() > 1e-3


# all copies in one forward; a few rows a forward; a KV cache of 24 blocks (20 free beside the corrupted run's)
@pytest.mark.parametrize("limit, kv_blocks", [(10**6, None), (8, None), (10**6, 24)])
def test_patching_equals_transformer_lens_looping_over_vlens(tmp_path, limit, kv_blocks, monkeypatch):
    """TransformerLens's patching module runs on a HookedLM as it is (one run_with_hooks per index); vlens's
    gives the same numbers with the patches packed, each copy of a text run from its patch's layer and first
    changed position on, at the keys and values of a grouped-query model (2 KV heads for 4 query heads) and
    at resid_mid, as many copies to a forward as the rows' and the free KV blocks' bounds allow; the KV blocks
    it lends are back afterwards."""
    from transformer_lens import patching as theirs

    path = build(LlamaConfig(**{**COMMON, "num_key_value_heads": 2}), tmp_path, "llama")
    per_block = 2 * COMMON["num_hidden_layers"] * 4 * 2 * (COMMON["hidden_size"] // COMMON["num_attention_heads"]) * 4
    hooked = HookedLM(path, dtype="float32", device="cpu", block_size=4,  # (copies share whole blocks, copy slots)
                      kv_cache_memory=kv_blocks and kv_blocks * per_block)  # fmt: skip
    assert kv_blocks is None or len(hooked.llm.engine.blocks.blocks) == kv_blocks
    monkeypatch.setattr(ours, "LOGIT_BYTES", limit * 4 * hooked.cfg.vocab_size)
    _, cache = hooked.run_with_cache(CLEAN)
    base = weighted(hooked(CORRUPTED))
    for name in ("get_act_patch_attn_head_k_by_pos", "get_act_patch_attn_head_v_all_pos", "get_act_patch_resid_mid"):
        want = getattr(theirs, name)(hooked, CORRUPTED, cache, weighted)
        got = getattr(ours, name)(hooked, CORRUPTED, cache, weighted)
        assert_same_effects(got, want, base, 1e-4, name)
    assert got.shape == (COMMON["num_hidden_layers"], CLEAN.shape[1])
    blocks = hooked.llm.engine.blocks
    assert len(blocks.free) == len(blocks.blocks)


def test_a_pattern_patch_under_grouped_query_attention_is_its_heads_outputs(tmp_path):
    """A pattern patch of head h goes in as the output it makes with its key-value head's values (2 query heads to
    each of 2 key-value heads): the same metric as run_with_hooks putting that output in by hand at hook_z."""
    path = build(LlamaConfig(**{**COMMON, "num_key_value_heads": 2}), tmp_path, "llama")
    hooked = HookedLM(path, dtype="float32", device="cpu")
    _, clean = hooked.run_with_cache(CLEAN)
    _, corrupted = hooked.run_with_cache(CORRUPTED)
    got = ours.get_act_patch_attn_head_pattern_all_pos(hooked, CORRUPTED, clean, weighted)
    assert got.shape == (COMMON["num_hidden_layers"], COMMON["num_attention_heads"])
    for layer, head in ((0, 3), (2, 1)):
        v = corrupted["v", layer][:, :, head // 2]  # [batch, src, d_head]
        z = torch.einsum("bqk,bkd->bqd", clean["pattern", layer][:, head], v)

        def put(value, hook, z=z, head=head):
            value[:, :, head] = z

        want = weighted(hooked.run_with_hooks(CORRUPTED, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", put)]))
        assert abs(got[layer, head] - want) <= 1e-5 * abs(want), (layer, head)
    assert (got - weighted(hooked(CORRUPTED))).abs().max() > 1e-3


def test_patching_refuses_what_it_cannot_patch_by_name_and_gives_its_blocks_back(tmp_path):
    path = build(LlamaConfig(**COMMON), tmp_path, "llama")
    hooked = HookedLM(path, dtype="float32", device="cpu")
    _, cache = hooked.run_with_cache(CLEAN)
    with pytest.raises(ValueError, match=r"^index_axis_names: 'token' is not one of layer, pos"):
        ours.generic_activation_patch(hooked, CORRUPTED, cache, weighted, ours.layer_pos_patch_setter,
                                      "resid_pre", index_axis_names=("layer", "token"))  # fmt: skip
    with pytest.raises(ValueError, match=r"^clean_cache: blocks.0.hook_resid_pre is \(2, 6, 64\) there and "
                                         r"\(2, 7, 64\) in the corrupted run"):  # fmt: skip
        ours.get_act_patch_resid_pre(hooked, CORRUPTED, hooked.run_with_cache(CLEAN[:, :6])[1], weighted)
    with pytest.raises(ValueError, match=r"^index_axis_names / index_df: give exactly one"):
        ours.generic_activation_patch(hooked, CORRUPTED, cache, weighted, ours.layer_pos_patch_setter, "resid_pre")

    def fails(logits):
        raise RuntimeError("the metric's own error")

    with pytest.raises(RuntimeError, match="the metric's own error"):
        ours.get_act_patch_resid_pre(hooked, CORRUPTED, cache, fails)
    blocks = hooked.llm.engine.blocks
    assert len(blocks.free) == len(blocks.blocks)  # (the lent blocks are back)


def test_the_ioi_example_finds_the_name_moving_to_the_last_position(smol_path, capsys):
    """examples/patching_ioi.py on SmolLM2: the patch at the name restores the clean answer in the early layers,
    at the last position in the late ones (the indirect-object circuit's shape), elsewhere nothing."""
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "patching_ioi.py"), run_name="__main__")
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    table = {int(row[0]): [float(v) for v in row[1:]] for row in rows}
    assert abs(table[0][1] - 1) < 0.02 and abs(table[27][5] - 1) < 0.1  # John early; "to" late
    assert max(abs(v) for row in table.values() for k, v in enumerate(row) if k not in (1, 5)) < 0.1


def _arena_path_patch(reference, orig_tokens, new_cache, orig_cache, metric, receivers=None, receiver_input="q"):
    """ARENA's path patching as its solutions write it (a forward or two per sender), on TransformerLens's model:
    the sender's hook_z from the new run, every other head's frozen at the orig run's; to the logits, or to the
    receivers' inputs, which a second forward patches in."""
    n, heads = reference.cfg.n_layers, reference.cfg.n_heads
    senders = n if receivers is None else max(layer for layer, _ in receivers)
    names = {f"blocks.{layer}.attn.hook_{receiver_input}" for layer, _ in receivers or ()}
    out = torch.zeros(senders, heads)
    for sender, head in itertools.product(range(senders), range(heads)):

        def patch_or_freeze(z, hook, sender=sender, head=head):
            z[...] = orig_cache[hook.name]
            if hook.layer() == sender:
                z[:, :, head] = new_cache[hook.name][:, :, head]

        freeze = [(lambda name: name.endswith("hook_z"), patch_or_freeze)]
        if receivers is None:
            logits = reference.run_with_hooks(orig_tokens, fwd_hooks=freeze)
        else:
            with reference.hooks(fwd_hooks=freeze):
                _, made = reference.run_with_cache(orig_tokens, names_filter=lambda name: name in names)

            def patch_input(x, hook):
                for layer, h in receivers:
                    if hook.layer() == layer:
                        x[:, :, h] = made[hook.name][:, :, h]

            logits = reference.run_with_hooks(orig_tokens, fwd_hooks=[(lambda name: name in names, patch_input)])
        out[sender, head] = metric(logits)
    return out


def test_path_patching_equals_arena_s_on_transformer_lens(tmp_path):
    """Path patching from every head to the logits, and to receivers' queries and values in two layers (one below
    some senders: they cannot reach it): vlens's sweeps (every sender's copies of a layer in one forward) give
    ARENA's per-sender loops on TransformerLens's own model, the same GPT-2 weights."""
    path, reference = transformer_lens_gpt2(tmp_path, initializer_range=0.1)
    hooked = HookedLM(path, dtype="float32", device="cpu")
    with torch.no_grad():
        orig_cache, new_cache = (reference.run_with_cache(t)[1] for t in (CLEAN, CORRUPTED))
        base = weighted(reference(CLEAN))
        new = hooked.run_with_cache(CORRUPTED, names_filter="blocks.*.attn.hook_z")[1]
        got = ours.get_path_patch_head_to_final_resid_post(hooked, CLEAN, new, weighted)
        want = _arena_path_patch(reference, CLEAN, new_cache, orig_cache, weighted)
        assert_same_effects(got, want, base, 1e-2, "to the logits")
        for receivers, receiver_input in (([(2, 1), (2, 3), (0, 2)], "q"), ([(2, 0), (1, 3)], "v")):
            got = ours.get_path_patch_head_to_heads(hooked, CLEAN, new, weighted, receivers, receiver_input)
            want = _arena_path_patch(reference, CLEAN, new_cache, orig_cache, weighted, receivers, receiver_input)
            assert_same_effects(got, want, base, 1e-2, f"to {receivers} {receiver_input}")
    with pytest.raises(ValueError, match=r"^receiver_input: 'z' is not one of q, k, v"):
        ours.get_path_patch_head_to_heads(hooked, CLEAN, new, weighted, [(2, 1)], "z")
    with pytest.raises(ValueError, match=r"^receiver_heads: \(2, 4\) is not a \(layer, head\)"):
        ours.get_path_patch_head_to_heads(hooked, CLEAN, new, weighted, [(2, 4)], "q")
    assert len(hooked.llm.engine.blocks.free) == len(hooked.llm.engine.blocks.blocks)  # (the sweeps gave theirs back)


def test_path_patching_to_key_value_heads_under_grouped_query_attention(tmp_path):
    """Receivers at "k" are key-value heads, each shared by two query heads: TransformerLens's grouped-query Llama
    caches its keys that way too, and ARENA's loops over it give vlens's metric."""
    path, reference = transformer_lens_llama(tmp_path)
    hooked = HookedLM(path, dtype="float32", device="cpu")
    with torch.no_grad():
        orig_cache, new_cache = (reference.run_with_cache(t)[1] for t in (CLEAN, CORRUPTED))
        new = hooked.run_with_cache(CORRUPTED, names_filter="blocks.*.attn.hook_z")[1]
        receivers = [(2, 1), (1, 0)]
        got = ours.get_path_patch_head_to_heads(hooked, CLEAN, new, weighted, receivers, "k")
        want = _arena_path_patch(reference, CLEAN, new_cache, orig_cache, weighted, receivers, "k")
        assert_same_effects(got, want, weighted(reference(CLEAN)), 1e-2, "to keys")


def test_the_path_patching_example_measures_the_paths_it_names(smol_path, capsys):
    """examples/path_patching_ioi.py on SmolLM2: the head it puts first moves a fifth of the answer's lead or more
    by its paths to the logits alone, as one forward with ARENA's hooks says (that head from the ABC run, every
    other frozen); its senders to the receivers' queries are the layers below the last receiver; edge attribution
    ranks the same heads first."""
    import runpy
    from pathlib import Path

    run = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "path_patching_ioi.py"), run_name="__main__")
    model, orig, new_cache, effect = run["model"], run["orig"], run["new_cache"], run["effect"]
    layer, head = run["movers"][0]
    orig_cache = model.run_with_cache(orig, names_filter="blocks.*.attn.hook_z")[1]

    def patch_or_freeze(z, hook):
        z[...] = orig_cache[hook.name]
        if hook.layer() == layer:
            z[:, :, head] = new_cache[hook.name][:, :, head]

    want = effect(model.run_with_hooks(orig, fwd_hooks=[("blocks.*.attn.hook_z", patch_or_freeze)]))
    assert abs(run["to_logits"][layer, head] - want) < 1e-4 and want < -0.2
    last = max(receiver_layer for receiver_layer, _ in run["receivers"])
    assert run["to_queries"].shape == (last, model.cfg.n_heads)
    assert f"L{layer}H{head} {want:+.3f}" in capsys.readouterr().out
    # edge attribution's first-order ranking of the heads' direct edges to the logits names the same five heads
    ranked, movers = [run["upstream"][i] for i in run["order"]], [f"L{layer}H{head}" for layer, head in run["movers"]]
    assert ranked[0] == movers[0] and set(ranked) == set(movers)


def test_patching_gemma4_from_the_layer_that_makes_the_shared_keys(tmp_path):
    """Gemma 4 (E2B's layout): a patch at a layer that attends to an earlier layer's keys and values runs its
    copies from that earlier layer, which makes them, and per-layer embeddings feed every copy; TransformerLens's
    patching module looping over the same HookedLM (a forward per index) gives the same metric."""
    from test_parity_gemma4 import CONFIGS
    from transformer_lens import patching as theirs

    path = build(CONFIGS["gemma4_per_layer_shared_kv"](), tmp_path, "gemma4")
    hooked = HookedLM(path, dtype="float32", device="cpu", block_size=4)
    assert [hooked.llm.model.resume_layer(layer) for layer in range(6)] == [0, 1, 2, 2, 2, 2]
    _, cache = hooked.run_with_cache(CLEAN)
    base = weighted(hooked(CORRUPTED))
    for name in ("get_act_patch_resid_pre", "get_act_patch_attn_head_out_by_pos", "get_act_patch_mlp_out"):
        want = getattr(theirs, name)(hooked, CORRUPTED, cache, weighted)
        got = getattr(ours, name)(hooked, CORRUPTED, cache, weighted)
        assert_same_effects(got, want, base, 1e-4, name)
