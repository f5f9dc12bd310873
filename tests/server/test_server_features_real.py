"""The newer request fields and APIs on the real engine and a tiny packed model, through the
official SDKs (openai, anthropic): echo logprobs, logit_bias, penalties, seeded n choices,
grammar-constrained tool calls and JSON, /v1/messages and /v1/responses."""
from __future__ import annotations

import json

import pytest

from conftest import live_server

pytest.importorskip("torch")
import torch  # noqa: E402

Engine = pytest.importorskip("moestream.engine.engine").Engine
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.engine.types import SamplingParams, TokenHistory  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL_ID = "tiny-moe"
USER = [{"role": "user", "content": "Hello world! naive cafe"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"type": "string", "enum": ["a", "b"]}},
    "required": ["n", "tag"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def model_dir(tiny_packed_model):
    return tiny_packed_model("qwen3_moe", max_position_embeddings=2048)  # room for a tools prompt


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.load(model_dir, options=EngineOptions(device="cpu"))


@pytest.fixture(scope="module")
def real(model_dir):
    with live_server(load=lambda: Engine.load(model_dir, options=EngineOptions(device="cpu")),
                     model_id=MODEL_ID) as s:
        yield s


def test_echo_logprobs_score_the_prompt(sdk, engine):
    ids = engine.tokenizer.encode("The quick brown fox jumps", add_special_tokens=False)
    out = sdk.completions.create(model=MODEL_ID, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits, _ = engine.prefill(ids, all_logits=True)
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 2 and max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert out.choices[0].text == engine.tokenizer.decode(ids) and out.usage.completion_tokens == 0


def test_prompt_list_one_choice_each(sdk):
    prompts = ["def f(", "Hello", "import os"]
    out = sdk.completions.create(model=MODEL_ID, prompt=prompts, max_tokens=4, temperature=0)
    singles = [sdk.completions.create(model=MODEL_ID, prompt=p, max_tokens=4, temperature=0).choices[0].text
               for p in prompts]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == singles


def test_logit_bias_forces_a_token(sdk, engine):
    token = engine.tokenizer.encode("fox", add_special_tokens=False)[0]
    out = sdk.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=5, temperature=0,
                                      logit_bias={str(token): 100})
    assert out.choices[0].message.content == engine.tokenizer.decode([token] * 5)


def test_penalties_match_the_engine(sdk, engine, real):
    prompt = real.worker.tokenizer.chat_ids(USER)
    for fp, pp in [(2.0, 0.0), (0.0, 2.0)]:
        out = sdk.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=12, temperature=0,
                                          frequency_penalty=fp, presence_penalty=pp)
        sampling = SamplingParams(frequency_penalty=fp, presence_penalty=pp, history=TokenHistory())
        ids = [e.token_id for e in engine.generate(prompt, max_new_tokens=12, sampling=sampling)]
        assert out.choices[0].message.content == engine.tokenizer.decode(ids)
    plain = [e.token_id for e in engine.generate(prompt, max_new_tokens=12, sampling=SamplingParams())]
    penalized = [e.token_id for e in engine.generate(prompt, max_new_tokens=12, sampling=SamplingParams(
        presence_penalty=2.0, history=TokenHistory()))]
    assert len(set(penalized)) >= len(set(plain))


def test_seeded_n_choices_reproducible(sdk):
    kw = dict(model=MODEL_ID, messages=USER, max_tokens=8, temperature=1.0, top_p=1.0, seed=11, extra_body={"top_k": 0})
    a = sdk.chat.completions.create(n=3, **kw)
    b = sdk.chat.completions.create(n=3, **kw)
    one = sdk.chat.completions.create(n=1, **kw)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert texts[0] == one.choices[0].message.content
    assert len(set(texts)) > 1  # distinct seeds per choice


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_is_always_valid(sdk, stream):
    for seed in range(3):
        kw = dict(model=MODEL_ID, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=200, temperature=1.0, seed=seed)
        if stream:
            name, args, reason = "", "", None
            for c in sdk.chat.completions.create(stream=True, **kw):
                for d in c.choices[0].delta.tool_calls or [] if c.choices else []:
                    name += d.function.name or ""
                    args += d.function.arguments or ""
                if c.choices and c.choices[0].finish_reason:
                    reason = c.choices[0].finish_reason
        else:
            out = sdk.chat.completions.create(**kw)
            reason = out.choices[0].finish_reason
            (call,) = out.choices[0].message.tool_calls
            name, args = call.function.name, call.function.arguments
        assert reason == "tool_calls" and name in ("lookup", "noop")
        parsed = json.loads(args)
        if name == "lookup":
            assert set(parsed) == {"n", "tag"} and isinstance(parsed["n"], int) and parsed["tag"] in ("a", "b")


def test_named_tool_call(sdk):
    out = sdk.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=200, temperature=0,
                                      parallel_tool_calls=False,
                                      tool_choice={"type": "function", "function": {"name": "lookup"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"n", "tag"}


def test_json_schema_and_json_object(sdk):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "k": {"type": "integer"}},
              "required": ["ok", "k"], "additionalProperties": False}
    for seed in range(2):
        out = sdk.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=60, temperature=1.0, seed=seed,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "r", "schema": schema, "strict": True}})
        value = json.loads(out.choices[0].message.content)
        assert set(value) == {"ok", "k"} and isinstance(value["ok"], bool) and isinstance(value["k"], int)
        assert out.choices[0].finish_reason == "stop"
    out = sdk.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=60, temperature=0,
                                      response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert out.choices[0].message.content.startswith("{")


def test_anthropic_messages(real, sdk):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=real.url, api_key="unused", max_retries=0)
    chat = sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "system", "content": "Be brief."}] + USER,
                                       max_tokens=10, temperature=0)
    msg = client.messages.create(model=MODEL_ID, system="Be brief.", messages=USER, max_tokens=10, extra_body={"temperature": 0})
    assert msg.role == "assistant" and msg.content[0].type == "text"
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 10
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(model=MODEL_ID, system="Be brief.", messages=USER, max_tokens=10,
                                extra_body={"temperature": 0}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    # a stop sequence is reported as such
    cut = msg.content[0].text[3:6]
    if cut:
        stopped = client.messages.create(model=MODEL_ID, system="Be brief.", messages=USER, max_tokens=10,
                                         extra_body={"temperature": 0}, stop_sequences=[cut])
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut
    tool = client.messages.create(model=MODEL_ID, messages=USER, max_tokens=200, extra_body={"temperature": 0},
                                  tools=[{"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert tool.stop_reason == "tool_use"
    block = next(b for b in tool.content if b.type == "tool_use")
    assert block.name == "lookup" and set(block.input) == {"n", "tag"}


def test_responses_api(sdk):
    chat = sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "system", "content": "Be brief."}] + USER,
                                       max_tokens=10, temperature=0)
    out = sdk.responses.create(model=MODEL_ID, instructions="Be brief.", input=USER[0]["content"],
                               max_output_tokens=10, temperature=0)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.output_tokens == 10 and out.usage.input_tokens == chat.usage.prompt_tokens
    events = list(sdk.responses.create(model=MODEL_ID, instructions="Be brief.", input=USER, max_output_tokens=10,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.usage.output_tokens == 10
