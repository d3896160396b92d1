"""64 concurrent clients against one server: a mix of capture and no capture, different hooks and
positions, completions and chat, streamed and not. Every response must equal the same request
served alone (tokens exactly, activations to float32 batch-order noise), with nothing lost and
nothing leaked between requests."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest
import torch
from conftest import rel_err
from replayed_graphs import replay_graphs
from server_helpers import decode_activations, metric, running_server, wait_idle

from vlens.server.config import ServerConfig

CLIENTS = 64
PROMPTS = ["The capital of France is", "Hello, my name is", "In 1492, Columbus sailed", "def fibonacci(n):"]
SPECS = [
    None,
    {"capture": {"hooks": ["blocks.3.hook_resid_post"], "positions": "all"}},
    {"capture": {"hooks": ["blocks.0.attn.hook_z", "blocks.7.attn.hook_v"], "positions": "last"}},
    {"capture": {"hooks": "blocks.{2,9}.mlp.hook_post", "positions": [0, -1]}},
    {"return_hidden_states": True},
    {"capture": {"hooks": ["hook_embed", "blocks.29.hook_resid_post"], "positions": {"start": 1, "stop": -1}}},
    {"capture": {"hooks": ["hidden_states.12", "unembed.hook_out"], "positions": "generated"}},
    None,
]


@dataclass(frozen=True)
class Kind:
    prompt: str
    extension: dict | None
    chat: bool
    stream: bool
    seed: int | None  # sampled (temperature 0.8) with this seed; None = greedy

    def expected_keys(self) -> set[str]:
        if self.extension is None:
            return set()
        keys = {"token_ids"}
        if "capture" in self.extension:
            hooks = self.extension["capture"]["hooks"]
            names = {"blocks.2.mlp.hook_post", "blocks.9.mlp.hook_post"} if isinstance(hooks, str) else set(hooks)
            keys |= names | {"positions"}
        if self.extension.get("return_hidden_states"):
            keys.add("hidden_states")
        return keys


KINDS = [
    Kind(PROMPTS[i % 4], SPECS[i % len(SPECS)], chat=i % 5 == 2, stream=i % 3 == 1, seed=7 + i if i % 7 == 3 else None)
    for i in range(16)
]


@dataclass
class Result:
    text: str
    finish_reason: str
    tensors: dict[str, torch.Tensor] | None


@pytest.fixture(scope="module", params=["eager", "queued ahead"])
def server(served_smol, request):
    """The server as it runs on the CPU (decode steps on the static path, eager, with the C paged kernel,
    queued ahead), and as on a GPU: decode steps on the static path replaying graphs (emulated:
    tests/replayed_graphs.py), each queued before the previous step's ids reach the host (async scheduling),
    with requests long enough to queue steps ahead."""
    config = ServerConfig(
        enable_capture=True, inline_activation_bytes=16 << 10, served_model_name="smol"
    )  # some inline, some handles
    runner = served_smol.runner
    default = runner.graphs, runner.static_decode, runner.pad_decode
    if request.param == "queued ahead":
        replay_graphs(runner)
    try:
        with running_server(served_smol, config) as url:
            yield url, (3 if request.param == "eager" else 8)
    finally:
        runner.graphs, runner.static_decode, runner.pad_decode = default
        runner._graphs.clear()


def run(client: openai.OpenAI, base_url: str, kind: Kind, max_tokens: int) -> Result:
    sampling = {"max_tokens": max_tokens, "temperature": 0.8 if kind.seed is not None else 0.0, "seed": kind.seed}
    extra = {"extra_body": {"vlens": kind.extension}} if kind.extension else {}
    if kind.chat:
        call = client.chat.completions.create
        args = dict(messages=[{"role": "user", "content": kind.prompt}], **sampling, **extra)
    else:
        call = client.completions.create
        args = dict(prompt=kind.prompt, **sampling, **extra)
    if not kind.stream:
        out = call(model="smol", **args)
        choice = out.choices[0]
        text = choice.message.content if kind.chat else choice.text
        return Result(text, choice.finish_reason, _tensors(out, base_url))
    pieces, finish, tensors = [], None, None
    for chunk in call(model="smol", stream=True, **args):
        choice = chunk.choices[0]
        pieces.append((choice.delta.content or "") if kind.chat else choice.text)
        finish = choice.finish_reason or finish
        tensors = _tensors(chunk, base_url) or tensors
    return Result("".join(pieces), finish, tensors)


def _tensors(response, base_url: str) -> dict[str, torch.Tensor] | None:
    extension = (response.model_extra or {}).get("vlens")
    return decode_activations(extension["activations"], base_url) if extension else None


def test_64_concurrent_clients_equal_their_requests_served_alone(server, served_smol):
    server, max_tokens = server
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)
    alone = [run(client, server, kind, max_tokens) for kind in KINDS]
    wait_idle(server)
    stats = served_smol.runner.graph_stats
    ahead, replays = stats.ahead_steps, stats.graph_steps

    start = threading.Barrier(CLIENTS)
    busiest = [0.0]
    done = threading.Event()

    def watch() -> None:  # proof that the requests really shared batches
        while not done.is_set():
            busiest[0] = max(busiest[0], metric(server, "vlens_requests_running"))
            time.sleep(0.01)

    def one(i: int) -> Result:
        start.wait()
        return run(client, server, KINDS[i % len(KINDS)], max_tokens)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(one, range(CLIENTS)))
    finally:
        done.set()
        watcher.join()

    assert len(results) == CLIENTS and busiest[0] > 1
    assert (stats.ahead_steps > ahead) == served_smol.runner.static_decode
    assert (stats.graph_steps > replays) == served_smol.runner.graphs
    for i, got in enumerate(results):
        kind, ref = KINDS[i % len(KINDS)], alone[i % len(KINDS)]
        assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason), (i, kind)
        if kind.extension is None:
            assert got.tensors is None and ref.tensors is None
            continue
        assert set(got.tensors) == set(ref.tensors) == kind.expected_keys(), (i, kind)  # its own hooks only
        assert torch.equal(got.tensors["token_ids"], ref.tensors["token_ids"])  # its own tokens
        if "positions" in got.tensors:
            assert torch.equal(got.tensors["positions"], ref.tensors["positions"])  # its own rows
        for name, t in got.tensors.items():
            assert t.shape == ref.tensors[name].shape and t.dtype == ref.tensors[name].dtype, (i, name)
            if t.is_floating_point() and t.numel():
                assert t.dtype == torch.float32
                assert rel_err(t, ref.tensors[name]) < 1e-4, (i, name)
    wait_idle(server)  # nothing left running, every KV block back
    assert metric(server, "vlens_activation_handles") == 0  # every handle was downloaded, none lost
