"""What every API route shares: turning a validated request into a queued Job (sampling, n
choices, constraints), and waiting for or streaming its events. Runs on the event loop; plain data
only (the grammar's tensors are touched on the worker thread, inside the sampler)."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from moestream.engine.types import SamplingParams, TokenHistory
from moestream.server.jobs import Choice, Failed, Finished, Job, PromptLogprobs, TextDelta, TokenLogprobInfo
from moestream.server.api_error import APIError, invalid
from moestream.server.reasoning import ReasoningMode, ReplyReader
from moestream.server.worker import NotReady, QueueFull, Worker

log = logging.getLogger(__name__)

SYSTEM_FINGERPRINT = "moestream"
SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i of a seeded request samples with seed + i * stride


@dataclass(frozen=True)
class RequestDefaults:
    """Sampling settings for requests that leave a field out."""

    temperature: float = 0.2
    top_k: int = 64
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = None  # None: the rest of the context


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index`: choice 0 keeps the request's seed (n=1 and n>1 agree on it),
    the others get distinct ones derived from it, so every choice is reproducible on its own."""
    return (seed + index * SEED_STRIDE) % (2**64)


class Sink:
    """Hands the worker's events to the event loop. A streaming request gets every event; a whole
    one gets only the end, with each choice's text and logprobs joined on the worker's side."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.loop = loop
        self.stream = stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.future: asyncio.Future = loop.create_future()
        self.texts: dict[int, list[tuple[str, int]]] = {}  # each choice's deltas: (text, generated tokens)
        self.logprobs: dict[int, list[TokenLogprobInfo]] = {}
        self.prompts: dict[int, PromptLogprobs] = {}
        self.ends: dict[int, Finished] = {}

    def __call__(self, event: Any) -> None:  # worker thread
        if self.stream:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
            return
        if isinstance(event, PromptLogprobs):
            self.prompts[event.index] = event
        elif isinstance(event, TextDelta):
            self.texts.setdefault(event.index, []).append((event.text, event.tokens))
            self.logprobs.setdefault(event.index, []).extend(event.logprobs)
        elif isinstance(event, Finished):
            self.logprobs.setdefault(event.index, []).extend(event.logprobs)
            self.ends[event.index] = event
            if event.last:
                self.loop.call_soon_threadsafe(self._resolve, event)
        elif isinstance(event, Failed):
            self.loop.call_soon_threadsafe(self._resolve, event)

    def text(self, index: int) -> str:
        return "".join(text for text, _ in self.texts.get(index, ()))

    def choice_ends(self) -> list[Finished]:
        return [self.ends[i] for i in sorted(self.ends)]

    def deltas(self, index: int) -> list[tuple[str, int]]:
        """A choice's text as it came: (text, generated tokens) per delta."""
        return self.texts.get(index, [])

    def _resolve(self, event: Any) -> None:
        if not self.future.done():
            self.future.set_result(event)


@dataclass
class Submitted:
    job: Job
    sink: Sink
    meta: dict  # id, created, model, system_fingerprint
    choices: int
    reasoning: Optional[ReasoningMode] = None  # a chat reply's reasoning format, where it is split off
    parse_tools: str = ""  # the tool-call format a chat reply is read in ("": none)

    def reply_reader(self) -> Optional[ReplyReader]:
        """The reader of a chat reply's parts (a fresh one each call); None when its text is the content."""
        return ReplyReader(self.reasoning, self.parse_tools) if self.reasoning or self.parse_tools else None


