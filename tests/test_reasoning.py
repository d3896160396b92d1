"""A reasoning model's thinking apart from its answer (vlens.server.reasoning, vLLM's --reasoning-parser): the
split of reply texts, streamed replies read a piece at a time (with tool calls after the thinking), and SmolLM2
served with the qwen3 parser, which a few worked examples teach to think inside <think></think> first: the message's
reasoning and content are its offline reply's two parts, streamed and not; a reply cut short while thinking, one
with enable_thinking false, and a structured one; through the Responses API, a reasoning item. An engine with a
reasoning parser lets a structured request think first: its structure holds only the text after </think>, its tokens
there HF's under xgrammar's processor, offline and served (the reply split into its thinking and its structure)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from server_helpers import running_server

from vlens import LLM, SamplingParams, StructuredOutputsParams
from vlens.reasoning import HARMONY_END, PARSERS, ThinkingEnd
from vlens.server.config import ServerConfig
from vlens.server.reasoning import split
from vlens.server.responses import Shape
from vlens.server.tool_parsers import PARSERS as TOOL_PARSERS
from vlens.server.tools import ToolReply

THINK = PARSERS["deepseek_r1"]  # (<think>...</think>)
SHOTS = [
    {"role": "system", "content": "Think first inside <think></think>, then answer."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>Two plus two makes four.</think>4"},
    {"role": "user", "content": "What is 3 + 5?"},
    {"role": "assistant", "content": "<think>Three plus five makes eight.</think>8"},
    {"role": "user", "content": "What is 1 + 6?"},
]


@pytest.mark.parametrize(
    ("text", "want"),
    [("<think>Plan.</think>Answer", ("Plan.", "Answer")),
     ("Plan.</think>Answer", ("Plan.", "Answer")),  # (the opening tag in the prompt: DeepSeek-R1's, Qwen3.5's)
     ("<think>Plan.</think>", ("Plan.", None)),
     ("<think>Still thinking", ("Still thinking", None)),  # (cut short: all reasoning)
     ("</think>Answer", ("", "Answer"))],
)  # fmt: skip
def test_a_reply_splits_at_the_end_of_its_thinking(text, want):
    assert split(text, True, THINK) == want


HARMONY = "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>7"


def test_gpt_oss_replies_split_at_the_final_channel():
    """vLLM's openai_gptoss: a harmony reply's analysis message is the reasoning and its final one the content,
    whole and streamed a character at a time (no delta carries a piece of a channel's header); cut short in the
    analysis, all reasoning. Its tags are special tokens, so the server keeps them in the reply's text."""
    gptoss = PARSERS["openai_gptoss"]
    assert gptoss.special and gptoss.thinking(None) and not THINK.special
    assert split(HARMONY, True, gptoss) == ("Add them.", "7")
    assert split(HARMONY[:40], True, gptoss) == (HARMONY[len(gptoss.start):40], None)
    deltas, finish = _streamed(Shape(chat=True, model="m", logprobs=None, text=str, thinking=gptoss), HARMONY)
    assert (_joined(deltas, "reasoning"), _joined(deltas, "content"), finish) == ("Add them.", "7", "stop")
    assert not any("<|" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas)


def test_gpt_oss_thinks_where_its_prompt_opens_a_reply():
    """The engine's end of gpt-oss's thinking is the final channel's header, as vLLM's: a prompt that ends with an
    assistant's turn to write thinks first; one whose last final message follows nothing thought is past it (vLLM
    reads a conversation's earlier final answers so too)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(["user", "assistant", "analysis", "final", "hi", "yes"])}
    inner = Tokenizer(models.WordLevel(words, unk_token="hi"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|end|>", "<|channel|>", "<|message|>"]})
    end = ThinkingEnd.of(tokenizer, PARSERS["openai_gptoss"])
    prompt = tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", add_special_tokens=False)
    assert end.end == tuple(tokenizer.encode(HARMONY_END, add_special_tokens=False)) and end.thinks(prompt)
    answered = prompt + tokenizer.encode("<|channel|>final<|message|>yes<|end|>", add_special_tokens=False)
    assert not end.thinks(answered + prompt[-2:])


def test_enable_thinking_false_turns_qwen3s_thinking_off():
    assert PARSERS["qwen3"].thinking({"enable_thinking": False}) is False
    assert PARSERS["qwen3"].thinking(None) and PARSERS["qwen3"].thinking({"enable_thinking": True})
    assert PARSERS["deepseek_r1"].thinking({"enable_thinking": False})  # (DeepSeek-R1 always thinks)


def test_deepseek_v3s_thinking_is_off_unless_asked():
    """DeepSeek-V3.1 (vLLM's deepseek_v3): a reply is content unless chat_template_kwargs turns thinking on."""
    v3 = PARSERS["deepseek_v3"]
    assert not v3.thinking(None) and not v3.thinking({"thinking": False}) and not v3.thinking({"enable_thinking": 0})
    assert v3.thinking({"thinking": True}) and v3.thinking({"enable_thinking": True})
    text = "<think>Hm.</think>Yes."
    for kwargs, want in [(None, (None, text)), ({"thinking": True}, ("Hm.", "Yes."))]:
        thinking = v3 if v3.thinking(kwargs) else None
        message = Shape(chat=True, model="m", logprobs=None, text=str, thinking=thinking).choice(
            0, text, [], [], "stop")["message"]  # fmt: skip
        assert (message.get("reasoning"), message["content"]) == want


def _streamed(shape: Shape, text: str) -> tuple[list[dict], str | None]:
    """`text` through a streaming Shape a character at a time: each delta, and the last one's finish reason."""
    deltas = [shape.choice(0, ch, [], [], None, delta=True, first=i == 0)["delta"] for i, ch in enumerate(text)]
    last = shape.choice(0, "", [], [], "stop", delta=True)
    return [*deltas, last["delta"]], last["finish_reason"]


def _joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


@pytest.mark.parametrize(
    "text",
    ["<think>Plan the sum.</think>The answer is 7.", "Plan.</think>Done", "<think>Cut short, still thinking",
     "<thin", "No tags at all"],
)  # fmt: skip
def test_streamed_thinking_comes_in_order_and_whole(text):
    """Joined, the deltas are the reply's two parts; no delta before the last carries a piece of a tag (what may be
    one waits: at the end, "<thin" is text)."""
    reasoning, content = split(text, True, THINK)
    deltas, finish = _streamed(Shape(chat=True, model="m", logprobs=None, text=str, thinking=THINK), text)
    assert (_joined(deltas, "reasoning"), _joined(deltas, "content") or None, finish) == (reasoning, content, "stop")
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)  # (vLLM's older name, kept)
    assert not any("<" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas[:-1])
    hidden = Shape(chat=True, model="m", logprobs=None, text=str, thinking=THINK, include_reasoning=False)
    assert not any("reasoning" in d for d in _streamed(hidden, text)[0])


def test_tool_calls_after_the_thinking():
    """With a tool parser too, the calls are read from the content (the text after the thinking)."""
    text = '<think>Need the weather.</think>Checking.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    tools = ToolReply(None, TOOL_PARSERS["hermes"])
    shape = Shape(chat=True, model="m", logprobs=None, text=str, tools=tools, thinking=THINK)
    full = shape.choice(0, text, [], [], "stop")
    message = full["message"]
    assert (message["reasoning"], message["content"], full["finish_reason"]) == (
        "Need the weather.", "Checking.", "tool_calls")  # fmt: skip
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("f", '{"a": 1}')]
    deltas, finish = _streamed(Shape(chat=True, model="m", logprobs=None, text=str, tools=tools, thinking=THINK), text)
    assert (_joined(deltas, "reasoning"), _joined(deltas, "content"), finish) == (
        "Need the weather.", "Checking.", "tool_calls")  # fmt: skip
    pieces = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert pieces[0]["function"]["name"] == "f" and {c["index"] for c in pieces} == {0}
    assert "".join(c["function"]["arguments"] for c in pieces) == '{"a": 1}'


