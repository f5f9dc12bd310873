"""A whole reply's content and tool calls, for tests of the streaming tool-call parser."""
from __future__ import annotations

from moestream.server.tools import ParsedCall, ToolCallParser


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[ParsedCall]]:
    """(the reply's content, the calls) from a whole reply; no calls: (text, [])."""
    parser = ToolCallParser(fmt)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, [p for p in pieces if isinstance(p, ParsedCall)]
