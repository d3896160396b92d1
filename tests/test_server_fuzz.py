"""Schemathesis over the server's own OpenAPI document, in process: bodies generated from every route's
schema (the `vlens` extension's included) and bodies that break it, sent with and without the API key.
No answer may be a 5xx; every 4xx has OpenAI's error shape, and a 400/422 names the field at fault; a
good request is answered the same before and after.

VLENS_FUZZ_EXAMPLES raises the examples per route and mode (generated bodies are derandomized, so a run
is reproducible)."""

from __future__ import annotations

import base64
import os
from collections import Counter
from dataclasses import dataclass, field

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from safetensors.torch import load
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi
from server_helpers import ENGINE

from vlens import LLM
from vlens.server.app import create_app
from vlens.server.config import ServerConfig
from vlens.server.extension import FIELDS
from vlens.server.specs import ExtensionSpec

KEY = "fuzz-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("VLENS_FUZZ_EXAMPLES", "48"))
GOOD = {
    "prompt": "The capital of France is",
    "max_tokens": 4,
    "temperature": 0,
    "vlens": {"capture": {"hooks": ["blocks.1.hook_resid_post"], "positions": "last"}},
}


@pytest.fixture(scope="module")
def app(smol4_path):
    # A short context keeps every generated request a few tokens long, on SmolLM2 cut to four layers
    # (conftest.smol4_path): the point is the edges, not the decoding.
    llm = LLM(model=str(smol4_path), enable_capture=True, **{**ENGINE, "max_model_len": 48})
    config = ServerConfig(enable_capture=True, api_key=KEY, inline_activation_bytes=16 << 10, max_n=4)
    app = create_app(llm, config)
    yield app
    asgi.shutdown_lifespans()  # schemathesis started the app's lifespan once, for the whole module


def problem(status: int, body: object) -> str | None:
    """What is wrong with a response, or None."""
    if status >= 500:
        return f"server error {status}: {body}"
    if status < 400:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"{status} not in OpenAI's error shape: {body}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"{status} without a message: {body}"
    if status in (400, 422) and not (isinstance(error["param"], str) and error["param"] in error["message"]):
        return f"{status} whose message does not name its field (param {error['param']!r}): {error['message']}"
    return None


def test_extension_schema_lists_the_parsed_keys():
    assert set(ExtensionSpec.model_fields) == set(FIELDS)


@dataclass
class Log:
    """What the fuzzer sent and what came back."""

    sent: Counter[str] = field(default_factory=Counter)  # per route
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


def fuzz(operation, mode: GenerationMode, log: Log) -> None:
    """EXAMPLES bodies for one route, every 4th sent without the key."""

    @settings(
        max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case) -> None:
        authenticated = log.sent[operation.label] % 4 != 3
        log.sent[operation.label] += 1
        response = case.call(headers=AUTH if authenticated else {"Authorization": ""})
        log.statuses[response.status_code] += 1
        try:
            body = response.json()
        except ValueError:
            body = response.text
        found = problem(response.status_code, body)
        if found:
            log.failures.append(f"{operation.label} ({mode.value}): {found}\n  request: {case.body!r}")

    try:
        send()
    except Unsatisfiable:  # a GET without parameters has nothing to break
        assert mode == GenerationMode.NEGATIVE


def test_fuzzed_requests(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    good_before = schema_call(schema, GOOD)
    log = Log()
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(result.ok(), mode, log)
    total = sum(log.sent.values())
    print(f"\nfuzz: {total} requests over {len(log.sent)} routes; statuses {dict(sorted(log.statuses.items()))}")
    assert total >= 500 or EXAMPLES < 48, log.sent
    assert not log.failures, "\n".join(log.failures[:20]) + f"\n({len(log.failures)} in all)"
    assert schema_call(schema, GOOD) == good_before


def schema_call(schema, body: dict) -> dict:
    """A good completion through the same in-process client: its choices and activation bytes."""
    from schemathesis.python.asgi import get_client

    with get_client(schema.app) as client:
        r = client.post("http://testserver/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    tensors = load(base64.b64decode(out["vlens"]["activations"]["data"]))
    return {"choices": out["choices"], **{name: t.tolist() for name, t in tensors.items()}}
