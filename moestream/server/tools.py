"""Tool calling: the conversation as the chat template sees it, and tool calls read back from the
model's text.

Templates that know tools (they mention `tools` and `tool_calls`) get them as transformers passes
them: `tools=` and structured messages. For templates that do not, the tools are described in a
system message and earlier calls and results are written as text, in the Hermes format that
Qwen-style models use: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and
`<tool_response>...</tool_response>`. Replies are parsed in that format and in Mistral's
`[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`.
Pure Python: runs on the event loop, never imports torch.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_calls" in template  # type: ignore[operator]


def tool_schemas(tools: list[Any]) -> list[dict]:
    """The tools as JSON-able dicts in OpenAI's shape (what templates iterate over)."""
    return [t.model_dump(by_alias=True, exclude_none=True) if hasattr(t, "model_dump") else dict(t) for t in tools]


def system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to help with the user's request. The functions are listed "
            f"here:\n<tools>\n{listed}\n</tools>\n\nTo call a function, reply with a JSON object holding its "
            f"name and arguments inside {OPEN}{CLOSE} tags, one per call:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def as_text_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation for a template that knows only role and content."""
    out: list[dict] = []
    if tools:
        intro = system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + intro})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": intro})
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            # consecutive results go in one user turn, as Qwen's template does
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool_turn": True})
            continue
        content = m["content"]
        for call in m.get("tool_calls") or ():
            body = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
                              ensure_ascii=False)
            content += ("\n" if content else "") + f"{OPEN}\n{body}\n{CLOSE}"
        out.append({"role": m["role"], "content": content})
    return [{k: v for k, v in m.items() if k != "_tool_turn"} for m in out]


def _call_from_json(obj: Any) -> Optional[ParsedCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """(content before the calls, the calls) from a whole reply; no calls: (text, [])."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, [p for p in pieces if isinstance(p, ParsedCall)]


class ToolCallParser:
    """Incremental: feed text deltas, get back content strings and ParsedCalls in order. Text that
    could be the start of a call marker is held back until it cannot."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False  # inside <tool_call> ... </tool_call>
        self._mistral = False  # after [TOOL_CALLS]: the rest is a JSON list
        self.calls = 0

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._held += text
        out: list[str | ParsedCall] = []
        while True:
            if self._mistral:
                return out
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    return out
                body = self._held[:end]
                call = self._parse_one(body)
                self._held = self._held[end + len(CLOSE):].lstrip("\n")
                self._in_call = False
                out.append(call if call is not None else OPEN + body + CLOSE)  # not a call: it stays text
                continue
            starts = [(i, m) for m in (OPEN, MISTRAL) if (i := self._held.find(m)) >= 0]
            if starts:
                i, marker = min(starts)
                before = self._held[:i]
                if before and not (self.calls and not before.strip()):
                    out.append(before)
                self._held = self._held[i + len(marker):]
                if marker == OPEN:
                    self._in_call = True
                else:
                    self._mistral = True
                continue
            keep = _marker_prefix_length(self._held)
            ready = self._held[: len(self._held) - keep]
            if ready and not (self.calls and not ready.strip()):  # whitespace between calls is not content
                out.append(ready)
            self._held = self._held[len(ready):]
            return out

    def finish(self) -> list[str | ParsedCall]:
        """The end of the reply: an unclosed call or a Mistral list is parsed now; text held back
        (or a call that does not parse) is content."""
        held, self._held = self._held, ""
        if self._mistral:
            try:
                items = json.loads(held.strip())
            except ValueError:
                return [MISTRAL + held]
            calls = [c for c in (_call_from_json(i) for i in (items if isinstance(items, list) else [items])) if c]
            self.calls += len(calls)
            return calls if calls else [MISTRAL + held]  # type: ignore[return-value]
        if self._in_call:
            call = self._parse_one(held)
            return [call] if call is not None else [OPEN + held]
        return [held] if held and not (self.calls and not held.strip()) else []

    def _parse_one(self, body: str) -> Optional[ParsedCall]:
        try:
            call = _call_from_json(json.loads(body.strip()))
        except ValueError:
            call = None
        if call is not None:
            self.calls += 1
        return call


def _marker_prefix_length(text: str) -> int:
    for length in range(min(len(text), max(len(OPEN), len(MISTRAL)) - 1), 0, -1):
        tail = text[len(text) - length:]
        if OPEN.startswith(tail) or MISTRAL.startswith(tail):
            return length
    return 0
