"""Anthropic's Messages API (POST /messages): translated into a chat request, answered in
Anthropic's shapes, whole or as its stream of named events; POST /messages/count_tokens counts
the prompt such a request would get.

Usage: the engine's prefix cache is automatic, so `cache_read_input_tokens` is the prompt tokens it
reused and `input_tokens` the rest (computed); `cache_creation_input_tokens` is always 0: nothing is
written to the cache on request, and no token is counted twice (Anthropic's total prompt is the sum
of the three)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from moestream.server.api_error import invalid
from moestream.server.chat_api import chat_prompt, start_chat
from moestream.server.generation import JobStream, Runtime, Submitted, events, wait_whole
from moestream.server.jobs import Failed, Finished, Started, TextDelta
from moestream.server.render import named_sse
from moestream.server.reply_blocks import TEXT, ReplyBlocks
from moestream.server.request_models import ChatCompletionRequest, parse_request, text_parts
from moestream.server.tools import ParsedCall


def _usage(end: Finished) -> dict:
    reused = min(end.prompt_tokens, int(end.receipt.get("reused_tokens", 0) or 0))
    return {"input_tokens": end.prompt_tokens - reused, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": reused, "output_tokens": end.completion_tokens}


def _text_of(content: Any, param: str) -> str:
    return text_parts(content, param, kinds=("text",), noun="blocks", refusal="Only text blocks are supported here.")


def to_chat(body: dict, *, generate: bool = True) -> dict:
    """The Messages request as an OpenAI chat request body (`generate` False: only its prompt
    counts, as count_tokens reads it, without max_tokens)."""
    if generate and (not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool)):
        raise invalid("max_tokens is required: an integer.", "max_tokens", code="missing_required_parameter")
    messages: list[dict] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_of(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list.", "messages")
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid("Each message needs role 'user' or 'assistant'.", f"{param}.role")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise invalid("content must be a string or a list of blocks.", f"{param}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            where = f"{param}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                result = block.get("content", "")
                messages.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                 "content": _text_of(result, f"{where}.content")})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # earlier reasoning sent back: templates leave it out of the history
            else:
                raise invalid(f"Unsupported content block {kind!r} in a {m['role']} message.", where)
        if texts or calls:
            message: dict = {"role": m["role"], "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    out: dict = {"messages": messages, "stream": bool(body.get("stream"))} if generate else {"messages": messages}
    if generate:
        out["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    tools = body.get("tools") or []
    if tools:
        out["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                          "parameters": t.get("input_schema") or {"type": "object"}}}
                        for t in tools if isinstance(t, dict)]
        choice = body.get("tool_choice") or {"type": "auto"}
        kind = choice.get("type") if isinstance(choice, dict) else None
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            mapped = {"type": "function", "function": {"name": choice.get("name")}}
        if mapped is None:
            raise invalid("tool_choice type must be auto, any, tool or none.", "tool_choice")
        out["tool_choice"] = mapped
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _stop_reason(end: Finished, has_calls: bool) -> tuple[str, Any]:
    # a reply cut by max_tokens says so even after a call: the last call may be cut too
    if end.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if end.stop_string is not None:
        return "stop_sequence", end.stop_string
    return "end_turn", None


def _event(kind: str, **payload: Any) -> str:
    return named_sse(kind, {"type": kind, **payload})


class ContentBlocks(ReplyBlocks):
    """The reply's content blocks (thinking, text, tool_use) and their stream events."""

    def __init__(self, sub: Submitted) -> None:
        super().__init__(sub)
        self.blocks: list[dict] = []

    def opened(self, kind: str) -> list[str]:
        self.blocks.append({"type": "text", "text": ""} if kind == TEXT else
                           {"type": "thinking", "thinking": "", "signature": ""})
        return [_event("content_block_start", index=len(self.blocks) - 1, content_block=self.blocks[-1])]

    def grew(self, kind: str, text: str) -> list[str]:
        delta = {"type": "text_delta", "text": text} if kind == TEXT else {"type": "thinking_delta", "thinking": text}
        return [_event("content_block_delta", index=len(self.blocks) - 1, delta=delta)]

    def closed(self, kind: str, text: str, end: Optional[Finished]) -> list[str]:
        self.blocks[-1]["text" if kind == TEXT else "thinking"] = text
        return [_event("content_block_stop", index=len(self.blocks) - 1)]

    def call(self, call: ParsedCall) -> list[str]:
        self.blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
        index = len(self.blocks) - 1
        return [_event("content_block_start", index=index,
                       content_block={"type": "tool_use", "id": call.id, "name": call.name, "input": {}}),
                _event("content_block_delta", index=index,
                       delta={"type": "input_json_delta", "partial_json": call.arguments}),
                _event("content_block_stop", index=index)]

    def message(self, end: Optional[Finished]) -> dict:
        """The Message: with what the reply holds so far, and its stop reason once it ended."""
        reason, sequence = _stop_reason(end, any(b["type"] == "tool_use" for b in self.blocks)) if end else (None, None)
        return {"id": "msg_" + self.sub.meta["id"].split("-", 1)[1], "type": "message", "role": "assistant",
                "model": self.sub.meta["model"], "content": self.blocks, "stop_reason": reason,
                "stop_sequence": sequence, "usage": _usage(end) if end else None}


def register(router: APIRouter, rt: Runtime) -> None:
    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        # (an APIError takes Anthropic's shape in the app's handler: this is a /messages route)
        req = parse_request(ChatCompletionRequest, to_chat(await rt.read_object(request), generate=False))
        prompt_ids, _ = await chat_prompt(rt, req)
        return JSONResponse({"input_tokens": len(prompt_ids)})

    @router.post("/messages")
    async def messages(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, to_chat(await rt.read_object(request)))
        sub = await start_chat(rt, request, req)
        if req.stream:
            return JobStream(sub.job, _stream(sub))
        end = await wait_whole(request, sub, "messages")
        if end is None:
            return Response(status_code=499)
        blocks = ContentBlocks(sub)
        blocks.read_whole(end)
        blocks.blocks = blocks.blocks or [{"type": "text", "text": ""}]
        return JSONResponse(blocks.message(end))


async def _stream(sub: Submitted) -> AsyncIterator[str]:
    blocks = ContentBlocks(sub)
    async for event in events(sub):
        if isinstance(event, Started):
            # the cache is consulted later, by the prefill: message_delta gives the final split
            yield _event("message_start", message={**blocks.message(None), "usage": {
                "input_tokens": len(sub.job.choices[0].prompt_ids), "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0, "output_tokens": 0}})
        elif isinstance(event, TextDelta):
            for text in blocks.feed(event.text, event.tokens):
                yield text
        elif isinstance(event, Finished):
            for text in blocks.finish(event):
                yield text
            done = blocks.message(event)
            yield _event("message_delta", delta={"stop_reason": done["stop_reason"],
                                                  "stop_sequence": done["stop_sequence"]}, usage=done["usage"])
            yield _event("message_stop")
        elif isinstance(event, Failed):
            yield _event("error", error={"type": "api_error", "message": event.message})
