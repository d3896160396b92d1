"""SAEs in the engine: loading SAELens's and Gemma Scope's files, features per request against SAELens's
formulas on HF's rows (and SAELens itself), feature steering and clamping against HF with the same edit
in a forward hook, batch isolation, one encoding per SAE per step, and clear errors for bad inputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from hf_reference import generate_with_hook
from sae_helpers import HOOK, LAYER, D, saelens_decode, saelens_encode, save_gemma_scope, save_saelens

from vlens import SAE, Capture, Clamp, SamplingParams, Steer
from vlens.capture.interventions import fingerprint

PROMPT = "The old mill by the river turned"
CASES = {  # name -> how the SAE is saved (d_sae 256..1024)
    "standard": {"architecture": "standard", "d_sae": 512},
    "jumprelu_raw_input": {"architecture": "jumprelu", "d_sae": 1024, "apply_b_dec_to_input": False},
    "topk_rescaled": {"architecture": "topk", "d_sae": 512, "k": 16, "rescale_acts_by_decoder_norm": True},
    "standard_layer_norm": {"architecture": "standard", "d_sae": 256, "normalize_activations": "layer_norm"},
    "jumprelu_norm_rescale": {
        "architecture": "jumprelu",
        "d_sae": 512,
        "normalize_activations": "constant_norm_rescale",
    },
    "topk_saelens5": {"architecture": "topk", "d_sae": 256, "k": 8, "legacy": True},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    return {name: save_saelens(root / name, seed=i, **case) for i, (name, case) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def hf_rows(smol, hf_smol):
    """HF's residual rows after layer LAYER for PROMPT, and its logits."""
    ids = torch.tensor([smol.tokenizer(PROMPT)["input_ids"]])
    with torch.inference_mode():
        out = hf_smol(ids, output_hidden_states=True)
    return out.hidden_states[LAYER + 1][0], out.logits[0]


