"""SAELens's HookedSAETransformer calls on HookedLM (vlens.hooked_saes) against SAELens's own HookedSAETransformer
on the same GPT-2 weights and the same SAEs (a residual one, and an attention one reading hook_z with its heads
flattened): logits with the SAEs spliced in, with the error term, every step's cached value, a latent ablated
by a hook at its step, and greedy generation."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import transformer_lens_gpt2
from sae_helpers import save_saelens, spliced_like_saelens

from vlens import SAE, HookedLM

TOL = 1e-5
TOKENS = torch.tensor([[5, 17, 99, 230, 3, 41, 7, 250, 12], [60, 22, 140, 33, 290, 11, 12, 8, 1]])
RESID, Z = "blocks.1.hook_resid_post", "blocks.0.attn.hook_z"
STEPS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
         "hook_sae_output")  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HookedLM, SAELens's HookedSAETransformer, vlens's SAEs, SAELens's) on the same weights."""
    from sae_lens import SAE as SAELensSAE
    from sae_lens import HookedSAETransformer

    root = tmp_path_factory.mktemp("saes")
    path, reference = transformer_lens_gpt2(root, initializer_range=0.1)
    theirs = HookedSAETransformer(reference.cfg)
    theirs.load_state_dict(reference.state_dict())
    dirs = [save_saelens(root / "resid", d_in=64, d_sae=96, hook=RESID)[0],
            save_saelens(root / "z", "topk", d_in=64, d_sae=80, seed=1, hook=Z, k=8, reshape_activations="hook_z")[0]]  # fmt: skip
    return (
        HookedLM(path, dtype="float32", device="cpu"),
        theirs,
        [SAE.load(d) for d in dirs],
        [SAELensSAE.load_from_disk(str(d)) for d in dirs],
    )


def test_spliced_logits_and_the_error_term_equal_saelens_s(pair):
    hooked, theirs, ours, saes = pair
    plain = hooked(TOKENS)
    spliced_like_saelens(hooked, theirs, ours, saes, TOKENS, TOL)
    assert not hooked._saes and torch.equal(hooked(TOKENS), plain)  # (reset at the end)
    # SAELens's own SAE objects (sae_lens.SAE.from_pretrained's) splice in as they are: read into vlens SAEs once
    assert torch.equal(hooked.run_with_saes(TOKENS, saes=saes), hooked.run_with_saes(TOKENS, saes=ours))
    assert SAE.from_saelens(saes[1]).k == 8 and SAE.from_saelens(saes[1]).hook == Z
    saes[0].use_error_term = True  # (use_error_term None: a SAELens SAE's own setting, as SAELens takes it)
    try:
        assert rel_err(hooked.run_with_saes(TOKENS, saes=saes[:1]), plain) <= TOL
    finally:
        saes[0].use_error_term = False


def test_every_step_is_cached_as_saelens_caches_it(pair):
    hooked, theirs, ours, saes = pair
    names = [f"{hook}.{step}" for hook in (RESID, Z) for step in STEPS]
    with torch.no_grad():
        _, cache = hooked.run_with_cache_with_saes(TOKENS, saes=ours, use_error_term=True, names_filter=names)
        _, ref = theirs.run_with_cache_with_saes(TOKENS, saes=saes, use_error_term=True, names_filter=names)
    for name in names:
        assert cache[name].shape == ref[name].shape and rel_err(cache[name], ref[name]) <= TOL, name
    _, everything = hooked.run_with_cache_with_saes(TOKENS, saes=ours[:1])  # (no filter: the steps are hooks too)
    assert [n for n in everything if ".hook_sae_" in n] == [f"{RESID}.{step}" for step in STEPS[:4] + STEPS[5:]]


def test_a_latent_ablated_at_its_step_and_generation_equal_saelens_s(pair):
    hooked, theirs, ours, saes = pair

    def ablate(acts, hook):
        acts[:, :, 3] = 0.0

    hooks = [(f"{RESID}.hook_sae_acts_post", ablate)]
    with torch.no_grad():
        got = hooked.run_with_hooks_with_saes(TOKENS, saes=ours[:1], fwd_hooks=hooks)
        assert rel_err(got, theirs.run_with_hooks_with_saes(TOKENS, saes=saes[:1], fwd_hooks=hooks)) <= TOL
        assert rel_err(got, hooked.run_with_saes(TOKENS, saes=ours[:1])) > 1e-4  # (the latent mattered)
        # with the error term, the ablation is all that changes the forward (the error is made without hooks)
        with hooked.saes(ours[:1], use_error_term=True), theirs.saes(saes[:1], use_error_term=True):
            assert (
                rel_err(hooked.run_with_hooks(TOKENS, fwd_hooks=hooks), theirs.run_with_hooks(TOKENS, fwd_hooks=hooks))
                <= TOL
            )
        settings = {"max_new_tokens": 5, "do_sample": False, "stop_at_eos": False, "verbose": False}
        with hooked.saes(ours), theirs.saes(saes):  # (TransformerLens's cached generate needs a tokenizer: README)
            want = theirs.generate(TOKENS, use_past_kv_cache=False, **settings)
            assert torch.equal(hooked.generate(TOKENS, **settings), want)


