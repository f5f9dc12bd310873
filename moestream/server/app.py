"""The HTTP app: auth, CORS, request ids, errors, models and health, and the API routes
(chat_api: OpenAI chat and completions; messages_api: Anthropic's Messages; responses_api:
OpenAI's Responses; tokenize_api: llama.cpp's /tokenize and /detokenize).

Everything here runs on the event loop and handles only JSON and text: requests are validated,
tokenized (in a thread, through the worker's locked tokenizer) and handed to the worker as Jobs;
events come back through a thread-safe sink. This module never imports torch.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from moestream.errors import NoTokenizerError
from moestream.server import chat_api, messages_api, responses_api, tokenize_api
from moestream.server.generation import RequestDefaults, Runtime  # noqa: F401 (re-exported)
from moestream.server.metrics import RequestCounter, ServerMetrics
from moestream.server.api_error import APIError
from moestream.server.reasoning import FORMATS as REASONING_FORMATS
from moestream.server.worker import Worker

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
API_PREFIXES = ("/v1", "/api/v1")
KEYED_ROOT_ROUTES = ("/tokenize", "/detokenize")  # outside the prefixes, still behind the key


# ------------------------------------------------------------------------------------- middleware

def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _is_api_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in API_PREFIXES) or path in KEYED_ROOT_ROUTES


def _is_anthropic_path(path: str) -> bool:
    """Anthropic's routes (/v1/messages and below): their errors take Anthropic's shape."""
    return any(path == p + "/messages" or path.startswith(p + "/messages/") for p in API_PREFIXES)


def _error_body(error: APIError, path: str) -> dict:
    return error.anthropic_body() if _is_anthropic_path(path) else error.body()


class APIKeyMiddleware:
    """The key on every /v1 and /api/v1 route (and /tokenize, /detokenize), as `Authorization:
    Bearer KEY` (OpenAI's header) or `x-api-key: KEY` (Anthropic's), compared in constant time
    (sha256 digests of both sides, then hmac.compare_digest, so neither the key's length nor its
    bytes leak)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = _digest(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_api_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        given: dict[bytes, str | None] = {}  # the first of each header (None: not a bearer token)
        for name, value in scope.get("headers", []):
            if name == b"authorization" and name not in given:
                scheme, _, token = value.decode("latin-1").strip().partition(" ")
                given[name] = token.strip() if scheme.lower() == "bearer" else None
            elif name == b"x-api-key" and name not in given:
                given[name] = value.decode("latin-1").strip()
        keys = [key for key in given.values() if key is not None]
        if not keys:
            error = APIError(401, "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                             code="invalid_api_key")
        elif not any([hmac.compare_digest(_digest(key), self._digest) for key in keys]):  # a list: compare each
            error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        await JSONResponse(_error_body(error, scope.get("path", "")), 401,
                           {"www-authenticate": "Bearer"})(scope, receive, send)


class RequestIdMiddleware:
    """Every answer carries x-request-id: the client's own (echoed, so it can match logs) or a new
    one. The id is in scope["state"]["request_id"] for the routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), "")
        # a printable id of sane length is echoed; anything else is replaced
        request_id = given if given and len(given) <= 200 and given.isprintable() else "req_" + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _error_response(error: APIError, request: Request) -> JSONResponse:
    return JSONResponse(_error_body(error, request.url.path), status_code=error.status, headers=error.headers)


# ---------------------------------------------------------------------------------------- the app

def create_app(worker: Worker, *, api_key: str | None = None, model_id: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, defaults: RequestDefaults | None = None,
               max_context: int | None = None, shutdown_timeout: float = 5.0,
               reasoning_format: str = "auto") -> FastAPI:
    """The ASGI app around a started Worker. `model_id` defaults to the engine's model name;
    `max_context` (prompt plus completion) is capped at the engine's. When the ASGI server's
    lifespan ends, the worker stops (within `shutdown_timeout` seconds) and closes the engine.
    `reasoning_format` (moestream.server.reasoning.FORMATS): auto gives a reply's reasoning apart
    from its content, none leaves it in the content."""
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, not {reasoning_format!r}")
    defaults = defaults or RequestDefaults()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if not await run_in_threadpool(worker.shutdown, shutdown_timeout):
            log.warning("the engine did not stop within %.1f s", shutdown_timeout)

    app = FastAPI(title="moestream", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker = worker
    metrics = ServerMetrics(worker)
    worker.observers.append(metrics)
    app.state.metrics = metrics

    def current_model_id() -> str:
        return model_id or worker.model_name or "moestream"

    def context_limit() -> int:
        limit = worker.max_context
        return min(limit, max_context) if max_context else limit

    runtime = Runtime(worker, defaults=defaults, model_id=current_model_id, context_limit=context_limit,
                      reasoning_format=reasoning_format, max_body_bytes=max_body_bytes)

    # ---- errors in OpenAI's shape (Anthropic's on its routes)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _error_response(exc, request)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"No route {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code, str(exc.detail))
        error = APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
        return _error_response(error, request)

    @app.exception_handler(NoTokenizerError)
    async def on_text_without_tokenizer(request: Request, exc: NoTokenizerError) -> Response:
        return _error_response(APIError(400, "This model has no tokenizer files: send the prompt as token ids "
                                        "(a list of integers, /v1/completions).", code="no_tokenizer"), request)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error_response(APIError(500, "Internal server error.", type="server_error", code="internal_error"),
                               request)

    # ---- routes

    router = APIRouter()

    def model_card() -> dict:
        return {"id": current_model_id(), "object": "model", "created": created, "owned_by": "moestream",
                "max_context": context_limit() or None}

    @router.get("/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @router.get("/models/{name:path}")
    async def get_model(name: str) -> Response:
        # The completion routes accept any model name and answer with the one model served, so a
        # lookup by any name does the same: a client that checks its model first then finds it.
        return JSONResponse(model_card())

    chat_api.register(router, runtime)
    messages_api.register(router, runtime)
    responses_api.register(router, runtime)
    app.include_router(router, prefix="/v1")
    app.include_router(router, prefix="/api/v1")
    root = APIRouter()
    tokenize_api.register(root, runtime)
    app.include_router(root)

    @app.get("/health")
    async def health() -> Response:
        if worker.state == "ready":
            body = {"status": "ok", "model": current_model_id(), "max_context": context_limit(),
                    "queue": {"waiting": worker.queue_depth, "max": worker.max_queue,
                              "tokens": worker.queue_tokens, "max_tokens": worker.limits.max_tokens, "busy": worker.busy,
                              "running": worker.running, "parallel": worker.parallel},
                    "requests_done": worker.jobs_done, "stats": worker.stats_snapshot,
                    "last_receipt": worker.last_receipt}
            return JSONResponse(body)
        body = {"status": worker.state}
        if worker.error:
            body["error"] = worker.error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    templates = [prefix + route.path for prefix in API_PREFIXES for route in router.routes] + \
        [route.path for route in root.routes] + ["/health", "/metrics"]
    return _wrap(app, api_key, metrics, templates)


def _wrap(app: FastAPI, api_key: str | None, metrics: ServerMetrics, templates: list[str]) -> FastAPI:
    # Outermost first: the request counter sees every answer; CORS answers preflights before the
    # key is checked and adds its header to every answer, errors included; every answer, refusals
    # too, carries x-request-id.
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=False, allow_methods=["*"],
                       allow_headers=["*"], expose_headers=["Retry-After", "x-request-id"], max_age=600)
    app.add_middleware(RequestCounter, metrics=metrics, templates=templates)
    return app
