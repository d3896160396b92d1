"""vLLM's pooling routes: `POST /v1/embeddings`, one vector per input, read from a hook and pooled on the device
(vlens.embedding, as `LLM.embed` reads it); `POST /classify`, a sequence classifier's class probabilities per input
(vlens.classify, as `LLM.classify`); a cross-encoder's `POST /score` of pairs of texts and `POST /rerank` of
documents by a query (as `LLM.score`); and `POST /pooling`, a pooling task's tensor per input (vlens.encode, as
`LLM.encode`: every token's last hidden state, a reward model's score at every token). All are prefill-only engine
requests under the requested model's steering or adapter. An embedding's hook and pooling come from the request's
`vlens` object, else from `vlens serve --embedding-hook/--embedding-pooling`; OpenAI's `encoding_format`: "float" (a
JSON list) or "base64" (little-endian float32 bytes).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vlens.classify import (
    ClassifierHead,
    check_cross_encoder,
    check_sequence_classifier,
    classification_params,
    last_rows,
    pair_tokens,
    pairs,
)
from vlens.embedding import EmbeddingDefaults, check_dimensions, check_hook, embedding_of, embedding_params
from vlens.encode import POOLING_TASKS, PoolingParams, bi_encoder, check_task, cosine, pooled, pooling_request
from vlens.engine.llm_engine import NewRequest
from vlens.inputs import truncated
from vlens.outputs import ClassificationOutput, RequestOutput
from vlens.sampling_params import SamplingParams
from vlens.server.generate import CLIENT_CLOSED, Generator
from vlens.server.protocol import APIError, ChatMessage, DocumentedAs, from_value_error, refuse_unknown, schema_error
from vlens.server.responses import usage
from vlens.server.tokens import render_chat


class EmbeddingOptions(BaseModel):
    """The request's `vlens` object."""

    model_config = ConfigDict(extra="forbid")
    hook: StrictStr | None = None
    pooling: Literal["mean", "last"] | None = None


class PromptsRequest(BaseModel):
    """The inputs of vLLM's pooling routes, in their two forms: `input` (texts or token lists; special tokens added by
    default), or a chat's `messages` (through the chat template, which holds the special tokens; no generation prompt
    by default: an embedding or a reward model reads a whole conversation)."""

    model_config = ConfigDict(extra="allow")
    NEUTRAL: ClassVar[dict[str, tuple]] = {"request_id": (None,)}
    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: StrictStr | None = None  # (as a chat completion's: vlens.server.protocol.ChatTemplates)
    user: StrictStr | None = None
    add_special_tokens: StrictBool | None = None  # default: True for input, False for messages
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)  # vLLM's: each input's last this many tokens
    priority: StrictInt = 0  # vLLM's: lower first, on a server run with --scheduling-policy priority


class EmbeddingRequest(PromptsRequest):
    """OpenAI's /v1/embeddings body, and vLLM's chat form of it (`messages`)."""

    NEUTRAL: ClassVar[dict[str, tuple]] = {"request_id": (None,), "additional_data": (None,)}
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None  # OpenAI's: a matryoshka model's vectors cut to their first dims
    normalize: StrictBool | None = None  # vLLM's: true, vectors of unit length (None: as the checkpoint says, else not)
    vlens: Annotated[dict[str, Any] | None, DocumentedAs(EmbeddingOptions)] = None


def _encoded(vector: torch.Tensor, encoding_format: str) -> list | str:
    """A float tensor as OpenAI's encoding_format says: nested JSON lists, or base64 of its float32 values."""
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class ClassificationRequest(PromptsRequest):
    """vLLM's /classify body, in its two forms (PromptsRequest)."""

    use_activation: StrictBool | None = None  # vLLM's: false, probs are the head's logits as they are


class PoolingRequest(ClassificationRequest):
    """vLLM's /pooling body: /classify's (`input` or a chat's `messages`; `use_activation` for the classifying tasks),
    the pooling `task` (required, as vLLM's), `normalize` and `dimensions` for the embedding tasks, and the data's
    encoding."""

    task: Literal[POOLING_TASKS] | None = None  # type: ignore[valid-type]
    normalize: StrictBool | None = None
    dimensions: StrictInt | None = None
    encoding_format: Literal["float", "base64"] = "float"


class ScoreRequest(BaseModel):
    """vLLM's /score body: pairs of texts (one with each of the others, or two lists item by item)."""

    model_config = ConfigDict(extra="allow")
    NEUTRAL: ClassVar[dict[str, tuple]] = {"request_id": (None,)}
    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)
    priority: StrictInt = 0


