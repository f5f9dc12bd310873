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
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

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


def _named_call(name: str, arguments: Any) -> Optional[ParsedCall]:
    """A call from a name and its arguments (an object, or JSON text of one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return _call_from_json({"name": name, "arguments": arguments}) if name else None


Parts = list  # of str (content) and ParsedCall, in reply order


def _read_json_call(body: str, *, listed: bool = False) -> Optional[Parts]:
    """A call as a JSON object (`listed`: or a list of them, as Mistral writes them)."""
    try:
        items = json.loads(body.strip())
    except ValueError:
        return None
    calls = [c for c in map(_call_from_json, items if listed and isinstance(items, list) else [items]) if c]
    return calls or None  # type: ignore[return-value]


HARMONY_MESSAGE = "<|message|>"


def harmony_words(header: str) -> list[str]:
    """A gpt-oss message header's words (`<|start|>assistant<|channel|>analysis` -> assistant, analysis)."""
    for mark in ("<|start|>", "<|channel|>", "<|constrain|>"):
        header = header.replace(mark, " ")
    return header.split()


def addressed(words: list[str]) -> bool:
    """Whether a harmony message goes to a tool (`to=functions.NAME`)."""
    return any(w.startswith("to=") for w in words)


def _read_harmony(body: str) -> Optional[Parts]:
    """One gpt-oss message after `<|start|>` or `<|channel|>`: a call when addressed to
    `functions.NAME`, content on the final channel (and commentary preambles), nothing for analysis."""
    header, sep, message = body.partition(HARMONY_MESSAGE)
    if not sep:
        return None
    words = harmony_words(header)
    recipient = next((w[3:] for w in words if w.startswith("to=")), "")
    if recipient:
        name = recipient.removeprefix("functions.")
        call = _named_call(name, message.strip()) if name != recipient else None
        return [call] if call else None
    if "analysis" in words:
        return []  # reasoning: not part of the reply's content
    if "final" in words or "commentary" in words:
        return [message]
    return None


def _harmony_streams(header: str) -> bool:
    words = harmony_words(header)
    return ("final" in words or "commentary" in words) and not addressed(words)


def deepseek_marker(word: str) -> str:
    return "<\uff5c" + word.replace(" ", "\u2581") + "\uff5c>"  # DeepSeek's full-width bars and joiners


DEEPSEEK_SEP = deepseek_marker("tool sep")


def _read_deepseek(body: str) -> Optional[Parts]:
    """DeepSeek-V3: `function<sep>NAME\n```json\n{...}\n````; V3.1 writes `NAME<sep>{...}`."""
    kind, sep, rest = body.partition(DEEPSEEK_SEP)
    if not sep:
        return None
    name, newline, arguments = rest.partition("\n")
    fenced = arguments.strip()
    if newline and fenced.startswith("```") and fenced.endswith("```"):
        fenced = fenced[3:-3]
        call = _named_call(name.strip(), fenced[4:] if fenced.startswith("json") else fenced)
    else:
        call = _named_call(kind.strip(), rest.strip())
    return [call] if call else None


GEMMA_QUOTE = '<|"|>'
_BARE_WORD = re.compile(r"[A-Za-z_][\w.-]*")


