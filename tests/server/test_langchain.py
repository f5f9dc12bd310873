"""langchain-openai against the real server (tiny packed model): a tool-calling round trip
through `bind_tools` (chat completions and the Responses API), and `with_structured_output` by
JSON schema and by function calling. The model is random, so calls are forced (tool_choice), which
the server enforces by grammar: the round trip's shapes are what is tested, and the final answer
must equal what the openai SDK gets for the same history."""
from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field


pytest.importorskip("torch")
langchain_openai = pytest.importorskip("langchain_openai")  # CI installs it (requirements-ci.txt)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

Engine = pytest.importorskip("moestream.engine.engine").Engine

pytestmark = pytest.mark.timeout(300)

MODEL_ID = "tiny-moe"
QUESTION = "Look up entry 7 of set a."


class LookupArgs(BaseModel):
    n: int = Field(ge=0, le=99)  # bounded: a random model may otherwise write digits until max_tokens
    tag: Literal["a", "b"]


@tool(args_schema=LookupArgs)
def lookup(n: int, tag: str) -> str:
    """Find an entry of a set."""
    return json.dumps({"entry": n, "set": tag, "value": n * 6})


class Verdict(BaseModel):
    """A judgement."""
    model_config = ConfigDict(extra="forbid")
    ok: bool
    score: int = Field(ge=0, le=9)


def chat_model(real, **kw):
    kw.setdefault("temperature", 0)
    return langchain_openai.ChatOpenAI(model=MODEL_ID, base_url=real.base_url, api_key="unused", max_retries=0,
                                       timeout=120, **kw)


@pytest.mark.parametrize("use_responses_api", [False, True])
def test_bind_tools_round_trip(real, use_responses_api):
    llm = chat_model(real, max_tokens=200, use_responses_api=use_responses_api)
    forced = llm.bind_tools([lookup], tool_choice="lookup", parallel_tool_calls=False)
    question = HumanMessage(QUESTION)
    asked = forced.invoke([question])
    assert isinstance(asked, AIMessage) and len(asked.tool_calls) == 1
    call = asked.tool_calls[0]
    assert call["name"] == "lookup" and set(call["args"]) == {"n", "tag"} and call["args"]["tag"] in ("a", "b")
    result = lookup.invoke(call)  # runs the tool: a ToolMessage for this call id
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    answer = chat_model(real, max_tokens=8, use_responses_api=use_responses_api).bind_tools(
        [lookup], tool_choice="none").invoke([question, asked, result])
    assert isinstance(answer, AIMessage) and not answer.tool_calls and answer.text
    # the history reached the template as the openai SDK sends it
    with real.client() as sdk:
        direct = sdk.chat.completions.create(
            model=MODEL_ID, max_tokens=8, temperature=0, tool_choice="none",
            tools=[{"type": "function", "function": {"name": "lookup", "description": lookup.description,
                                                     "parameters": lookup.tool_call_schema.model_json_schema()}}],
            messages=[{"role": "user", "content": QUESTION},
                      {"role": "assistant", "content": "", "tool_calls": [{"id": call["id"], "type": "function",
                                                                           "function": {"name": "lookup",
                                                                                        "arguments": json.dumps(call["args"])}}]},
                      {"role": "tool", "tool_call_id": call["id"], "content": result.content}])
    assert answer.text == direct.choices[0].message.content
    assert answer.usage_metadata["output_tokens"] == 8


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(real, method):
    # (json_mode enforces an object but no schema: a random model may write one until max_tokens)
    llm = chat_model(real, max_tokens=80, temperature=1.0, seed=3)
    structured = llm.with_structured_output(Verdict, method=method, strict=True)
    for question in ("Judge this.", "And this one?"):
        verdict = structured.invoke(question)
        assert isinstance(verdict, Verdict)
