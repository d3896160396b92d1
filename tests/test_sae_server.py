"""SAEs through `vlens serve`: loaded at start from --sae NAME=PATH[@HOOK], listed by GET /v1/saes, named
by requests for features (compact JSON, equal to offline generation) and for steering and clamping, with
bad names and values refused as HTTP 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import rel_err
from sae_helpers import HOOK, save_gemma_scope, save_saelens
from server_helpers import running_server

from vlens import SAE, Capture, Clamp, SamplingParams, Steer
from vlens.cli import main
from vlens.server.app import create_app
from vlens.server.config import ServerConfig

PROMPT = "The capital of France is"
TC_IN, TC_OUT = "blocks.4.mlp.hook_in", "blocks.4.hook_mlp_out"  # (a transcoder: SAELens's names)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    jump = save_saelens(root / "jump", architecture="jumprelu", d_sae=512, seed=1)[0]
    scope = save_gemma_scope(root / "scope" / "params.npz", seed=2)[0]
    tc = save_saelens(root / "tc", "transcoder", seed=3, hook=TC_IN, apply_b_dec_to_input=False, hook_name_out=TC_OUT)[0]
    return jump, scope, tc


@pytest.fixture(scope="module")
def server(served_smol, paths):
    saes = (f"jump={paths[0]}", f"scope={paths[1]}@{HOOK}", f"tc={paths[2]}")
    config = ServerConfig(enable_capture=True, saes=saes)
    with running_server(served_smol, config) as url:
        yield url


def _complete(server, vlens, max_tokens=5):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "vlens": vlens}
    return httpx.post(server + "/v1/completions", json=body, timeout=120)


def test_saes_are_listed(server, paths):
    data = httpx.get(server + "/v1/saes").json()["data"]
    assert [(s["name"], s["hook"], s["architecture"], s["d_sae"]) for s in data] == [
        ("jump", HOOK, "jumprelu", 512),
        ("scope", HOOK, "jumprelu", 256),
        ("tc", "blocks.4.ln2.hook_out", "standard", 512),
    ]
    assert data[2]["hook_out"] == TC_OUT
    assert data[0]["sha256"] == SAE.load(paths[0]).sha256


def test_features_come_back_as_json_equal_to_offline(server, smol, paths):
    vlens = {"capture": {"hook": HOOK, "sae": "jump", "top_k": 4, "positions": "generated", "sae_error": True}}
    r = _complete(server, vlens)
    assert r.status_code == 200, r.text
    got = r.json()["vlens"]
    assert set(got) == {"sae_features"}  # no activations file: the features are the capture
    entry = got["sae_features"][HOOK]
    capture = Capture(sae=SAE.load(paths[0]), top_k=4, positions="generated", sae_error=True)
    [offline] = smol.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0, capture=capture), use_tqdm=False)
    ids, values = offline.sae_features[HOOK]
    tokens = offline.prompt_token_ids + offline.outputs[0].token_ids
    assert entry["positions"] == offline.activation_positions.tolist() == [5, 6, 7, 8]
    assert entry["token_ids"] == [tokens[p] for p in entry["positions"]]
    assert entry["ids"] == ids.tolist() and rel_err(torch.tensor(entry["values"]), values) < 1e-5
    assert rel_err(torch.tensor(entry["errors"]), offline.sae_errors[HOOK]) < 1e-5
    dense = _complete(server, {"capture": {"sae": "scope", "features": [0, 7], "positions": [1, 2]}}).json()
    assert (
        len(dense["vlens"]["sae_features"][HOOK]["values"]) == 2 and "ids" not in dense["vlens"]["sae_features"][HOOK]
    )


def test_steering_and_clamping_by_name_equal_offline(server, smol, paths):
    interventions = [
        {"type": "clamp", "hook": HOOK, "sae": "jump", "feature": 5, "value": 40.0, "positions": "all"},
        {"type": "steer", "hook": HOOK, "sae": "scope", "feature": 9, "scale": 25.0},
        {"type": "clamp", "hook": TC_OUT, "sae": "tc", "feature": 3, "value": 30.0},  # (read at its input)
    ]
    r = _complete(server, {"interventions": interventions}, max_tokens=8)
    assert r.status_code == 200, r.text
    jump, scope, tc = SAE.load(paths[0]), SAE.load(paths[1], hook=HOOK), SAE.load(paths[2])
    clamps = [Clamp(HOOK, jump, 5, 40.0), Steer(HOOK, sae=scope, feature=9, scale=25.0)]
    texts = [
        smol.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, interventions=ivs), use_tqdm=False)[0]
        .outputs[0].text for ivs in (clamps + [Clamp(TC_OUT, tc, 3, 30.0)], clamps)
    ]  # fmt: skip
    assert r.json()["choices"][0]["text"] == texts[0] != texts[1]


@pytest.mark.parametrize(
    "vlens, param, message",
    [
        (
            {"capture": {"sae": "nope", "top_k": 4}},
            "vlens.capture.sae",
            "'nope' is not an SAE of this server; loaded: jump, scope",
        ),
        ({"capture": {"sae": "jump", "top_k": 513}}, "vlens.capture.top_k", "expected an int in 1..512"),
        (
            {"capture": {"hook": "blocks.6.hook_resid_post", "sae": "jump", "top_k": 2}},
            "vlens.capture.hooks",
            "is not the hook this SAE reads",
        ),
        ({"capture": {"hooks": HOOK, "top_k": 2}}, "vlens.capture.top_k", "only with capture.sae"),
        (
            {"interventions": [{"type": "clamp", "hook": HOOK, "sae": "jump", "feature": 600, "value": 1}]},
            "vlens.interventions[0]",
            "clamp.feature: 600",
        ),
        (
            {"interventions": [{"type": "clamp", "hook": HOOK, "sae": "jump", "feature": 6}]},
            "vlens.interventions[0]",
            "needs sae",
        ),
    ],
)
def test_bad_sae_requests_are_400_naming_the_field(server, vlens, param, message):
    r = _complete(server, vlens)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_operator_mistakes_stop_the_server_before_it_serves(smol, paths, tmp_path, capsys):
    assert main(["serve", "--sae", "jump", "--sae", "b=x"]) == 2
    assert "saes: 'jump' is not NAME=PATH or NAME=PATH@HOOK" in capsys.readouterr().err
    assert main(["serve", "--sae", f"a={paths[0]}", "--sae", f"a={paths[1]}"]) == 2
    assert "saes: names a more than once" in capsys.readouterr().err
    assert main(["serve", "--sae", f"a={tmp_path / 'nowhere'}"]) == 2  # before the model loads
    assert "saes: a=" in (err := capsys.readouterr().err) and "nowhere: no such file or directory" in err
    with pytest.raises(ValueError, match="saes: scope: sae: this SAE names no hook"):
        create_app(smol, ServerConfig(saes=(f"scope={paths[1]}",)))
    narrow = save_saelens(tmp_path / "narrow", d_sae=256, d_in=64)[0]
    with pytest.raises(ValueError, match="saes: n: sae: the SAE's d_in is 64"):
        create_app(smol, ServerConfig(saes=(f"n={narrow}",)))