@pytest.fixture(scope="module")
def server(served_smol):
    with running_server(served_smol, ServerConfig(served_model_name="smol", reasoning_parser="qwen3")) as url:
        yield url


def _reply(server: str, **fields) -> dict:
    body = {"model": "smol", "messages": SHOTS, "temperature": 0, "max_tokens": 40} | fields
    out = httpx.post(server + "/v1/chat/completions", json=body, timeout=120)
    assert out.status_code == 200, out.text
    return out.json()["choices"][0]


def _chunks(server: str, **fields) -> list[dict]:
    body = {"model": "smol", "messages": SHOTS, "temperature": 0, "max_tokens": 40, "stream": True} | fields
    lines = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).text.splitlines()
    return [json.loads(line[6:])["choices"][0]["delta"] for line in lines if line.startswith("data: {")]


def test_the_served_reply_is_its_thinking_and_its_answer(server, smol):
    [offline] = smol.chat(SHOTS, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    thought, _, answer = offline.outputs[0].text.removeprefix("<think>").partition("</think>")
    assert thought and answer and "<" not in thought + answer  # (SmolLM2 copies the worked examples' form)
    message = _reply(server)["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (thought, thought, answer)
    deltas = _chunks(server)
    assert (_joined(deltas, "reasoning"), _joined(deltas, "content")) == (thought, answer)
    assert "reasoning" not in _reply(server, include_reasoning=False)["message"]


def test_cut_short_thinking_off_and_structured_replies(server, smol):
    [cut] = smol.chat(SHOTS, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    message = _reply(server, max_tokens=4)["message"]  # (stopped while thinking: all reasoning, no content)
    assert (message["reasoning"], message["content"]) == (cut.outputs[0].text.removeprefix("<think>"), None)
    off = {"chat_template_kwargs": {"enable_thinking": False}}  # (Qwen3's switch: the reply is content)
    [whole] = smol.chat(SHOTS, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    message = _reply(server, **off)["message"]
    assert message["content"] == whole.outputs[0].text and "reasoning" not in message
    assert _joined(_chunks(server, **off), "content") == whole.outputs[0].text
    # a structure holds the reply from its first token: it is content, tags and all
    structured = _reply(server, structured_outputs={"regex": "<think>[a-z ]+</think>[0-9]"})["message"]
    assert structured["content"].startswith("<think>") and "reasoning" not in structured


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(server, smol):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    [offline] = smol.chat(SHOTS, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    thought, _, answer = offline.outputs[0].text.removeprefix("<think>").partition("</think>")
    response = client.responses.create(model="smol", input=SHOTS, max_output_tokens=40, temperature=0)
    reasoning, message = response.output
    assert (reasoning.type, reasoning.content[0].text, response.output_text) == ("reasoning", thought, answer)
    assert response.status == "completed" and message.status == "completed"
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = list(client.responses.create(model="smol", input=SHOTS, max_output_tokens=40, temperature=0,
                                          stream=True))  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].type == "response.completed"


# -- an engine with a reasoning parser: a structured request thinks first (vlens.reasoning) ------------------------

CHOICE = StructuredOutputsParams(choice=["seven", "eight"])  # (its own answer, "10" or so, is neither)
# The reply opened with <think> in the prompt, as DeepSeek-R1's template opens it (SHOTS' earlier turns keep their
# thinking, which a prompt without the open tag after them reads as thinking already done: vLLM's rule)
OPENED = dict(continue_final_message=True, add_generation_prompt=False)
THINKING = [*SHOTS, {"role": "assistant", "content": "<think>"}]


@pytest.fixture(scope="module")
def thinker(smol_path) -> LLM:
    return LLM(str(smol_path), dtype="float32", device="cpu", kv_cache_memory=64 << 20, reasoning_parser="deepseek_r1")


def _after_thinking(ids: list[int], end: tuple[int, ...]) -> int:
    """Where the tokens after the first `end` start."""
    return next(i + len(end) for i in range(len(ids)) if tuple(ids[i : i + len(end)]) == end)


def test_a_structured_request_thinks_first_then_keeps_to_its_structure(thinker, smol, hf_smol):
    import xgrammar

    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=CHOICE)
    [plain] = smol.chat(THINKING, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False, **OPENED)
    [held] = smol.chat(THINKING, params, use_tqdm=False, **OPENED)  # (no parser: the structure from the first token)
    [out] = thinker.chat(THINKING, params, use_tqdm=False, **OPENED)
    c = out.outputs[0]
    thought, _, answer = c.text.partition("</think>")
    assert thought == plain.outputs[0].text.partition("</think>")[0] and len(thought) > 10
    assert answer in ("seven", "eight") and c.finish_reason == "stop" and held.outputs[0].text in ("seven", "eight")
    [history] = thinker.chat(SHOTS, params, use_tqdm=False)  # (earlier turns' </think> last: thinking done)
    assert history.outputs[0].token_ids == smol.chat(SHOTS, params, use_tqdm=False)[0].outputs[0].token_ids
    # after the thinking, the tokens are HF's under xgrammar's processor, from the prompt and the thought
    k = _after_thinking(c.token_ids, ThinkingEnd.of(thinker.tokenizer, PARSERS["deepseek_r1"]).end)
    compiled = thinker.engine.grammars.compile(CHOICE)
    ids = torch.tensor([out.prompt_token_ids + c.token_ids[:k]])
    eos = sorted(thinker.engine.eos_ids)
    with torch.inference_mode():
        ref = hf_smol.generate(ids, max_new_tokens=40 - k, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                               logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)])  # fmt: skip
    assert c.token_ids[k:] == ref[0, ids.shape[1] :].tolist()


def test_a_prompt_that_ends_its_thinking_is_held_at_once(thinker, smol):
    """Qwen3's template with thinking off writes <think></think> into the prompt: the structure starts at once."""
    [plain] = smol.chat(SHOTS, SamplingParams(max_tokens=1), use_tqdm=False)
    prompt = plain.prompt_token_ids + thinker.tokenizer.encode("<think>Easy.</think>", add_special_tokens=False)
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=CHOICE)
    [out], [held] = thinker.generate([prompt], params, use_tqdm=False), smol.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].token_ids == held.outputs[0].token_ids and out.outputs[0].text in ("seven", "eight")


