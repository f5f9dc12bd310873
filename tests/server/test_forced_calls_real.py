"""Forced tool calls with an ordinary schema (no additionalProperties) on the real engine and a
tiny random-weight model, which left to itself writes a string until max_tokens: every forced form
(a named tool, "required", Anthropic's any and tool, the Responses API) returns a call that parses
and fits the schema, whole and streamed, with a generous or a tight max_tokens."""
from __future__ import annotations

import json

import pytest


pytest.importorskip("torch")
Engine = pytest.importorskip("moestream.engine.engine").Engine

pytestmark = pytest.mark.timeout(300)

MODEL_ID = "tiny-moe"
USER = [{"role": "user", "content": "Weather in Paris?"}]
ORDINARY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ORDINARY}},
         {"type": "function", "function": {"name": "get_time", "parameters": ORDINARY}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TIGHT = 75  # tokens: about what the shortest call takes in the tiny model's byte-level vocabulary


def _fits(name: str, arguments: str) -> None:
    assert name in ("get_weather", "get_time")
    value = json.loads(arguments)
    assert set(value) == {"city"} and isinstance(value["city"], str)


def _chat(sdk, stream: bool, **kw) -> tuple[str, str, str, int]:
    """(name, arguments, finish_reason, completion tokens) of a one-call reply."""
    kw = dict(model=MODEL_ID, messages=USER, tools=TOOLS, parallel_tool_calls=False, temperature=1.0, **kw)
    if not stream:
        out = sdk.chat.completions.create(**kw)
        (call,) = out.choices[0].message.tool_calls
        return call.function.name, call.function.arguments, out.choices[0].finish_reason, out.usage.completion_tokens
    name, arguments, reason, used = "", "", None, 0
    for chunk in sdk.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
            reason = choice.finish_reason or reason
        used = chunk.usage.completion_tokens if chunk.usage else used
    return name, arguments, reason, used


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [NAMED, "required"])
@pytest.mark.parametrize("max_tokens", [TIGHT, 160])
def test_a_forced_call_always_finishes(sdk, stream, choice, max_tokens):
    for seed in range(2):
        name, arguments, reason, used = _chat(sdk, stream, tool_choice=choice, max_tokens=max_tokens, seed=seed)
        assert reason == "tool_calls" and used < max_tokens
        _fits(name, arguments)
        if choice is NAMED:
            assert name == "get_weather"


def _sse(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
@pytest.mark.parametrize("max_tokens", [TIGHT, 160])
def test_anthropic_forced_tool_use(real, choice, max_tokens):
    body = {"model": MODEL_ID, "messages": USER, "max_tokens": max_tokens, "temperature": 1.0,
            "tools": [{"name": t["function"]["name"], "input_schema": ORDINARY} for t in TOOLS],
            "tool_choice": {**choice, "disable_parallel_tool_use": True}}
    with real.http(timeout=120) as http:
        whole = http.post("/v1/messages", json=body).json()
        assert whole["stop_reason"] == "tool_use" and whole["usage"]["output_tokens"] < max_tokens
        (block,) = [b for b in whole["content"] if b["type"] == "tool_use"]
        _fits(block["name"], json.dumps(block["input"]))
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            events = _sse(r)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    (tool,) = [b for b in starts if b["type"] == "tool_use"]
    _fits(tool["name"], partial)
    assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
    if choice["type"] == "tool":
        assert block["name"] == tool["name"] == "get_weather"


def test_responses_forced_function_call(sdk):
    out = sdk.responses.create(model=MODEL_ID, input=USER[0]["content"], max_output_tokens=TIGHT, temperature=1.0,
                               tools=[{"type": "function", "name": "get_weather", "parameters": ORDINARY}],
                               tool_choice="required", parallel_tool_calls=False)
    (call,) = [item for item in out.output if item.type == "function_call"]
    _fits(call.name, call.arguments)