class RerankRequest(BaseModel):
    """vLLM's /rerank body (Jina's and Cohere's form): documents ranked by their relevance to the query."""

    model_config = ConfigDict(extra="allow")
    NEUTRAL: ClassVar[dict[str, tuple]] = {"request_id": (None,)}
    model: StrictStr | None = None
    query: StrictStr = Field(min_length=1)
    documents: list[Annotated[StrictStr, Field(min_length=1)]] = Field(min_length=1)
    top_n: StrictInt | None = Field(None, ge=1)  # the best this many (None: all)
    return_documents: StrictBool = True
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)
    priority: StrictInt = 0


class Pooler:
    def __init__(self, generator: Generator, classifier: ClassifierHead | None, defaults: EmbeddingDefaults):
        self.generator, self.classifier, self.defaults = generator, classifier, defaults
        g = generator
        try:  # a bad server default fails at start-up, not in every request
            check_hook(g.config.embedding_hook, g.cfg)
        except ValueError as e:
            raise ValueError(f"embedding_hook: {e}") from None
        self.cfg, self.config = g.cfg, g.config

    def _options(self, raw: dict[str, Any] | None) -> tuple[str, str]:
        try:
            options = EmbeddingOptions.model_validate(raw or {})
        except ValidationError as e:
            raise schema_error(e.errors(), 400, ("vlens",)) from None
        hook = options.hook or self.config.embedding_hook
        try:
            check_hook(hook, self.cfg)
        except ValueError as e:
            raise APIError(400, f"vlens.hook: {' '.join(str(e).split())}", param="vlens.hook") from None
        return hook, options.pooling or self.config.embedding_pooling or self.defaults.pooling or "mean"

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        g = self.generator
        refuse_unknown(body.model_extra, EmbeddingRequest.NEUTRAL)
        hook, pooling = self._options(body.vlens)
        try:
            check_dimensions(body.dimensions, self.cfg, hook)
        except ValueError as e:
            raise from_value_error(e) from None
        # (a steered model's embeddings are read with its steering, an adapter's under it)
        params = embedding_params(hook, pooling, self.cfg, g.steers_of(body.model))
        token_lists, field = self._inputs(body)
        run = await self._run(token_lists, field, body, params, request)
        if run is None:
            return Response(status_code=CLIENT_CLOSED)
        outputs, tokens = run
        normalize = bool(self.defaults.normalize) if body.normalize is None else body.normalize
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encoded(embedding_of(out, hook, normalize, body.dimensions), body.encoding_format),
            }
            for i, out in enumerate(outputs)
        ]
        return JSONResponse({"object": "list", "data": data, "model": body.model or g.model_name,
                             "usage": usage(tokens, 0)})  # fmt: skip

    async def classify(self, body: ClassificationRequest, request: Request) -> Response:
        g = self.generator
        refuse_unknown(body.model_extra, ClassificationRequest.NEUTRAL)
        try:
            check_sequence_classifier(self.cfg, "model")
        except ValueError as e:
            raise from_value_error(e) from None
        token_lists, field = self._inputs(body)
        run = await self._classes(token_lists, field, body, request)
        if run is None:
            return Response(status_code=CLIENT_CLOSED)
        classes, tokens = run
        data = [{"index": i, "label": c.label, "probs": c.probs if body.use_activation is not False else c.logits,
                 "num_classes": c.num_classes, "logits": c.logits} for i, c in enumerate(classes)]  # fmt: skip
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": body.model or g.model_name, "data": data, "usage": usage(tokens, 0)})  # fmt: skip

    async def pooling(self, body: PoolingRequest, request: Request) -> Response:
        g = self.generator
        refuse_unknown(body.model_extra, PoolingRequest.NEUTRAL)
        try:
            task = check_task(body.task, self.cfg, "task")
            params = PoolingParams(body.normalize, body.use_activation, body.dimensions)
            params.check(task, self.cfg, prefix="")
        except ValueError as e:
            raise from_value_error(e) from None
        token_lists, field = self._inputs(body)
        params = params.resolved(task, self.defaults)
        run = await self._run(token_lists, field, body, pooling_request(task, self.defaults, g.steers_of(body.model)),
                              request)  # fmt: skip
        if run is None:
            return Response(status_code=CLIENT_CLOSED)
        outputs, tokens = run
        data = [{"index": i, "object": "pooling",
                 "data": _encoded(pooled(task, out, params, self.classifier), body.encoding_format)}
                for i, out in enumerate(outputs)]  # fmt: skip
        return JSONResponse({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": body.model or g.model_name, "data": data, "usage": usage(tokens, 0)})  # fmt: skip

    def _inputs(self, body: PromptsRequest) -> tuple[list[list[int]], str]:
        """The token lists of a body of `input` (special tokens added by default) or of a chat's `messages` (through
        the chat template, which holds them), and the field they came from."""
        g = self.generator
        if (body.input is None) == (body.messages is None):
            raise APIError(400, "input: give either input (texts or token lists) or messages (a conversation)", "input")
        if body.messages is not None:
            text = render_chat(g.tokenizer, body.messages, g.templates.options(body))
            return g.tokenize(text, "messages", bool(body.add_special_tokens)), "messages"
        return g.tokenize(body.input, "input", body.add_special_tokens is not False), "input"

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        refuse_unknown(body.model_extra, ScoreRequest.NEUTRAL)
        try:
            joined = pairs(body.text_1, body.text_2, ("text_1", "text_2"))
        except ValueError as e:
            raise from_value_error(e) from None
        run = await self._scores(joined, "text_2", body, request)
        if run is None:
            return Response(status_code=CLIENT_CLOSED)
        scores, tokens = run
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": body.model or self.generator.model_name, "data": data,
                             "usage": usage(tokens, 0)})  # fmt: skip

    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        refuse_unknown(body.model_extra, RerankRequest.NEUTRAL)
        run = await self._scores([(body.query, d) for d in body.documents], "documents", body, request)
        if run is None:
            return Response(status_code=CLIENT_CLOSED)
        scores, tokens = run
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
        results = [{"index": i, "relevance_score": scores[i]}
                   | ({"document": {"text": body.documents[i]}} if body.return_documents else {})
                   for i in ranked]  # fmt: skip
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or self.generator.model_name,
                             "usage": {"total_tokens": tokens}, "results": results})  # fmt: skip

    async def _scores(
        self, joined: list[tuple[str, str]], field: str, body: ScoreRequest | RerankRequest, request: Request
    ) -> tuple[list[float], int] | None:
        """Each pair's relevance, the pair tokenized as the tokenizer joins two texts, or an embedding model's cosine
        of the two texts' embeddings (LLM.score's)."""
        if bi_encoder(self.cfg, self.defaults):
            texts = list(dict.fromkeys(text for pair in joined for text in pair))
            g, params = self.generator, PoolingParams(normalize=False)  # (a cosine needs no unit vectors)
            request_ = pooling_request("embed", self.defaults, g.steers_of(body.model))
            run = await self._run(g.tokenize(texts, field, True), field, body, request_, request)
            if run is None:
                return None
            embedded = dict(zip(texts, (pooled("embed", out, params, None) for out in run[0])))
            return [cosine(embedded[a], embedded[b]) for a, b in joined], run[1]
        try:
            check_cross_encoder(self.cfg, "model")
        except ValueError as e:
            raise from_value_error(e) from None
        token_lists = [pair_tokens(self.generator.tokenizer, self.cfg, a, b) for a, b in joined]
        run = await self._classes(token_lists, field, body, request)
        return None if run is None else ([c.probs[0] for c in run[0]], run[1])

    async def _classes(
        self, token_lists: list[list[int]], field: str, body: ClassificationRequest | ScoreRequest | RerankRequest,
        request: Request,
    ) -> tuple[list[ClassificationOutput], int] | None:  # fmt: skip
        """Each input's classes, read under the body's model's steering: as _run's outputs."""
        params = classification_params(self.cfg, self.generator.steers_of(body.model))
        run = await self._run(token_lists, field, body, params, request)
        return None if run is None else (self.classifier.classify(last_rows(run[0])), run[1])

    async def _run(self, token_lists: list[list[int]], field: str, body: Any, params: SamplingParams,
                   request: Request) -> tuple[list[RequestOutput], int] | None:  # fmt: skip
        """Each input's prefill-only request (cut to the body's truncate_prompt_tokens) under the body's model's
        adapter: the outputs, in input order, and the inputs' tokens; None when the client went away. `field`: what
        a too long input's 400 names."""
        g = self.generator
        token_lists = [truncated(ids, body.truncate_prompt_tokens) for ids in token_lists]
        for i, ids in enumerate(token_lists):
            if len(ids) >= g.max_model_len:
                where = f"{field}[{i}]"
                raise APIError(400, f"{where}: {len(ids)} tokens; this server's context is {g.max_model_len}", where,
                               code="context_length_exceeded")  # fmt: skip
        lora = g.lora_of(body.model)
        ticket = g.admission.admit(len(token_lists), 0, field)  # a row per input, JSON: no capture bytes to hold
        try:
            requests = [NewRequest(ids, params, lora=lora, priority=body.priority) for ids in token_lists]
            outputs = await g.outputs(requests, request)
        finally:
            g.admission.release(ticket)
        return None if outputs is None else (outputs, sum(len(ids) for ids in token_lists))
