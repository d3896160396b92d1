"""A tuned lens (vlens.TunedLens) read from the files the tuned-lens package saves: per request, each captured
residual row through its layer's translator, then the final norm and the unembedding, equal to the package's own
`TunedLens.forward` on HF's hidden states (top-k ids and log-probabilities), at layer inputs and outputs, in
generation and beside other requests; the taps it cannot translate are refused by name."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from server_helpers import decode_activations, running_server
from transformers import AutoModelForCausalLM, LlamaConfig

from vlens import LLM, Capture, SamplingParams, TunedLens
from vlens.server.config import ServerConfig
from vlens.server.specs import CaptureSpec

K = 5
PROMPT = [5, 17, 99, 230, 3, 41, 7, 250, 12]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(vlens LLM, HF model, the tuned-lens package's lens with random translators, its directory)."""
    from tuned_lens.nn import TunedLens as Theirs

    root = tmp_path_factory.mktemp("tuned")
    path = build(LlamaConfig(**COMMON, num_key_value_heads=2), root, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    theirs = Theirs.from_model(hf)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.layer_translators.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    theirs.save(root / "lens")
    return LLM(model=path, dtype="float32", device="cpu"), hf, theirs, root / "lens"


def test_tuned_lens_equals_the_tuned_lens_package_s(setup):
    llm, hf, theirs, where = setup
    lens = TunedLens.load(where)
    hooks = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.2.hook_resid_post", "hidden_states.2"]
    capture = Capture(hooks=hooks, logit_lens=K, tuned_lens=lens, positions="all")
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks, logit_lens=K))
    tuned = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=capture)
    out, untuned = llm.generate([PROMPT, PROMPT], [tuned, plain], use_tqdm=False)
    ids = torch.tensor(out.prompt_token_ids + out.outputs[0].token_ids[:-1])
    with torch.no_grad():
        states = hf(ids[None], output_hidden_states=True).hidden_states
        for hook, index in zip(hooks, (0, 2, 3, 2)):
            # (the last layer's output needs no translator: the model's own unembedding, as the package has it)
            logits = theirs(states[index][0], index) if index < 3 else hf(ids[None]).logits[0]
            want_values, want_ids = logits.log_softmax(-1).topk(K)
            got_ids, got_values = out.logit_lens[hook]
            assert torch.equal(got_ids, want_ids) and rel_err(got_values, want_values) <= 1e-5, hook
    assert not torch.equal(out.logit_lens["blocks.1.hook_resid_post"][0], untuned.logit_lens["blocks.1.hook_resid_post"][0])
    assert torch.equal(out.logit_lens["blocks.2.hook_resid_post"][0], untuned.logit_lens["blocks.2.hook_resid_post"][0])


def test_what_a_tuned_lens_cannot_read_is_refused_by_name(setup, tmp_path):
    llm, *_, where = setup
    lens = TunedLens.load(where)
    with pytest.raises(ValueError, match=r"^capture\.tuned_lens: with logit_lens=k"):
        Capture(hooks="blocks.1.hook_resid_post", tuned_lens=lens)
    with pytest.raises(ValueError, match=r"^capture\.tuned_lens: expected a vlens\.TunedLens"):
        Capture(hooks="blocks.1.hook_resid_post", logit_lens=3, tuned_lens=str(where))
    params = SamplingParams(max_tokens=1, capture=Capture(hooks="blocks.1.hook_resid_mid", logit_lens=3, tuned_lens=lens))
    with pytest.raises(ValueError, match=r"^capture\.tuned_lens: translates a layer's input or output .* not "
                                         r"blocks\.1\.hook_resid_mid"):  # fmt: skip
        llm.generate([PROMPT], params, use_tqdm=False)
    small = TunedLens(lens.weight[:2], lens.bias[:2])
    params = SamplingParams(max_tokens=1, capture=Capture(hooks="blocks.1.hook_resid_post", logit_lens=3, tuned_lens=small))
    with pytest.raises(ValueError, match=r"^capture\.tuned_lens: a lens of 2 layers of width 64; this model has 3"):
        llm.generate([PROMPT], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^tuned_lens: .* is not a tuned-lens directory"):
        TunedLens.load(tmp_path)


def test_a_server_reads_its_tuned_lens_when_a_capture_asks(setup):
    """`vlens serve --tuned-lens PATH`: /v1/models says so, and capture.tuned_lens: true gives what LLM.generate
    gives with the same lens; a server without one refuses it by name."""
    llm, *_, where = setup
    hook = "blocks.1.hook_resid_post"
    with running_server(llm, ServerConfig(enable_capture=True, tuned_lens=str(where))) as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["tuned_lens"] is True
        body = {"model": llm.model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                "vlens": {"capture": {"hooks": hook, "logit_lens": K, "tuned_lens": True}}}  # fmt: skip
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = decode_activations(r.json()["vlens"]["activations"], url, {})
    capture = Capture(hooks=hook, logit_lens=K, tuned_lens=TunedLens.load(where))
    [ref] = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, capture=capture), use_tqdm=False)
    ids, logprobs = ref.logit_lens[hook]
    assert torch.equal(got[f"{hook}.logit_lens.token_ids"], ids)
    assert rel_err(got[f"{hook}.logit_lens.logprobs"], logprobs) <= 1e-5
    with pytest.raises(ValueError, match=r"^capture\.tuned_lens: this server has no tuned lens; .* --tuned-lens PATH"):
        CaptureSpec.model_validate({"hooks": hook, "logit_lens": K, "tuned_lens": True}).to_capture({}, None)


def test_a_lens_file_that_does_not_fit_is_refused_by_name(setup, tmp_path):
    *_, where = setup
    (tmp_path / "config.json").write_text((where / "config.json").read_text())
    state = torch.load(where / "params.pt", weights_only=True)
    del state["1.bias"]
    torch.save(state, tmp_path / "params.pt")
    with pytest.raises(ValueError, match=r"params\.pt lacks 1\.bias of shape \(64,\) \(a lens of 3 layers of width 64"):
        TunedLens.load(tmp_path)


def test_a_server_refuses_a_lens_of_another_model_at_start(setup, tmp_path):
    from vlens.server.app import create_app

    llm, *_, where = setup
    state = torch.load(where / "params.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if not k.startswith("2.")}, tmp_path / "params.pt")
    (tmp_path / "config.json").write_text('{"d_model": 64, "num_hidden_layers": 2}')
    with pytest.raises(ValueError, match=r"^tuned_lens: a lens of 2 layers of width 64; this model has 3 of width 64"):
        create_app(llm, ServerConfig(enable_capture=True, tuned_lens=str(tmp_path)))