def _greedy(n=1, **kw):
    return SamplingParams(max_tokens=n, temperature=0, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_features_equal_saelens_formulas_on_hf_rows(smol, saved, hf_rows, case):
    path, weights, cfg = saved[case]
    sae = SAE.load(path)
    assert sae.hook == HOOK and sae.d_in == D and sae.d_sae == CASES[case]["d_sae"]
    everything = Capture(sae=sae, features=list(range(sae.d_sae)), sae_error=True)
    dense_out, top_out = smol.generate(
        [PROMPT, PROMPT],
        [_greedy(capture=everything), _greedy(capture=Capture(HOOK, sae=sae, top_k=8))],
        use_tqdm=False,
    )
    x = hf_rows[0]
    expected = saelens_encode(weights, cfg, x)
    dense = dense_out.sae_features[HOOK]
    assert dense.shape == expected.shape and rel_err(dense, expected) < 1e-5
    error = ((x - saelens_decode(weights, cfg, expected, x)) ** 2).sum(-1) / (x**2).sum(-1)
    assert rel_err(dense_out.sae_errors[HOOK], error) < 1e-5
    assert not dense_out.activations and top_out.activation_positions.tolist() == list(range(len(x)))
    ids, values = top_out.sae_features[HOOK]
    assert ids.dtype == torch.int32 and ids.shape == values.shape == (len(x), 8)
    top = dense.topk(8)  # ties aside, the same latents in the same order
    assert torch.equal(ids.long(), top.indices) and rel_err(values, top.values) < 1e-6


def test_features_equal_saelens_own_encode(smol, saved, hf_rows):
    from sae_lens import SAE as SAELensSAE

    x = hf_rows[0]
    saes = {name: SAE.load(path) for name, (path, _, _) in saved.items()}
    params = [_greedy(capture=Capture(sae=sae, features=list(range(sae.d_sae)))) for sae in saes.values()]
    outs = smol.generate([PROMPT] * len(saes), params, use_tqdm=False)
    for (name, (path, _, _)), out in zip(saved.items(), outs):
        with torch.inference_mode():
            theirs = SAELensSAE.load_from_disk(str(path)).encode(x)
        assert rel_err(out.sae_features[HOOK], theirs) < 1e-5, name


def test_gemma_scope_params_npz(smol, tmp_path, hf_rows):
    path, weights = save_gemma_scope(tmp_path / "layer_5" / "width_256" / "params.npz")
    for where in (path, path.parent):  # the file, or the directory holding it
        sae = SAE.load(where, hook=HOOK)
        assert sae.architecture == "jumprelu" and not sae.apply_b_dec_to_input and sae.path == str(path)
    [out] = smol.generate(PROMPT, _greedy(capture=Capture(sae=sae, features=list(range(256)))), use_tqdm=False)
    cfg = {"architecture": "jumprelu", "apply_b_dec_to_input": False, "normalize_activations": "none"}
    assert rel_err(out.sae_features[HOOK], saelens_encode(weights, cfg, hf_rows[0])) < 1e-5
    with pytest.raises(ValueError, match="capture.hooks: required, since this SAE names no hook"):
        Capture(sae=SAE.load(path), top_k=4)
    with pytest.raises(ValueError, match=r"interventions\[0\]\.sae: this SAE names no hook"):
        smol.generate(PROMPT, _greedy(interventions=[Steer(HOOK, sae=SAE.load(path), feature=3)]), use_tqdm=False)


def _hf_generate(hf, tok, edit, n=6):
    """HF's n greedy tokens and the logits of the whole sequence, with `edit` applied to layer LAYER's output."""
    return generate_with_hook(hf, tok, PROMPT, hf.model.layers[LAYER], lambda module, args, output: edit(output), n)


def test_steer_along_a_feature_matches_hf_hook(smol, hf_smol, saved, hf_rows):
    path, weights, _ = saved["standard"]
    sae, feature, scale = SAE.load(path), 77, 12.0
    hf_tokens, hf_logits = _hf_generate(hf_smol, smol.tokenizer, lambda x: x + scale * weights["W_dec"][feature])
    capture = Capture(hooks="unembed.hook_out")
    [out] = smol.generate(
        PROMPT,
        _greedy(6, capture=capture, interventions=[Steer(HOOK, sae=sae, feature=feature, scale=scale)]),
        use_tqdm=False,
    )
    assert out.outputs[0].token_ids == hf_tokens
    assert rel_err(out.activations["unembed.hook_out"], hf_logits) < 1e-4
    plain = hf_rows[1]
    assert rel_err(out.activations["unembed.hook_out"][: len(plain)], plain) > 1e-3  # the steer did something


def _clamp_in_hf(weights, cfg, clamps):
    """x + decode(f with the latent set) − decode(f): the SAE's reconstruction error kept, per clamp in order."""

    def edit(x):
        for feature, value in clamps:
            acts = saelens_encode(weights, cfg, x)
            changed = acts.clone()
            changed[..., feature] = value
            x = x + saelens_decode(weights, cfg, changed, x) - saelens_decode(weights, cfg, acts, x)
        return x

    return edit


@pytest.mark.parametrize(
    "case, tokens", [("jumprelu_raw_input", 6), ("standard_layer_norm", 2), ("jumprelu_norm_rescale", 2)]
)
def test_clamp_matches_hf_hook(smol, hf_smol, saved, case, tokens):
    path, weights, cfg = saved[case]
    sae = SAE.load(path)
    clamps = [(5, 30.0), (11, 0.0)]  # raise one latent, switch another off; applied in this order
    hf_tokens, hf_logits = _hf_generate(hf_smol, smol.tokenizer, _clamp_in_hf(weights, cfg, clamps), tokens)
    interventions = [Clamp(HOOK, sae, feature, value) for feature, value in clamps]
    capture = Capture(hooks="unembed.hook_out")
    [out] = smol.generate(PROMPT, _greedy(tokens, capture=capture, interventions=interventions), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_tokens
    assert rel_err(out.activations["unembed.hook_out"], hf_logits) < 1e-4


def test_requests_without_saes_are_untouched_and_one_encoding_serves_a_step(smol, saved, monkeypatch):
    """The plain request gets bit for bit what it gets in the same batch with no SAE anywhere (a batch of
    the same layout: ignore_eos keeps every request to 5 tokens), and its solo result within 1e-5."""
    from vlens.capture import runtime

    jump, standard = SAE.load(saved["jumprelu_raw_input"][0]), SAE.load(saved["standard"][0])
    plain = _greedy(5, ignore_eos=True, capture=Capture(hooks=["blocks.8.hook_resid_post", "unembed.hook_out"]))
    with_saes = [
        _greedy(5, ignore_eos=True, capture=Capture(sae=jump, top_k=4, positions="generated")),
        _greedy(5, ignore_eos=True, capture=Capture(sae=jump, features=[1, 2, 3], sae_error=True),
                interventions=[Clamp(HOOK, jump, 9, 4.0)]),
        plain,
        _greedy(5, ignore_eos=True, capture=Capture(sae=standard, top_k=2), interventions=[Steer(HOOK, sae=standard, feature=3, scale=5.0)]),
        _greedy(5, ignore_eos=True, capture=Capture(sae=jump, top_k=16, dtype="bfloat16")),
    ]  # fmt: skip
    groups = []
    real = runtime.read_group
    monkeypatch.setattr(
        runtime, "read_group", lambda readouts, *rest: groups.append(len(readouts)) or real(readouts, *rest)
    )
    prompts = [PROMPT, "Hello there", "The weather today is", PROMPT, "A dog"]
    together = smol.generate(prompts, with_saes, use_tqdm=False)
    # One encoding per SAE per step: jump's readouts share one (two in the prefill, where the first
    # request wants no row; three in each of the 4 decode steps), standard has its own.
    assert sorted(groups) == sorted([2, 1] + [3, 1] * 4)
    without = smol.generate(prompts, [plain] * len(prompts), use_tqdm=False)[2]
    [alone] = smol.generate(prompts[2], plain, use_tqdm=False)
    mine = together[2]
    assert mine.outputs[0].token_ids == without.outputs[0].token_ids == alone.outputs[0].token_ids
    for name, rows in without.activations.items():
        # (its prompt's logits are a GEMM over other rows here, as the batches capture other positions: on some
        # CPUs the kernel for that shape sums in another order, 3e-7 off on an AVX-512 Xeon)
        same = torch.equal if name != "unembed.hook_out" else lambda a, b: rel_err(a, b) < 1e-6
        assert same(mine.activations[name], rows), name
        assert rel_err(mine.activations[name], alone.activations[name]) < 1e-5, name
    assert not mine.sae_features and not mine.sae_errors
    ids, values = together[4].sae_features[HOOK]
    assert values.dtype == torch.bfloat16 and ids.shape == (len(together[4].activation_positions), 16)
    assert together[1].sae_features[HOOK].shape[1] == 3 and together[1].sae_errors[HOOK].dtype == torch.float32
    first = len(together[0].prompt_token_ids)
    assert together[0].activation_positions.tolist() == list(range(first, first + 4))


def test_prefix_cache_keeps_clamped_kv_apart(smol, saved):
    sae = SAE.load(saved["jumprelu_raw_input"][0])
    prompt = " ".join(["the river ran past the old mill"] * 4)  # two full KV blocks and a part
    capture = Capture(hooks="unembed.hook_out", positions="prompt")
    clamped = _greedy(2, capture=capture, interventions=[Clamp(HOOK, sae, 5, 30.0, positions=[3])])
    blocks = smol.engine.blocks
    blocks.enable_prefix_caching = False
    try:
        [reference] = smol.generate(prompt, clamped, use_tqdm=False)
    finally:
        blocks.enable_prefix_caching = True
    [plain] = smol.generate(prompt, _greedy(2, capture=capture), use_tqdm=False)  # its blocks are cached now
    [after] = smol.generate(prompt, clamped, use_tqdm=False)
    assert torch.equal(after.activations["unembed.hook_out"], reference.activations["unembed.hook_out"])
    assert rel_err(plain.activations["unembed.hook_out"], reference.activations["unembed.hook_out"]) > 1e-4
    other = SAE.load(saved["jumprelu_norm_rescale"][0])
    salts = {fingerprint([c]) for c in (Clamp(HOOK, sae, 5, 30.0), Clamp(HOOK, sae, 5, 31.0), Clamp(HOOK, sae, 6, 30.0),
                                        Clamp(HOOK, other, 5, 30.0), Clamp(HOOK, sae, 5, 30.0, positions=[3]))}  # fmt: skip
    assert len(salts) == 5 and fingerprint([Clamp(HOOK, SAE.load(saved["jumprelu_raw_input"][0]), 5, 30.0)]) in salts


def _write(path, text):
    path.write_text(text)
    return path


def _bad_sae_cases(tmp_path, saved):
    """name -> (what to run, the message it must raise)."""
    good = saved["standard"][0]
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    _write(no_weights / "cfg.json", "{}")
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    _write(bad_json / "cfg.json", "{not json")
    (bad_json / "sae_weights.safetensors").write_bytes((good / "sae_weights.safetensors").read_bytes())
    torn = tmp_path / "torn"
    torn.mkdir()
    _write(torn / "cfg.json", (good / "cfg.json").read_text())
    (torn / "sae_weights.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    gated, _, _ = save_saelens(tmp_path / "gated", architecture="gated", d_sae=256)
    narrow, _, _ = save_saelens(tmp_path / "narrow", d_sae=256, d_in=64)
    elsewhere, _, _ = save_saelens(tmp_path / "elsewhere", d_sae=256, hook="blocks.99.hook_resid_post")
    lying = tmp_path / "lying"
    save_saelens(lying, d_sae=256)
    cfg = json.loads((lying / "cfg.json").read_text())
    _write(lying / "cfg.json", json.dumps({**cfg, "d_sae": 300}))
    topk = SAE.load(saved["topk_rescaled"][0])
    sae = SAE.load(good)
    return {
        "missing": (lambda: SAE.load(tmp_path / "nowhere"), "does not exist"),
        "no_weights": (lambda: SAE.load(no_weights), "has cfg.json but no sae_weights.safetensors"),
        "malformed_json": (lambda: SAE.load(bad_json), "is not valid JSON"),
        "malformed_weights": (lambda: SAE.load(torn), "is not a readable safetensors file"),
        "architecture": (lambda: SAE.load(gated), "architecture 'gated'.* supported: standard, jumprelu, topk"),
        "cfg_vs_weights": (lambda: SAE.load(lying), "says d_sae=300 but W_enc"),
        "width": (
            lambda: _run(Capture(sae=SAE.load(narrow), top_k=3)),
            r"d_in is 64 but its hook blocks.5.hook_resid_post has rows of \(576,\)",
        ),
        "hook_not_in_model": (
            lambda: _run(Capture(sae=SAE.load(elsewhere), top_k=3)),
            "'blocks.99.hook_resid_post' is not in this model",
        ),
        "other_hook": (
            lambda: _run(Capture("blocks.6.hook_resid_post", sae=sae, top_k=3)),
            "is not the hook this SAE reads",
        ),
        "steer_feature": (
            lambda: Steer(HOOK, sae=sae, feature=512),
            r"steer.feature: 512 is not a latent of this SAE; expected an int in 0..511",
        ),
        "clamp_feature": (lambda: Clamp(HOOK, sae, -1, 1.0), "clamp.feature: -1 is not a latent"),
        "capture_features": (lambda: Capture(sae=sae, features=[3, 900]), "capture.features: 900 is not a latent"),
        "top_k": (lambda: Capture(sae=sae, top_k=513), r"capture.top_k: expected an int in 1..512"),
        "nothing_asked": (lambda: Capture(sae=sae), "say what to return"),
        "topk_clamp": (lambda: Clamp(HOOK, topk, 1, 2.0), "clamp.sae: a topk SAE"),
        "clamp_other_hook": (
            lambda: _run(None, [Clamp("blocks.4.hook_resid_post", sae, 1, 2.0)]),
            r"interventions\[0\]\.hook: .* is not the hook",
        ),
    }


_SMOL = []


def _run(capture, interventions=()):
    return _SMOL[0].generate(PROMPT, _greedy(capture=capture, interventions=list(interventions)), use_tqdm=False)


def test_bad_inputs_are_value_errors_before_any_model_work(smol, saved, tmp_path):
    _SMOL[:] = [smol]
    for name, (run, message) in _bad_sae_cases(tmp_path, saved).items():
        with pytest.raises(ValueError, match=message):
            run()
        assert not smol.engine.has_work(), name


def test_generate_prints_the_top_latents_of_each_generated_token(smol, smol_path, saved, tmp_path, capsys):
    from safetensors.torch import load_file

    from vlens.cli import main

    path, out_file = saved["standard"][0], tmp_path / "features.safetensors"
    argv = ["generate", PROMPT, "--model", str(smol_path), "--dtype", "float32", "--device", "cpu", "--max-tokens", "4",
            "--sae", str(path), "--top-k", "3", "--out", str(out_file)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    capture = Capture(sae=SAE.load(path), top_k=3, positions="generated")
    [offline] = smol.generate(PROMPT, _greedy(4, capture=capture), use_tqdm=False)
    ids, values = offline.sae_features[HOOK]
    tokens = offline.prompt_token_ids + offline.outputs[0].token_ids
    assert f"SAE features at {HOOK} (top 3 per row):" in printed
    for p, row_ids, row_values in zip(offline.activation_positions.tolist(), ids.tolist(), values.tolist()):
        latents = "  ".join(f"{f}: {v:.3f}" for f, v in zip(row_ids, row_values))
        token = re.escape(repr(smol.tokenizer.decode([tokens[p]])))
        assert re.search(rf"^ +{p} +{token} +{re.escape(latents)}$", printed, re.MULTILINE), (p, printed)
    saved_ids = load_file(out_file)[f"0/{HOOK}.sae_ids"]
    assert torch.equal(saved_ids, ids)
    assert main([*argv[:-2], "--capture", HOOK]) == 2
    assert "--capture: give --capture or --sae, not both" in capsys.readouterr().err


def _saelens_encode(path, x):
    from sae_lens import SAE as SAELensSAE

    with torch.inference_mode():
        return SAELensSAE.load_from_disk(str(path)).encode(x)


def test_saelens5_topk_config_that_also_says_architecture_standard_is_topk(tmp_path):
    """SAELens 5 saved TopK SAEs as architecture "standard" with activation_fn "topk"; SAELens loads them as TopK."""
    path, _, _ = save_saelens(tmp_path / "topk5", d_sae=256, k=8, legacy=True, architecture="topk")
    cfg = json.loads((path / "cfg.json").read_text())
    _write(path / "cfg.json", json.dumps({**cfg, "architecture": "standard"}))
    sae, x = SAE.load(path), torch.randn(5, D)
    assert sae.architecture == "topk" and sae.k == 8
    assert rel_err(sae.encode(x), _saelens_encode(path, x)) < 1e-5


def test_a_threshold_in_a_config_that_is_not_jumprelu_is_refused(tmp_path):
    """A config without `architecture` (before SAELens 6) is standard; its threshold would be dropped unused."""
    path, _, _ = save_saelens(tmp_path / "jumprelu5", architecture="jumprelu", d_sae=256, legacy=True)
    with pytest.raises(ValueError, match="threshold.*architecture 'standard'.*jumprelu"):
        SAE.load(path)


def test_an_activation_other_than_relu_or_topk_is_refused(tmp_path):
    """SAELens before 6 trained tanh-relu SAEs too; encoding one with ReLU would give other latents."""
    path, _, _ = save_saelens(tmp_path / "tanh", d_sae=256, legacy=True, activation_fn_str="tanh-relu")
    with pytest.raises(ValueError, match="activation_fn 'tanh-relu'.*supported: relu, topk"):
        SAE.load(path)


def test_a_params_npz_of_arrays_that_are_not_numbers_names_the_file(tmp_path):
    """E.g. bfloat16 arrays saved with ml_dtypes, which numpy alone reads back as raw bytes (dtype V2)."""
    import numpy as np

    path, weights = save_gemma_scope(tmp_path / "params.npz")
    np.savez(path, **{**{k: v.numpy() for k, v in weights.items()}, "W_enc": np.zeros((D, 256), dtype="V2")})
    with pytest.raises(ValueError, match=r"sae: '.*params.npz' is not a readable .npz file"):
        SAE.load(path, hook=HOOK)


def test_a_params_npz_with_a_scaling_factor_or_unknown_arrays_is_refused_as_saelens_does(tmp_path):
    import numpy as np

    path, weights = save_gemma_scope(tmp_path / "params.npz")
    arrays = {k: v.numpy() for k, v in weights.items()}
    np.savez(path, **arrays, scaling_factor=np.full(256, 2.0, dtype=np.float32))
    with pytest.raises(ValueError, match="scaling_factor that is not all ones"):
        SAE.load(path, hook=HOOK)
    np.savez(path, **arrays, b_gate=np.zeros(256, dtype=np.float32))
    with pytest.raises(ValueError, match="has tensors no SAE architecture here uses: b_gate"):
        SAE.load(path, hook=HOOK)
    np.savez(path, **arrays, scaling_factor=np.ones(256, dtype=np.float32))
    assert torch.equal(SAE.load(path, hook=HOOK).threshold, weights["threshold"])


@pytest.mark.parametrize("legacy", [False, True])
def test_an_sae_of_transformer_lens_processed_weights_is_refused(tmp_path, legacy):
    """A few SAELens releases were trained on TransformerLens with center_writing_weights=True: their
    residual stream is HF's minus its mean, so their latents on HF's raw rows would be wrong. The default
    (False, what SAELens trains with) and fold_ln (no change to these hooks) load. SAELens 6 keeps the
    setting under metadata, earlier versions at the top of cfg.json."""

    def saved(name: str, kwargs: dict) -> Path:
        path, _, _ = save_saelens(tmp_path / name, d_sae=256, legacy=legacy)
        cfg = json.loads((path / "cfg.json").read_text())
        (cfg if legacy else cfg["metadata"])["model_from_pretrained_kwargs"] = kwargs
        (path / "cfg.json").write_text(json.dumps(cfg))
        return path

    with pytest.raises(ValueError, match=r"model_from_pretrained_kwargs center_writing_weights=True\)"):
        SAE.load(saved("tl", {"center_writing_weights": True, "fold_ln": True}))
    assert SAE.load(saved("raw", {"center_writing_weights": False, "fold_ln": True})).d_sae == 256


def test_a_gemma_scope_embedding_sae_is_rescaled_and_reads_hook_embed_as_saelens_loads_it(tmp_path, monkeypatch):
    from sae_lens.loading import pretrained_sae_loaders as loaders

    folder = "embedding/width_4k/average_l0_6"
    path, weights = save_gemma_scope(tmp_path / folder / "params.npz")
    monkeypatch.setattr(loaders, "hf_hub_download", lambda **kw: str(path))  # SAELens's own loader, offline
    cfg, theirs, _ = loaders.gemma_2_sae_huggingface_loader(
        "google/gemma-scope-2b-pt-res", folder, cfg_overrides={"d_in": D}
    )
    sae = SAE.load(path.parent)
    assert sae.hook == cfg["hook_name"] == "hook_embed"
    for name in ("W_enc", "W_dec", "b_enc", "b_dec", "threshold"):
        assert torch.equal(getattr(sae, name), theirs[name]), name
    assert not torch.equal(sae.W_enc, weights["W_enc"])  # (rescaled: sqrt(d_in) != 1)
    # another folder's SAE is read as saved
    other, _ = save_gemma_scope(tmp_path / "layer_5" / "width_256" / "params.npz")
    assert torch.equal(SAE.load(other, hook=HOOK).W_enc, weights["W_enc"]) and SAE.load(other).hook is None
