"""Every refusal: its status and OpenAI's error shape {"error": {message, type, param, code}}."""
from __future__ import annotations

import json

import openai
import pytest

from conftest import MODEL_ID

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": MODEL_ID, "messages": USER, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, **fields}


def assert_error(response, status: int, param=..., code=...) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


REFUSED = [
    # unsupported features, and what the new ones refuse
    (CHAT, chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    (COMPLETIONS, completion(best_of=2), "best_of", "unsupported_parameter"),
    (COMPLETIONS, completion(suffix="end"), "suffix", "unsupported_parameter"),  # the fake model has no FIM tokens
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"99999": 1}), "logit_bias", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", "invalid_value"),
    (CHAT, chat(tool_choice="required"), "tool_choice", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name",
     "invalid_value"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema",
     "missing_required_parameter"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format", "invalid_value"),
    (COMPLETIONS, completion(prompt=[]), "prompt", "invalid_value"),
    # image and other non-text parts
    (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
     "messages[0].content[1]", "unsupported_content_type"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
     "messages[0].content[0]", "unsupported_content_type"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "banana"}]}]), "messages[0].content[0]",
     "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text",
     "invalid_type"),
    (CHAT, chat(messages=[{"role": "user", "content": []}]), "messages[0].content", "invalid_value"),
    (CHAT, chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role", "invalid_value"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id",
     "missing_required_parameter"),
    (CHAT, chat(messages=[{"role": "assistant", "content": None,
                           "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": None}]), "messages[0].content", "invalid_value"),
    # values outside the spec's ranges
    (CHAT, chat(temperature=2.5), "temperature", "invalid_value"),
    (CHAT, chat(temperature=-0.1), "temperature", "invalid_value"),
    (CHAT, chat(top_p=1.5), "top_p", "invalid_value"),
    (CHAT, chat(top_k=-2), "top_k", "invalid_value"),
    (CHAT, chat(min_p=2), "min_p", "invalid_value"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
    (CHAT, chat(frequency_penalty=3), "frequency_penalty", "invalid_value"),
    (CHAT, chat(n=0), "n", "invalid_value"),
    (CHAT, chat(max_tokens=-1), "max_tokens", "invalid_value"),
    (CHAT, chat(max_completion_tokens=-5), "max_completion_tokens", "invalid_value"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (COMPLETIONS, completion(logprobs=6), "logprobs", "invalid_value"),
    (CHAT, chat(seed=2**63), "seed", "invalid_value"),
    (CHAT, chat(stop=[str(i) for i in range(17)]), "stop", "invalid_value"),
    (CHAT, chat(messages=[]), "messages", "invalid_value"),
    (COMPLETIONS, completion(prompt=[5, 10**9]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[-1]), "prompt", "invalid_value"),
    # wrong types
    (CHAT, chat(temperature="hot"), "temperature", "invalid_type"),
    (CHAT, chat(temperature=True), "temperature", "invalid_type"),
    (CHAT, chat(max_tokens=1.5), "max_tokens", "invalid_type"),
    (CHAT, chat(max_tokens="10"), "max_tokens", "invalid_type"),
    (CHAT, chat(stream="yes"), "stream", "invalid_type"),
    (CHAT, chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage", "invalid_type"),
    (CHAT, chat(stop=["ok", 5]), "stop", "invalid_type"),
    (CHAT, chat(messages="hello"), "messages", "invalid_type"),
    (CHAT, chat(messages=["hello"]), "messages[0]", "invalid_type"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
    (CHAT, chat(messages=[{"content": "no role"}]), "messages[0].role", "missing_required_parameter"),
    (CHAT, chat(model=5), "model", "invalid_type"),
    (COMPLETIONS, completion(prompt=5), "prompt", "invalid_type"),
    (COMPLETIONS, completion(prompt=[1.5]), "prompt", "invalid_type"),
    (CHAT, {"model": MODEL_ID}, "messages", "missing_required_parameter"),
]


@pytest.mark.parametrize("path,body,param,code", REFUSED, ids=[f"{p[0].split('/')[-1]}-{p[2]}-{i}"
                                                               for i, p in enumerate(REFUSED)])
def test_refused_with_400(http, path, body, param, code):
    assert_error(http.post(path, json=body), 400, param, code)


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"   ", b"[1, 2]", b'"text"', b"null", b"42",
                                 b'{"temperature": NaN, "messages": []}', b"\xff\xfe\x00garbage"])
def test_malformed_or_non_object_body(http, raw):
    error = assert_error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)
    assert error["code"] in ("invalid_json", "invalid_type")


