"""The OpenAI-compatible HTTP API: routes, auth, CORS, errors and server-sent events.

Everything here runs on the event loop and handles only JSON and text: requests are validated,
tokenized (in a thread, through the worker's locked tokenizer) and handed to the worker as Jobs;
events come back through a thread-safe sink. This module never imports torch.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from moestream.engine.types import SamplingParams
from moestream.server.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    PromptTokensDetails,
    invalid,
    parse_request,
    timings_from_receipt,
)
from moestream.server.worker import Failed, Finished, Job, NotReady, QueueFull, Started, TextDelta, TokenLogprobInfo, Worker

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
SYSTEM_FINGERPRINT = "moestream"
API_PREFIXES = ("/v1", "/api/v1")


@dataclass(frozen=True)
class RequestDefaults:
    """Sampling settings for requests that leave a field out."""

    temperature: float = 0.2
    top_k: int = 64
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = None  # None: the rest of the context


# -------------------------------------------------------------------------------------- middleware

def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _is_api_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in API_PREFIXES)


async def _send_json(send: Send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


class APIKeyMiddleware:
    """Bearer key on every /v1 and /api/v1 route, compared in constant time (sha256 digests of
    both sides, then hmac.compare_digest, so neither the key's length nor its bytes leak)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = _digest(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_api_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").strip().partition(" ")
                if scheme.lower() == "bearer":
                    given = token.strip()
                break
        if given is None:
            error = APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
        elif not hmac.compare_digest(_digest(given), self._digest):
            error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        await _send_json(send, 401, error.body(), {"www-authenticate": "Bearer"})


# ----------------------------------------------------------------------------------------- helpers

def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _read_json(request: Request, max_bytes: int) -> Any:
    too_large = APIError(413, f"The request body is larger than {max_bytes} bytes.", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    if not body.strip():
        raise invalid("The request body is empty: send a JSON object.", code="invalid_json")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(bytes(body), parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}.", code="invalid_json") from None


class _Sink:
    """Hands the worker's events to the event loop. A streaming request gets every event; a whole
    one gets only the end, with the text joined on the worker's side."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.loop = loop
        self.stream = stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.future: asyncio.Future = loop.create_future()
        self.started: Started | None = None
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprobInfo] = []

    def __call__(self, event: Any) -> None:  # worker thread
        if self.stream:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
            return
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, TextDelta):
            self.parts.append(event.text)
            self.logprobs.extend(event.logprobs)
        else:
            if isinstance(event, Finished):
                self.logprobs.extend(event.logprobs)
            self.loop.call_soon_threadsafe(self._resolve, event)

    def _resolve(self, event: Any) -> None:
        if not self.future.done():
            self.future.set_result(event)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json(exclude_none=False)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _without_nulls(body: dict, *keys: str) -> dict:
    for key in keys:
        if body.get(key) is None:
            body.pop(key, None)
    return body


def _usage(event: Finished) -> Usage:
    reused = event.receipt.get("reused_tokens", 0)
    return Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                 total_tokens=event.prompt_tokens + event.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=int(reused or 0)))


def _chat_logprobs(infos: list[TokenLogprobInfo]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        TokenLogprob(token=i.token, logprob=i.logprob, bytes=list(i.token.encode("utf-8")),
                     top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in i.top])
        for i in infos])


def _completion_logprobs(infos: list[TokenLogprobInfo], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for info in infos:
        out.tokens.append(info.token)
        out.token_logprobs.append(info.logprob)
        top: dict[str, float] = {}
        for text, lp in info.top:
            top.setdefault(text, lp)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(info.token)
    return out


# ---------------------------------------------------------------------------------------- the app

def create_app(worker: Worker, *, api_key: str | None = None, model_id: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, defaults: RequestDefaults | None = None,
               max_context: int | None = None, shutdown_timeout: float = 5.0) -> FastAPI:
    """The ASGI app around a started Worker. `model_id` defaults to the engine's model name;
    `max_context` (prompt plus completion) is capped at the engine's. When the ASGI server's
    lifespan ends, the worker stops (within `shutdown_timeout` seconds) and closes the engine."""
    defaults = defaults or RequestDefaults()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if not await run_in_threadpool(worker.shutdown, shutdown_timeout):
            log.warning("the engine did not stop within %.1f s", shutdown_timeout)

    app = FastAPI(title="moestream", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker = worker

    def current_model_id() -> str:
        return model_id or worker.model_name or "moestream"

    def context_limit() -> int:
        limit = worker.max_context
        return min(limit, max_context) if max_context else limit

    # ---- errors in OpenAI's shape

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"No route {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code, str(exc.detail))
        error = APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
        return _error_response(error)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error_response(APIError(500, "Internal server error.", type="server_error", code="internal_error"))

    # ---- routes

    router = APIRouter()

    @router.get("/models")
    async def list_models() -> Response:
        card = ModelCard(id=current_model_id(), created=created, max_context=context_limit() or None)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @router.get("/models/{name:path}")
    async def get_model(name: str) -> Response:
        if name != current_model_id():
            raise APIError(404, f"The model {name!r} does not exist; this server has {current_model_id()!r}.",
                           param="model", code="model_not_found")
        return JSONResponse(ModelCard(id=name, created=created, max_context=context_limit() or None).model_dump())

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await _read_json(request, max_body_bytes))
        tokenizer = _require_ready(worker)
        messages = req.chat_messages()
        try:
            prompt_ids = await run_in_threadpool(tokenizer.chat_ids, messages, True)
        except Exception as exc:  # the model's chat template refused the conversation
            raise invalid(f"The chat template could not format these messages: {exc}", "messages") from None
        return await _generate(request, req, prompt_ids, chat=True)

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await _read_json(request, max_body_bytes))
        tokenizer = _require_ready(worker)
        prompt = req.prompt_value()
        if isinstance(prompt, str):
            prompt_ids = await run_in_threadpool(tokenizer.encode, prompt, True)
        else:
            vocab = tokenizer.vocab_size
            bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise invalid(f"Token id {bad[0]} is outside the vocabulary (0..{(vocab or 0) - 1}).", "prompt")
            prompt_ids = prompt
        return await _generate(request, req, prompt_ids, chat=False)

    app.include_router(router, prefix="/v1")
    app.include_router(router, prefix="/api/v1")

    @app.get("/health")
    async def health() -> Response:
        if worker.state == "ready":
            body = {"status": "ok", "model": current_model_id(), "max_context": context_limit(),
                    "queue": {"waiting": worker.queue_depth, "max": worker.max_queue, "busy": worker.busy},
                    "requests_done": worker.jobs_done, "stats": worker.stats_snapshot,
                    "last_receipt": worker.last_receipt}
            return JSONResponse(body)
        body = {"status": worker.state}
        if worker.error:
            body["error"] = worker.error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    # ---- generation

    def _plan(req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int]) -> tuple[int, SamplingParams]:
        limit = context_limit()
        if not prompt_ids:
            raise invalid("The prompt is empty.", "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        if len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(prompt_ids)} tokens and leaves no room for a reply.",
                           param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        room = limit - len(prompt_ids)
        wanted = req.max_new_tokens if req.max_new_tokens is not None else defaults.max_tokens
        max_new = room if wanted is None else min(wanted, room)
        top_k = defaults.top_k if req.top_k is None else req.top_k
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        sampling = SamplingParams(
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_k=max(0, top_k),
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            min_p=defaults.min_p if req.min_p is None else req.min_p,
            repetition_penalty=defaults.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
            seed=seed % (2**64),
        )
        return max_new, sampling

    async def _generate(request: Request, req: Any, prompt_ids: list[int], *, chat: bool) -> Response:
        max_new, sampling = _plan(req, prompt_ids)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        sink = _Sink(asyncio.get_running_loop(), stream=bool(req.stream))
        job = Job(prompt_ids=list(prompt_ids), max_new_tokens=max_new, sampling=sampling, sink=sink,
                  stops=req.stop_list(), logprobs=req.logprobs_k, request_id=request_id)
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise APIError(503, f"The server is busy: {worker.max_queue} requests are already waiting. Retry later.",
                           type="server_error", code="server_busy",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except NotReady as exc:
            raise _not_ready(exc) from None
        meta = {"id": request_id, "created": int(time.time()), "model": current_model_id(),
                "system_fingerprint": SYSTEM_FINGERPRINT}
        if req.stream:
            make = _chat_stream if chat else _completion_stream
            return _JobStream(job, make(job, sink, meta, req.include_usage))
        end = await _wait_whole(request, job, sink)
        if end is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(end, Failed):
            if end.code == "invalid_request":
                raise invalid(end.message, "messages" if chat else "prompt")
            raise APIError(500 if end.code == "engine_error" else 503, end.message, type="server_error", code=end.code)
        text = "".join(sink.parts)
        usage = _usage(end)
        timings = timings_from_receipt(end.receipt, queue_s=end.queue_s)
        reason = _finish_reason(end)
        if chat:
            logprobs = _chat_logprobs(sink.logprobs) if req.logprobs_k is not None else None
            body = ChatCompletion(**meta, choices=[ChatChoice(message=ResponseMessage(content=text), logprobs=logprobs,
                                                              finish_reason=reason)],
                                  usage=usage, timings=timings)
        else:
            logprobs = _completion_logprobs(sink.logprobs, 0) if req.logprobs_k is not None else None
            body = Completion(**meta, choices=[CompletionChoice(text=text, logprobs=logprobs, finish_reason=reason)],
                              usage=usage, timings=timings)
        return JSONResponse(body.model_dump())

    return _wrap(app, api_key)


def _wrap(app: FastAPI, api_key: str | None) -> FastAPI:
    # Outermost first: CORS answers preflights before the key is checked and adds its header to
    # every answer, errors included.
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=False, allow_methods=["*"],
                       allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
    return app


def _require_ready(worker: Worker):
    if worker.state != "ready" or worker.tokenizer is None:
        raise _not_ready(NotReady(worker.state, worker.error or f"the model is {worker.state}"))
    return worker.tokenizer


def _not_ready(exc: NotReady) -> APIError:
    if exc.state == "loading":
        return APIError(503, "The model is still loading; retry shortly.", type="server_error",
                        code="model_loading", headers={"Retry-After": "5"})
    return APIError(503, f"The server cannot take requests: {exc}.", type="server_error", code="unavailable",
                    headers={"Retry-After": "10"})


def _finish_reason(end: Finished) -> str:
    return end.finish_reason if end.finish_reason in ("stop", "length") else "stop"


async def _wait_whole(request: Request, job: Job, sink: _Sink) -> Finished | Failed | None:
    """Wait for the end of a non-streaming job, cancelling it if the client disconnects."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({sink.future, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if sink.future in done:
            return sink.future.result()
        job.cancel()
        log.info("request %s: client disconnected", job.request_id)
        return None
    finally:
        watcher.cancel()
        job.cancel()


class _JobStream(StreamingResponse):
    """A server-sent event stream that cancels its job however the response ends (finished,
    client gone, server shutting down), without waiting for the generator to be collected."""

    def __init__(self, job: Job, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            await self.body_iterator.aclose()


def _error_event(event: Failed) -> str:
    return _sse({"error": {"message": event.message, "type": "server_error", "param": None, "code": event.code}})


async def _events(job: Job, sink: _Sink) -> AsyncIterator[Any]:
    """The worker's events up to the end; cancels the job if the stream is abandoned."""
    try:
        while True:
            event = await sink.queue.get()
            yield event
            if isinstance(event, (Finished, Failed)):
                return
    finally:
        job.cancel()


async def _chat_stream(job: Job, sink: _Sink, meta: dict, include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict[str, str], *, finish: str | None = None, logprobs=None, **extra) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        return _sse(ChatCompletionChunk(**meta, choices=[choice], **extra))

    wants_logprobs = job.logprobs is not None
    async for event in _events(job, sink):
        if isinstance(event, Started):
            yield chunk({"role": "assistant", "content": ""})
        elif isinstance(event, TextDelta):
            yield chunk({"content": event.text},
                        logprobs=_chat_logprobs(event.logprobs) if wants_logprobs else None)
        elif isinstance(event, Finished):
            usage, timings = _usage(event), timings_from_receipt(event.receipt, queue_s=event.queue_s)
            logprobs = _chat_logprobs(event.logprobs) if wants_logprobs and event.logprobs else None
            if include_usage:
                yield chunk({}, finish=_finish_reason(event), logprobs=logprobs)
                yield _sse(ChatCompletionChunk(**meta, choices=[], usage=usage, timings=timings))
            else:
                yield chunk({}, finish=_finish_reason(event), logprobs=logprobs, usage=usage, timings=timings)
            yield "data: [DONE]\n\n"
        elif isinstance(event, Failed):
            yield _error_event(event)
            yield "data: [DONE]\n\n"


async def _completion_stream(job: Job, sink: _Sink, meta: dict, include_usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, *, finish: str | None = None, logprobs=None, **extra) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish, logprobs=logprobs)
        # a completion's usage is an object when present (no nulls, unlike chat chunks)
        return _sse(_without_nulls(Completion(**meta, choices=[choice], **extra).model_dump(), "usage", "timings"))

    wants_logprobs = job.logprobs is not None
    offset = 0
    async for event in _events(job, sink):
        if isinstance(event, TextDelta):
            logprobs = _completion_logprobs(event.logprobs, offset) if wants_logprobs else None
            offset += sum(len(i.token) for i in event.logprobs)
            yield chunk(event.text, logprobs=logprobs)
        elif isinstance(event, Finished):
            usage, timings = _usage(event), timings_from_receipt(event.receipt, queue_s=event.queue_s)
            logprobs = _completion_logprobs(event.logprobs, offset) if wants_logprobs and event.logprobs else None
            if include_usage:
                yield chunk("", finish=_finish_reason(event), logprobs=logprobs)
                yield _sse(Completion(**meta, choices=[], usage=usage, timings=timings))
            else:
                yield chunk("", finish=_finish_reason(event), logprobs=logprobs, usage=usage, timings=timings)
            yield "data: [DONE]\n\n"
        elif isinstance(event, Failed):
            yield _error_event(event)
            yield "data: [DONE]\n\n"
