"""OpenAI's Responses API (POST /responses): `input` as a string or a list of items (messages,
function_call, function_call_output), `instructions` as the system message, function `tools` with
`tool_choice` and `parallel_tool_calls`, `text.format` as the response format; the answer whole
or as its event stream (response.created, output items, text and function-argument deltas,
response.completed). Translated into a chat request: the same template, grammar and queue."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from moestream.server.chat_api import start_chat
from moestream.server.generation import JobStream, Runtime, Submitted, events, wait_whole
from moestream.server.jobs import Failed, Finished, Started, TextDelta
from moestream.server.api_error import APIError, invalid, unsupported
from moestream.server.request_models import ChatCompletionRequest, parse_request, text_parts
from moestream.server.render import named_sse
from moestream.server.reply_blocks import REASONING, TEXT, ReplyBlocks
from moestream.server.tools import ParsedCall


def _content_text(content: Any, param: str) -> str:
    return text_parts(content, param, kinds=("input_text", "output_text", "text"), noun="parts",
                      refusal="Only text parts (input_text, output_text) are supported.")


def _input_messages(given: list, messages: list[dict]) -> None:
    for i, item in enumerate(given):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            messages.append({"role": item["role"], "content": _content_text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise invalid("A function_call item needs a name and arguments (a JSON string).", param)
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls of one turn stay in one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                             "content": _content_text(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning sent back: templates leave it out of the history
        else:
            raise invalid("Each input item must be a message with a role, a function_call, a "
                          "function_call_output or a reasoning item.", param)


def _tools(body: dict, out: dict) -> None:
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise invalid("tools must be a list.", "tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise unsupported("Only function tools are supported.", f"tools[{i}]")
        function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {"type": "object"}}
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        converted.append({"type": "function", "function": function})
    out["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                          '{"type": "function", "name": ...}.', "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]


def _text_format(body: dict, out: dict) -> None:
    text = body.get("text")
    if text is None:
        return
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise invalid("text.format must be an object.", "text.format")
    if fmt.get("type") == "json_schema":
        for name in ("name", "schema"):  # required here (Chat Completions defaults them; the Responses API does not)
            if fmt.get(name) is None:
                raise invalid(f"text.format of type 'json_schema' needs '{name}'.", f"text.format.{name}",
                              code="missing_required_parameter")
        schema = {name: fmt[name] for name in ("name", "description", "schema", "strict") if fmt.get(name) is not None}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        out["response_format"] = {"type": fmt.get("type")}


def to_chat(body: dict) -> dict:
    for name in ("previous_response_id", "conversation"):  # nothing is stored: a reply without them would mislead
        if body.get(name) is not None:
            raise unsupported(f"{name} is not supported (this server stores no responses): send the whole "
                              "conversation as input.", name)
    messages: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise invalid("instructions must be a string.", "instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        _input_messages(given, messages)
    else:
        raise invalid("input must be a string or a non-empty list of items.", "input",
                      code="missing_required_parameter" if given is None else "invalid_value")
    out: dict = {"messages": messages, "stream": bool(body.get("stream"))}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    _tools(body, out)
    _text_format(body, out)
    return out


def _tools_echo(req: ChatCompletionRequest) -> tuple[list[dict], Any]:
    """The request's tools and tool_choice as a Response object states them."""
    tools = [{"type": "function", "name": t.function.name, "description": t.function.description or None,
              "parameters": t.function.parameters, "strict": bool(getattr(t.function, "strict", None))}
             for t in req.tools]
    mode = req.tool_mode
    choice = {"type": "function", "name": req.forced_tool} if mode == "named" else (mode if req.tools else "none")
    return tools, choice


