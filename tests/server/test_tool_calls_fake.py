"""Tool calls parsed from a scripted reply (fake engine), through the official openai SDK: whole
and streamed, Hermes and Mistral formats, x-request-id, n choices."""
from __future__ import annotations

import json

import pytest

from conftest import MODEL_ID, live_server
from fake_engine import FakeEngine
from moestream.server.tools import ToolCallParser, as_text_messages
from tool_replies import parse_tool_calls

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "weather in Paris and Rome?"}]
HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted():
    engine = FakeEngine()
    with live_server(engine) as s:
        yield s, engine


def test_whole_reply_tool_calls(scripted):
    server, engine = scripted
    engine.script = HERMES
    with server.client() as client:
        out = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=400)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)


def test_streamed_tool_calls_match_whole(scripted):
    server, engine = scripted
    engine.script = HERMES
    with server.client() as client:
        chunks = list(client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=400,
                                                     stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me check."
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            if d.id:
                entry["id"] = d.id
            if d.function and d.function.name:
                entry["name"] += d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(calls[i]["id"] and calls[i]["name"] == "get_weather" for i in calls)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_keeps_text(scripted):
    server, engine = scripted
    engine.script = HERMES
    with server.client() as client:
        out = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, tool_choice="none",
                                             max_tokens=400)
    assert out.choices[0].message.content == HERMES and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


def test_history_with_tool_calls_renders(scripted):
    server, engine = scripted
    engine.script = "It is sunny."
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    with server.client() as client:
        out = client.chat.completions.create(model=MODEL_ID, messages=history, tools=TOOLS, max_tokens=50)
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].finish_reason == "stop"


def test_request_id_echoed_or_made(scripted):
    server, _ = scripted
    with server.http() as http:
        given = http.get("/v1/models", headers={"x-request-id": "my-trace-42"})
        made = http.get("/v1/models")
        refused = http.post("/v1/chat/completions", json={"messages": []}, headers={"x-request-id": "r-1"})
    assert given.headers["x-request-id"] == "my-trace-42"
    assert made.headers["x-request-id"].startswith("req_") and len(made.headers["x-request-id"]) > 8
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "r-1"


def test_n_choices_in_order(scripted):
    server, engine = scripted
    engine.script = None
    with server.client() as client:
        out = client.chat.completions.create(model=MODEL_ID, messages=USER, n=3, max_tokens=6, temperature=1, seed=7)
        one = client.chat.completions.create(model=MODEL_ID, messages=USER, n=1, max_tokens=6, temperature=1, seed=7)
        streamed = list(client.chat.completions.create(model=MODEL_ID, messages=USER, n=3, max_tokens=6,
                                                       temperature=1, seed=7, stream=True))
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.choices[0].message.content == one.choices[0].message.content  # choice 0 keeps the seed
    assert out.usage.completion_tokens == 18 and out.usage.prompt_tokens == one.usage.prompt_tokens
    texts = {i: "" for i in range(3)}
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in out.choices]


def test_parser_units():
    # markers split across deltas, Mistral's format, a call that does not parse stays text
    parser, out = ToolCallParser(), []
    for piece in ["Hi <tool", "_call>{\"name\": \"f\", \"argu", "ments\": {}}</tool_", "call>"]:
        out += parser.feed(piece)
    out += parser.finish()
    assert out[0] == "Hi " and out[1].name == "f" and out[1].arguments == "{}"
    content, calls = parse_tool_calls('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert content == "" and [c.name for c in calls] == ["a", "b"]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    rendered = as_text_messages([{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "", "tool_calls": [
                                     {"id": "1", "function": {"name": "f", "arguments": {"a": 1}}}]},
                                 {"role": "tool", "content": "r1", "tool_call_id": "1"},
                                 {"role": "tool", "content": "r2", "tool_call_id": "2"}], [TOOLS[0]])
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' in rendered[2]["content"]
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nr1\n</tool_response>\n"
                                                      "<tool_response>\nr2\n</tool_response>"}


HARMONY_REPLY = ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "Hello there!")


def test_harmony_reply_without_tools_is_the_final_channel(scripted):
    server, engine = scripted
    engine.script = HARMONY_REPLY
    engine.tokenizer.chat_template = "{{ tools }}{{ tool_calls }}<|start|>assistant<|channel|>final<|message|>"
    try:
        with server.client() as client:
            whole = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400)
            chunks = list(client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400, stream=True))
            raw = client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=400)
    finally:
        del engine.tokenizer.chat_template
    assert whole.choices[0].message.content == "Hello there!" and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there!"
    assert raw.choices[0].text == HARMONY_REPLY  # /completions stays raw
