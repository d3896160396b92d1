"""Conversations into prompts, with vLLM's chat options: a reply that continues a last assistant message
(continue_final_message, add_generation_prompt=False), another template and the template's own variables
(chat_template, chat_template_kwargs) — offline in LLM.chat, and served: chat completions and /tokenize render
them as LLM.chat does, under the server's template (--chat-template) or a request's own where the server trusts
them; bad combinations refused by name."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_helpers import running_server

from vlens import SamplingParams
from vlens.chat import ChatOptions
from vlens.server.config import ServerConfig
from vlens.server.engine_loop import EngineLoop
from vlens.server.protocol import APIError, ChatRequest, ChatTemplates

PREFILLED = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}{{ cue }}{% endif %}"
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def test_a_reply_continues_the_last_message(smol):
    [out] = smol.chat(PREFILLED, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    text = smol.tokenizer.apply_chat_template(PREFILLED, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")  # (open: no end-of-message token after it)
    assert out.prompt_token_ids == smol.tokenizer(text, add_special_tokens=False)["input_ids"]
    [alone] = smol.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert out.outputs[0].text.startswith(" Paris")
    [closed] = smol.chat(PREFILLED, GREEDY, use_tqdm=False)  # (by default: a new assistant message after it)
    assert len(closed.prompt_token_ids) > len(out.prompt_token_ids)


def test_another_template_and_its_variables(smol):
    [out] = smol.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template=TEMPLATE,
                      chat_template_kwargs={"cue": "Answer:"}, use_tqdm=False)  # fmt: skip
    assert out.prompt == "Hi\nAnswer:"
    assert out.prompt_token_ids == smol.tokenizer("Hi\nAnswer:", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "options, message",
    [({"continue_final_message": True}, "^continue_final_message: leaves the last message open"),
     ({"chat_template_kwargs": {"tokenize": True}}, "^chat_template_kwargs: tokenize are apply_chat_template's own"),
     ({"chat_template_kwargs": ["cue"]}, "^chat_template_kwargs: expected a dict"),
     ({"chat_template": "{% if %}"}, "^messages: the chat template refused the conversation")],
)  # fmt: skip
def test_bad_options_are_refused_by_name(smol, options, message):
    with pytest.raises(ValueError, match=message):
        smol.chat(PREFILLED, GREEDY, use_tqdm=False, **options)
    assert not smol.engine.has_work()


@pytest.fixture(scope="module")
def server(served_smol, tmp_path_factory):
    """Served with the checkpoint's own template from a file (--chat-template), trusting requests' templates."""
    file = tmp_path_factory.mktemp("template") / "chat.jinja"
    file.write_text(served_smol.tokenizer.chat_template)
    config = ServerConfig(served_model_name="smol", chat_template=str(file), trust_request_chat_template=True)
    with running_server(served_smol, config) as url:
        yield url


def test_served_chats_render_as_llm_chat_does(server, smol):
    fields = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"unused": 1}}
    body = {"model": "smol", "messages": PREFILLED, "max_tokens": 6, "temperature": 0} | fields
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=120)
    [ref] = smol.chat(PREFILLED, GREEDY, use_tqdm=False, **fields)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
    assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    tokens = httpx.post(server + "/tokenize", json={"messages": PREFILLED} | fields, timeout=120).json()
    assert tokens["tokens"] == ref.prompt_token_ids
    assert ChatOptions(**fields).render(smol.tokenizer, PREFILLED, "messages").endswith("France is")
    bad = httpx.post(server + "/v1/chat/completions", json=body | {"add_generation_prompt": True}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message", bad.text


def test_the_servers_template_and_a_trusted_requests_own(server, smol):
    assert httpx.get(server + "/tokenizer_info", timeout=60).json()["chat_template"] == smol.tokenizer.chat_template
    hi = [{"role": "user", "content": "Hi"}]
    fields = {"chat_template": TEMPLATE, "chat_template_kwargs": {"cue": "Answer:"}}
    [ref] = smol.chat(hi, GREEDY, use_tqdm=False, **fields)
    tokens = httpx.post(server + "/tokenize", json={"messages": hi} | fields, timeout=60).json()["tokens"]
    assert tokens == ref.prompt_token_ids == smol.tokenizer("Hi\nAnswer:", add_special_tokens=False)["input_ids"]
    body = {"model": "smol", "messages": hi, "max_tokens": 6, "temperature": 0, "return_token_ids": True} | fields
    choice = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()
    assert choice["prompt_token_ids"] == ref.prompt_token_ids
    assert choice["choices"][0]["message"]["content"] == ref.outputs[0].text
    # a server that does not trust requests' templates (vLLM's default) refuses one by name
    request = ChatRequest(messages=hi, chat_template=TEMPLATE)
    with pytest.raises(APIError, match="^chat_template: .* --trust-request-chat-template") as e:
        ChatTemplates("{{ messages }}").options(request)
    assert e.value.param == "chat_template"
    assert ChatTemplates("{{ messages }}").options(ChatRequest(messages=hi)).chat_template == "{{ messages }}"
    with pytest.raises(ValueError, match="^chat_template: nowhere.jinja: no such file, and no Jinja template"):
        ServerConfig(chat_template="nowhere.jinja")


def test_a_served_llm_is_stepped_by_its_server_alone(server, served_smol):
    """A notebook's LLM.generate on the LLM it serves is refused before any work (stepped from two threads at once,
    the engine would fail both), and the server goes on."""
    with pytest.raises(RuntimeError, match="^this LLM is being served"):
        served_smol.generate(["Hi"], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="^this LLM is being served"):  # (a forward outside the engine's steps)
        served_smol.trace("Hi", "blocks.0.hook_resid_post")
    with pytest.raises(RuntimeError, match="^this LLM is being served already"):  # (a second server on it)
        EngineLoop(served_smol.engine).start(asyncio.new_event_loop())
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 6, "temperature": 0}
    assert httpx.post(server + "/v1/completions", json=body, timeout=120).status_code == 200
    assert not served_smol.engine.has_work()