def _function_call(call: ParsedCall) -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.split("_", 1)[-1], "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning(item_id: str, text: str) -> dict:
    # an open model's own reasoning is its content; OpenAI's summaries are not made
    return {"type": "reasoning", "id": item_id, "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class OutputItems(ReplyBlocks):
    """The Response's output items (reasoning, message, function_call), the stream's events as they
    come (numbered), and the Response object at any point."""

    def __init__(self, sub: Submitted, req: ChatCompletionRequest, created: int) -> None:
        super().__init__(sub)
        self.req, self.created = req, created
        self.output: list[dict] = []  # the items done so far
        self.sequence = 0
        self.base_id = sub.meta["id"].split("-", 1)[1]

    def event(self, kind: str, **payload: Any) -> str:
        self.sequence += 1
        return named_sse(kind, {"type": kind, "sequence_number": self.sequence - 1, **payload})

    def item_id(self, kind: str) -> str:
        """The next item's id: the reply's id after the kind's prefix (msg_, rs_), and its position
        after the first item."""
        return ("rs_" if kind == REASONING else "msg_") + self.base_id + (f"_{len(self.output)}" if self.output else "")

    def opened(self, kind: str) -> list[str]:
        item_id, index = self.item_id(kind), len(self.output)
        if kind == REASONING:
            item = {"type": "reasoning", "id": item_id, "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                           part=part)]

    def grew(self, kind: str, text: str) -> list[str]:
        where = {"item_id": self.item_id(kind), "output_index": len(self.output), "content_index": 0}
        if kind == REASONING:
            return [self.event("response.reasoning_text.delta", **where, delta=text)]
        return [self.event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def closed(self, kind: str, text: str, end: Optional[Finished]) -> list[str]:
        item_id, index = self.item_id(kind), len(self.output)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if kind == REASONING:
            item = _reasoning(item_id, text)
            done = self.event("response.reasoning_text.done", **where, text=text)
        else:  # the message the limit cut is incomplete
            item = _message(item_id, text, "incomplete" if end and end.finish_reason == "length" else "completed")
            done = self.event("response.output_text.done", **where, text=text, logprobs=[])
        self.output.append(item)
        return [done, self.event("response.content_part.done", **where, part=item["content"][0]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: ParsedCall) -> list[str]:
        item, index = _function_call(call), len(self.output)
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=call.name, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=item)]

    def finish(self, end: Finished) -> list[str]:
        out = self.parts(self.reader.finish())
        if self.open != TEXT and all(item["type"] == "reasoning" for item in self.output):
            out += self.add(TEXT, "")  # an empty answer is still one (empty) message
        return out + self.close(end)

    def response(self, status: str, end: Optional[Finished] = None) -> dict:
        usage = None
        if end is not None:
            cached = int(end.receipt.get("reused_tokens", 0) or 0)
            usage = {"input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": end.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reader.reasoning_tokens},
                     "total_tokens": end.prompt_tokens + end.completion_tokens}
        incomplete = end is not None and end.finish_reason == "length"
        tools, choice = _tools_echo(self.req)
        return {"id": "resp_" + self.base_id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "model": self.sub.meta["model"], "output": self.output, "parallel_tool_calls": self.req.parallel_tool_calls,
                "tool_choice": choice, "tools": tools, "error": None, "usage": usage}


def _responses_param(param: str | None) -> str | None:
    """A chat field's name as the Responses request spells it (messages do not map one to one)."""
    if param is None:
        return None
    for chat, ours in (("max_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input")):
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours if chat == "messages" else ours + param[len(chat):]
    return param


def register(router: APIRouter, rt: Runtime) -> None:
    @router.post("/responses")
    async def responses(request: Request) -> Response:
        body = to_chat(await rt.read_object(request))
        try:
            req = parse_request(ChatCompletionRequest, body)
            sub = await start_chat(rt, request, req)
        except APIError as exc:
            renamed = _responses_param(exc.param)
            if renamed != exc.param:
                exc.message = exc.message.replace(f"'{exc.param}'", f"'{renamed}'")
                exc.param = renamed
            raise
        items = OutputItems(sub, req, int(time.time()))
        if req.stream:
            return JobStream(sub.job, _stream(sub, items))
        end = await wait_whole(request, sub, "input")
        if end is None:
            return Response(status_code=499)
        items.read_whole(end)
        return JSONResponse(items.response("completed", end))


async def _stream(sub: Submitted, items: OutputItems) -> AsyncIterator[str]:
    async for ev in events(sub):
        if isinstance(ev, Started):
            yield items.event("response.created", response=items.response("in_progress"))
            yield items.event("response.in_progress", response=items.response("in_progress"))
        elif isinstance(ev, TextDelta):
            for text in items.feed(ev.text, ev.tokens):
                yield text
        elif isinstance(ev, Finished):
            for text in items.finish(ev):
                yield text
            yield items.event("response.completed", response=items.response("completed", ev))
        elif isinstance(ev, Failed):
            yield items.event("response.failed", response={**items.response("failed"),
                                                           "error": {"code": ev.code, "message": ev.message}})
