"""The HTTP surface: routes, error handlers in OpenAI's shape, middleware, and start-up/shutdown."""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from vlens.capture import TunedLens
from vlens.capture.names import hook_shapes, request_shapes
from vlens.llm import LLM
from vlens.server.activations import ActivationStore, Download, owner_of
from vlens.server.admission import Admission
from vlens.server.auth import BearerAuth, presented_key
from vlens.server.config import ServerConfig
from vlens.server.engine_loop import EngineLoop
from vlens.server.extension import ExtensionContext
from vlens.server.generate import Generator
from vlens.server.limits import BodyLimit
from vlens.server.loras import LoraAdapterRequest, load_adapter, load_loras, unload_adapter
from vlens.server.metrics import CountRequests, Metrics
from vlens.server.pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    Pooler,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from vlens.server.protocol import APIError, ChatRequest, CompletionRequest, schema_error
from vlens.server.responses_api import ResponsesRequest
from vlens.server.saes import describe, load_saes
from vlens.server.steering import describe as describe_steering
from vlens.server.steering import load_steering_vectors
from vlens.server.tokens import DetokenizeRequest, TokenizeRequest, Tokens
from vlens.version import __version__
from vlens.viz.html import page_html

log = logging.getLogger("vlens.server")


@dataclass
class Served:
    """What an app serves, made once by `create_app`. Its routes find it at `request.app.state.served` rather than
    close over it: FastAPI keeps every endpoint it has looked at in a module-level cache, and an endpoint that held the
    LLM would keep its weights and KV cache after the app is gone (a notebook's server, a test's)."""

    config: ServerConfig
    model_name: str
    max_model_len: int
    shapes: dict[str, tuple[int, ...]]  # every hook a request may name
    always: dict[str, tuple[int, ...]]  # ... but TransformerLens's optional ones
    saes: dict
    tuned_lens: TunedLens | None
    steering_vectors: dict
    store: ActivationStore
    metrics: Metrics
    loop: EngineLoop
    admission: Admission
    generator: Generator
    pooler: Pooler
    tokens: Tokens
    lens_page: str
    created: int


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    """An app serving `llm`; its engine runs on a background thread from start-up to shutdown."""
    engine = llm.engine
    if config.enable_capture and not engine.enable_capture:
        raise ValueError("enable_capture: the server allows capture but the LLM was built with enable_capture=False")
    model_name = config.served_model_name or llm.model_name
    shapes = request_shapes(llm.config)
    saes = load_saes(config.saes, llm.config, shapes)
    tuned_lens = None
    if config.tuned_lens is not None:
        tuned_lens = TunedLens.load(Path(config.tuned_lens).expanduser())
        tuned_lens.check(llm.config, "tuned_lens")  # (at start, not at the first request)
    steering_vectors = load_steering_vectors(config.steering_vectors, llm.config, shapes)
    if model_name in steering_vectors:  # (a request's model names the base model or a steered one)
        raise ValueError(f"steering_vectors: {model_name!r} is the served model's name; give the vector another")
    loras = load_loras(config.lora_modules, engine, [model_name, *steering_vectors])
    if config.allow_runtime_lora_updating and engine.loras is None:
        raise ValueError("allow_runtime_lora_updating: the model was built without enable_lora=True")
    extension = ExtensionContext(config.enable_capture, saes, tuned_lens, steering_vectors, loras)
    store = ActivationStore(config.activation_ttl_s)
    metrics = Metrics()
    loop = EngineLoop(engine)
    admission = Admission(config.max_pending_requests, config.max_capture_bytes_in_flight, store)
    generator = Generator(
        config,
        loop,
        copy.deepcopy(llm.tokenizer),  # the front's own: the engine thread decodes with the engine's
        llm.config,
        shapes,
        llm.dtype,
        model_name,
        engine.max_model_len,
        store,
        metrics,
        extension,
        admission,
        llm.image_encoder,
        llm.sampling_defaults,
    )
    tokens = Tokens(generator.tokenizer, llm.config.vocab_size, model_name, engine.max_model_len, steering_vectors,
                    loras, generator.templates)  # fmt: skip
    served = Served(
        config, model_name, engine.max_model_len, shapes, hook_shapes(llm.config), saes, tuned_lens, steering_vectors,
        store, metrics, loop, admission, generator, Pooler(generator, llm.classifier, llm.embedding_defaults), tokens,
        page_html(None), int(time.time()),
    )  # fmt: skip

    app = FastAPI(title="vlens", version=__version__, lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.served = served
    for kind, handler in ((APIError, _api_error), (RequestValidationError, _invalid_body),
                          (HTTPException, _http_error), (Exception, _internal_error)):  # fmt: skip
        app.add_exception_handler(kind, handler)
    app.include_router(routes)
    # Outermost first on the way in: count every response, then authenticate, then bound the body.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(BearerAuth, api_key=config.api_key)
    app.add_middleware(CountRequests, metrics=metrics)

    async def drain() -> None:
        """Shut down gently: refuse new requests, let running ones finish for up to --shutdown-timeout,
        then end the rest with a 503 (streams get it as their last event)."""
        timeout_s = config.shutdown_timeout_s
        admission.closing = True
        deadline = time.monotonic() + timeout_s
        while admission.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission.requests:
            log.warning(
                "shutting down: %d requests still running after %.0f s end with 503", admission.requests, timeout_s
            )
            loop.fail_all(
                f"the server shut down before this request finished (--shutdown-timeout {timeout_s:g} s)", 503
            )

    app.state.drain = drain
    app.state.engine_loop = loop
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    served = app.state.served
    served.loop.start(asyncio.get_running_loop())
    sweeper = asyncio.create_task(_sweep(served.store, served.config.activation_ttl_s))
    try:
        yield
    finally:
        sweeper.cancel()
        await asyncio.to_thread(served.loop.stop)


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
    error = schema_error(e.errors(), 422)
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 400:  # FastAPI's only one: a body it could not decode (not UTF-8, say)
        error = APIError(400, f"body: {e.detail}; expected a JSON object in UTF-8", param="body", code="json_invalid")
    else:
        error = APIError(
            e.status_code,
            f"{request.method} {request.url.path}: {e.detail}",
            code="not_found" if e.status_code == 404 else None,
        )
    return JSONResponse(error.body(), status_code=e.status_code)


async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)


