"""Reasoning through the server (fake engine, scripted replies one byte-token at a time, so every tag
arrives split across deltas): chat's reasoning_content whole and streamed with reasoning_tokens,
a prompt that opens the think block, a tool call after the reasoning, gpt-oss's analysis channel,
the Responses API's reasoning item, Anthropic's thinking block, and --reasoning-format none."""
from __future__ import annotations

import json

import pytest

from conftest import MODEL_ID, live_server
from fake_engine import FakeEngine
from moestream.server.app import create_app
from moestream.server.worker import Worker

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "What is 2+2?"}]
THINK_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<think>"  # a template that shows the tags
REASONING = "The user asks 2+2.\nThat is 4."
ANSWER = "It is 4."
THINK_REPLY = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
REASONING_TOKENS = len(f"<think>\n{REASONING}\n</think>".encode())  # one token a byte
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HARMONY_TEMPLATE = "{{ tools }}{{ tool_calls }}<|start|>assistant<|channel|>final<|message|>"
HARMONY_REPLY = ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "Hello there!")


@pytest.fixture(scope="module")
def scripted():
    engine = FakeEngine()
    with live_server(engine) as s:
        yield s, engine


@pytest.fixture
def thinker(scripted):
    """The scripted server as a model whose template shows think tags; reset afterwards."""
    server, engine = scripted
    engine.script, engine.tokenizer.chat_template = THINK_REPLY, THINK_TEMPLATE
    yield server, engine
    engine.script = None
    for name in ("chat_template", "generation_prompt"):
        engine.tokenizer.__dict__.pop(name, None)


def _chat_stream(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = [("reasoning" if getattr(d, "reasoning_content", None) else "content" if d.content else None)
             for d in deltas]
    return chunks, deltas, [k for k in kinds if k]


def test_chat_whole_has_reasoning_apart(thinker):
    server, _ = thinker
    with server.client() as client:
        out = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400)
    message = out.choices[0].message
    assert message.content == ANSWER and message.reasoning_content == REASONING
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(THINK_REPLY.encode())
    assert out.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_chat_streamed_sends_reasoning_deltas_first(thinker):
    server, _ = thinker
    with server.client() as client:
        chunks, deltas, kinds = _chat_stream(client, stream_options={"include_usage": True})
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == REASONING and "".join(d.content or "" for d in deltas) == ANSWER
    # the reasoning streams as it is written (many deltas), all before the content
    assert kinds.count("reasoning") > 5 and kinds == sorted(kinds, key=lambda k: k == "content")
    assert all("<" not in (getattr(d, "reasoning_content", None) or "") + (d.content or "") for d in deltas)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_prompt_that_opens_the_block(thinker):
    server, engine = thinker
    engine.tokenizer.generation_prompt = "<assistant><think>\n"
    engine.script = f"{REASONING}\n</think>\n\n{ANSWER}"
    with server.client() as client:
        whole = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400)
        _, deltas, _ = _chat_stream(client)
        cut = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=10)
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (REASONING, ANSWER)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    # cut by max_tokens while reasoning: all of it is reasoning, nothing is content
    assert cut.choices[0].message.reasoning_content == REASONING[:10] and cut.choices[0].message.content == ""
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens_details.reasoning_tokens == 10


def test_tool_call_after_reasoning(thinker):
    server, engine = thinker
    engine.script = ('<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                     '"arguments": {"city": "Paris"}}\n</tool_call>')
    with server.client() as client:
        whole = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=400)
        chunks, deltas, _ = _chat_stream(client, tools=TOOLS)
    message = whole.choices[0].message
    assert message.reasoning_content == "Need the weather." and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Need the weather."
    streamed = [t.function.arguments for d in deltas for t in (d.tool_calls or []) if t.function.arguments]
    assert [json.loads(a) for a in streamed] == [{"city": "Paris"}]
    assert not "".join(d.content or "" for d in deltas)


def test_tool_call_after_reasoning_in_responses_and_messages(thinker):
    server, engine = thinker
    engine.script = ('<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                     '"arguments": {"city": "Paris"}}\n</tool_call>')
    tool = {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}
    with server.client() as client:
        whole = client.responses.create(model=MODEL_ID, input="Weather in Paris?", tools=[tool],
                                        max_output_tokens=400)
        events = list(client.responses.create(model=MODEL_ID, input="Weather in Paris?", tools=[tool],
                                              max_output_tokens=400, stream=True))
    for output in (whole.output, events[-1].response.output):
        assert [item.type for item in output] == ["reasoning", "function_call"]
        assert output[0].content[0].text == "Need the weather." and json.loads(output[1].arguments) == {"city": "Paris"}
    body = {"model": MODEL_ID, "max_tokens": 400, "messages": USER,
            "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]}
    with server.http() as http:
        message = http.post("/v1/messages", json=body).json()
        streamed = _sse(http.post("/v1/messages", json={**body, "stream": True}).text)
    assert [b["type"] for b in message["content"]] == ["thinking", "tool_use"] and message["stop_reason"] == "tool_use"
    assert message["content"][1]["input"] == {"city": "Paris"}
    starts = [e["content_block"]["type"] for name, e in streamed if name == "content_block_start"]
    assert starts == ["thinking", "tool_use"]


def test_harmony_analysis_is_reasoning(scripted):
    server, engine = scripted
    engine.script, engine.tokenizer.chat_template = HARMONY_REPLY, HARMONY_TEMPLATE
    try:
        with server.client() as client:
            whole = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400)
            _, deltas, kinds = _chat_stream(client)
    finally:
        engine.script = None
        del engine.tokenizer.chat_template
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user greets.", "Hello there!")
    assert whole.usage.completion_tokens_details.reasoning_tokens == \
        len("<|channel|>analysis<|message|>The user greets.<|end|>".encode())
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user greets."
    assert "".join(d.content or "" for d in deltas) == "Hello there!" and kinds[0] == "reasoning"


