"""What real clients send to `vlens serve` and read back: echo with prompt log-probabilities (what
lm-eval scores with), parallel samples, penalties and logit_bias, the tokenizer routes lm-eval's
remote tokenizer calls, embeddings through the official client, bodies as LangChain-style clients
build them, and the 400s that name a bad field while the server keeps serving."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import rel_err
from server_helpers import running_server

from vlens import Capture, SamplingParams
from vlens.server.config import ServerConfig

PROMPT = "The capital of France is"
SAMPLED = {"max_tokens": 6, "temperature": 1.0, "top_p": 0.9}


@pytest.fixture(scope="module")
def server(served_smol):
    config = ServerConfig(max_n=4, embedding_hook="blocks.5.hook_resid_post", served_model_name="smol")
    with running_server(served_smol, config) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path, body):
    return httpx.post(server + path, json=body, timeout=120)


# -- echo and prompt log-probabilities ------------------------------------------------------------


def test_echo_as_lm_eval_sends_it(server, smol):
    ids = smol.tokenizer("Question: What is the capital of France?\nAnswer: Paris")["input_ids"]
    body = {"prompt": [ids, ids[:-2]], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    [ref] = smol.generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1), use_tqdm=False
    )
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(ref.prompt_logprobs[p][ids[p]].logprob, abs=1e-5)
        assert len(lp["top_logprobs"][p]) == 1
    generated = ref.outputs[0].token_ids[0]
    assert lp["token_logprobs"][-1] == pytest.approx(ref.outputs[0].logprobs[0][generated].logprob, abs=1e-5)
    assert lp["text_offset"][0] == 0 and choice["text"].startswith(smol.tokenizer.decode(ids))
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_echo_without_generating(server, client, smol):
    out = client.completions.create(model="smol", prompt=PROMPT, echo=True, max_tokens=0, logprobs=2)
    choice = out.choices[0]
    n = len(smol.tokenizer(PROMPT)["input_ids"])
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == n
    assert "".join(choice.logprobs.tokens) == PROMPT
    plain = client.completions.create(model="smol", prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_echo_streamed_adds_up(client):
    kw = {"model": "smol", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0, "n": 2}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    for i in range(2):
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(p.text for p in parts) == full.choices[i].text
        streamed = [v for p in parts if p.logprobs for v in p.logprobs.token_logprobs]
        assert streamed == full.choices[i].logprobs.token_logprobs


def test_vllm_prompt_logprobs_field(server, smol):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    [ref] = smol.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2), use_tqdm=False)
    assert entries[0] is None and len(entries) == len(ref.prompt_logprobs)
    for got, want in zip(entries[1:], ref.prompt_logprobs[1:]):
        assert {int(t): v["rank"] for t, v in got.items()} == {t: lp.rank for t, lp in want.items()}


# -- sampling options ------------------------------------------------------------------------------


def test_n_samples_are_the_seeded_requests_alone(client):
    out = client.completions.create(model="smol", prompt=PROMPT, n=3, seed=21, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, c in enumerate(out.choices):
        alone = client.completions.create(model="smol", prompt=PROMPT, seed=21 + i, **SAMPLED)
        assert c.text == alone.choices[0].text
    again = client.completions.create(model="smol", prompt=PROMPT, n=3, seed=21, **SAMPLED)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    two = client.completions.create(model="smol", prompt=[PROMPT, "Hello"], n=2, seed=21, **SAMPLED)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.text for c in two.choices[:2]] == [c.text for c in out.choices[:2]]
    best = client.completions.create(model="smol", prompt=PROMPT, n=1, best_of=3, seed=21, **SAMPLED)
    assert best.choices[0].text in [c.text for c in out.choices] and best.usage.completion_tokens <= 6
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi"}], n=2, seed=5, **SAMPLED
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)


def test_penalties_and_logit_bias_equal_offline(client, smol):
    options = {"presence_penalty": 1.2, "frequency_penalty": 0.6, "logit_bias": {"28": 3.5, "30": -100}}
    out = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"repetition_penalty": 1.3}, **options
    )
    params = SamplingParams(
        max_tokens=10, temperature=0, presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.3,
        logit_bias={28: 3.5, 30: -100},
    )  # fmt: skip
    [ref] = smol.generate(PROMPT, params, use_tqdm=False)
    assert out.choices[0].text == ref.outputs[0].text
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, **options
    )
    assert chat.choices[0].message.content


def test_vllm_token_bans_and_kept_stops_equal_offline(client, smol):
    options = {"min_tokens": 6, "bad_words": ["Paris"], "allowed_token_ids": None, "include_stop_str_in_output": True}
    out = client.completions.create(model="smol", prompt=PROMPT, max_tokens=12, temperature=0, stop=["."],
                                    extra_body=options)  # fmt: skip
    [ref] = smol.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=["."], **options), use_tqdm=False)
    assert out.choices[0].text == ref.outputs[0].text and "Paris" not in ref.outputs[0].text
    allowed, messages = smol.tokenizer.encode(" Lyon.", add_special_tokens=False), [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"allowed_token_ids": allowed})  # fmt: skip
    [ref] = smol.chat(messages, SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=allowed), use_tqdm=False)
    assert chat.choices[0].message.content == ref.outputs[0].text
    assert set(ref.outputs[0].token_ids) <= set(allowed)


def test_return_token_ids_streamed_and_not(server, smol):
    """vLLM's return_token_ids: completions' choices carry the prompt's and their own token ids, a chat's response
    its prompt's at the top level; streamed, the prompt's come in the first chunk and each chunk its own tokens. And
    return_tokens_as_token_ids: log-probabilities name their tokens by id."""
    messages = [{"role": "user", "content": "Hi"}]
    [ref] = smol.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    [chat_ref] = smol.chat(messages, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    for path, body, want in (("/v1/completions", {"prompt": PROMPT}, ref), ("/v1/chat/completions",
                                                                           {"messages": messages}, chat_ref)):
        body |= {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
        out = post(server, path, body).json()
        prompt_ids = out["prompt_token_ids"] if "messages" in body else out["choices"][0]["prompt_token_ids"]
        assert (prompt_ids, out["choices"][0]["token_ids"]) == (want.prompt_token_ids, want.outputs[0].token_ids)
        chunks = []
        with httpx.stream("POST", server + path, json=body | {"stream": True}, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        first = chunks[0] if "messages" in body else chunks[0]["choices"][0]
        assert first["prompt_token_ids"] == want.prompt_token_ids
        assert all("prompt_token_ids" not in c and "prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.outputs[0].token_ids
    plain = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    named = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                             "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
    assert named["tokens"] == [f"token_id:{t}" for t in ref.outputs[0].token_ids]  # (vLLM's names: no text lost)
    assert all(len(top) == 2 and all(name.startswith("token_id:") for name in top) for top in named["top_logprobs"])
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                 "logprobs": True, "return_tokens_as_token_ids": True}).json()
    assert [e["token"] for e in chat["choices"][0]["logprobs"]["content"]] == \
        [f"token_id:{t}" for t in chat_ref.outputs[0].token_ids]  # fmt: skip


def test_cache_salt_keeps_prefixes_apart(server):
    """vLLM's cache_salt: a prompt's cached blocks serve only requests with its salt (a tenant's prefixes are not
    another's to time), and the text is the same either way."""
    prompt = "The history of the Roman Empire, told briefly: " * 8
    asked = [post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0} | salt).json()
             for salt in ({"cache_salt": "a"}, {"cache_salt": "a"}, {"cache_salt": "b"}, {})]  # fmt: skip
    cached = [out["usage"]["prompt_tokens_details"]["cached_tokens"] for out in asked]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == cached[3] == 0, cached
    assert len({out["choices"][0]["text"] for out in asked}) == 1


