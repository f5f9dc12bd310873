"""The official SDKs on the real engine and a tiny packed model, for what agents and structured-
output clients send: Responses API tools (whole, streamed, the function_call_output round trip)
and text.format; the openai SDK's own parse helpers; Anthropic tool_use / tool_result round
trips, streamed tool input, a named tool, content blocks; request ids."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ConfigDict, Field


pytest.importorskip("torch")
Engine = pytest.importorskip("moestream.engine.engine").Engine

pytestmark = pytest.mark.timeout(300)

MODEL_ID = "tiny-moe"
QUESTION = "Look up entry 7 of set a."
LOOKUP_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "tag": {"type": "string", "enum": ["a", "b"]}},
                 "required": ["n", "tag"], "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", "name": "lookup", "description": "find an entry", "parameters": LOOKUP_SCHEMA,
                    "strict": True},
                   {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}]
ANTHROPIC_TOOLS = [{"name": "lookup", "description": "find an entry", "input_schema": LOOKUP_SCHEMA}]


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool
    score: int = Field(ge=0, le=9)  # bounded: a random model may otherwise write digits until max_tokens


def valid_lookup(arguments: dict) -> bool:
    return set(arguments) == {"n", "tag"} and isinstance(arguments["n"], int) and arguments["tag"] in ("a", "b")


@pytest.fixture(scope="module")
def claude(real):
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=real.url, api_key="unused", max_retries=0) as c:
        yield c


# ------------------------------------------------------------------------------------ Responses

def test_responses_required_tool_call(sdk):
    out = sdk.responses.create(model=MODEL_ID, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
                               parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("lookup", "noop") and calls[0].call_id.startswith("call_")
    args = json.loads(calls[0].arguments)
    assert valid_lookup(args) if calls[0].name == "lookup" else args == {}
    assert out.status == "completed" and out.tool_choice == "required" and not out.parallel_tool_calls
    assert [t.name for t in out.tools] == ["lookup", "noop"]


@pytest.mark.parametrize("one_call", [True, False])
def test_responses_named_tool_streamed_equals_whole(sdk, one_call):
    # parallel calls from a random model go on until max_output_tokens cuts one: the items keep
    # their order (the cut call stays text, last), whole and streamed alike
    kw = dict(model=MODEL_ID, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "lookup"},
              parallel_tool_calls=not one_call, max_output_tokens=200, temperature=0)
    whole = sdk.responses.create(**kw)
    call = [item for item in whole.output if item.type == "function_call"][0]
    assert whole.output[0] == call and call.name == "lookup" and valid_lookup(json.loads(call.arguments))
    assert whole.status == ("completed" if one_call else "incomplete")
    events = list(sdk.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    calls = [i.arguments for i in whole.output if i.type == "function_call"]
    assert deltas == "".join(done) and done == calls
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [a.name for a in added] == ["lookup"] * len(calls)
    final = events[-1].response
    assert [(i.type, getattr(i, "arguments", None), getattr(i, "content", None)) for i in final.output] == \
        [(i.type, getattr(i, "arguments", None), getattr(i, "content", None)) for i in whole.output]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_call_output_round_trip(sdk, real):
    first = sdk.responses.create(model=MODEL_ID, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    history = [{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"value": 42}'}]
    second = sdk.responses.create(model=MODEL_ID, input=history, tools=RESPONSES_TOOLS, tool_choice="none",
                                  max_output_tokens=8, temperature=0)
    assert [item.type for item in second.output] == ["message"] and second.usage.output_tokens == 8
    # the same turn through chat: the same prompt and reply
    chat = sdk.chat.completions.create(
        model=MODEL_ID, max_tokens=8, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                 "parameters": t["parameters"], "strict": t.get("strict")}}
               for t in RESPONSES_TOOLS],
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                      "name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": '{"value": 42}'}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # the tool result is in the prompt: a different result gives a different prompt
    other = sdk.responses.create(model=MODEL_ID, input=history[:2] + [{**history[2], "output": "no such entry, sorry"}],
                                 tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=1, temperature=0)
    assert other.usage.input_tokens != second.usage.input_tokens


def test_responses_parse_text_format(sdk):
    for seed in range(2):
        out = sdk.responses.parse(model=MODEL_ID, input="Judge this.", text_format=Verdict, max_output_tokens=60,
                                  temperature=1.0, extra_body={"seed": seed})
        assert isinstance(out.output_parsed, Verdict)


def test_responses_refusals(sdk):
    import openai
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=MODEL_ID, input="x", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError):
        sdk.responses.create(model=MODEL_ID, input="x", tools=RESPONSES_TOOLS,
                             tool_choice={"type": "function", "name": "missing"})
    with pytest.raises(openai.BadRequestError):
        sdk.responses.create(model=MODEL_ID, input=[{"type": "reasoning", "summary": []}])
    with pytest.raises(openai.BadRequestError) as info:  # nothing is stored to continue from
        sdk.responses.create(model=MODEL_ID, input="x", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:  # named as the Responses API names it
        sdk.responses.create(model=MODEL_ID, input="x", max_output_tokens=-1)
    assert info.value.body["param"] == "max_output_tokens" and "'max_output_tokens'" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=MODEL_ID, input="x", text={"format": {"type": "xml"}})
    assert info.value.body["param"].startswith("text.format")


# ------------------------------------------------------------------------- chat: the SDK helpers

def test_chat_parse_with_a_pydantic_model(sdk):
    for seed in range(2):
        out = sdk.chat.completions.parse(model=MODEL_ID, messages=[{"role": "user", "content": "Judge this."}],
                                         response_format=Verdict, max_tokens=60, temperature=1.0, seed=seed)
        assert isinstance(out.choices[0].message.parsed, Verdict) and out.choices[0].finish_reason == "stop"


def test_streamed_json_schema_equals_whole(sdk):
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Judge this."}], max_tokens=60, temperature=0,
              response_format={"type": "json_schema", "json_schema": {
                  "name": "verdict", "schema": Verdict.model_json_schema(), "strict": True}})
    whole = sdk.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole and Verdict.model_validate_json(whole)


def test_request_id_through_the_sdk(sdk):
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_headers={"x-request-id": "trace-abc-1"})
    assert raw.headers["x-request-id"] == "trace-abc-1" and raw.parse().choices
    made = sdk.models.list()
    assert made._request_id is not None and made._request_id.startswith("req_")  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------- Anthropic

def test_anthropic_tool_result_round_trip(claude, sdk):
    first = claude.messages.create(model=MODEL_ID, max_tokens=200, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
                                   messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "lookup" and valid_lookup(use.input)
    history = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": '{"value": 42}'}]}]}]
    second = claude.messages.create(model=MODEL_ID, max_tokens=8, tools=ANTHROPIC_TOOLS, messages=history,
                                    tool_choice={"type": "none"}, system=[{"type": "text", "text": "Be brief."}],
                                    extra_body={"temperature": 0})
    assert second.stop_reason == "max_tokens" and [b.type for b in second.content] == ["text"]
    chat = sdk.chat.completions.create(
        model=MODEL_ID, max_tokens=8, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "lookup", "description": "find an entry",
                                                 "parameters": LOOKUP_SCHEMA}}],
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
                      "name": "lookup", "arguments": json.dumps(use.input)}}]},
                  {"role": "tool", "tool_call_id": use.id, "content": '{"value": 42}'}])
    assert second.content[0].text == chat.choices[0].message.content
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("one_call", [True, False])
def test_anthropic_streamed_tool_use_equals_whole(claude, one_call):
    # parallel calls from a random model go on until max_tokens cuts one: the blocks keep their
    # order (the cut call stays text, last) and the reason is max_tokens, whole and streamed alike
    kw = dict(model=MODEL_ID, max_tokens=200, tools=ANTHROPIC_TOOLS,
              tool_choice={"type": "any", "disable_parallel_tool_use": one_call},
              messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == ("tool_use" if one_call else "max_tokens")
    assert whole.content[0].type == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]
    assert "input_json" in kinds and kinds[-1] == "message_stop"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_errors_are_anthropic_shaped(claude):
    anthropic = pytest.importorskip("anthropic")
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL_ID, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
