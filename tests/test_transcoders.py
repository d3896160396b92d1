"""Transcoders (SAELens's Transcoder, SkipTranscoder, JumpReLUTranscoder, JumpReLUSkipTranscoder): read from the
files SAELens saves and from its objects; spliced into HookedLM against SAELens's own HookedSAETransformer on the
same GPT-2 weights (logits, error term, every step, a latent ablated, generation); in the engine, latents read at
the input hook equal SAELens's encode of HF's rows, and a steer along a latent goes to the hook it writes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rel_err
from family_parity import transformer_lens_gpt2
from sae_helpers import save_gemma_scope, spliced_like_saelens

from vlens import SAE, Capture, Clamp, HookedLM, SamplingParams, Steer
from vlens.capture.names import hook_shapes, resolve_hooks
from vlens.server.saes import describe, load_saes

TOL = 1e-5
TOKENS = torch.tensor([[5, 17, 99, 230, 3, 41, 7, 250, 12], [60, 22, 140, 33, 290, 11, 12, 8, 1]])
STEPS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
         "hook_sae_output")  # fmt: skip
# (class, input hook as SAELens names it, the hook vlens reads, output hook)
KINDS = {
    "transcoder": ("Transcoder", "blocks.0.mlp.hook_in", "blocks.0.ln2.hook_out", "blocks.0.hook_mlp_out"),
    "jumprelu": ("JumpReLUTranscoder", "blocks.1.ln2.hook_normalized", "blocks.1.ln2.hook_normalized",
                 "blocks.1.hook_mlp_out"),  # fmt: skip
    "skip": ("SkipTranscoder", "blocks.2.mlp.hook_in", "blocks.2.ln2.hook_out", "blocks.2.hook_mlp_out"),
    "jumprelu_skip": ("JumpReLUSkipTranscoder", "blocks.1.hook_resid_mid", "blocks.1.hook_resid_mid",
                      "blocks.2.hook_resid_pre"),  # fmt: skip
}


def saelens_transcoder(kind: str, seed: int, d_in: int = 64):
    """A SAELens transcoder of this kind on the tiny GPT-2 (d 64), with random weights, biases and thresholds."""
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    name, hook, _, hook_out = KINDS[kind]
    config = getattr(sae_lens, name + "Config")(
        d_in=d_in, d_sae=96, d_out=64, apply_b_dec_to_input=False,
        metadata=SAEMetadata(hook_name=hook, hook_name_out=hook_out),
    )  # fmt: skip
    transcoder = getattr(sae_lens, name)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in transcoder.state_dict().items():
            scale = 0.05 if key == "W_skip" else 0.3 if key in ("threshold", "b_enc", "b_dec") else 0.25
            tensor.copy_((torch.rand if key == "threshold" else torch.randn)(tensor.shape, generator=g) * scale)
    return transcoder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HookedLM, SAELens's HookedSAETransformer on the same weights, SAELens's transcoders by kind)."""
    from sae_lens import HookedSAETransformer

    root = tmp_path_factory.mktemp("transcoders")
    path, reference = transformer_lens_gpt2(root, initializer_range=0.1)
    theirs = HookedSAETransformer(reference.cfg)
    theirs.load_state_dict(reference.state_dict(), strict=False)
    theirs.setup()
    transcoders = {kind: saelens_transcoder(kind, i) for i, kind in enumerate(KINDS)}
    transcoders["wide"] = saelens_transcoder("transcoder", 7, d_in=256)  # (reads the MLP's hidden layer)
    transcoders["wide"].cfg.metadata.hook_name = "blocks.1.mlp.hook_post"
    transcoders["wide"].cfg.metadata.hook_name_out = "blocks.1.hook_mlp_out"
    return HookedLM(path, dtype="float32", device="cpu"), theirs, transcoders


