"""A reasoning model's thinking apart from its answer: vLLM's reasoning parsers (`vlens serve --reasoning-parser`,
vlens.reasoning).

With a parser, a chat reply's message carries the thinking as `reasoning` (and `reasoning_content`, its older name, as
vLLM keeps both) and the answer as `content`; streamed, each goes out in its own deltas as it comes. A reply that
stops while still thinking is all reasoning; Qwen3's with `chat_template_kwargs: {"enable_thinking": false}` (no
thinking asked for) is all content. gpt-oss's (openai_gptoss) is its analysis channel's message and its final
channel's, read with the special tokens that mark them. A structured reply (response_format, a forced tool choice)
is split so where its engine lets it think first (the engine's own reasoning_parser, which `vlens serve
--reasoning-parser` sets too); elsewhere its structure holds it from its first token, and it is content.
"""

from __future__ import annotations

from vlens.reasoning import ThinkTags
from vlens.server.tool_parsers import unmatched_tail


def split(text: str, done: bool, tags: ThinkTags) -> tuple[str, str | None]:
    """A thinking reply's (reasoning, content): the text before the tags' end (`</think>`; after their start where
    the reply opens with it) and the text after it, None where there is none. Before the reply's end (`done` False)
    the content is what came after the end so far ("" before it) and the reasoning what is surely reasoning: not a
    tag still being written."""
    if not done and tags.start.startswith(text):
        return "", ""
    body = text.removeprefix(tags.start)
    end = body.find(tags.end)
    if end >= 0:
        content = body[end + len(tags.end):]
        return body[:end], content if content or not done else None
    return (body, None) if done else (body[: unmatched_tail(body, tags.end)], "")