routes = APIRouter()  # (every app's: each route reads its app's Served)


def _served(request: Request) -> Served:
    return request.app.state.served


@routes.get("/health")
async def health(request: Request) -> JSONResponse:
    if not _served(request).loop.alive:
        return JSONResponse(APIError(503, "the engine thread is not running").body(), status_code=503)
    return JSONResponse({"status": "ok"})


@routes.get("/v1/models")
async def models(request: Request) -> dict:
    s = _served(request)
    card = {
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "vlens",
        "max_model_len": s.max_model_len,
        "tuned_lens": s.tuned_lens is not None,  # (capture.tuned_lens: true reads the logit lens through it)
    }
    # each steering vector, a model of its own: the base model steered by it (as vLLM lists LoRA adapters); and
    # each LoRA adapter, as vLLM lists it
    steered = [{**card, "id": name, "parent": s.model_name} for name in s.steering_vectors]
    adapted = [{**card, "id": name, "root": lora.lora_path, "parent": s.model_name}
               for name, lora in s.generator.extension.loras.items()]  # fmt: skip
    return {"object": "list", "data": [card, *steered, *adapted]}


@routes.get("/v1/hooks")
async def hooks(request: Request) -> dict:
    s = _served(request)
    # (TransformerLens's optional hooks flagged: a request names them in full, a glob leaves them out)
    data = [{"name": name, "shape": list(shape), "optional": name not in s.always} for name, shape in s.shapes.items()]
    return {"object": "list", "capture_enabled": s.config.enable_capture, "data": data}


@routes.get("/v1/saes")
async def list_saes(request: Request) -> dict:
    return {"object": "list", "data": describe(_served(request).saes)}


@routes.get("/v1/steering_vectors")
async def list_steering_vectors(request: Request) -> dict:
    return {"object": "list", "data": describe_steering(_served(request).steering_vectors)}


