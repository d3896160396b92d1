"""SIGTERM while requests run: new requests get 503, running ones finish or, past --shutdown-timeout,
end with a 503 (a stream as its last event), every activation file that is returned is whole, and
`vlens serve` exits 0."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from server_helpers import decode_activations, metric, vlens_serve

CAPTURE = {"vlens": {"capture": {"hooks": ["blocks.3.hook_resid_post"], "positions": "all"}}}
SHORT = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **CAPTURE}
LONG = {"prompt": "Once upon a time", "max_tokens": 240, "temperature": 0, "ignore_eos": True, **CAPTURE}


def outcome(url: str, body: dict) -> str:
    """'done' for a whole answer (its activations decoded), 'shut down' for the 503; anything else fails."""
    if not body.get("stream"):
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        if r.status_code == 503:
            assert r.json()["error"]["code"] is None and "shut down" in r.json()["error"]["message"]
            return "shut down"
        assert r.status_code == 200, r.text
        decode_activations(r.json()["vlens"]["activations"], url)
        return "done"
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-2 if events[-1] == "[DONE]" else -1])
    if "error" in last:
        assert "shut down" in last["error"]["message"] and events[-1] != "[DONE]", events[-3:]
        return "shut down"
    assert events[-1] == "[DONE]" and last["choices"][0]["finish_reason"] == "length"
    decode_activations(last["vlens"]["activations"], url)
    return "done"


def test_sigterm_drains_then_exits_0(smol4_path):
    """On SmolLM2 cut to four layers (conftest.smol4_path), where 240 tokens still outlast the 2 s timeout."""
    args = ["--model", str(smol4_path), "--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--max-model-len",
            "256", "--enable-capture", "--shutdown-timeout", "2", "--inline-activation-bytes", "4096"]  # fmt: skip
    with vlens_serve(args) as (url, proc):
        bodies = [SHORT, {**SHORT, "stream": True}, LONG, {**LONG, "stream": True}] * 2
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(outcome, url, body) for body in bodies]
            while metric(url, "vlens_requests_admitted") < len(bodies) and not any(f.done() for f in futures):
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # uvicorn notices the signal on its next tick
            try:
                late = httpx.post(url + "/v1/completions", json=SHORT, timeout=30)
                assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
                assert late.headers["retry-after"] == "1"
            except httpx.ConnectError:
                pass  # already gone
            outcomes = [f.result() for f in futures]
        assert proc.wait(timeout=60) == 0, proc.output()
    assert set(outcomes) <= {"done", "shut down"}
    print(outcomes)
