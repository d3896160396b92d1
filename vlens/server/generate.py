"""From a validated request body to an OpenAI response: prompts and sampling parameters, the checks
that must pass before anything reaches the engine, then the wait for results, streamed or not.

Everything that can be refused is refused here, before submission, or by the engine's own
validation of the whole submission, so a bad request never runs and never disturbs another one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from vlens.beam_search import BeamSearch, BeamSearchParams
from vlens.capture import Steer
from vlens.config import ModelConfig
from vlens.engine.llm_engine import NewRequest
from vlens.engine.logprobs import TokenText
from vlens.engine.lora import LoRARequest
from vlens.images import ImageEncoder, PromptImages, chat_images
from vlens.inputs import ImagePrompt, to_token_lists, truncated
from vlens.outputs import RequestOutput
from vlens.reasoning import ThinkTags
from vlens.sampling_params import SamplingParams
from vlens.server.activations import ActivationStore, capture_bound, encode, owner_of, present
from vlens.server.admission import Admission
from vlens.server.auth import presented_key
from vlens.server.config import ServerConfig
from vlens.server.engine_loop import EngineLoop, Failed, Progress, Submission
from vlens.server.extension import ExtensionContext, parse_extension
from vlens.server.metrics import Metrics
from vlens.server.protocol import APIError, ChatRequest, ChatTemplates, CompletionRequest, check_model, from_value_error
from vlens.server.responses import Echo, Shape, prompt_logprobs_json, usage
from vlens.server.responses_api import ResponseForm, ResponsesRequest, renamed
from vlens.server.saes import features_json
from vlens.server.tokens import render_chat
from vlens.server.tools import template_message

CLIENT_CLOSED = 499  # nginx's convention; the client never sees it
# Body fields that are SamplingParams' fields of the same name and meaning.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "best_of",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "allowed_token_ids",
    "bad_words", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
)  # fmt: skip


@dataclass
class Prepared:
    """A request ready for the engine."""

    requests: list[NewRequest]
    shape: Shape
    stream: bool
    include_usage: bool
    wants_activations: bool
    wants_features: bool  # a capture through an SAE: its features come back as JSON
    owner: bytes  # who may download this request's activation handle
    n: int  # choices per prompt: prompt i's sample j is choice i * n + j
    capture_bytes: int  # the most activation bytes the requests can return (what admission reserves)
    echo: list[Echo] | None = None  # per prompt, what each of its choices starts with
    prompt_logprobs: bool = False  # the body asked for vLLM's prompt_logprobs field
    token_ids: bool = False  # vLLM's return_token_ids: prompt_token_ids and each choice's token_ids
    structure_field: str | None = None  # the body field a structured output comes from (response_format, ...)
    form: ResponseForm | None = None  # a chat's reply as OpenAI's Responses API's (vlens.server.responses_api)


class Generator:
    def __init__(
        self,
        config: ServerConfig,
        engine: EngineLoop,
        tokenizer: Any,
        cfg: ModelConfig,
        shapes: dict[str, tuple[int, ...]],
        model_dtype: torch.dtype,
        model_name: str,
        max_model_len: int,
        store: ActivationStore,
        metrics: Metrics,
        extension: ExtensionContext,
        admission: Admission,
        image_encoder: Callable[[str], ImageEncoder],
        sampling_defaults: dict[str, Any],
    ):
        self.config, self.engine, self.tokenizer, self.cfg = config, engine, tokenizer, cfg
        self.image_encoder = image_encoder  # (the served LLM's, built at the first image)
        self.shapes, self.model_dtype, self.model_name = shapes, model_dtype, model_name
        self.max_model_len, self.store, self.metrics, self.admission = max_model_len, store, metrics, admission
        self.token_text = TokenText(tokenizer)
        self.extension = extension  # (what requests may name: SAEs, the tuned lens, steering vectors)
        self.templates = ChatTemplates(config.chat_template_text(), config.trust_request_chat_template)
        self.sampling_defaults = sampling_defaults  # (the generation config's, for fields a body leaves out)

    def steers_of(self, model: str | None) -> list[Steer]:
        """What a request's `model` adds: a steering vector's name is the served model steered by it (as vLLM serves
        a LoRA adapter under its name, so a client that sets only the model, lm-eval's, evaluates it); the served
        model's name, or none, adds nothing; another is a 404."""
        vectors = self.extension.steering_vectors
        if model in vectors:
            return vectors[model].steers()
        check_model(model, self.model_name, vectors, self.extension.loras)
        return []

    def lora_of(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (vlens serve --lora-modules), or None."""
        return self.extension.loras.get(model)

    def tokenize(self, value: Any, field: str, add_special_tokens: bool) -> list[list[int]]:
        """A body's prompt or input (text, token ids, or a list of either) as token lists; a 400 naming
        `field` when it is neither."""
        try:
            return to_token_lists(
                value, self.tokenizer, self.cfg.vocab_size, field=field, add_special_tokens=add_special_tokens
            )
        except ValueError as e:
            raise from_value_error(e) from None

    # -- endpoints ----------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        body.check(self.config.max_n)
        token_lists = self.tokenize(body.prompt, "prompt", body.add_special_tokens)
        several = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
        texts = [p if isinstance(p, str) else None for p in (body.prompt if several else [body.prompt])]
        prompts = _truncated(list(zip(token_lists, texts)), body.truncate_prompt_tokens)
        prepared = self._prepare(body, request, prompts, body.max_tokens, body.logprobs, chat=False)
        if body.use_beam_search:
            return await self._beam_search(prepared, body, request)
        if body.echo:
            prepared.echo = [Echo(t if t is not None else self.tokenizer.decode(ids), ids) for ids, t in prompts]
        return await self._run(prepared, request)

    async def chat(self, body: ChatRequest, request: Request, form: ResponseForm | None = None) -> Response:
        """A chat completion; with `form`, presented as a Responses API response (its body a chat request)."""
        body.check(self.config.max_n)
        images = None
        if any(m.has_images() for m in body.messages):
            ids, rendered, images = await asyncio.to_thread(self._chat_with_images, body)
        else:
            rendered = render_chat(self.tokenizer, body.messages, self.templates.options(body))
            ids = self.tokenizer(rendered, add_special_tokens=body.add_special_tokens)["input_ids"]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        prompts = [(ids, rendered)]
        if images is None:  # (the engine refuses to cut a prompt with images)
            prompts = _truncated(prompts, body.truncate_prompt_tokens)
        prepared = self._prepare(body, request, prompts, max_tokens, top, chat=True, images=images)
        prepared.form = form
        if body.use_beam_search:
            if images is not None:
                raise APIError(400, "use_beam_search: takes conversations of text; one with images goes without it",
                               param="use_beam_search")  # fmt: skip
            return await self._beam_search(prepared, body, request)
        return await self._run(prepared, request)

    async def respond(self, body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API: the body run as the chat completion it is, its reply presented as a Response."""
        chat = body.to_chat()

        def count(text: str) -> int:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        form = ResponseForm(body, body.model or self.model_name, count)
        try:
            return await self.chat(chat, request, form)
        except APIError as e:
            raise renamed(e) from None

    def _chat_with_images(self, body: ChatRequest) -> tuple[list[int], str, PromptImages]:
        """A conversation with image parts through the processor's chat template and the vision tower (vlens.images),
        off the event loop (the first builds the tower). Their URLs are data: URLs: a server reads no files."""
        try:
            messages = [template_message(m.model_dump(exclude_none=True)) for m in body.messages]
            conversation, images = chat_images(messages, "messages", local_files=False)
            encoder = self.image_encoder("messages")
            text = encoder.render_chat(conversation, "messages", self.templates.options(body))
            [(ids, rows)] = encoder.encode([ImagePrompt(text, images)], ["messages"], body.add_special_tokens)
        except ValueError as e:
            raise from_value_error(e) from None
        return ids, text, rows

    # -- before the engine --------------------------------------------------------------------------

    def _prepare(
        self, body, request: Request, prompts, max_tokens: int | None, logprobs: int | None, chat: bool,
        images: PromptImages | None = None,
    ) -> Prepared:  # fmt: skip
        tools = body.tool_reply(self.config.tool_parser()) if chat else None
        thinking = self._thinking(body) if chat else None
        keeps = (tools is not None and tools.parser is not None and tools.parser.keeps_special_tokens) or \
            (thinking is not None and thinking.special)  # fmt: skip
        if keeps and "skip_special_tokens" not in body.model_fields_set:  # (as vLLM's parsers adjust the request)
            body.skip_special_tokens = False
        steers = self.steers_of(body.model)
        extension = parse_extension(body.vlens, self.extension)
        if steers:
            extension["interventions"] = steers + extension.get("interventions", [])
        capture = extension.get("capture")
        wants_features = capture is not None and capture.sae is not None
        wants_activations = (capture is not None and not wants_features) or extension.get("return_hidden_states", False)
        if (wants_activations or wants_features) and len(prompts) > 1:
            raise APIError(
                400,
                "prompt: capture needs one prompt per request (send several requests; they are "
                "batched together anyway)",
                param="prompt",
            )
        lora = self.lora_of(body.model)
        requests, bounds = zip(*(self._request(body, ids, text, max_tokens, logprobs, extension, chat, images, lora)
                                 for ids, text in prompts))  # fmt: skip
        key = presented_key(request.scope) if self.config.api_key else None
        return Prepared(
            requests=list(requests),
            shape=Shape(chat=chat, model=body.model or self.model_name, logprobs=logprobs,
                        text=_token_id_text if body.return_tokens_as_token_ids else self.token_text,
                        tools=tools, thinking=thinking,
                        include_reasoning=not chat or body.include_reasoning),
            stream=body.stream,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
            wants_activations=wants_activations,
            wants_features=wants_features,
            owner=owner_of(key),
            n=body.n,
            capture_bytes=sum(bounds),
            prompt_logprobs=body.prompt_logprobs is not None,
            token_ids=bool(body.return_token_ids),
            structure_field=body.structure_field(),
        )

    def _thinking(self, body: ChatRequest) -> ThinkTags | None:
        """The tags the reply is read by as a reasoning model's: a server with a reasoning parser, thinking asked for
        (Qwen3's enable_thinking), no structure holding the reply from its first token (an engine with a reasoning
        parser lets a structured request think first: vlens.reasoning); None where it is not."""
        tags = self.config.think_tags()
        held = body.structure_field() is not None and self.engine.engine.thinking_end is None
        return tags if tags is not None and tags.thinking(body.chat_template_kwargs) and not held else None

    def _request(
        self,
        body,
        ids: list[int],
        text: str | None,
        max_tokens: int | None,
        logprobs: int | None,
        extension: dict[str, Any],
        chat: bool,
        images: PromptImages | None = None,
        lora: LoRARequest | None = None,
    ) -> tuple[NewRequest, int]:
        """The engine request of one prompt (with its images' rows: a chat's; under its LoRA adapter) and the bound on
        the activation bytes it can return."""
        prompt_param = "messages" if chat else "prompt"
        room = self.max_model_len - len(ids)
        if room < 1:
            raise APIError(
                400,
                f"{prompt_param}: {len(ids)} tokens; this server's context is {self.max_model_len} "
                "tokens, and at least one must be left to generate",
                param=prompt_param,
                code="context_length_exceeded",
            )
        prompt_logprobs = body.prompt_logprobs
        if body.echo and (logprobs is not None or max_tokens == 0):
            # echo shows the prompt's log-probabilities with `logprobs`; a prefill-only request must read something
            prompt_logprobs = max(prompt_logprobs or 0, logprobs or 0)
        if max_tokens is None:  # (the generation config's max_new_tokens where it has one: vlens.generation_config)
            max_tokens = min(room, self.sampling_defaults.get("max_tokens", room))
        elif max_tokens > room:
            field = "max_tokens" if getattr(body, "max_completion_tokens", None) is None else "max_completion_tokens"
            raise APIError(
                400,
                f"{field}: {max_tokens} plus the {len(ids)}-token prompt exceed this server's "
                f"context of {self.max_model_len} tokens; at most {room}",
                param=field,
                code="context_length_exceeded",
            )
        try:
            given = {name: getattr(body, name) for name in SAMPLING_FIELDS}
            given |= {name: value for name, value in self.sampling_defaults.items()
                      if name in given and name not in body.model_fields_set}  # fmt: skip
            params = SamplingParams(
                max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=body.structure(), **given, **extension,
            )  # fmt: skip
            bound = capture_bound(params, len(ids), self.shapes, self.cfg, self.model_dtype)
        except ValueError as e:
            raise _engine_error(e) from None
        if bound > self.config.max_capture_bytes:
            raise APIError(
                400,
                f"vlens.capture: this request could return up to {bound} bytes of activations, "
                f"over this server's --max-capture-bytes of {self.config.max_capture_bytes}; capture "
                "fewer hooks or positions, lower max_tokens, or use a smaller dtype",
                param="vlens.capture",
                code="capture_too_large",
            )
        return NewRequest(ids, params, text, stream=body.stream, images=images, lora=lora,
                          cache_salt=body.cache_salt, priority=body.priority), bound  # fmt: skip

    # -- with the engine ----------------------------------------------------------------------------

    async def _run(self, prepared: Prepared, request: Request) -> Response:
        # Held until the response is written: encoded activations are in memory until then.
        ticket = self.admission.admit(len(prepared.requests), prepared.capture_bytes, "prompt")
        if not prepared.stream:
            try:
                outputs = await self.outputs(prepared.requests, request, prepared.structure_field)
                if outputs is None:
                    return Response(status_code=CLIENT_CLOSED)
                body = await self._response(outputs, prepared)
                return JSONResponse(body if prepared.form is None else prepared.form.body(body))
            finally:
                self.admission.release(ticket)
        try:
            submission = await self._submit(prepared.requests, prepared.structure_field)
        except BaseException:
            self.admission.release(ticket)
            raise

        def close() -> None:
            self._abort_unless_done(submission)
            self.admission.release(ticket)

        chunks = self._chunks(submission, prepared)
        events = _sse_events(chunks) if prepared.form is None else prepared.form.events(chunks)
        return _EventStream(events, on_close=close)

    async def _beam_search(self, prepared: Prepared, body, request: Request) -> Response:
        """vLLM's use_beam_search: per prompt its n best beams (vlens.beam_search), each step's beams one batch of
        one-token requests through the engine thread (their prefixes from the prefix cache), under the request's
        adapter or steering; a beam's text is its tokens' (an ending EOS's left out, as vLLM's)."""
        first = prepared.requests[0]
        try:
            params = BeamSearchParams(body.n, min(r.params.max_tokens for r in prepared.requests), body.ignore_eos,
                                      body.length_penalty)  # fmt: skip
        except ValueError as e:
            raise from_value_error(e) from None
        search = BeamSearch([r.prompt_token_ids for r in prepared.requests], params, self.engine.engine.eos_ids)
        step = replace(search.step, interventions=first.params.interventions)
        field = "messages" if prepared.shape.chat else "prompt"
        ticket = self.admission.admit(len(prepared.requests) * body.n, 0, field)
        try:
            while beams := search.beams():
                requests = [replace(first, prompt_token_ids=ids, params=step, prompt=None) for ids in beams]
                outputs = await self.outputs(requests, request)
                if outputs is None:
                    return Response(status_code=CLIENT_CLOSED)
                search.take(outputs)
        finally:
            self.admission.release(ticket)
        choices, generated_tokens = [], 0
        for i, (result, prompt) in enumerate(zip(search.results(None), prepared.requests, strict=True)):
            for j, beam in enumerate(result.sequences):
                generated = beam.tokens[len(prompt.prompt_token_ids):]
                shown = generated[:-1] if beam.finish_reason == "stop" else generated
                text = self.tokenizer.decode(shown, skip_special_tokens=body.skip_special_tokens)
                choices.append(prepared.shape.choice(i * body.n + j, text, generated, [], beam.finish_reason))
                generated_tokens += len(generated)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in prepared.requests)
        out = prepared.shape.body(choices, usage(prompt_tokens, generated_tokens))
        return JSONResponse(out if prepared.form is None else prepared.form.body(out))

    async def _submit(self, requests: list[NewRequest], structure_field: str | None = None) -> Submission:
        try:
            return await self.engine.submit(requests)
        except ValueError as e:
            raise _engine_error(e, structure_field) from None

    async def outputs(
        self, requests: list[NewRequest], request: Request, structure_field: str | None = None
    ) -> list[RequestOutput] | None:  # fmt: skip
        """Run the requests; their outputs in order, or None when the client left first (the requests
        are then aborted). `structure_field`: the body field a structure that does not compile names."""
        submission = await self._submit(requests, structure_field)
        collecting = asyncio.ensure_future(_collect(submission, len(requests)))
        watching = asyncio.ensure_future(_until_disconnect(request))
        gone = False
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not collecting.done():  # the client left (or the server is shutting down)
                gone = True
                collecting.cancel()
                self._abort(submission)
        if gone:
            return None
        for out in collecting.result():
            self.metrics.observe(out)
        return collecting.result()

    async def _response(self, outputs: list[RequestOutput], prepared: Prepared) -> dict[str, Any]:
        shape = prepared.shape
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text, tokens, entries = c.text, c.token_ids, c.logprobs or []
                if prepared.echo is not None:
                    text, tokens, entries = prepared.echo[i].before(out.prompt_logprobs, text, tokens, entries)
                choice = shape.choice(i * prepared.n + c.index, text, tokens, entries, c.finish_reason, c.stop_reason)
                if prepared.prompt_logprobs and not shape.chat:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                if prepared.token_ids:  # (the generated ones, echo or not; chat's prompt's are at the top level)
                    choice |= {"token_ids": c.token_ids} if shape.chat else {"prompt_token_ids": out.prompt_token_ids,
                                                                             "token_ids": c.token_ids}  # fmt: skip
                choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        cached = sum(out.num_cached_tokens or 0 for out in outputs)
        extra: dict[str, Any] = await self._vlens(outputs[0], prepared)
        if prepared.prompt_logprobs and shape.chat:  # vLLM puts the one prompt's at the top level
            extra["prompt_logprobs"] = prompt_logprobs_json(outputs[0].prompt_logprobs)
        if prepared.token_ids and shape.chat:
            extra["prompt_token_ids"] = outputs[0].prompt_token_ids
        return shape.body(choices, usage(prompt_tokens, completion_tokens, cached), **extra)

    async def _chunks(self, submission: Submission, prepared: Prepared) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (an error's body, {"error": ...}, ends it early)."""
        shape = prepared.shape
        started: set[int] = set()  # choices that sent a chunk (chat's first names the role, echo's holds the prompt)
        prompt_entries: dict[int, list] = {}  # per prompt, from the delta of the sample that computed them
        remaining, prompt_tokens, completion_tokens, cached = len(prepared.requests), 0, 0, 0
        while remaining:
            event = await submission.next()
            if isinstance(event, Failed):
                submission.done = True
                yield APIError(event.status, event.message).body()
                return
            if not isinstance(event, Progress):
                continue
            i, delta = event.index, event.delta
            index = i * prepared.n + delta.index
            if delta.prompt_logprobs is not None:
                prompt_entries[i] = delta.prompt_logprobs
            text, tokens, entries = delta.text, delta.token_ids, delta.logprobs
            if prepared.echo is not None and index not in started:
                text, tokens, entries = prepared.echo[i].before(prompt_entries.get(i), text, tokens, entries)
            extra: dict[str, Any] = {}
            if delta.finished:
                remaining -= 1
                out = delta.output
                self.metrics.observe(out)
                prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                cached += out.num_cached_tokens or 0
                extra = await self._vlens(out, prepared)
            if text or delta.finish_reason or extra or ((shape.logprobs is not None or prepared.token_ids) and tokens):
                first = index not in started
                choice = shape.choice(
                    index, text, tokens, entries, delta.finish_reason, delta.stop_reason, delta=True, first=first,
                )  # fmt: skip
                if prepared.token_ids:  # (vLLM's: the prompt's in the first chunk, each chunk's own tokens)
                    choice["token_ids"] = delta.token_ids
                    if first and not shape.chat:
                        choice["prompt_token_ids"] = prepared.requests[i].prompt_token_ids
                    elif first and not started:
                        extra["prompt_token_ids"] = prepared.requests[i].prompt_token_ids
                started.add(index)
                yield shape.chunk([choice], **extra)
        submission.done = True
        if prepared.include_usage:
            yield shape.chunk([], usage(prompt_tokens, completion_tokens, cached))

    async def _vlens(self, output: RequestOutput, prepared: Prepared) -> dict[str, Any]:
        """The `vlens` field of a response (or of the chunk that finishes a stream), if it has one."""
        fields: dict[str, Any] = {}
        if prepared.wants_activations:
            fields["activations"] = await self._activations(output, prepared)
        if prepared.wants_features:
            fields["sae_features"] = features_json(output)
        return {"vlens": fields} if fields else {}

    async def _activations(self, output: RequestOutput, prepared: Prepared) -> dict[str, Any]:
        # Encoding copies every captured tensor: off the event loop and off the engine thread.
        data = await asyncio.to_thread(encode, output, self.model_name)
        self.metrics.captured_bytes += len(data)
        return present(data, self.config.inline_activation_bytes, self.store, prepared.owner)

    def _abort_unless_done(self, submission: Submission) -> None:
        if not submission.done:  # the client went away mid-stream: stop its sequences, free their blocks
            self._abort(submission)

    def _abort(self, submission: Submission) -> None:
        submission.done = True
        self.engine.abort(submission)
        self.metrics.aborted += 1


class _EventStream(StreamingResponse):
    """Server-sent events whose request is aborted however the response ends early: the client
    disconnecting (before or during the stream), a failed send, or the server shutting down."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _collect(submission: Submission, n: int) -> list[RequestOutput]:
    outputs: list[RequestOutput | None] = [None] * n
    while any(out is None for out in outputs):
        event = await submission.next()
        if isinstance(event, Failed):
            submission.done = True
            raise APIError(event.status, event.message)
        if isinstance(event, Progress) and event.delta.finished:
            outputs[event.index] = event.delta.output
    submission.done = True
    return outputs


async def _until_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """OpenAI's server-sent events of completions and chat completions: each chunk, then [DONE] (not after an
    error, which ends the stream)."""
    async for chunk in chunks:
        yield _sse(chunk)
        if "error" in chunk:
            return
    yield "data: [DONE]\n\n"


def _token_id_text(token: int) -> str:
    """vLLM's return_tokens_as_token_ids: a log-probability's token named by its id (one no JSON text can lose)."""
    return f"token_id:{token}"


def _truncated(prompts: list[tuple[list[int], str | None]], keep: int | None) -> list[tuple[list[int], str | None]]:
    """vLLM's truncate_prompt_tokens on (ids, text) prompts: a cut prompt's text is its kept tokens' (echo's)."""
    cut = [(truncated(ids, keep), text) for ids, text in prompts]
    return [(ids, text if len(ids) == len(whole) else None) for (ids, text), (whole, _) in zip(cut, prompts)]


def _engine_error(e: ValueError, structure_field: str | None = None) -> APIError:
    """Name the request field behind a vlens ValueError: capture and intervention fields live under `vlens`; a
    structure that does not compile, the body field it came from."""
    message = str(e)
    if structure_field not in (None, "structured_outputs") and message.startswith("structured_outputs."):
        return from_value_error(ValueError(f"{structure_field}: {message.split(': ', 1)[1]}"))
    if message.startswith("hooks"):
        return from_value_error(e, prefix="vlens.capture.")
    return from_value_error(e, prefix="vlens." if message.startswith(("capture", "interventions")) else "")