def test_files_and_objects_read_as_saelens_computes(pair, tmp_path):
    """save_model's files and the objects give the same SAE: its hooks (SAELens's mlp.hook_in read as ln2.hook_out),
    and encode / decode equal to SAELens's encode and forward (a skip transcoder's skip connection included)."""
    *_, transcoders = pair
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    for kind, theirs in transcoders.items():
        if kind == "wide":
            continue
        theirs.save_model(tmp_path / kind)
        loaded, from_object = SAE.load(tmp_path / kind), SAE.from_saelens(theirs)
        assert loaded.sha256 == from_object.sha256
        _, _, hook, hook_out = KINDS[kind]
        assert (loaded.hook, loaded.hook_out, loaded.writes, loaded.transcoder) == (hook, hook_out, hook_out, True)
        assert loaded.architecture == ("jumprelu" if "jumprelu" in kind else "standard")
        assert (loaded.W_skip is not None) == ("skip" in kind) and loaded.d_out == 64
        with torch.no_grad():
            acts = loaded.encode(x)
            assert rel_err(acts, theirs.encode(x)) <= TOL and (acts == 0).any() and (acts > 0).any()
            assert rel_err(loaded.decode(acts, x), theirs(x)) <= TOL, kind
    assert "hook_out='blocks.2.hook_mlp_out', d_out=64, skip" in repr(SAE.from_saelens(transcoders["skip"]))


def test_spliced_transcoders_equal_saelens_s(pair):
    """Logits with transcoders in place of MLPs, with and without the error term, and every step cached (named
    after the hook each writes) equal SAELens's HookedSAETransformer's."""
    hooked, theirs, transcoders = pair
    tcs = [transcoders["transcoder"], transcoders["jumprelu"]]
    plain = hooked(TOKENS)
    spliced_like_saelens(hooked, theirs, tcs, tcs, TOKENS, TOL)
    with torch.no_grad():
        names = [f"blocks.{layer}.hook_mlp_out.{step}" for layer in (0, 1) for step in STEPS]
        _, cache = hooked.run_with_cache_with_saes(TOKENS, saes=tcs, use_error_term=True, names_filter=names)
        _, ref = theirs.run_with_cache_with_saes(TOKENS, saes=tcs, use_error_term=True, names_filter=names)
    for name in names:
        assert cache[name].shape == ref[name].shape and rel_err(cache[name], ref[name]) <= TOL, name
    with torch.no_grad():  # (bypassed at some tokens: the value written there is the model's own)
        got = hooked.run_with_saes(TOKENS, saes=tcs, exclude_special_tokens=[12, 5])
        assert rel_err(got, theirs.run_with_saes(TOKENS, saes=tcs, exclude_special_tokens=[12, 5])) <= TOL
    assert not hooked._saes and torch.equal(hooked(TOKENS), plain)
    with hooked.saes(tcs):  # (the steps are hook names after the hook each writes)
        names = list(hooked.hook_dict)
        at = names.index("blocks.0.hook_mlp_out")
        assert names[at + 1 : at + 6] == [f"blocks.0.hook_mlp_out.{step}" for step in STEPS[:4] + STEPS[5:]]


def test_a_latent_ablated_and_generation_equal_saelens_s(pair):
    hooked, theirs, transcoders = pair
    tc = transcoders["transcoder"]

    def ablate(acts, hook):
        acts[:, :, :40] = 0.0

    hooks = [("blocks.0.hook_mlp_out.hook_sae_acts_post", ablate)]
    with torch.no_grad():
        for use_error_term in (False, True):
            with hooked.saes([tc], use_error_term=use_error_term), theirs.saes([tc], use_error_term=use_error_term):
                got = hooked.run_with_hooks(TOKENS, fwd_hooks=hooks)
                assert rel_err(got, theirs.run_with_hooks(TOKENS, fwd_hooks=hooks)) <= TOL
                assert rel_err(got, hooked(TOKENS)) > 1e-4  # (the latents mattered)
        settings = {"max_new_tokens": 5, "do_sample": False, "stop_at_eos": False, "verbose": False}
        with hooked.saes([tc]), theirs.saes([tc]):  # (TransformerLens's cached generate needs a tokenizer: see README)
            want = theirs.generate(TOKENS, use_past_kv_cache=False, **settings)
            assert torch.equal(hooked.generate(TOKENS, **settings), want)


def test_a_skip_transcoder_splices_its_forward(pair):
    """A skip transcoder's output at the hook it writes is its forward on its input (SAELens's HookedSAETransformer
    leaves the skip out: it splices encode and decode); with the error term the forward is the model's."""
    hooked, theirs, transcoders = pair
    plain = hooked(TOKENS)
    for kind in ("skip", "jumprelu_skip"):
        tc = transcoders[kind]
        _, _, reads, writes = KINDS[kind]
        with torch.no_grad():
            _, cache = hooked.run_with_cache_with_saes(TOKENS, saes=[tc], names_filter=[reads, writes])
            assert rel_err(cache[writes], tc(cache[reads])) <= TOL, kind
            assert rel_err(cache[writes], tc.decode(tc.encode(cache[reads]))) > 1e-3  # (the skip mattered)
            assert rel_err(hooked.run_with_saes(TOKENS, saes=[tc], use_error_term=True), plain) <= TOL
    with hooked.saes([transcoders["skip"]]):  # (SAELens's input name resets it)
        hooked.reset_saes("blocks.2.mlp.hook_in")
        assert not hooked._saes