ACCEPTED = [
    chat(tools=[]),
    chat(response_format={"type": "text"}),
    chat(frequency_penalty=0, presence_penalty=0.0, logit_bias={}),
    chat(frequency_penalty=0.5, presence_penalty=-1, logit_bias={"5": 10}, n=2),
    # null means "not given" for every optional field
    chat(n=None, tools=None, tool_choice=None, response_format=None, user=None, logit_bias=None, stop=None,
         parallel_tool_calls=None, functions=None, max_completion_tokens=None, stream_options=None, seed=None),
    chat(messages=[{"role": "user", "content": "hi", "name": None, "tool_calls": None}]),
    chat(n=1, top_k=0, min_p=0.0, repetition_penalty=1.0),
    chat(some_unknown_field={"x": 1}, user="u", metadata={"a": "b"}, store=False, parallel_tool_calls=True),
    chat(stop="x", seed=-5, temperature=0, top_p=1, top_logprobs=None),
    chat(top_logprobs=2),  # without logprobs: true, ignored
    chat(messages=[{"role": "assistant", "content": None}, {"role": "user", "content": "hi", "name": "bob"}]),
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_accepted(http, body):
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


def test_context_length_exceeded(http, server):
    limit = server.worker.max_context
    long_prompt = "x" * (limit + 10)
    assert_error(http.post(CHAT, json=chat(messages=[{"role": "user", "content": long_prompt}])), 400, "messages",
                 "context_length_exceeded")
    assert_error(http.post(COMPLETIONS, json=completion(prompt=long_prompt)), 400, "prompt",
                 "context_length_exceeded")
    assert_error(http.post(COMPLETIONS, json=completion(prompt=[1] * limit, stream=True)), 400, "prompt",
                 "context_length_exceeded")


def test_stream_refusals_come_before_the_stream(http):
    response = http.post(CHAT, json=chat(n=0, stream=True))
    assert response.headers["content-type"].startswith("application/json")
    assert_error(response, 400, "n")


def test_sdk_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=USER, n=0)
    assert info.value.status_code == 400 and info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=USER, logit_bias={"5": 500})
    assert info.value.body["param"] == "logit_bias"


def test_not_found_and_method_not_allowed(http):
    assert_error(http.get("/v1/nothing-here"), 404, None, "not_found")
    assert_error(http.get("/nothing"), 404, None, "not_found")
    assert_error(http.get(CHAT), 405, None, "method_not_allowed")
    assert_error(http.post("/v1/models", json={}), 405, None, "method_not_allowed")
    assert_error(http.delete("/api/v1/completions"), 405, None, "method_not_allowed")



def test_model_lookup_accepts_what_completions_accept(http):
    """POST accepts any model name and answers as the served model; GET /v1/models/{name} agrees."""
    served = http.get(f"/v1/models/{MODEL_ID}").json()
    assert served["id"] == MODEL_ID
    for name in ("other", "gpt-4o", "org/some-model"):
        card = http.get(f"/v1/models/{name}")
        assert card.status_code == 200 and card.json() == served
        answer = http.post("/v1/completions", json=completion(temperature=0, model=name))
        assert answer.status_code == 200 and answer.json()["model"] == MODEL_ID


def test_api_v1_prefix_serves_the_same_routes(http):
    assert http.get("/api/v1/models").json() == http.get("/v1/models").json()
    a = http.post("/api/v1/completions", json=completion(temperature=0)).json()
    b = http.post("/v1/completions", json=completion(temperature=0)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert http.post("/api/v1/chat/completions", json=chat()).status_code == 200
    assert http.get(f"/api/v1/models/{MODEL_ID}").json()["id"] == MODEL_ID


def test_body_too_large(server):
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * (2 << 20)}])).encode()
    with server.http() as http:
        assert_error(http.post(CHAT, content=big), 413, None, "request_too_large")

        def chunks():  # no Content-Length: the cap applies while reading
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]
        assert_error(http.post(CHAT, content=chunks()), 413, None, "request_too_large")