def test_what_cannot_be_spliced_is_refused_by_name(pair, tmp_path):
    hooked, *_ = pair
    wide = SAE.load(save_saelens(tmp_path / "wide", d_in=32, d_sae=16, hook=RESID)[0])
    with pytest.raises(ValueError, match=r"^sae: d_in 32 does not match blocks\.1\.hook_resid_post, 64 wide"):
        hooked.add_sae(wide)
    with pytest.raises(ValueError, match=r"^sae: its hook 'blocks\.9\.hook_resid_post' is not a hook"):
        hooked.add_sae(SAE.load(save_saelens(tmp_path / "far", d_in=64, d_sae=16, hook="blocks.9.hook_resid_post")[0]))
    with pytest.raises(TypeError, match=r"^sae: expected a vlens\.SAE or a SAELens SAE, got str"):
        hooked.add_sae("sae")
    assert not hooked._saes and not hooked._hooks


def test_gradients_at_the_steps_equal_saelens_s(pair):
    """run_with_cache_with_saes(incl_bwd=True): every step's gradient of the loss (the error term, made without a
    graph, has none, as in SAELens), and a backward hook at a latent's step sees the same gradient."""
    hooked, theirs, ours, saes = pair
    names = [f"{hook}.{step}" for hook in (RESID, Z) for step in STEPS if step != "hook_sae_error"]
    options = {"use_error_term": True, "names_filter": names, "return_type": "loss", "incl_bwd": True}
    _, cache = hooked.run_with_cache_with_saes(TOKENS, saes=ours, **options)
    _, ref = theirs.run_with_cache_with_saes(TOKENS, saes=saes, **options)
    for name in names:
        assert rel_err(cache[f"{name}_grad"], ref[f"{name}_grad"]) <= TOL, name
    seen = []
    with hooked.saes(ours[:1]):
        hooked.run_with_hooks(TOKENS, bwd_hooks=[(names[2], lambda grad, hook: seen.append(grad))], return_type="loss",
                              reset_hooks_end=False).backward()  # fmt: skip
        hooked.reset_hooks()
    with theirs.saes(saes[:1]):
        _, want = theirs.run_with_cache(TOKENS, names_filter=names[2], return_type="loss", incl_bwd=True)
    assert len(seen) == 1 and rel_err(seen[0], want[f"{names[2]}_grad"]) <= TOL


def test_excluded_tokens_bypass_the_saes_as_in_saelens(pair):
    """exclude_special_tokens=[ids]: the value at those tokens passes as it came (no error term there either), as
    SAELens's HookedSAETransformer bypasses them; every step cached equal to its, and generation."""
    hooked, theirs, ours, saes = pair
    skip = [12, 5, 290]  # (in both texts, at the first, last and middle positions)
    with torch.no_grad():
        for use_error_term in (False, True):
            names = [f"{hook}.{step}" for hook in (RESID, Z) for step in STEPS if use_error_term or "error" not in step]
            options = {"use_error_term": use_error_term, "exclude_special_tokens": skip}
            got, cache = hooked.run_with_cache_with_saes(TOKENS, saes=ours, names_filter=names, **options)
            want, ref = theirs.run_with_cache_with_saes(TOKENS, saes=saes, names_filter=names, **options)
            assert rel_err(got, want) <= TOL and rel_err(got, hooked.run_with_saes(TOKENS, saes=ours)) > 1e-4
            for name in cache:
                assert rel_err(cache[name], ref[name]) <= TOL, (use_error_term, name)
        # generation: each step's forward is the one above (SAELens's own generate hands its forward embeddings,
        # which it then masks as if they were tokens), with the KV cache as without it
        settings = {"max_new_tokens": 4, "do_sample": False, "stop_at_eos": False, "verbose": False}
        with hooked.saes(ours, exclude_special_tokens=skip), theirs.saes(saes, exclude_special_tokens=skip):
            tokens = hooked.generate(TOKENS, **settings)
            assert torch.equal(tokens, hooked.generate(TOKENS, use_past_kv_cache=False, **settings))
            steps = [theirs(tokens[:, :n])[:, -1].argmax(-1) for n in range(9, 13)]
            assert torch.equal(tokens[:, 9:], torch.stack(steps, 1))
    with pytest.raises(ValueError, match=r"^exclude_special_tokens: True takes the tokenizer's special ids, and this"):
        hooked.add_sae(ours[0], exclude_special_tokens=True)
    with pytest.raises(ValueError, match=r"^exclude_special_tokens: expected True, False or token ids in 0\.\.299"):
        hooked.add_sae(ours[0], exclude_special_tokens=[5, 300])
    assert not hooked._saes
