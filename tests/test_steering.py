"""Steering vectors from contrastive pairs (vlens.steering) against the steering-vectors library on HF's model:
the same vectors (mean difference and principal direction, at the residual stream and the MLP's output), and the
same generation when the vector steers, in a batch beside an unsteered request; saved, loaded by `vlens serve
--steering-vector` and named by requests, which then generate as the same steers do offline."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import rel_err
from server_helpers import running_server
from steering_vectors import SteeringVector as LibraryVector
from steering_vectors import pca_aggregator
from steering_vectors import train_steering_vector as library_train

from vlens import Capture, HookedLM, SamplingParams, Steer
from vlens.server.app import create_app
from vlens.server.config import ServerConfig
from vlens.steering import SteeringVector, train_steering_vector

PAIRS = [
    ("The capital of France is Paris", "The capital of France is Berlin"),
    ("2 + 2 = 4", "2 + 2 = 7"),
    ("I love this film, it was wonderful", "I hate this film, it was dreadful"),
    ("Water boils at 100 degrees Celsius at sea level", "Water boils at 20 degrees Celsius at sea level"),
    ("She thanked him warmly", "She insulted him coldly"),
    ("The sun rises in the east", "The sun rises in the west"),
]
LAYERS = [3, 9]


@pytest.fixture(scope="module")
def hf(hf_smol, smol):
    return hf_smol, smol.tokenizer


def library(hf, layer_type: str = "decoder_block", **kwargs) -> dict[int, torch.Tensor]:
    model, tokenizer = hf
    return library_train(model, tokenizer, PAIRS, layers=LAYERS, layer_type=layer_type, batch_size=1,
                         **kwargs).layer_activations  # fmt: skip


def test_vectors_match_the_library(smol, hf):
    ours = train_steering_vector(smol, PAIRS, hooks="blocks.{3,9}.hook_resid_post")
    assert list(ours.vectors) == ["blocks.3.hook_resid_post", "blocks.9.hook_resid_post"]
    for layer, vector in library(hf).items():
        assert rel_err(ours.vectors[f"blocks.{layer}.hook_resid_post"], vector) < 1e-5, layer
    # the MLP's output, read at the second-to-last token, through the principal direction
    ours = train_steering_vector(smol, PAIRS, hooks="blocks.{3,9}.hook_mlp_out", read_token_index=-2, aggregator="pca")
    for layer, vector in library(hf, "mlp", read_token_index=-2, aggregator=pca_aggregator()).items():
        mine = ours.vectors[f"blocks.{layer}.hook_mlp_out"]
        assert abs(mine.norm().item() - 1) < 1e-5 and rel_err(mine, vector) < 1e-5, layer
    # any function of the positive and negative rows
    ours = train_steering_vector(smol, PAIRS[:2], hooks="blocks.3.hook_resid_post", aggregator=lambda p, n: p[0] - n[1])
    rows = library(hf, aggregator=lambda p, n: p[0] - n[1])
    assert rel_err(ours.vectors["blocks.3.hook_resid_post"], rows[3]) < 1e-5


def test_steering_generates_as_the_library_steers_hf(smol, hf):
    trained = train_steering_vector(smol, PAIRS, hooks="blocks.{3,9}.hook_resid_post")
    model, tokenizer = hf
    prompt = "My opinion of the new restaurant is that"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    vectors = {int(hook.split(".")[1]): v for hook, v in trained.vectors.items()}
    with torch.inference_mode(), LibraryVector(vectors).apply(model, multiplier=6.0):
        expected = model.generate(ids, max_new_tokens=8, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)  # fmt: skip
    tokens = expected.sequences[0, ids.shape[1] :].tolist()
    plain = SamplingParams(max_tokens=8, temperature=0)
    steered = SamplingParams(max_tokens=8, temperature=0, interventions=trained.steers(multiplier=6.0),
                             capture=Capture(hooks="unembed.hook_out", positions="generated"))  # fmt: skip
    unsteered, mine = smol.generate([prompt, prompt], [plain, steered], use_tqdm=False)
    assert mine.outputs[0].token_ids == tokens != unsteered.outputs[0].token_ids
    [alone] = smol.generate([prompt], [plain], use_tqdm=False)
    assert unsteered.outputs[0].token_ids == alone.outputs[0].token_ids
    # the logits each steered token was chosen from (the row before the first generated token is the prompt's)
    scores = torch.cat(expected.scores[1:])
    assert rel_err(mine.activations["unembed.hook_out"], scores) < 1e-5


def test_hooked_lm_steers_through_the_vectors_fwd_hooks(smol4_path):
    """TransformerLens's form: HookedLM's forward and its generate with `fwd_hooks` give what the engine gives
    requests with the same vector's steers."""
    hooked = HookedLM(str(smol4_path), dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(3)
    vector = SteeringVector({f"blocks.{layer}.hook_resid_post": torch.randn(576, generator=g) for layer in (1, 2)})
    ids = hooked.tokenizer("My day at work was")["input_ids"]
    logits = Capture(hooks="unembed.hook_out")
    steered = SamplingParams(max_tokens=6, temperature=0, interventions=vector.steers(3.0), capture=logits)
    plain = SamplingParams(max_tokens=6, temperature=0, capture=logits)
    want, unsteered = hooked.llm.generate([ids, ids], [steered, plain], use_tqdm=False)
    with hooked.hooks(fwd_hooks=vector.fwd_hooks(3.0)):
        got = hooked(torch.tensor([ids]))[0]
        tokens = hooked.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, verbose=False)[0]
    rows = want.activations["unembed.hook_out"][: len(ids)]
    assert rel_err(got, rows) < 1e-5 and rel_err(got, unsteered.activations["unembed.hook_out"][: len(ids)]) > 1e-2
    assert tokens[len(ids) :].tolist() == want.outputs[0].token_ids != unsteered.outputs[0].token_ids


