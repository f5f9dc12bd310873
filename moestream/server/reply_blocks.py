"""A chat reply's parts as Anthropic's Messages and OpenAI's Responses answers list them: a run of
reasoning is one block, a run of text one block, each tool call a block of its own.

A subclass says what each block's stream events are and keeps the blocks it builds: `opened(kind)`,
`grew(kind, text)`, `closed(kind, text, end)` (`end`: the reply's end, where the block closes with
it) and `call(call)` each return their events. A whole answer is built by reading the choice's
deltas the same way, so whole and streamed answers always agree."""
from __future__ import annotations

from typing import Optional

from moestream.server.generation import Submitted
from moestream.server.jobs import Finished
from moestream.server.reasoning import Reasoning, ReplyReader
from moestream.server.tools import ParsedCall

REASONING, TEXT = "reasoning", "text"


class ReplyBlocks:
    def __init__(self, sub: Submitted) -> None:
        self.sub = sub
        self.reader = sub.reply_reader() or ReplyReader(None)
        self.open: Optional[str] = None  # the kind of the block now open (REASONING, TEXT)
        self.texts: list[str] = []  # the open block's text

    def feed(self, text: str, tokens: int) -> list[str]:
        return self.parts(self.reader.feed(text, tokens))

    def finish(self, end: Finished) -> list[str]:
        """The reply's end: what the reader held back, then the open block closed."""
        return self.parts(self.reader.finish()) + self.close(end)

    def read_whole(self, end: Finished) -> None:
        """A whole reply (its deltas as they came), into the blocks."""
        for text, tokens in self.sub.sink.deltas(0):
            self.feed(text, tokens)
        self.finish(end)

    def parts(self, parts: list) -> list[str]:
        out: list[str] = []
        for part in parts:
            if isinstance(part, ParsedCall):
                out += self.close() + self.call(part)
            elif isinstance(part, Reasoning):
                out += self.add(REASONING, part.text)
            elif part:
                out += self.add(TEXT, part)
        return out

    def add(self, kind: str, text: str) -> list[str]:
        out = self.close() if self.open not in (None, kind) else []
        if self.open is None:
            self.open, self.texts = kind, []
            out += self.opened(kind)
        self.texts.append(text)
        return out + self.grew(kind, text)

    def close(self, end: Optional[Finished] = None) -> list[str]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        return self.closed(kind, "".join(self.texts), end)
