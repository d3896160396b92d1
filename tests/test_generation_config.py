"""vLLM's --generation-config (vlens.generation_config): SmolLM2 cut to four layers, with a generation_config.json
whose makers recommend greedy decoding with a repetition penalty, top_k and 5 new tokens: requests that leave those
fields out take them (LLM.generate without params, get_default_sampling_params, a served body without the fields),
requests that give them keep theirs; "vllm" reads none; a folder's file; bad sources and values refused by name."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from server_helpers import running_server

from vlens import LLM, SamplingParams
from vlens.server.config import ServerConfig

RECOMMENDED = {"do_sample": True, "temperature": 0.0, "top_k": 3, "repetition_penalty": 1.3, "max_new_tokens": 5}
ENGINE = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 16 << 20}
PROMPT = [1, 504, 3458, 282, 4649, 314]  # (token ids)


def _checkpoint(smol4_path, folder, config: dict):
    """smol4's files, with `config` as its generation_config.json."""
    folder.mkdir()
    for name in os.listdir(smol4_path):
        if name != "generation_config.json":
            os.symlink(smol4_path / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def recommended(smol4_path, tmp_path_factory):
    return _checkpoint(smol4_path, tmp_path_factory.mktemp("gen") / "model", RECOMMENDED)


def test_requests_that_leave_the_fields_out_take_the_models_recommendation(recommended, smol4_path):
    llm = LLM(model=str(recommended), **ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 3, 1.3, 5)
    assert defaults.top_p == 1.0 and defaults.min_p == 0.0  # (what the file leaves out: SamplingParams' own)
    [out] = llm.generate([PROMPT], use_tqdm=False)
    explicit = SamplingParams(temperature=0.0, top_k=3, repetition_penalty=1.3, max_tokens=5)
    [want] = llm.generate([PROMPT], explicit, use_tqdm=False)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) == 5
    plain = LLM(model=str(recommended), generation_config="vllm", **ENGINE).get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.repetition_penalty, plain.max_tokens) == (1.0, 0, 1.0, 16)
    elsewhere = LLM(model=str(smol4_path), generation_config=str(recommended), **ENGINE)  # (another folder's file)
    assert elsewhere.get_default_sampling_params().max_tokens == 5

    with running_server(llm, ServerConfig()) as url:
        chat = {"messages": [{"role": "user", "content": "Name a colour."}]}
        served = httpx.post(url + "/v1/chat/completions", json=chat | {"return_token_ids": True}, timeout=60).json()
        mine = {"max_tokens": 3, "temperature": 0, "repetition_penalty": 1.0}
        given = httpx.post(url + "/v1/chat/completions", json=chat | mine, timeout=60).json()
    [offline] = llm.chat(chat["messages"], use_tqdm=False)  # (the defaults: greedy, penalised, 5 tokens)
    assert served["choices"][0]["token_ids"] == offline.outputs[0].token_ids and len(offline.outputs[0].token_ids) == 5
    [mine] = llm.chat(chat["messages"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert given["choices"][0]["message"]["content"] == mine.outputs[0].text  # (the body's fields win)


def test_bad_sources_and_values_are_refused_by_name(smol4_path, tmp_path):
    with pytest.raises(ValueError, match="^generation_config: must be auto, vllm or a folder"):
        LLM(model=str(smol4_path), generation_config=str(tmp_path / "nowhere"), **ENGINE)
    bad = _checkpoint(smol4_path, tmp_path / "bad", {"do_sample": True, "top_p": 1.5})
    with pytest.raises(ValueError, match="^generation_config: its sampling defaults are refused: top_p"):
        LLM(model=str(bad), **ENGINE)