def test_responses_reasoning_item_before_the_message(thinker):
    server, _ = thinker
    with server.client() as client:
        whole = client.responses.create(model=MODEL_ID, input="What is 2+2?", max_output_tokens=400)
        events = list(client.responses.create(model=MODEL_ID, input="What is 2+2?", max_output_tokens=400,
                                              stream=True))
        # the reasoning item sent back with the next turn is accepted
        again = client.responses.create(model=MODEL_ID, max_output_tokens=400, input=[
            {"role": "user", "content": "What is 2+2?"}, whole.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And 3+3?"}])
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert [c.text for c in whole.output[0].content] == [REASONING] and whole.output[0].summary == []
    assert whole.output_text == ANSWER and whole.output[0].id != whole.output[1].id
    assert whole.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == REASONING and len(deltas) > 5
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    completed = events[-1].response
    assert [item.type for item in completed.output] == ["reasoning", "message"]
    assert completed.output[0].content[0].text == REASONING and completed.output_text == ANSWER
    assert completed.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"] and again.output_text == ANSWER


def _sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_messages_thinking_block_before_the_text(thinker):
    server, _ = thinker
    body = {"model": MODEL_ID, "max_tokens": 400, "messages": USER}
    with server.http() as http:
        whole = http.post("/v1/messages", json=body).json()
        streamed = _sse(http.post("/v1/messages", json={**body, "stream": True}).text)
        history = {**body, "messages": USER + [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": ""},
                                              {"type": "text", "text": ANSWER}]},
            {"role": "user", "content": "And 3+3?"}]}
        again = http.post("/v1/messages", json=history)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == REASONING and whole["content"][1]["text"] == ANSWER
    starts = [e["content_block"]["type"] for name, e in streamed if name == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = [e["delta"]["thinking"] for name, e in streamed
                if name == "content_block_delta" and e["delta"]["type"] == "thinking_delta"]
    text = [e["delta"]["text"] for name, e in streamed
            if name == "content_block_delta" and e["delta"]["type"] == "text_delta"]
    assert "".join(thinking) == REASONING and len(thinking) > 5 and "".join(text) == ANSWER
    blocks = [e["index"] for name, e in streamed if name in ("content_block_start", "content_block_stop")]
    assert blocks == [0, 0, 1, 1]
    assert again.status_code == 200 and again.json()["content"][-1]["text"] == ANSWER


def test_reasoning_format_none_keeps_it_in_the_content():
    engine = FakeEngine()
    engine.script, engine.tokenizer.chat_template = THINK_REPLY, THINK_TEMPLATE
    with live_server(engine, reasoning_format="none") as server, server.client() as client:
        whole = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400)
        _, deltas, kinds = _chat_stream(client)
        response = client.responses.create(model=MODEL_ID, input="What is 2+2?", max_output_tokens=400)
        engine.script, engine.tokenizer.chat_template = HARMONY_REPLY, HARMONY_TEMPLATE
        harmony = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400)
    # gpt-oss's reply is still read by channel, as before: the final channel, the analysis left out
    assert harmony.choices[0].message.content == "Hello there!"
    assert getattr(harmony.choices[0].message, "reasoning_content", None) is None
    assert whole.choices[0].message.content == THINK_REPLY
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    assert "".join(d.content or "" for d in deltas) == THINK_REPLY and "reasoning" not in kinds
    assert [item.type for item in response.output] == ["message"] and response.output_text == THINK_REPLY


def test_model_without_reasoning_is_unchanged(scripted):
    server, engine = scripted
    engine.script = THINK_REPLY  # the tags, but a template (and family) that knows no reasoning
    try:
        with server.client() as client:
            whole = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400)
    finally:
        engine.script = None
    assert whole.choices[0].message.content == THINK_REPLY
    assert "reasoning_content" not in whole.choices[0].message.model_dump(exclude_unset=True)


def test_reasoning_format_flag_is_checked(capsys):
    from moestream.commands.serve import build_parser, main

    parser = build_parser(engine_arguments=False)
    assert parser.parse_args([]).reasoning_format == "auto"
    assert parser.parse_args(["--reasoning-format", "none"]).reasoning_format == "none"
    with pytest.raises(SystemExit) as info:
        main(["--reasoning-format", "hidden"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "moestream serve: error: argument --reasoning-format: invalid choice: 'hidden' (choose from 'auto', 'none')"]
    with pytest.raises(ValueError, match="reasoning_format"):
        create_app(Worker(FakeEngine), reasoning_format="hidden")


@pytest.mark.parametrize("limit,texts", [
    (10, ["Th", ""]),  # cut while reasoning: the reasoning so far, then an empty (cut) answer
    (REASONING_TOKENS + 5, [REASONING, "It "]),  # cut in the answer
])
def test_responses_cut_with_reasoning_whole_and_streamed_agree(thinker, limit, texts):
    server, _ = thinker
    with server.client() as client:
        whole = client.responses.create(model=MODEL_ID, input="What is 2+2?", max_output_tokens=limit)
        events = list(client.responses.create(model=MODEL_ID, input="What is 2+2?", max_output_tokens=limit,
                                              stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    for output in (whole.output, events[-1].response.output, done):
        assert [(item.type, item.status) for item in output] == [("reasoning", "completed"), ("message", "incomplete")]
        assert [item.content[0].text for item in output] == texts
    for response in (whole, events[-1].response):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens_details.reasoning_tokens == min(limit, REASONING_TOKENS)
    streamed_id = events[-1].response.id
    assert [o.id.replace(whole.id[5:], streamed_id[5:]) for o in whole.output] == [o.id for o in done]
