"""Incremental detokenization that never splits a UTF-8 character."""
from __future__ import annotations


class IncrementalDecoder:
    """Feed token ids; get back only text that is final (no dangling partial character)."""

    def __init__(self, decode):
        self._decode = decode
        self._ids: list[int] = []
        self._emitted = 0  # characters of the full decoded text already handed out

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte sequence: wait for the next token
            return ""
        new, self._emitted = text[self._emitted:], len(text)
        return new

    def flush(self) -> str:
        text = self._decode(self._ids)
        new, self._emitted = text[self._emitted:], len(text)
        return new