class Runtime:
    """The worker plus the server's settings, as the API modules use them."""

    def __init__(self, worker: Worker, *, defaults: RequestDefaults, model_id: Callable[[], str],
                 context_limit: Callable[[], int], reasoning_format: str = "auto", max_body_bytes: int) -> None:
        self.worker = worker
        self.max_body_bytes = max_body_bytes
        self.reasoning_format = reasoning_format  # auto: reasoning apart from the content; none: left in it
        self.defaults = defaults
        self.model_id = model_id
        self.context_limit = context_limit
        self._grammar_tokenizer: Any = None
        self._grammar_lock = threading.Lock()

    def tokenizer(self):
        worker = self.worker
        if worker.state != "ready" or worker.tokenizer is None:
            raise not_ready(NotReady(worker.state, worker.error or f"the model is {worker.state}"))
        return worker.tokenizer

    async def read_object(self, request: Request) -> dict:
        """The request's body: a JSON object (no NaN or Infinity) of at most max_body_bytes."""
        too_large = APIError(413, f"The request body is larger than {self.max_body_bytes} bytes.",
                             code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_large
        if not body.strip():
            raise invalid("The request body is empty: send a JSON object.", code="invalid_json")

        def no_constants(name: str) -> Any:
            raise ValueError(f"{name} is not valid JSON")

        try:
            data = json.loads(bytes(body), parse_constant=no_constants)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise invalid(f"The request body is not valid JSON: {exc}.", code="invalid_json") from None
        if not isinstance(data, dict):
            raise invalid("The request body must be a JSON object.", code="invalid_type")
        return data

    # ---- prompts

    async def chat_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        from moestream.server.tools import as_text_messages, template_knows_tools

        tokenizer = self.tokenizer()
        needs_text = (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)) and \
            not template_knows_tools(tokenizer.chat_template)
        if needs_text:
            messages, tools = as_text_messages(messages, tools or []), None
        try:
            return await run_in_threadpool(tokenizer.chat_ids, messages, True, tools)
        except Exception as exc:  # the model's chat template refused the conversation
            raise invalid(f"The chat template could not format these messages: {exc}", "messages") from None

    def tool_format(self) -> str:
        """How this model writes tool calls (moestream.server.tools.FORMATS)."""
        from moestream.server.tools import tool_format

        packed = getattr(self.worker.engine, "packed", None)
        return tool_format(self.tokenizer().chat_template, getattr(packed, "family", None))

    def grammar_tokenizer(self) -> Any:
        """The model's vocabulary as llguidance reads it (each token's bytes), built once; raises
        GrammarError where the tokenizer offers no such view. Blocks: call it off the event loop."""
        from moestream.server.grammar import GrammarTokenizer

        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                raw = self.worker.engine.tokenizer
                args = getattr(self.worker.engine, "args", None)
                vocab = getattr(args, "vocab_size", None) or self.worker.tokenizer.vocab_size
                self._grammar_tokenizer = GrammarTokenizer(raw, raw.eos_token_ids, vocab)
            return self._grammar_tokenizer

    async def grammar_masks(self, grammar: str, param: str, *, closing: bool = False) -> Callable[[int], Any]:
        """Fresh allowed-token masks for `grammar` on this model's vocabulary, given a choice's token
        budget (`closing`: a forced call, finished within that budget); a 400 naming `param` if it
        cannot be compiled."""
        from moestream.server.closing import Closing
        from moestream.server.grammar import GrammarError, GrammarMask

        def build() -> Any:
            tokenizer = self.grammar_tokenizer()
            with self._grammar_lock:
                vocab = tokenizer.closing_vocab() if closing else None
            return tokenizer.matcher(grammar), vocab

        self.tokenizer()
        try:
            matcher, vocab = await run_in_threadpool(build)
        except GrammarError as exc:
            raise invalid(f"The {param} cannot be enforced: {exc}.", param) from None
        return lambda budget: GrammarMask(matcher.deep_copy(), Closing(vocab, budget) if vocab is not None else None)

    # ---- sampling and submission

    def plan(self, req: Any, prompt_ids: list[int], param: str) -> tuple[int, SamplingParams]:
        limit = self.context_limit()
        if not prompt_ids:
            raise invalid("The prompt is empty.", param)
        if len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(prompt_ids)} tokens and leaves no room for a reply.",
                           param=param, code="context_length_exceeded")
        room = limit - len(prompt_ids)
        d = self.defaults
        wanted = req.max_new_tokens if req.max_new_tokens is not None else d.max_tokens
        max_new = room if wanted is None else min(wanted, room)
        bias = req.bias_pairs()
        vocab = self.tokenizer().vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t, _ in bias):
            bad = next(t for t, _ in bias if not 0 <= t < vocab)
            raise invalid(f"logit_bias names token {bad}, outside the vocabulary (0..{vocab - 1}).", "logit_bias")
        top_k = d.top_k if req.top_k is None else req.top_k
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        sampling = SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_k=max(0, top_k),
            top_p=d.top_p if req.top_p is None else req.top_p,
            min_p=d.min_p if req.min_p is None else req.min_p,
            repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
            seed=seed % (2**64),
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            logit_bias=bias,
        )
        return max_new, sampling

    def submit(self, request: Request, choices: list[Choice], *, stream: bool, stops: list[str],
               logprobs: Optional[int], prefix: str) -> Submitted:
        request_id = prefix + uuid.uuid4().hex[:24]
        sink = Sink(asyncio.get_running_loop(), stream=stream)
        job = Job(choices=choices, sink=sink, stops=stops, logprobs=logprobs,
                  request_id=getattr(request.state, "request_id", "") or request_id)
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            raise APIError(503, f"The server is busy: {exc}. Retry later.", type="server_error", code="server_busy",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except NotReady as exc:
            raise not_ready(exc) from None
        meta = {"id": request_id, "created": int(time.time()), "model": self.model_id(),
                "system_fingerprint": SYSTEM_FINGERPRINT}
        return Submitted(job, sink, meta, len(choices))


def make_choices(prompts: list[list[int]], n: int, max_new: list[int], base: list[SamplingParams], *,
                 echo: bool = False, processor: Optional[Callable[[], Any]] = None) -> list[Choice]:
    """n choices per prompt, in order (prompt 0's n, then prompt 1's ...), each with its own seed
    and, when constrained, its own allowed-token mask (they keep state)."""
    out = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            extra: dict[str, Any] = {"seed": choice_seed(base[p].seed, i)}
            proc = processor() if processor is not None else None
            if proc is not None:
                extra["allowed_tokens"] = proc
            if proc is not None or base[p].frequency_penalty or base[p].presence_penalty:
                extra["history"] = TokenHistory()
            sampling = SamplingParams(**{**base[p].__dict__, **extra})
            out.append(Choice(list(ids), max_new[p], sampling, echo=echo))
    return out


def not_ready(exc: NotReady) -> APIError:
    if exc.state == "loading":
        return APIError(503, "The model is still loading; retry shortly.", type="server_error",
                        code="model_loading", headers={"Retry-After": "5"})
    return APIError(503, f"The server cannot take requests: {exc}.", type="server_error", code="unavailable",
                    headers={"Retry-After": "10"})


def failure(end: Failed, param: str) -> APIError:
    if end.code == "invalid_request":
        return invalid(end.message, param)
    return APIError(500 if end.code == "engine_error" else 503, end.message, type="server_error", code=end.code)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_whole(request: Request, sub: Submitted, param: str) -> Optional[Finished]:
    """Wait for the end of a non-streaming job (None if the client left; it is cancelled);
    a failure becomes an APIError."""
    job, sink = sub.job, sub.sink
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({sink.future, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if sink.future not in done:
            job.cancel()
            log.info("request %s: client disconnected", job.request_id)
            return None
        end = sink.future.result()
        if isinstance(end, Failed):
            raise failure(end, param)
        return end
    finally:
        watcher.cancel()
        job.cancel()


async def events(sub: Submitted) -> AsyncIterator[Any]:
    """The worker's events up to the end; cancels the job if the stream is abandoned."""
    try:
        while True:
            event = await sub.sink.queue.get()
            yield event
            if isinstance(event, Failed) or (isinstance(event, Finished) and event.last):
                return
    finally:
        sub.job.cancel()


class JobStream(StreamingResponse):
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


def finish_reason(end: Finished) -> str:
    return end.finish_reason if end.finish_reason in ("stop", "length") else "stop"
