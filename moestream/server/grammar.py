"""Constrained decoding with llguidance: JSON mode, JSON schemas and forced tool calls.

A grammar is compiled per request (on the HTTP side, so a bad schema is a 400 before anything is
queued); the worker's sampler calls a GrammarMask with the tokens generated so
far, and it sets every token the grammar does not allow next to -inf. When the grammar is complete
only the end-of-sequence token is allowed, so the engine stops there. Schemas are enforced with
their objects closed (closed_schema), and a forced call is finished within its token budget (closing).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import llguidance

from moestream.server.closed_schema import closed, rebased
from moestream.server.closing import Closing, ClosingVocab, unpack
from moestream.server.tools import CLOSE, OPEN, deepseek_marker

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """The grammar (or the schema it came from) cannot be compiled; the message says why."""


# compact JSON: free whitespace lets a weak model pad forever instead of finishing the object
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _styled(schema: dict) -> dict:
    return {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}


def json_object_grammar() -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(_styled({"type": "object"}))


def json_schema_grammar(schema: dict) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(_styled(closed(schema)))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be used: {exc}") from None


def _parameters(tool: dict) -> dict:
    """A tool's parameters as the grammar holds its arguments to (none given: no arguments)."""
    return closed(tool["function"].get("parameters") or {"type": "object", "properties": {}})


def _call_schema(tool: dict, at: str) -> dict:
    """The Hermes call object for `tool`, placed at JSON pointer `at` of the whole schema."""
    arguments = rebased(_parameters(tool), at + "/properties/arguments")
    return {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[dict], name: str, *, parallel: bool, fmt: str = "hermes",
                      token_id: Callable[[str], Optional[int]] = lambda _: None) -> tuple[str, str]:
    """One call (or several, when parallel and the format allows) to the named tool or ("*") any, in
    the model's own format where its markers are single tokens (`token_id` finds them), else in
    Hermes. Returns (the grammar, the format the call is written in)."""
    chosen = [t for t in tools if name == "*" or t["function"]["name"] == name]
    write = FORCED_CALLS.get(fmt)
    lark = write(chosen, parallel, token_id) if write else None
    if lark is None:
        fmt, lark = "hermes", _hermes_calls(chosen, parallel, token_id)
    return llguidance.LLMatcher.grammar_from_lark(lark), fmt


def _arguments_rules(chosen: list[dict]) -> str:
    """`args_i`: tool i's parameters as compact JSON."""
    return "".join(f"args_{i}: %json {json.dumps(_styled(_parameters(t)))}\n" for i, t in enumerate(chosen))


def _hermes_calls(chosen: list[dict], parallel: bool, token_id) -> str:
    schema = (_call_schema(chosen[0], "") if len(chosen) == 1 else
              {"anyOf": [_call_schema(t, f"/anyOf/{i}") for i, t in enumerate(chosen)]})
    repeat = "+" if parallel else ""
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE + chr(10))}\n"
            f"body: %json {json.dumps(_styled(schema))}\n")


def _specials(token_id, *markers: str) -> Optional[list[str]]:
    """The markers as llguidance token references, or None when one is not a single token."""
    ids = [token_id(m) for m in markers]
    return None if None in ids else [f"<[{i}]>" for i in ids]


def _harmony_calls(chosen: list[dict], parallel: bool, token_id) -> Optional[str]:
    """gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
    after the prompt's `<|start|>assistant`; `<|call|>` ends the turn, so one call."""
    marks = _specials(token_id, "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")
    if marks is None:
        return None
    channel, constrain, message, call = marks
    calls = "".join(f"call_{i}: {channel} {json.dumps('commentary to=functions.' + t['function']['name'] + ' ')} "
                    f"{constrain} \"json\" {message} args_{i} {call}\n" for i, t in enumerate(chosen))
    return f"start: {' | '.join(f'call_{i}' for i in range(len(chosen)))}\n" + calls + _arguments_rules(chosen)