def _gemma_arguments(text: str) -> Any:
    """Gemma 4 writes arguments with bare keys and strings between <|"|> marks: JSON made of it."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith(GEMMA_QUOTE, i):
            end = text.find(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
            if end < 0:
                raise ValueError("unclosed string")
            out.append(json.dumps(text[i + len(GEMMA_QUOTE):end], ensure_ascii=False))
            i = end + len(GEMMA_QUOTE)
        elif (word := _BARE_WORD.match(text, i)) and not (out and out[-1][-1:].isdigit()):
            i = word.end()
            is_key = text[i:].lstrip().startswith(":")
            out.append(json.dumps(word.group()) if is_key else word.group())
        else:
            out.append(text[i])
            i += 1
    return json.loads("".join(out))


def _read_gemma(body: str) -> Optional[Parts]:
    """Gemma 4: `call:NAME{key:<|"|>text<|"|>,n:1}`."""
    body = body.strip()
    if not body.startswith("call:") or "{" not in body:
        return None
    name, brace, rest = body[len("call:"):].partition("{")
    try:
        arguments = _gemma_arguments(brace + rest)
    except ValueError:
        return None
    call = _named_call(name.strip(), arguments) if isinstance(arguments, dict) else None
    return [call] if call else None


@dataclass(frozen=True)
class Span:
    """A stretch of the reply between `open` and one of `close` (none: it runs to the end), read
    into parts; a read that fails leaves the stretch as text."""
    open: str
    close: tuple[str, ...]
    read: Callable[[str], Optional[Parts]]
    streams: Optional[Callable[[str], bool]] = None  # header -> the body is content, sent as it comes


@dataclass(frozen=True)
class ToolFormat:
    spans: tuple[Span, ...]
    dropped: tuple[str, ...] = ()  # markers that only group calls


HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
FORMATS = {
    "hermes": ToolFormat((Span(OPEN, (CLOSE,), _read_json_call),
                          Span(MISTRAL, (), lambda body: _read_json_call(body, listed=True)))),
    "harmony": ToolFormat((Span("<|start|>", HARMONY_ENDS, _read_harmony, _harmony_streams),
                           Span("<|channel|>", HARMONY_ENDS, _read_harmony, _harmony_streams))),
    "deepseek": ToolFormat((Span(deepseek_marker("tool call begin"), (deepseek_marker("tool call end"),), _read_deepseek),),
                           (deepseek_marker("tool calls begin"), deepseek_marker("tool calls end"))),
    "gemma": ToolFormat((Span("<|tool_call>", ("<tool_call|>",), _read_gemma),)),
}
FAMILY_FORMATS = {"gpt_oss": "harmony", "deepseek_v3": "deepseek", "gemma4": "gemma", "gemma4_text": "gemma"}


def tool_format(template: str | None, family: str | None = None) -> str:
    """The format this model writes tool calls in: read off its chat template's markers, else its
    family; Hermes (and Mistral) when the template does not know tools, since then the tools are
    described to the model in the Hermes format."""
    if not template_knows_tools(template):
        return "hermes"
    for marker, name in (("<|channel|>", "harmony"), (deepseek_marker("tool call begin"), "deepseek"),
                         ("<|tool_call>", "gemma")):
        if marker in template:  # type: ignore[operator]
            return name
    return FAMILY_FORMATS.get(family or "", "hermes")


class ToolCallParser:
    """Incremental: feed text deltas, get back content strings and ParsedCalls in order. Text that
    could be the start of a marker is held back until it cannot, so any split of the reply gives the
    same parts as the whole."""

    def __init__(self, fmt: str | bool = "hermes") -> None:
        self.format = FORMATS[fmt if isinstance(fmt, str) and fmt else "hermes"]
        self._markers = tuple(s.open for s in self.format.spans) + self.format.dropped
        self._held = ""
        self._span: Optional[Span] = None  # inside this span
        self._streaming = False  # inside a span whose body is content
        self.calls = 0

    def _text(self, text: str, out: Parts) -> None:
        if text and not (self.calls and not text.strip()):  # whitespace between calls is not content
            out.append(text)

    def _close(self, parts: Optional[Parts], raw: str, out: Parts) -> None:
        for part in parts if parts is not None else [raw]:
            if isinstance(part, ParsedCall):
                self.calls += 1
                out.append(part)
            else:
                self._text(part, out)

    def feed(self, text: str) -> Parts:
        self._held += text
        out: Parts = []
        while True:
            span = self._span
            if span is not None:
                if not span.close:
                    return out
                ends = earliest(self._held, span.close)
                if self._streaming:
                    if not ends:
                        ready = self._held[:releasable(self._held, span.close)]
                        self._held = self._held[len(ready):]
                        self._text(ready, out)
                        return out
                    end, marker = ends
                    self._text(self._held[:end], out)
                elif not ends:
                    if span.streams and HARMONY_MESSAGE in self._held:
                        header, _, body = self._held.partition(HARMONY_MESSAGE)
                        if span.streams(header):
                            self._held, self._streaming = body, True
                            continue
                    return out
                else:
                    end, marker = ends
                    body = self._held[:end]
                    self._close(span.read(body), span.open + body + marker, out)
                self._held = self._held[end + len(marker):]
                self._span, self._streaming = None, False
                continue
            starts = earliest(self._held, self._markers)
            if starts:
                i, marker = starts
                self._text(self._held[:i], out)
                self._held = self._held[i + len(marker):]
                self._span = next((s for s in self.format.spans if s.open == marker), None)
                continue
            ready = self._held[:releasable(self._held, self._markers)]
            if self.calls and not ready.strip():
                return out  # maybe whitespace before the next call: decided when more comes
            self._text(ready, out)
            self._held = self._held[len(ready):]
            return out

    def finish(self) -> Parts:
        """The end of the reply: an unclosed span is read now (the stop token that ends it is not
        part of the text); text held back, or a span that does not read, is content."""
        held, span, streaming = self._held, self._span, self._streaming
        self._held, self._span, self._streaming = "", None, False
        out: Parts = []
        if span is None or streaming:
            self._text(held, out)
        else:
            self._close(span.read(held), span.open + held, out)
        return out


def earliest(text: str, markers: tuple[str, ...]) -> Optional[tuple[int, str]]:
    """(where, which) of the first of `markers` in `text`, or None."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else None


def releasable(text: str, markers: tuple[str, ...]) -> int:
    """How much of `text` can go now: all but an end that could begin one of `markers`."""
    for length in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[len(text) - length:]
        if any(m.startswith(tail) for m in markers):
            return len(text) - length
    return len(text)