def test_deepseek_v3s_structure_waits_only_for_a_thinking_its_prompt_opens(smol_path, smol):
    """A switchable model (DeepSeek-V3.1, off by default) thinks only where its prompt opens a thinking (its
    template's thinking mode ends the prompt with <think>): elsewhere a structure holds the reply from its first token,
    as vLLM's parser (identity when thinking is off) lets it; after <think> it waits for </think>."""
    v3 = LLM(str(smol_path), dtype="float32", device="cpu", kv_cache_memory=16 << 20, reasoning_parser="deepseek_v3")
    [plain] = smol.chat(SHOTS, SamplingParams(max_tokens=1), use_tqdm=False)
    opened = plain.prompt_token_ids + smol.tokenizer.encode("<think>", add_special_tokens=False)
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=CHOICE)
    [out], [held] = v3.generate([plain.prompt_token_ids], params, use_tqdm=False), smol.generate(
        [plain.prompt_token_ids], params, use_tqdm=False)  # fmt: skip
    assert out.outputs[0].token_ids == held.outputs[0].token_ids and out.outputs[0].text in ("seven", "eight")
    [thinking] = v3.generate([opened], params, use_tqdm=False)  # (8 tokens of thinking: no </think>, no structure)
    [free] = smol.generate([opened], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert thinking.outputs[0].token_ids == free.outputs[0].token_ids
    end = ThinkingEnd((9,), (10,), by_default=False)
    assert not end.thinks([1, 2]) and end.thinks([9, 3]) and not end.thinks([9, 3, 10])
    default = ThinkingEnd((9,), (10,))
    assert default.thinks([1, 2]) and default.thinks([9, 3]) and not default.thinks([9, 3, 10])


def test_served_the_structured_reply_is_its_thinking_and_its_structure(thinker, smol):
    [offline] = thinker.chat(THINKING, SamplingParams(max_tokens=40, temperature=0, structured_outputs=CHOICE),
                             use_tqdm=False, **OPENED)  # fmt: skip
    thought, _, answer = offline.outputs[0].text.partition("</think>")
    fields = dict(messages=THINKING, structured_outputs={"choice": ["seven", "eight"]}, **OPENED)
    with running_server(thinker, ServerConfig(served_model_name="smol", reasoning_parser="deepseek_r1")) as url:
        message, chunks = _reply(url, **fields)["message"], _chunks(url, **fields)
    assert (message["reasoning"], message["content"]) == (thought, answer)
    assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == (thought, answer)