def test_truncate_prompt_tokens_on_completions_and_embeddings(server, smol):
    ids = smol.tokenizer(PROMPT)["input_ids"]
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "truncate_prompt_tokens": 3}
    out = post(server, "/v1/completions", body).json()
    [ref] = smol.generate([ids[-3:]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert out["choices"][0]["text"] == smol.tokenizer.decode(ids[-3:]) + ref.outputs[0].text
    assert out["usage"]["prompt_tokens"] == 3
    cut = post(server, "/v1/embeddings", {"input": PROMPT, "truncate_prompt_tokens": 2}).json()
    alone = post(server, "/v1/embeddings", {"input": [ids[-2:]]}).json()
    assert cut["data"][0]["embedding"] == alone["data"][0]["embedding"] and cut["usage"]["prompt_tokens"] == 2


def test_langchain_style_body(server):
    """The defaults LangChain's OpenAI wrappers send with every request, vLLM's extras included."""
    body = {
        "model": "smol", "prompt": [PROMPT], "temperature": 0, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0,
        "n": 1, "logit_bias": {}, "max_tokens": 4, "best_of": 1, "seed": None, "logprobs": None, "stream": False,
        "use_beam_search": False, "skip_special_tokens": True, "min_tokens": 0, "response_format": None,
    }  # fmt: skip
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(" Paris")


# -- tokenizer routes and embeddings --------------------------------------------------------------


def test_tokenizer_routes_as_lm_eval_uses_them(server, smol):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server + "/v1/completions")
    remote = RemoteTokenizer(server + "/v1/completions")
    assert remote.encode("Hello world") == smol.tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert remote.decode(remote.encode("Hello world")) == "Hello world"
    assert remote.eos_token_id == smol.tokenizer.eos_token_id and remote.bos_token_id == smol.tokenizer.bos_token_id
    assert remote.apply_chat_template([{"role": "user", "content": "Hi"}]) == smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    r = post(server, "/tokenize", {"prompt": "Hello", "return_token_strs": True}).json()
    assert r == {"count": 1, "max_model_len": 512, "tokens": [19556], "token_strs": ["Hello"]}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 5


def test_embeddings(client, server, smol):
    texts = ["The cat sat on the mat.", "Quantum field theory"]
    out = client.embeddings.create(model="smol", input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens > 0
    for text, d in zip(texts, out.data):
        capture = Capture(hooks="blocks.5.hook_resid_post", positions="prompt", reduce="mean")
        [ref] = smol.generate(text, SamplingParams(max_tokens=0, capture=capture), use_tqdm=False)
        assert np.allclose(d.embedding, ref.activations["blocks.5.hook_resid_post"][0].numpy(), atol=1e-5)
    last = post(
        server, "/v1/embeddings", {"input": texts[0], "vlens": {"hook": "ln_final.hook_out", "pooling": "last"}}
    )
    capture = Capture(hooks="ln_final.hook_out", positions="last")
    [ref] = smol.generate(texts[0], SamplingParams(max_tokens=0, capture=capture), use_tqdm=False)
    assert np.allclose(last.json()["data"][0]["embedding"], ref.activations["ln_final.hook_out"][0].numpy(), atol=1e-5)
    raw = post(server, "/v1/embeddings", {"input": [[1, 2, 3]], "encoding_format": "base64"}).json()
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").shape == (576,)
    # vLLM's normalize: unit vectors, the same directions (LLM.embed's too)
    unit = post(server, "/v1/embeddings", {"input": texts, "normalize": True}).json()["data"]
    offline = smol.embed(texts, hook="blocks.5.hook_resid_post", normalize=True, use_tqdm=False)
    for d, raw_vector, o in zip(unit, out.data, offline, strict=True):
        vector = np.asarray(d["embedding"])
        assert abs(np.linalg.norm(vector) - 1) < 1e-5 and np.allclose(vector, o.outputs.embedding.numpy(), atol=1e-6)
        assert np.allclose(vector, np.asarray(raw_vector.embedding) / np.linalg.norm(raw_vector.embedding), atol=1e-6)


def test_llm_embed_equals_hf_and_the_server(client, smol, hf_smol):
    """vLLM's LLM.embed on any model: the mean of a layer's stream over the prompt, or the final norm's last row, as
    HF's hidden states give them and /v1/embeddings returns them."""
    texts = ["The cat sat on the mat.", "Quantum field theory"]
    means = smol.embed(texts, hook="blocks.5.hook_resid_post", use_tqdm=False)
    lasts = smol.embed(texts, pooling="last", use_tqdm=False)  # (ln_final.hook_out, the server's default)
    served = client.embeddings.create(model="smol", input=texts)
    for text, mean, last, d in zip(texts, means, lasts, served.data, strict=True):
        ids = smol.tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            hidden = hf_smol(ids, output_hidden_states=True).hidden_states
        assert mean.prompt_token_ids == ids[0].tolist() and mean.outputs.embedding.shape == (576,)
        assert rel_err(mean.outputs.embedding, hidden[6][0].mean(0)) < 1e-5
        assert rel_err(last.outputs.embedding, hidden[-1][0, -1]) < 1e-5
        assert np.allclose(d.embedding, mean.outputs.embedding.numpy(), atol=1e-5)
    cut = smol.embed(texts[0], truncate_prompt_tokens=2, use_tqdm=False)[0]
    assert cut.prompt_token_ids == smol.tokenizer(texts[0])["input_ids"][-2:]
    for kwargs, message in (({"pooling": "max"}, "^pooling: 'max' is not allowed"),
                            ({"hook": "blocks.*.hook_resid_post"}, "^hook: 'blocks.*.hook_resid_post' matches 30")):
        with pytest.raises(ValueError, match=message):
            smol.embed(texts, **kwargs)


# -- refusals ------------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 5}, "n"),  # over this server's max_n
    ("/v1/completions", {"prompt": PROMPT, "best_of": 5}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"12": 100.5}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [49152]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "bad_words": [" "]}, "bad_words"),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/completions", {"prompt": PROMPT, "nonsense": 1}, "nonsense"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 9}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"-3": 1}}, "logit_bias"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",  # ("auto", the default with tools: vlens has no parser of tool-call text)
    ),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "vlens": {"hook": "blocks.*.hook_resid_post"}}, "vlens.hook"),
    ("/v1/embeddings", {"input": "x", "vlens": {"hook": "nope"}}, "vlens.hook"),
    ("/v1/embeddings", {"input": "x", "vlens": {"hook": "blocks.1.attn.hook_pattern", "pooling": "last"}}, "vlens.hook"),
    ("/v1/embeddings", {"input": "x", "vlens": {"pooling": "max"}}, "vlens.pooling"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ("/detokenize", {"tokens": [1, 60000]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{p}:{param}" for p, _, param in BAD])
def test_bad_values_name_the_field_and_the_server_keeps_serving(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    ok = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200