def _deepseek_calls(chosen: list[dict], parallel: bool, token_id) -> Optional[str]:
    """DeepSeek-V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}
    \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""
    marks = _specials(token_id, *(deepseek_marker(w) for w in
                                  ("tool calls begin", "tool call begin", "tool sep", "tool call end", "tool calls end")))
    if marks is None:
        return None
    calls_begin, begin, sep, end, calls_end = marks
    calls = "".join(f"call_{i}: {begin} \"function\" {sep} {json.dumps(t['function']['name'] + chr(10) + '```json' + chr(10))} "
                    f"args_{i} {json.dumps(chr(10) + '```')} {end}\n" for i, t in enumerate(chosen))
    repeat = "+" if parallel else ""
    return (f"start: {calls_begin} call{repeat} {calls_end}\n"
            f"call: {' | '.join(f'call_{i}' for i in range(len(chosen)))}\n" + calls + _arguments_rules(chosen))


# Gemma 4 writes arguments in its own quoting, not JSON: its forced calls stay Hermes
FORCED_CALLS = {"hermes": _hermes_calls, "harmony": _harmony_calls, "deepseek": _deepseek_calls}


class GrammarTokenizer:
    """llguidance's view of the model's vocabulary, built once (about a second on a large one)."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], vocab_size: Optional[int] = None) -> None:
        backend = getattr(tokenizer, "backend", None)
        eos = sorted(eos_ids) or None
        if backend is not None:
            import llguidance.hf as from_hf  # (a plain `import llguidance.hf` would make llguidance local here)
            self.ll = from_hf.from_tokenizer(backend, n_vocab=vocab_size, eos_token=eos)
        elif hasattr(tokenizer, "token_bytes"):
            self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_BytesVocab(tokenizer, eos)),
                                             n_vocab=vocab_size, eos_token=eos)
        else:
            raise GrammarError("this model's tokenizer cannot be used for constrained decoding")
        self.vocab_size = self.ll.vocab_size
        self.eos = eos or []
        self._closing: Optional[ClosingVocab] = None

    def closing_vocab(self) -> ClosingVocab:
        """What forced calls' look-ahead needs of the vocabulary (built on first use)."""
        if self._closing is None:
            self._closing = ClosingVocab(self.ll, self.eos, [deepseek_marker("tool calls end")])
        return self._closing

    def matcher(self, grammar: str) -> "llguidance.LLMatcher":
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        if error and not error.startswith("WARNING"):
            raise GrammarError(error.splitlines()[0])
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().splitlines()[0])
        return matcher


class _BytesVocab:
    """A tokenizer that lists each token's bytes (token_bytes()), in the shape llguidance wraps."""

    def __init__(self, tokenizer: Any, eos: Optional[list[int]]) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = list(getattr(tokenizer, "special_token_ids", []))

    def __call__(self, text: bytes) -> list[int]:
        return list(self._tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False))


class GrammarMask:
    """The allowed-token mask: generated tokens -> a numpy bool array [V] of the tokens the grammar
    allows next. It follows the generated tokens itself (consuming new ones, rolling back on a
    shorter list), so it needs no other channel than what the sampler passes. With `closing`, a
    forced call's look-ahead, it allows only the way to finish the call once the budget runs short."""

    def __init__(self, matcher: "llguidance.LLMatcher", closing: Optional[Closing] = None) -> None:
        self._matcher = matcher
        self._closing = closing
        self._consumed = 0
        self._lock = threading.Lock()

    def __call__(self, generated: Sequence[int]) -> Any:
        with self._lock:
            if len(generated) < self._consumed:
                self._matcher.rollback(self._consumed - len(generated))
                self._consumed = len(generated)
                if self._closing is not None:
                    self._closing.rolled_back(self._consumed)
            new = list(generated[self._consumed:])
            if new and not self._matcher.consume_tokens(new):
                raise RuntimeError(f"the grammar refused a generated token: {self._matcher.get_error()}")
            if new and self._closing is not None:
                self._closing.consumed(new)
            self._consumed = len(generated)
            bits = self._matcher.compute_bitmask()
            allowed = unpack(bits, len(bits) * 8)  # tokens past its length: not allowed
            only = self._closing.only(self._matcher, allowed) if self._closing is not None else None
        if only is not None:
            allowed[:] = False
            allowed[only] = True
        return allowed
