"""OpenAI's Responses API (POST /responses), text in and text out: `input` as a string or a list
of messages, `instructions` as the system message; the answer whole or as its event stream
(response.created, output_text deltas, response.completed)."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from moestream.server.chat_api import start_chat
from moestream.server.generation import JobStream, Runtime, Submitted, events, wait_whole
from moestream.server.protocol import ChatCompletionRequest, invalid, parse_request
from moestream.server.render import named_sse
from moestream.server.worker import Failed, Finished, Started, TextDelta

ReadJSON = Callable[[Request], Awaitable[Any]]


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of parts.", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise invalid("Only text parts (input_text, output_text) are supported.", f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def to_chat(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_type")
    messages: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise invalid("instructions must be a string.", "instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if not isinstance(item, dict) or item.get("role") not in ("user", "assistant", "system", "developer"):
                raise invalid("Each input item must be a message with a role.", f"input[{i}]")
            messages.append({"role": item["role"], "content": _content_text(item.get("content"), f"input[{i}].content")})
    else:
        raise invalid("input must be a string or a non-empty list of messages.", "input",
                      code="missing_required_parameter" if given is None else "invalid_value")
    out: dict = {"messages": messages, "stream": bool(body.get("stream"))}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    return out


def _response(sub: Submitted, status: str, text: str | None, end: Finished | None, created: int) -> dict:
    message_id = "msg_" + sub.meta["id"].split("-", 1)[1]
    output = [] if text is None else [{
        "type": "message", "id": message_id, "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    usage = None
    if end is not None:
        cached = int(end.receipt.get("reused_tokens", 0) or 0)
        usage = {"input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": end.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": end.prompt_tokens + end.completion_tokens}
    incomplete = end is not None and end.finish_reason == "length"
    return {"id": "resp_" + sub.meta["id"].split("-", 1)[1], "object": "response", "created_at": created,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": sub.meta["model"], "output": output, "parallel_tool_calls": False, "tool_choice": "none",
            "tools": [], "error": None, "usage": usage}


def register(router: APIRouter, rt: Runtime, read_json: ReadJSON) -> None:
    @router.post("/responses")
    async def responses(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, to_chat(await read_json(request)))
        sub = await start_chat(rt, request, req)
        created = int(time.time())
        if req.stream:
            return JobStream(sub.job, _stream(sub, created))
        end = await wait_whole(request, sub, "input")
        if end is None:
            return Response(status_code=499)
        return JSONResponse(_response(sub, "completed", sub.sink.text(0), end, created))


async def _stream(sub: Submitted, created: int) -> AsyncIterator[str]:
    seq = 0
    parts: list[str] = []
    item_id = "msg_" + sub.meta["id"].split("-", 1)[1]

    def event(name: str, **payload: Any) -> str:
        nonlocal seq
        seq += 1
        return named_sse(name, {"type": name, "sequence_number": seq - 1, **payload})

    async for ev in events(sub):
        if isinstance(ev, Started):
            yield event("response.created", response=_response(sub, "in_progress", None, None, created))
            yield event("response.output_item.added", output_index=0, item={
                "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
            yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []})
        elif isinstance(ev, TextDelta):
            parts.append(ev.text)
            yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                        delta=ev.text, logprobs=[])
        elif isinstance(ev, Finished):
            text = "".join(parts)
            yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": text, "annotations": []})
            final = _response(sub, "completed", text, ev, created)
            yield event("response.output_item.done", output_index=0, item=final["output"][0])
            yield event("response.completed", response=final)
        elif isinstance(ev, Failed):
            yield event("response.failed", response={**_response(sub, "failed", None, None, created),
                                                     "error": {"code": ev.code, "message": ev.message}})