def test_engine_reads_latents_at_the_input_and_steers_at_the_output(pair, tmp_path):
    """Capture(sae=transcoder) reads its latents at the hook it reads (SAELens's encode of the rows there); a
    Steer along a latent adds its decoder row at the hook it writes, as the same vector steered there does."""
    hooked, theirs, transcoders = pair
    llm = hooked.llm
    tc = transcoders["transcoder"]
    sae = SAE.from_saelens(tc)
    prompts = TOKENS.tolist()
    greedy = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    capture = Capture(sae=sae, features=list(range(96)), positions="prompt")
    outs = llm.generate(prompts, SamplingParams(**greedy, capture=capture), use_tqdm=False)
    with torch.no_grad():
        _, ref = theirs.run_with_cache(TOKENS, names_filter="blocks.0.mlp.hook_in")  # (the MLP's input)
        for i, out in enumerate(outs):
            assert rel_err(out.sae_features[sae.hook], tc.encode(ref["blocks.0.mlp.hook_in"][i])) <= TOL
    steer = Steer(sae.writes, sae=sae, feature=7, scale=4.0)
    vector = Steer(sae.writes, vector=sae.W_dec[7], scale=4.0)
    watch = Capture(hooks="blocks.2.hook_resid_post")
    a, b, plain = (llm.generate(prompts, SamplingParams(**greedy, capture=watch, interventions=ivs), use_tqdm=False)
                   for ivs in ([steer], [vector], []))  # fmt: skip
    for x, y, z in zip(a, b, plain):
        key = "blocks.2.hook_resid_post"
        assert torch.equal(x.activations[key], y.activations[key])
        assert rel_err(x.activations[key], z.activations[key]) > 1e-3
    with pytest.raises(ValueError, match=r"is not the hook this SAE writes \(blocks\.0\.hook_mlp_out\)"):
        llm.generate(prompts, SamplingParams(**greedy, interventions=[Steer(sae.hook, sae=sae, feature=7)]))
    tc.save_model(tmp_path / "tc")  # the server's --sae checks both hooks and lists them
    [listed] = describe(load_saes((f"tc={tmp_path / 'tc'}",), llm.config, hook_shapes(llm.config)))
    assert (listed["hook"], listed["hook_out"], listed["d_out"]) == (sae.hook, sae.hook_out, 64)


def test_engine_measures_a_transcoders_error_against_the_rows_it_writes(pair):
    """Capture(sae=transcoder, sae_error=True): ‖y − ŷ‖²/‖y‖² per row, ŷ SAELens's forward of the rows it reads
    and y the model's where it writes (as SAELens's HookedSAETransformer has both), beside a request that reads
    the same transcoder's latents alone (one encoding), a skip transcoder's error at generated rows and a wide
    one's."""
    hooked, theirs, transcoders = pair
    kinds = ("transcoder", "transcoder", "skip", "wide")
    captures = [
        Capture(sae=SAE.from_saelens(transcoders["transcoder"]), top_k=5, sae_error=True),
        Capture(sae=SAE.from_saelens(transcoders["transcoder"]), top_k=5),
        Capture(sae=SAE.from_saelens(transcoders["skip"]), sae_error=True, positions="generated"),
        Capture(sae=SAE.from_saelens(transcoders["wide"]), features=[1, 2], sae_error=True),
    ]
    captures[1].sae = captures[0].sae  # (the same object: one encoding serves both)
    prompts = [TOKENS[i // 2].tolist() for i in range(4)]  # (the first two: the same prompt)
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=c) for c in captures]
    outs = hooked.llm.generate(prompts, params, use_tqdm=False)
    assert not outs[1].sae_errors
    for out, kind, capture in zip(outs, kinds, captures):
        if not capture.sae_error:
            continue
        tc, hook = transcoders[kind], capture.sae.hook
        fed = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids[:-1]])
        names = [tc.cfg.metadata.hook_name, tc.cfg.metadata.hook_name_out]
        with torch.no_grad():
            _, cache = theirs.run_with_cache(fed, names_filter=names)
            x, y = (cache[name][0, out.activation_positions] for name in names)
            expected = (y - tc(x)).pow(2).sum(-1) / y.pow(2).sum(-1)
        assert out.sae_errors[hook].dtype == torch.float32 and rel_err(out.sae_errors[hook], expected) <= TOL, kind
        if capture.top_k:
            ids, values = out.sae_features[hook]
            alone = outs[1].sae_features[hook]
            assert torch.equal(ids, alone[0]) and torch.equal(values, alone[1])
    assert len(outs[2].activation_positions) == 3 and outs[3].sae_features[captures[3].sae.hook].shape == (12, 2)