@routes.get("/metrics")
async def prometheus(request: Request) -> PlainTextResponse:
    s = _served(request)
    s.store.sweep()  # the handle gauges count only what can still be downloaded
    return PlainTextResponse(s.metrics.render(s.loop.stats, s.store, s.admission),
                             media_type="text/plain; version=0.0.4")  # fmt: skip


@routes.get("/v1/activations/{handle}")
async def activations(handle: str, request: Request) -> Response:
    s = _served(request)
    key = presented_key(request.scope) if s.config.api_key else None
    data = s.store.take(handle, owner_of(key))
    if data is None:
        raise APIError(
            404,
            f"activations {handle!r}: no such handle (never made, made under another key, "
            "already downloaded or expired)",
            param="id",
            code="not_found",
        )
    return Download(data, handle, s.store)


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _served(request).generator.completions(body, request)


@routes.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request) -> Response:
    return await _served(request).generator.chat(body, request)


@routes.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await _served(request).generator.respond(body, request)


@routes.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return await _served(request).pooler.embeddings(body, request)


@routes.post("/classify")
async def classify(body: ClassificationRequest, request: Request) -> Response:
    return await _served(request).pooler.classify(body, request)


@routes.post("/pooling")
async def pooling(body: PoolingRequest, request: Request) -> Response:
    return await _served(request).pooler.pooling(body, request)


@routes.post("/score")
@routes.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> Response:
    return await _served(request).pooler.score(body, request)


@routes.post("/rerank")
@routes.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    return await _served(request).pooler.rerank(body, request)


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoraAdapterRequest, request: Request) -> PlainTextResponse:
    s = _runtime_loras(request)
    taken = [s.model_name, *s.steering_vectors]
    loras = s.generator.extension.loras
    return PlainTextResponse(await asyncio.to_thread(load_adapter, body, s.loop.engine, loras, taken))


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: LoraAdapterRequest, request: Request) -> PlainTextResponse:
    return PlainTextResponse(unload_adapter(body, _runtime_loras(request).generator.extension.loras))


def _runtime_loras(request: Request) -> Served:
    s = _served(request)
    if not s.config.allow_runtime_lora_updating:
        raise APIError(404, "LoRA adapters are loaded at run time only on a server started with "
                            "--allow-runtime-lora-updating", code="not_found")  # fmt: skip
    return s


@routes.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    return _served(request).tokens.tokenize(body)


@routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    return _served(request).tokens.detokenize(body)


@routes.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    return _served(request).tokens.info()


# The lens page: it asks this API for its data (with the key typed into it), so it is open, and it is
# no part of the API's OpenAPI document; nor is /lens/texts, the token texts it names its cells by.
@routes.get("/lens", include_in_schema=False)
async def lens(request: Request) -> HTMLResponse:
    return HTMLResponse(_served(request).lens_page)


@routes.post("/lens/texts", include_in_schema=False)
async def lens_texts(body: DetokenizeRequest, request: Request) -> dict:
    return _served(request).tokens.texts(body)


async def _sweep(store: ActivationStore, ttl_s: float) -> None:
    """Drop expired handles even when no request touches the store."""
    while True:
        await asyncio.sleep(min(ttl_s, 30.0))
        store.sweep()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which drains the app (create_app's `drain`) before its own shutdown and returns
    normally after the signal that stopped it."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets=None) -> None:
        # uvicorn's own shutdown closes the listening socket, waits for open connections, then runs the
        # lifespan's end; draining first answers requests arriving meanwhile with a 503, not a refused connection.
        await self.drain()
        await super().shutdown(sockets)

    @contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal after a graceful shutdown, which ends the process with -SIGTERM (or a
        # KeyboardInterrupt); the shutdown is complete by then, so the signal is not raised again.
        handlers = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def serve(llm: LLM, config: ServerConfig) -> int:
    """Run the server until SIGTERM or SIGINT (what `vlens serve` does after loading the model), drain it,
    and return 0; or, when the engine stops for good (a tensor-parallel rank died), answer 503, shut
    down and return 1, rather than serve from a broken model."""
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", config.host)
    app = create_app(llm, config)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port), app.state.drain)
    engine_loop = app.state.engine_loop
    engine_loop.on_broken = lambda: setattr(server, "should_exit", True)
    server.run()
    return 0 if engine_loop.broken is None else 1