def test_bad_input_is_refused_by_name(smol):
    with pytest.raises(ValueError, match="aggregator: 'median' is not one of mean, pca"):
        train_steering_vector(smol, PAIRS, aggregator="median")
    with pytest.raises(ValueError, match="pairs: empty"):
        train_steering_vector(smol, [])
    with pytest.raises(ValueError, match=r"pairs: expected a list of \(positive, negative\)"):
        train_steering_vector(smol, ["just one prompt"])
    with pytest.raises(ValueError, match="read_token_index: expected an int"):
        train_steering_vector(smol, PAIRS, read_token_index="last")
    with pytest.raises(ValueError, match="cannot be steered"):
        train_steering_vector(smol, PAIRS, hooks="blocks.2.attn.hook_pattern")
    with pytest.raises(ValueError, match="hooks"):
        train_steering_vector(smol, PAIRS, hooks="blocks.99.hook_resid_post")
    assert SteeringVector({"blocks.1.hook_resid_post": torch.ones(576)}).steers(2.0)[0].scale == 2.0


def test_the_server_steers_with_the_vectors_it_loaded(smol, served_smol, tmp_path):
    trained = train_steering_vector(smol, PAIRS, hooks="blocks.{3,9}.hook_resid_post")
    path = tmp_path / "kind.safetensors"
    trained.save(path)
    loaded = SteeringVector.load(path)
    assert loaded.vectors.keys() == trained.vectors.keys()
    assert all(torch.equal(loaded.vectors[h], v) for h, v in trained.vectors.items())
    prompt = "My opinion of the new restaurant is that"
    extra = torch.randn(576, generator=torch.Generator().manual_seed(2))
    trained.scaled(6.0).save(tmp_path / "kind6.safetensors")
    cases = [  # (the request's model and vlens object, the same interventions offline)
        (None, {"steering": [{"name": "kind", "multiplier": 6.0}]}, trained.steers(6.0)),
        (None, {"interventions": [{"type": "steer", "hook": "blocks.5.hook_resid_post", "vector": extra.tolist()}],
                "steering": [{"name": "kind", "multiplier": -4.0, "positions": "generated"}]},
         [Steer("blocks.5.hook_resid_post", extra), *trained.steers(-4.0, positions="generated")]),
        ("kind6", None, trained.steers(6.0)),  # (a vector's name as the model: the base model steered by it)
    ]  # fmt: skip
    vectors = (f"kind={path}", f"kind6={tmp_path / 'kind6.safetensors'}")
    with running_server(served_smol, ServerConfig(steering_vectors=vectors)) as url:
        listed, _ = httpx.get(url + "/v1/steering_vectors").json()["data"]
        assert listed["name"] == "kind" and list(listed["hooks"]) == list(trained.vectors)
        norm = trained.vectors["blocks.9.hook_resid_post"].norm().item()
        assert listed["hooks"]["blocks.9.hook_resid_post"] == pytest.approx(norm)
        models = httpx.get(url + "/v1/models").json()["data"]
        base = models[0]["id"]
        assert [(m["id"], m.get("parent")) for m in models] == [(base, None), ("kind", base), ("kind6", base)]
        texts = set()
        for model, vlens, interventions in cases:
            body = {"model": model or base, "prompt": prompt, "max_tokens": 8, "temperature": 0, "vlens": vlens}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
            [want] = smol.generate(prompt, SamplingParams(max_tokens=8, temperature=0, interventions=interventions),
                                   use_tqdm=False)  # fmt: skip
            assert answer["choices"][0]["text"] == want.outputs[0].text and answer["model"] == body["model"]
            texts.add(want.outputs[0].text)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        texts.add(httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])
        assert len(texts) == 3  # each steers (the first and the last alike)
        # the steered model's embeddings are read with its steering; its tokenizer is the served model's
        embedded = httpx.post(url + "/v1/embeddings", json={"model": "kind6", "input": prompt}, timeout=120).json()
        mean = Capture(hooks="ln_final.hook_out", reduce="mean")
        [want] = smol.generate(prompt, SamplingParams(max_tokens=0, capture=mean, interventions=trained.steers(6.0)),
                               use_tqdm=False)  # fmt: skip
        got = torch.tensor(embedded["data"][0]["embedding"])
        assert embedded["model"] == "kind6" and rel_err(got, want.activations["ln_final.hook_out"][0]) < 1e-5
        assert httpx.post(url + "/tokenize", json={"model": "kind6", "prompt": prompt}).status_code == 200
        missing = httpx.post(url + "/v1/completions", json={**body, "model": "cruel"}, timeout=120)
        assert missing.status_code == 404 and missing.json()["error"]["message"].endswith(
            "and steered by its vectors: 'kind', 'kind6'")
        bad = {**body, "vlens": {"steering": [{"name": "cruel"}]}}
        answer = httpx.post(url + "/v1/completions", json=bad, timeout=120)
        assert answer.status_code == 400 and answer.json()["error"]["message"] == (
            "vlens.steering[0].name: 'cruel' is not a steering vector of this server; loaded: kind, kind6")
        bad = {**body, "vlens": {"steering": [{"name": "kind", "scale": 2}]}}
        assert httpx.post(url + "/v1/completions", json=bad, timeout=120).status_code == 400
    # what cannot load stops the server at start, naming the flag and the vector
    with pytest.raises(ValueError, match=r"^steering_vectors: 'base' is the served model's name"):
        create_app(served_smol, ServerConfig(steering_vectors=(f"base={path}",), served_model_name="base"))
    with pytest.raises(ValueError, match=r"^steering_vectors: .*: no such file or directory"):
        ServerConfig(steering_vectors=(f"kind={tmp_path / 'missing.safetensors'}",))
    SteeringVector({"blocks.99.hook_resid_post": torch.ones(576)}).save(tmp_path / "deep.safetensors")
    with pytest.raises(ValueError, match=r"^steering_vectors: deep: hooks: "):
        create_app(served_smol, ServerConfig(steering_vectors=(f"deep={tmp_path / 'deep.safetensors'}",)))
    SteeringVector({"blocks.1.hook_resid_post": torch.ones(64)}).save(tmp_path / "narrow.safetensors")
    with pytest.raises(ValueError, match=r"^steering_vectors: narrow: the vector at blocks\.1\.hook_resid_post has"):
        create_app(served_smol, ServerConfig(steering_vectors=(f"narrow={tmp_path / 'narrow.safetensors'}",)))
