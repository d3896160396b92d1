"""The server's parts that need no server: the capture-size bound, the handle store, extension parsing,
streamed text and error shapes."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from transformers import AutoTokenizer

from vlens import Capture, Positions, SamplingParams
from vlens.capture.names import hook_shapes
from vlens.config import ModelConfig
from vlens.engine.detokenizer import Detokenizer
from vlens.server.activations import DOWNLOAD_CHUNK, ActivationStore, Download, capture_bound, owner_of
from vlens.server.admission import Admission
from vlens.server.extension import ExtensionContext, parse_extension
from vlens.server.metrics import route_label
from vlens.server.protocol import APIError, ChatMessage, CompletionRequest, from_value_error, schema_error


@pytest.fixture(scope="module")
def cfg(smol_path):
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(smol_path))


@pytest.mark.parametrize(
    "positions,rows",
    [
        ("all", 8),
        ("prompt", 5),
        ("generated", 3),
        ("last", 1),
        ([0, 2, -1], 3),
        (slice(-3, 2), 2),
        (slice(1, None, 2), 4),
    ],
)
def test_capture_bound_counts_rows_of_the_spec(cfg, positions, rows):
    shapes = hook_shapes(cfg)
    params = SamplingParams(
        max_tokens=4, capture=Capture(hooks=["blocks.3.hook_resid_post", "blocks.1.attn.hook_z"], positions=positions)
    )
    row = (576 + 9 * 64) * 4 + 8  # two float32 hooks and the int64 position
    assert capture_bound(params, 5, shapes, cfg, torch.float32) == rows * row + 9 * 8  # + token_ids
    half = SamplingParams(
        max_tokens=4, capture=Capture(hooks="blocks.3.hook_resid_post", positions=positions, dtype="bfloat16")
    )
    assert capture_bound(half, 5, shapes, cfg, torch.float32) == rows * (576 * 2 + 8) + 9 * 8


def test_capture_bound_of_attention_patterns(cfg):
    """rows x heads x K: K is the widest context a row can have (prompt + max_tokens - 1)."""
    shapes = hook_shapes(cfg)
    params = SamplingParams(max_tokens=4, capture=Capture(hooks="blocks.3.attn.hook_pattern", positions="last"))
    assert capture_bound(params, 5, shapes, cfg, torch.float32) == 1 * (9 * 8 * 4 + 8) + 9 * 8
    picked = SamplingParams(max_tokens=4, capture=Capture(hooks="blocks.3.attn.hook_pattern", positions="all", heads=[2]))
    assert capture_bound(picked, 5, shapes, cfg, torch.float32) == 8 * (1 * 8 * 4 + 8) + 9 * 8


def test_capture_bound_of_hidden_states_and_of_nothing(cfg):
    shapes = hook_shapes(cfg)
    assert capture_bound(SamplingParams(max_tokens=4), 5, shapes, cfg, torch.float32) == 0
    hidden = SamplingParams(max_tokens=4, return_hidden_states=True)
    assert capture_bound(hidden, 5, shapes, cfg, torch.bfloat16) == 8 * 576 * 2 + 9 * 8
    with pytest.raises(ValueError, match="matches no hook"):
        capture_bound(SamplingParams(capture=Capture(hooks="nope")), 5, shapes, cfg, torch.float32)


def test_store_hands_out_once_to_the_right_key_until_expiry():
    now = [1000.0]
    store = ActivationStore(ttl_s=60, clock=lambda: now[0])
    alice, bob = owner_of("alice"), owner_of("bob")
    handle, expires = store.put(b"tensor bytes", alice)
    assert expires == 1060 and len(handle) >= 4 + 32  # 192 random bits, url-safe
    assert handle != store.put(b"other", alice)[0]
    assert store.take(handle, bob) is None  # bound to the key that made it
    assert store.take(handle, alice) == b"tensor bytes"
    assert store.take(handle, alice) is None  # deleted after download
    store.sent(b"tensor bytes")  # counted until its download ended
    late, _ = store.put(b"late", owner_of(None))
    now[0] += 61
    assert store.take(late, owner_of(None)) is None and store.count == 0 and store.nbytes == 0


def test_expired_handles_hold_no_capture_budget():
    """Found in review: admission counted a handle past its TTL until the next sweep (up to 30 s), so a
    capture that fits got 429s."""
    now = [1000.0]
    store = ActivationStore(ttl_s=60, clock=lambda: now[0])
    admission = Admission(max_requests=8, max_capture_bytes=100, store=store)
    store.put(b"x" * 80, b"")
    with pytest.raises(APIError) as e:
        admission.admit(1, 50, "prompt")
    assert e.value.status == 429
    now[0] += 61
    assert admission.admit(1, 50, "prompt").capture_bytes == 50


def test_a_download_is_sent_in_chunks_and_counted_until_it_ends():
    """Found in review: a download was one Response of the whole payload, which the transport copied into
    its buffer for a slow client, and its bytes left the in-flight count as soon as it began."""
    data = bytes(range(256)) * (3 * DOWNLOAD_CHUNK // 256 + 7)
    store = ActivationStore(ttl_s=60)
    headers, chunks, held = {}, [], []

    async def download(leave_after: int | None = None) -> None:
        handle, _ = store.put(data, b"")
        chunks.clear(), held.clear()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers.update({k.decode(): v.decode() for k, v in message["headers"]})
            elif message["body"]:
                if len(chunks) == leave_after:
                    raise OSError("the client left")
                chunks.append(bytes(message["body"]))
                held.append(store.nbytes)

        response = Download(store.take(handle, b""), handle, store)
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)

    asyncio.run(download())
    assert b"".join(chunks) == data and max(map(len, chunks)) == DOWNLOAD_CHUNK
    assert headers["content-length"] == str(len(data)) and headers["content-type"] == "application/octet-stream"
    assert held == [len(data)] * len(chunks) and store.nbytes == 0 and store.count == 0
    with pytest.raises(ClientDisconnect):  # the client leaves mid-download: its bytes are freed all the same
        asyncio.run(download(leave_after=1))
    assert held == [len(data)] and store.nbytes == 0


def test_extension_fields_are_parsed_or_refused_by_name():
    on, off = ExtensionContext(enable_capture=True), ExtensionContext(enable_capture=False)
    kwargs = parse_extension({"capture": {"hooks": "blocks.1.hook_resid_post", "positions": {"start": 2}}}, on)
    assert kwargs["capture"].positions == Positions.parse(slice(2, None, None))
    heads = parse_extension({"capture": {"hooks": "blocks.1.attn.hook_pattern", "heads": [3, 1]},
                             "interventions": [{"type": "ablate", "hook": "blocks.2.attn.hook_z", "heads": [0]}]}, on)
    assert heads["capture"].heads == [3, 1] and heads["interventions"][0].heads == [0]
    assert parse_extension({"return_hidden_states": False, "capture": None}, off) == {"return_hidden_states": False}
    with pytest.raises(APIError, match="vlens.steer: unknown field") as e:
        parse_extension({"steer": 1, "capture": {"hooks": "x"}}, on)
    assert e.value.param == "vlens.steer" and "known: capture, return_hidden_states" in e.value.message
    with pytest.raises(APIError, match="--enable-capture") as e:
        parse_extension({"capture": {"hooks": "x"}}, off)
    assert (e.value.status, e.value.code) == (400, "capture_disabled")
    with pytest.raises(APIError) as e:
        parse_extension({"capture": {"hooks": "x", "positions": 1.5}}, on)
    assert e.value.param == "vlens.capture.positions"


def test_errors_name_the_field():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": ["a", [1]]})
    error = schema_error(e.value.errors(), 422)
    assert error.param == "prompt" and "matches none of the forms" in error.message
    assert error.body()["error"].keys() == {"message", "type", "param", "code"}
    assert from_value_error(ValueError("capture.positions: bad"), prefix="vlens.").param == "vlens.capture.positions"
    assert from_value_error(ValueError("something else went wrong")).param is None


def test_chat_content_parts_are_joined_as_vllm_joins_them(smol_path):
    """Found in review: a message's text parts were run together ("part onepart two"); vLLM joins them with
    newlines, so the same chat request made another prompt here than on vLLM."""
    from vlens.server.tokens import render_chat

    tokenizer = AutoTokenizer.from_pretrained(smol_path)
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}])
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "part one\ntwo"}], add_generation_prompt=True, tokenize=False
    )
    assert parts.text() == "part one\ntwo" and render_chat(tokenizer, [parts]) == expected


def test_streamed_text_adds_up_and_never_shows_a_stop_string(smol_path):
    tokenizer = AutoTokenizer.from_pretrained(smol_path)
    prompt = tokenizer("Say:")["input_ids"]
    tokens = tokenizer(" Hello world. How are you? Fine")["input_ids"]
    for stops, stop_reason, final in [
        ([], None, " Hello world. How are you? Fine"),
        (["How are"], "How are", " Hello world. "),
    ]:
        detokenizer = Detokenizer(tokenizer, prompt, SamplingParams(stop=stops))
        released = ""
        for n, token in enumerate(tokens, 1):
            found = detokenizer.add(token)
            if found is not None or n == len(tokens):  # the engine finishes the request at this token
                break
            released += detokenizer.release(final=False)
            assert all(s not in released for s in stops)
        assert found == stop_reason
        assert released + detokenizer.release(final=True) == final == detokenizer.text


def test_text_is_cut_at_the_earliest_stop_string(smol_path):
    """One token (")," here) can complete two stop strings: the text ends before the earlier one, whichever
    is listed first, so it holds neither (as lm-eval's HF model cuts it)."""
    tokenizer = AutoTokenizer.from_pretrained(smol_path)
    for stops in ([",", ")"], [")", ","]):
        detokenizer = Detokenizer(tokenizer, tokenizer("Say:")["input_ids"], SamplingParams(stop=stops))
        found = next(filter(None, map(detokenizer.add, tokenizer(" He said (yes), then")["input_ids"])))
        assert (found, detokenizer.text) == (")", " He said (yes")


def test_route_labels_stay_bounded():
    assert route_label("/v1/activations/act-abc") == "/v1/activations/{id}"
    assert route_label("/v1/completions") == "/v1/completions" and route_label("/etc/passwd") == "other"


def test_a_dropped_app_frees_its_llm(smol_path):
    """FastAPI keeps every endpoint it has looked at in a module-level cache, so routes that closed over the LLM held
    its weights and KV cache for the life of the process once their app was dropped (a notebook's server, a test's):
    the routes read their app's `Served`, and a dropped app and LLM free the model once collected."""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    from vlens import LLM
    from vlens.server.app import create_app
    from vlens.server.config import ServerConfig

    llm = LLM(str(smol_path), dtype="float32", device="cpu", kv_cache_memory=64 << 20)
    app = create_app(llm, ServerConfig())
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json={"model": llm.model_name, "prompt": "Hi", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    model = weakref.ref(llm.model)
    del app, client, llm, answer
    gc.collect()
    assert model() is None