def _saelens_with_latents_set(theirs, tcs, sets, tokens, new_tokens, watch):
    """SAELens's HookedSAETransformer with the transcoders spliced (error term on) and latent f of the i-th set to v
    for each (i, f, v) in `sets`: its greedy tokens (recomputed each step) and its rows at `watch` over them."""

    def setter(f, v):
        def hook(acts, hook):
            acts[..., f] = v

        return hook

    hooks = [(f"{tcs[i].cfg.metadata.hook_name_out}.hook_sae_acts_post", setter(f, v)) for i, f, v in sets]
    with torch.no_grad(), theirs.saes(tcs, use_error_term=True):
        with theirs.hooks(fwd_hooks=hooks):
            out = theirs.generate(tokens, max_new_tokens=new_tokens, do_sample=False, stop_at_eos=False,
                                  use_past_kv_cache=False, verbose=False)  # fmt: skip
            _, cache = theirs.run_with_cache(out[:, :-1], names_filter=watch)
    return out[:, tokens.shape[1] :], cache[watch]


def test_engine_clamps_a_transcoder_latent_as_saelens_sets_it(pair):
    """Clamp(sae=transcoder) sets a latent read where the transcoder reads, where it writes: greedy tokens and every
    row captured downstream equal SAELens's HookedSAETransformer with the transcoder spliced (its error term on)
    and the latent set at hook_sae_acts_post — one clamp, two at different layers, a latent turned off — with a
    plain request and another request's other clamp in the same batch, each as it runs alone."""
    hooked, theirs, transcoders = pair
    llm = hooked.llm
    watch, new = "blocks.2.hook_resid_post", 4
    cases = [
        (["transcoder"], [(0, 5, 3.0)]),
        (["jumprelu", "jumprelu_skip"], [(0, 9, 2.0), (1, 11, 2.5)]),  # (reads resid_mid 1, writes resid_pre 2)
        (["skip", "wide"], [(0, 0, 0.0), (1, 4, 6.0)]),  # (the wide one reads 256-wide rows, writes 64)
    ]
    greedy = {"max_tokens": new, "temperature": 0, "ignore_eos": True}
    plain = llm.generate(TOKENS.tolist(), SamplingParams(**greedy, capture=Capture(hooks=watch)), use_tqdm=False)
    for kinds, sets in cases:
        tcs = [transcoders[k] for k in kinds]
        saes = [SAE.from_saelens(tc) for tc in tcs]
        want_tokens, want_rows = _saelens_with_latents_set(theirs, tcs, sets, TOKENS, new, watch)
        clamps = [Clamp(saes[i].writes, saes[i], f, v) for i, f, v in sets]
        other = [Clamp(saes[0].writes, saes[0], 1, 4.0, positions=[2, 3])]
        params = [SamplingParams(**greedy, capture=Capture(hooks=watch), interventions=ivs)
                  for ivs in (clamps, clamps, [], other)]  # fmt: skip
        p0, p1 = TOKENS.tolist()
        outs = llm.generate([p0, p1, p1, p0], params, use_tqdm=False)
        for i in (0, 1):
            assert outs[i].outputs[0].token_ids == want_tokens[i].tolist(), kinds
            assert rel_err(outs[i].activations[watch], want_rows[i]) <= TOL, kinds
        assert outs[2].outputs[0].token_ids == plain[1].outputs[0].token_ids
        assert rel_err(outs[2].activations[watch], plain[1].activations[watch]) <= TOL
        assert rel_err(outs[0].activations[watch], plain[0].activations[watch]) > 1e-3, kinds  # (the clamp mattered)
        [alone] = llm.generate([p0], params[3], use_tqdm=False)
        assert alone.outputs[0].token_ids == outs[3].outputs[0].token_ids
        assert rel_err(alone.activations[watch], outs[3].activations[watch]) <= TOL


