"""A reply's reasoning, apart from its answer.

Two formats, chosen by the model (its chat template, else its family), never by the request:

- think: a `<think>...</think>` block at the reply's start (Qwen3, DeepSeek-R1 and V3.1, GLM-4.5,
  MiniMax-M2, Kimi). A template may open the block in its generation prompt (the rendered prompt
  ends in `<think>`), so the reply starts inside it and writes only the closing tag.
- harmony: gpt-oss's messages on the analysis channel are reasoning; every other message (final,
  commentary, calls) passes on untouched to the tool-call reader, which reads the final channel as
  the content.

`ReplyReader` splits the reasoning off first, then reads tool calls in what is left, so a call
after the reasoning is still a call. Deltas are read as they come: text that could be the start of
a tag is held back until it cannot, so any split of the reply gives the same parts as the whole.
Pure Python: runs on the event loop, never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from starlette.concurrency import run_in_threadpool

from moestream.server.tools import (HARMONY_ENDS, HARMONY_MESSAGE, ParsedCall, ToolCallParser, addressed, earliest,
                                   harmony_words, releasable)

FORMATS = ("auto", "none")  # the server's --reasoning-format: split the reasoning off, or leave it in
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# families whose models write a think block, for templates that do not show the tags
THINK_FAMILIES = frozenset({"qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite",
                            "minimax_m2", "kimi_k25"})
HARMONY_OPENS = ("<|start|>", "<|channel|>")
PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to see whether it opens a think block


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ReasoningMode:
    format: str  # "think" or "harmony"
    inside: bool = False  # the prompt opened the think block: the reply starts in it


Parts = list  # of Reasoning, str (content) and ParsedCall, in reply order
Piece = Union[Reasoning, str]


def reasoning_format(template: Optional[str], family: Optional[str], tool_format: str) -> str:
    """The format this model reasons in ("think", "harmony"), or "" for none."""
    if tool_format == "harmony":  # the channels are read together with the calls
        return "harmony"
    if template and (THINK_OPEN in template or THINK_CLOSE in template):
        return "think"
    return "think" if family in THINK_FAMILIES else ""


def opens_think(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside a think block (`...<think>\\n`, not `<think></think>`)."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


async def reasoning_mode(rt: Any, prompt_ids: list[int], *, constrained: bool) -> Optional[ReasoningMode]:
    """How a chat reply to `prompt_ids` is split (rt: the server's Runtime); None: not at all. A
    grammar decides the reply from its first token, so a constrained reply has no open think block."""
    if rt.reasoning_format == "none":
        return None
    tokenizer = rt.tokenizer()
    family = getattr(getattr(rt.worker.engine, "packed", None), "family", None)
    fmt = reasoning_format(tokenizer.chat_template, family, rt.tool_format())
    if fmt != "think" or constrained:
        return ReasoningMode(fmt) if fmt else None
    tail = await run_in_threadpool(tokenizer.decode, prompt_ids[-PROMPT_TAIL_TOKENS:])
    return ReasoningMode("think", opens_think(tail))


class _Splitter:
    """Held text and the reasoning's spans, as offsets into everything fed (tokens are counted by them)."""

    def __init__(self) -> None:
        self.held = ""
        self.base = 0  # the offset of held[0]
        self.spans: list[list] = []  # [start, end or None while open]

    def consume(self, n: int) -> str:
        taken, self.held = self.held[:n], self.held[n:]
        self.base += n
        return taken

    def open_span(self, at: int) -> None:
        self.spans.append([self.base + at, None])

    def close_span(self, at: int) -> None:
        self.spans[-1][1] = self.base + at


class ThinkSplitter(_Splitter):
    """`<think>reasoning</think>content`. The tag counts only at the reply's start (after any
    whitespace): a reply that talks about the tag later is content. Whitespace around the reasoning
    and between it and the content is dropped."""

    def __init__(self, inside: bool = False) -> None:
        super().__init__()
        self.state = "reasoning" if inside else "start"
        self.leading = True  # the reasoning's leading whitespace is still to drop
        if inside:
            self.open_span(0)

    def feed(self, text: str) -> list[Piece]:
        self.held += text
        out: list[Piece] = []
        while self.held:
            if self.state == "start":
                rest = self.held.lstrip()
                if rest.startswith(THINK_OPEN):
                    at = len(self.held) - len(rest)
                    self.open_span(at)
                    self.consume(at + len(THINK_OPEN))
                    self.state = "reasoning"
                elif THINK_OPEN.startswith(rest):
                    break  # whitespace, or the tag's start so far
                else:
                    self.state = "content"
            elif self.state == "content":
                out.append(self.consume(len(self.held)))
            elif self.state == "after":  # the whitespace between the reasoning and the content
                rest = self.held.lstrip()
                self.consume(len(self.held) - len(rest))
                if rest:
                    self.state = "content"
            else:
                if self.leading:
                    rest = self.held.lstrip()
                    self.consume(len(self.held) - len(rest))
                    if not rest:
                        break
                    self.leading = False
                end = self.held.find(THINK_CLOSE)
                if end >= 0:
                    _reasoning(out, self.held[:end].rstrip())
                    self.close_span(end + len(THINK_CLOSE))
                    self.consume(end + len(THINK_CLOSE))
                    self.state = "after"
                    continue
                ready = self.held[:releasable(self.held, (THINK_CLOSE,))]
                # trailing whitespace waits: it is dropped if the closing tag follows
                _reasoning(out, self.consume(len(ready.rstrip())))
                break
        return out

    def finish(self) -> list[Piece]:
        """The end of the reply: an unclosed block is all reasoning."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return [Reasoning(held.rstrip())] if held.strip() else []
        if self.state == "after":
            return []
        return [held] if held else []


class HarmonySplitter(_Splitter):
    """gpt-oss: `<|channel|>analysis<|message|>reasoning<|end|>` (or after `<|start|>assistant`)
    is reasoning; anything else, markup included, passes on as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "scan"  # scan | header | analysis

    def feed(self, text: str) -> list[Piece]:
        self.held += text
        out: list[Piece] = []
        while self.held:
            if self.state == "scan":
                start = earliest(self.held, HARMONY_OPENS)
                if start:
                    _content(out, self.consume(start[0]))
                    self.state = "header"
                    continue
                _content(out, self.consume(releasable(self.held, HARMONY_OPENS)))
                break
            if self.state == "header":
                end = self.held.find(HARMONY_MESSAGE)
                if end < 0:
                    break
                words = harmony_words(self.held[:end])
                if "analysis" in words and not addressed(words):  # reasoning: the analysis channel, to no tool
                    self.open_span(0)
                    self.consume(end + len(HARMONY_MESSAGE))
                    self.state = "analysis"
                else:
                    _content(out, self.consume(end + len(HARMONY_MESSAGE)))
                    self.state = "scan"
                continue
            ends = earliest(self.held, HARMONY_ENDS)
            if ends:
                end, marker = ends
                _reasoning(out, self.consume(end))
                self.close_span(len(marker))
                self.consume(len(marker))
                self.state = "scan"
                continue
            _reasoning(out, self.consume(releasable(self.held, HARMONY_ENDS)))
            break
        return out

    def finish(self) -> list[Piece]:
        """The end of the reply (the stop token that ends a message is not part of the text)."""
        held, state = self.held, self.state
        self.held, self.state = "", "scan"
        if not held:
            return []
        return [Reasoning(held)] if state == "analysis" else [held]


def _reasoning(out: list[Piece], text: str) -> None:
    if text:
        out.append(Reasoning(text))


def _content(out: list[Piece], text: str) -> None:
    if text:
        out.append(text)


class ReplyReader:
    """A reply's parts in order: Reasoning, content text and ParsedCalls. `tools` is the tool-call
    format to read the content in ("" for none)."""

    def __init__(self, mode: Optional[ReasoningMode], tools: str = "") -> None:
        self.splitter: Optional[_Splitter] = None
        if mode is not None:
            self.splitter = HarmonySplitter() if mode.format == "harmony" else ThinkSplitter(mode.inside)
        self.tools = ToolCallParser(tools) if tools else None
        self._deltas: list[tuple[int, int]] = []  # (offset, generated tokens) of each delta
        self._fed = 0

    def feed(self, text: str, tokens: int = 0) -> Parts:
        self._deltas.append((self._fed, tokens))
        self._fed += len(text)
        return self._read(self.splitter.feed(text) if self.splitter else [text])

    def finish(self) -> Parts:
        out = self._read(self.splitter.finish() if self.splitter else [])
        return out + (self.tools.finish() if self.tools else [])

    def read(self, deltas: list[tuple[str, int]]) -> Parts:
        """A whole reply, delta by delta as it came (so whole and streamed read the same)."""
        out: Parts = []
        for text, tokens in deltas:
            out += self.feed(text, tokens)
        return out + self.finish()

    def _read(self, pieces: list[Piece]) -> Parts:
        out: Parts = []
        for piece in pieces:
            if isinstance(piece, Reasoning) or self.tools is None:
                out.append(piece)
            else:
                out += self.tools.feed(piece)
        return out

    @property
    def reasoning_tokens(self) -> int:
        """Generated tokens of the reasoning, its tags included: those of each delta that starts in it."""
        spans = self.splitter.spans if self.splitter else []
        return sum(tokens for at, tokens in self._deltas
                   if any(start <= at and (end is None or at < end) for start, end in spans))


def split_reply(parts: Parts) -> tuple[str, str, list[ParsedCall]]:
    """(reasoning, content, calls) of a whole reply's parts."""
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    content = "".join(p for p in parts if isinstance(p, str))
    return reasoning, content, [p for p in parts if isinstance(p, ParsedCall)]
