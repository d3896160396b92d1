"""Overload: more requests than the engine runs at once queue; past --max-pending-requests, or past
--max-capture-bytes-in-flight (running captures plus handles not yet downloaded), a request gets 429 with
Retry-After, and the server takes requests again as soon as the held ones end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest
import torch
from server_helpers import ENGINE, decode_activations, running_server, wait_idle

from vlens import LLM, Capture, SamplingParams
from vlens.capture.names import hook_shapes
from vlens.server.activations import capture_bound
from vlens.server.config import ServerConfig

PROMPT = "The capital of France is"
HOOK = "blocks.3.hook_resid_post"
PENDING = 6
SHORT = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
LONG = {"prompt": PROMPT, "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True}
CAPTURE = {"vlens": {"capture": {"hooks": [HOOK], "positions": "all"}}}
# A large capture from a long prompt (one prefill) rather than from many decode steps: quick to run.
BIG = {"prompt": "word " * 400, "max_tokens": 8, "temperature": 0, **CAPTURE}


@pytest.fixture(scope="module")
def llm(smol_path):
    return LLM(model=str(smol_path), enable_capture=True, **{**ENGINE, "max_num_seqs": 2})


@pytest.fixture(scope="module")
def server(llm):
    ids = llm.tokenizer(BIG["prompt"])["input_ids"]
    params = SamplingParams(max_tokens=BIG["max_tokens"], capture=Capture(hooks=[HOOK]))
    bound = capture_bound(params, len(ids), hook_shapes(llm.config), llm.config, torch.float32)
    config = ServerConfig(
        enable_capture=True, max_pending_requests=PENDING, max_capture_bytes_in_flight=bound * 3 // 2,
        inline_activation_bytes=0,  # every capture leaves a handle, held until downloaded
    )  # fmt: skip
    with running_server(llm, config) as url:
        yield url


def hold(stack: ExitStack, url: str, body: dict) -> None:
    """Start a stream (its status comes once the engine queued it) and leave it open, so the server holds
    the request until the stack closes."""
    r = stack.enter_context(httpx.stream("POST", url + "/v1/completions", json=body, timeout=120))
    assert r.status_code == 200, r.read()


def busy(r: httpx.Response) -> str:
    """The 429's message, after checking its shape."""
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["code"] == "server_busy" and set(error) == {"message", "type", "param", "code"}
    return error["message"]


def test_more_requests_than_max_num_seqs_queue(server):
    with ThreadPoolExecutor(PENDING) as pool:
        replies = list(
            pool.map(lambda _: httpx.post(server + "/v1/completions", json=SHORT, timeout=120), range(PENDING))
        )
    assert [r.status_code for r in replies] == [200] * PENDING
    assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
    wait_idle(server)


def test_past_max_pending_requests_429_then_recovers(server):
    with ExitStack() as stack:
        for _ in range(PENDING):
            hold(stack, server, LONG)
        assert "--max-pending-requests" in busy(httpx.post(server + "/v1/completions", json=SHORT, timeout=120))
        embed = httpx.post(server + "/v1/embeddings", json={"input": "Hi"}, timeout=120)
        assert "--max-pending-requests" in busy(embed)
    wait_idle(server)
    assert httpx.post(server + "/v1/completions", json=SHORT, timeout=120).status_code == 200
    # More prompts in one request than the server ever holds: not a 429, which would be retried forever
    for path, body in (("/v1/completions", {**SHORT, "prompt": [PROMPT] * (PENDING + 1)}),
                       ("/v1/embeddings", {"input": ["Hi"] * (PENDING + 1)})):  # fmt: skip
        r = httpx.post(server + path, json=body, timeout=120)
        field = "prompt" if "prompt" in body else "input"
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "--max-pending-requests (6)" in r.json()["error"]["message"]


def test_past_max_capture_bytes_in_flight_429_then_recovers(server):
    with ExitStack() as stack:
        hold(stack, server, {**LONG, **BIG, "max_tokens": 100})
        assert "--max-capture-bytes-in-flight" in busy(httpx.post(server + "/v1/completions", json=BIG, timeout=120))
        assert httpx.post(server + "/v1/completions", json=SHORT, timeout=120).status_code == 200  # no capture
    wait_idle(server)
    # An undownloaded handle holds its bytes until fetched (or expired): the next large capture waits for it.
    first = httpx.post(server + "/v1/completions", json=BIG, timeout=120)
    assert first.status_code == 200
    assert "--max-capture-bytes-in-flight" in busy(httpx.post(server + "/v1/completions", json=BIG, timeout=120))
    tensors = decode_activations(first.json()["vlens"]["activations"], server)
    assert tensors[HOOK].shape == (len(tensors["token_ids"]) - 1, 576)
    second = httpx.post(server + "/v1/completions", json=BIG, timeout=120)
    assert second.status_code == 200 and second.json()["choices"] == first.json()["choices"]
    decode_activations(second.json()["vlens"]["activations"], server)
    wait_idle(server)