def test_what_a_transcoder_cannot_do_is_refused_by_name(pair, tmp_path):
    hooked, _, transcoders = pair
    sae = SAE.from_saelens(transcoders["jumprelu"])
    with pytest.raises(ValueError, match=r"^interventions\[0\]\.hook: 'blocks\.1\.ln2\.hook_normalized' is not the hook "
                       r"this SAE writes \(blocks\.1\.hook_mlp_out\)"):  # fmt: skip
        hooked.llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, interventions=[Clamp(sae.hook, sae, 3, 1.0)]))
    back = SAE.from_saelens(transcoders["transcoder"])
    back.hook, back.hook_out = "blocks.1.hook_resid_post", "blocks.1.hook_resid_mid"
    with pytest.raises(ValueError, match=r"^interventions\[0\]\.sae: the transcoder reads blocks\.1\.hook_resid_post, "
                       r"which the forward reaches after blocks\.1\.hook_resid_mid"):  # fmt: skip
        hooked.llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, interventions=[Clamp(back.writes, back, 3, 1.0)]))
    far = SAE.from_saelens(transcoders["transcoder"])
    far.hook_out = "blocks.0.mlp.hook_post"
    with pytest.raises(ValueError, match=r"^sae: d_out 64 does not match blocks\.0\.mlp\.hook_post, 256 wide"):
        hooked.add_sae(far)
    far.hook_out = "blocks.7.hook_mlp_out"
    with pytest.raises(ValueError, match=r"^sae: its hook_out 'blocks\.7\.hook_mlp_out' is not a hook of this model"):
        hooked.add_sae(far)
    far.hook_out = "blocks.0.attn.hook_pattern"
    with pytest.raises(ValueError, match=r"^sae: its hook_out 'blocks\.0\.attn\.hook_pattern' is not a hook"):
        hooked.add_sae(far)
    assert not hooked._saes
    with pytest.raises(ValueError, match=r"SAELens's name for the MLP's input, which vlens calls blocks\.0\.ln2\."):
        resolve_hooks("blocks.0.mlp.hook_in", hooked.cfg)
    with pytest.raises(ValueError, match=r"^sae: a transcoder with apply_b_dec_to_input"):
        SAE(sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, hook=sae.hook, hook_out=sae.hook_out)
    with pytest.raises(ValueError, match=r"^sae: a W_skip tensor but no hook_out"):
        SAE(sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, apply_b_dec_to_input=False, W_skip=torch.zeros(64, 64))
    with pytest.raises(ValueError, match=r"normalize_activations 'layer_norm'; transcoders here normalise nothing"):
        SAE(sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, hook=sae.hook, hook_out=sae.hook_out,
            apply_b_dec_to_input=False, normalize_activations="layer_norm")  # fmt: skip
    # a skip transcoder's file without its W_skip, and a plain one with one
    for kind, drop in (("skip", True), ("transcoder", False)):
        transcoders[kind].save_model(tmp_path / kind)
        weights = tmp_path / kind / "sae_weights.safetensors"
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        if drop:
            del tensors["W_skip"]
        else:
            tensors["W_skip"] = torch.zeros(64, 64)
        save_file(tensors, weights)
        with pytest.raises(ValueError, match="W_skip"):
            SAE.load(tmp_path / kind)
    cfg = json.loads((tmp_path / "transcoder" / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name_out"] == "blocks.0.hook_mlp_out"  # (what the reader keys on)


def test_a_gemma_scope_params_npz_is_a_transcoder_given_the_hook_it_writes(tmp_path):
    path, w = save_gemma_scope(tmp_path / "layer_3" / "params.npz")
    tc = SAE.load(path, hook="blocks.3.ln2.hook_out", hook_out="blocks.3.hook_mlp_out")
    assert tc.transcoder and tc.architecture == "jumprelu" and not tc.apply_b_dec_to_input
    x = torch.randn(4, tc.d_in, generator=torch.Generator().manual_seed(2))
    pre = x @ w["W_enc"] + w["b_enc"]
    acts = pre.relu() * (pre > w["threshold"])
    assert rel_err(tc.encode(x), acts) <= TOL and (acts > 0).any()
    assert rel_err(tc.decode(acts, x), acts @ w["W_dec"] + w["b_dec"]) <= TOL
