"""`vlens serve` as an operator runs it: a subprocess, the API key from VLENS_API_KEY, capture off."""

from __future__ import annotations

import re
import signal

import httpx
import openai
import pytest
import torch
from server_helpers import vlens_serve

from vlens import Capture, SamplingParams
from vlens.cli import main
from vlens.server.app import create_app
from vlens.server.config import ServerConfig

KEY = "env-key-9876543210"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smol4_path):
    """`vlens serve` on SmolLM2 cut to four layers (conftest.smol4_path): nothing here depends on the model."""
    args = ["--model", str(smol4_path), "--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--max-model-len",
            "256", "--embedding-hook", "blocks.3.hook_resid_post", "--embedding-pooling", "last"]  # fmt: skip
    with vlens_serve(args, env={"VLENS_API_KEY": KEY}) as served:
        yield served


def test_capture_is_refused_unless_enabled(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    for extension in ({"capture": {"hooks": ["blocks.3.hook_resid_post"]}}, {"return_hidden_states": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"vlens": extension})
        error = e.value.body
        assert error["code"] == "capture_disabled" and "--enable-capture" in error["message"]
    assert httpx.get(url + "/v1/hooks", headers=AUTH).json()["capture_enabled"] is False
    plain = client.completions.create(
        model=model, prompt="Hi", max_tokens=2, extra_body={"vlens": {"return_hidden_states": False}}
    )
    assert plain.usage.completion_tokens == 2 and "vlens" not in (plain.model_extra or {})


def test_embeddings_need_no_enable_capture(server, smol4):
    """An embedding is the server's own capture: it works with capture off, at the flags' hook and pooling."""
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out = client.embeddings.create(model=client.models.list().data[0].id, input=["Hello there", "Bye"])
    capture = Capture(hooks="blocks.3.hook_resid_post", positions="last")
    for text, d in zip(["Hello there", "Bye"], out.data):
        [ref] = smol4.generate(text, SamplingParams(max_tokens=0, capture=capture), use_tqdm=False)
        assert torch.allclose(torch.tensor(d.embedding), ref.activations["blocks.3.hook_resid_post"][0], atol=1e-5)


def test_bad_embedding_hook_fails_at_start(smol):
    with pytest.raises(ValueError, match="^embedding_hook: hooks: 'nope' matches no hook"):
        create_app(smol, ServerConfig(embedding_hook="nope"))
    for hook in ("blocks.*.hook_resid_post", "blocks.0.attn.hook_pattern"):  # (several taps; rows of varying width)
        with pytest.raises(ValueError, match=f"^embedding_hook: '{re.escape(hook)}'"):
            create_app(smol, ServerConfig(embedding_hook=hook))


def test_key_comes_from_the_environment(server):
    url, _ = server
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200


def test_server_outlives_a_pipe_of_access_log(server):
    """More access-log output (2.4 MB) than a pipe holds (64 KiB by default, 1 MiB at most): the server keeps
    answering only if the harness does not leave its output in an unread pipe (see ServeProcess)."""
    url, proc = server
    pad = "x" * 8000  # the access log writes the query string
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(300):
            assert client.get(f"/health?pad={pad}").status_code == 200
        assert client.get("/metrics", headers=AUTH).status_code == 200
    assert proc.output().count(pad) == 300


def test_interrupt_stops_the_server(server):
    _, proc = server
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


def test_bad_server_options_fail_before_loading(capsys):
    assert main(["serve", "--max-capture-bytes", "-1"]) == 2
    assert "max_capture_bytes" in capsys.readouterr().err
