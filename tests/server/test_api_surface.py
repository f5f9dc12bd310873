"""What clients beyond the OpenAI SDK send, on the fake engine: Anthropic's `x-api-key` and error
shape, /v1/messages/count_tokens and the cache fields of Messages usage, the Responses API's
text.format checks and incomplete items, llama.cpp's /tokenize and /detokenize, and the latency
and KV-pool figures of /metrics."""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import API_KEY, live_server
from fake_engine import BOS, VOCAB_SIZE, FakeEngine, FakeTokenizer

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "hello there"}]
MESSAGES = {"model": "m", "max_tokens": 4, "system": "Be brief.", "messages": USER}
TOOLS = [{"name": "lookup", "description": "find an entry",
          "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}]


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def events(r: httpx.Response) -> list[tuple[str, dict]]:
    """A named-event stream as (event, data) pairs."""
    out = []
    for block in r.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


# ------------------------------------------------------------------------------------ auth, errors

@pytest.fixture(scope="module")
def keyed():
    with live_server(FakeEngine(), api_key=API_KEY) as s:
        yield s


@pytest.mark.parametrize("path", ["/v1/messages", "/api/v1/messages", "/v1/messages/count_tokens"])
def test_x_api_key_and_anthropic_401_on_messages_routes(keyed, path):
    url = keyed.url + path
    assert httpx.post(url, json=MESSAGES, headers={"x-api-key": API_KEY}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        message = anthropic_error(httpx.post(url, json=MESSAGES, headers=headers), 401, "authentication_error")
        assert ("Missing" in message) == (not headers)


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/tokenize"), ("POST", "/detokenize")])
def test_x_api_key_on_openai_routes_with_openai_401(keyed, method, path):
    body = {"messages": USER, "max_tokens": 2, "content": "x", "tokens": [104]}
    ok = httpx.request(method, keyed.url + path, json=body, headers={"x-api-key": API_KEY})
    assert ok.status_code == 200, ok.text
    refused = httpx.request(method, keyed.url + path, json=body, headers={"x-api-key": API_KEY + "x"})
    assert openai_error(refused, 401)["code"] == "invalid_api_key"
    assert openai_error(httpx.request(method, keyed.url + path, json=body), 401)["code"] == "invalid_api_key"


def test_either_header_may_carry_the_key(keyed):
    both = {"Authorization": "Bearer wrong", "x-api-key": API_KEY}
    assert httpx.get(keyed.url + "/v1/models", headers=both).status_code == 200
    both = {"Authorization": f"Bearer {API_KEY}", "x-api-key": "wrong"}
    assert httpx.get(keyed.url + "/v1/models", headers=both).status_code == 200


def test_errors_on_messages_routes_are_anthropic_shaped(server, http):
    anthropic_error(http.post("/v1/messages", json={"messages": USER}), 400, "invalid_request_error")
    anthropic_error(http.post("/v1/messages", content=b"{nope"), 400, "invalid_request_error")
    anthropic_error(http.post("/v1/messages/count_tokens", json={"messages": []}), 400, "invalid_request_error")
    anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    anthropic_error(http.post("/v1/messages/nowhere", json=MESSAGES), 404, "not_found_error")
    anthropic_error(http.post("/api/v1/messages/nowhere", json=MESSAGES), 404, "not_found_error")
    # the OpenAI routes keep OpenAI's shape, and so does a route that only starts like Anthropic's
    openai_error(http.get("/v1/chat/completions"), 405)
    openai_error(http.post("/v1/messagesx", json=MESSAGES), 404)
    openai_error(http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": -1}), 400, "max_tokens")


def test_body_too_large_on_messages_is_anthropic_shaped():
    with live_server(FakeEngine(), max_body_bytes=1000) as s, s.http() as http:
        big = {**MESSAGES, "messages": [{"role": "user", "content": "x" * 2000}]}
        anthropic_error(http.post("/v1/messages", json=big), 413, "request_too_large")
        openai_error(http.post("/v1/chat/completions", json={"messages": big["messages"]}), 413)


# ------------------------------------------------------------------- count_tokens and cache usage

def fake_prompt(messages: list[dict]) -> list[int]:
    return FakeTokenizer().chat_ids(messages)


def test_count_tokens_is_the_prompt_the_server_builds(server, http):
    expected = fake_prompt([{"role": "system", "content": "Be brief."}, *USER])
    body = {k: v for k, v in MESSAGES.items() if k != "max_tokens"}
    counted = http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200 and counted.json() == {"input_tokens": len(expected)}
    # with tools the template's prompt describes them: counted as a Messages call would send them
    with_tools = http.post("/v1/messages/count_tokens", json={**body, "tools": TOOLS}).json()["input_tokens"]
    reply = http.post("/v1/messages", json={**MESSAGES, "tools": TOOLS}).json()["usage"]
    assert with_tools > len(expected)
    assert with_tools == reply["input_tokens"] + reply["cache_read_input_tokens"]
    # tool_choice none gives the template no tools
    none = http.post("/v1/messages/count_tokens", json={**body, "tools": TOOLS, "tool_choice": {"type": "none"}})
    assert none.json() == {"input_tokens": len(expected)}
    # content blocks and a tool round trip count as the Messages route renders them
    blocks = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert http.post("/v1/messages/count_tokens", json=blocks).json() == \
        {"input_tokens": len(fake_prompt([{"role": "user", "content": "a\nb"}]))}


def test_messages_usage_reports_the_prefix_cache():
    engine = FakeEngine()
    with live_server(engine) as s, s.http() as http:
        prompt = len(fake_prompt([{"role": "system", "content": "Be brief."}, *USER]))
        first = http.post("/v1/messages", json=MESSAGES).json()["usage"]
        # nothing cached yet: every prompt token is computed
        assert first == {"input_tokens": prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                         "output_tokens": 4}
        # the same prompt again: all but its last token come from the cache (the last one is run)
        again = http.post("/v1/messages", json=MESSAGES).json()["usage"]
        assert again == {"input_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": prompt - 1,
                         "output_tokens": 4}
        streamed = events(http.post("/v1/messages", json={**MESSAGES, "stream": True}))
        start = streamed[0][1]["message"]["usage"]
        assert start["input_tokens"] == prompt and start["output_tokens"] == 0
        (delta,) = [data for name, data in streamed if name == "message_delta"]
        assert delta["usage"] == again
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."}, *USER],
                                                       "max_tokens": 4}).json()["usage"]
        assert chat["prompt_tokens"] == prompt and chat["prompt_tokens_details"]["cached_tokens"] == prompt - 1


# ------------------------------------------------------------------------------------- Responses

@pytest.mark.parametrize("fmt,param", [({"type": "json_schema", "name": "x"}, "text.format.schema"),
                                       ({"type": "json_schema", "schema": {"type": "object"}}, "text.format.name")])
def test_responses_json_schema_needs_schema_and_name(http, fmt, param):
    error = openai_error(http.post("/v1/responses", json={"input": "x", "text": {"format": fmt}}), 400, param)
    assert error["code"] == "missing_required_parameter" and param.rsplit(".", 1)[1] in error["message"]


def test_responses_cut_by_max_output_tokens_leave_the_message_incomplete(http):
    whole = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3, "temperature": 0}).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["status"] for item in whole["output"]] == ["incomplete"]
    streamed = events(http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3, "temperature": 0,
                                                       "stream": True}))
    done = [data["item"] for name, data in streamed if name == "response.output_item.done"]
    assert [item["status"] for item in done] == ["incomplete"]
    final = streamed[-1][1]["response"]
    assert final["status"] == "incomplete" and [i["status"] for i in final["output"]] == ["incomplete"]
    assert [i["content"][0]["text"] for i in final["output"]] == [i["content"][0]["text"] for i in whole["output"]]


def test_responses_that_end_by_themselves_are_completed():
    engine = FakeEngine()
    engine.script = "done"
    with live_server(engine) as s, s.http() as http:
        whole = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 50}).json()
        assert whole["status"] == "completed" and whole["output"][0]["status"] == "completed"
        assert whole["output"][0]["content"][0]["text"] == "done"
        streamed = events(http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 50, "stream": True}))
        done = [data["item"]["status"] for name, data in streamed if name == "response.output_item.done"]
        assert done == ["completed"]


# --------------------------------------------------------------------------- tokenize, detokenize

def test_tokenize_and_detokenize(http):
    text = "hé ab"
    plain = list(text.encode("utf-8"))  # the fake's ids are bytes
    assert http.post("/tokenize", json={"content": text}).json() == {"tokens": plain}
    assert http.post("/tokenize", json={"content": text, "add_special": True}).json() == {"tokens": [BOS, *plain]}
    pieces = http.post("/tokenize", json={"content": "ab", "with_pieces": True, "model": "ignored"}).json()
    assert pieces == {"tokens": [{"id": 97, "piece": "a"}, {"id": 98, "piece": "b"}]}
    assert http.post("/detokenize", json={"tokens": plain}).json() == {"content": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"content": ""}


@pytest.mark.parametrize("body,param", [
    ({"tokens": [104, VOCAB_SIZE]}, "tokens[1]"), ({"tokens": [-1]}, "tokens[0]"), ({"tokens": [True]}, "tokens[0]"),
    ({"tokens": ["a"]}, "tokens[0]"), ({"tokens": [1.5]}, "tokens[0]"), ({"tokens": 5}, "tokens"), ({}, "tokens")])
def test_detokenize_refuses_bad_ids(http, body, param):
    openai_error(http.post("/detokenize", json=body), 400, param)


@pytest.mark.parametrize("body,param", [({}, "content"), ({"content": 5}, "content"),
                                        ({"content": "x", "add_special": "yes"}, "add_special")])
def test_tokenize_refuses_bad_bodies(http, body, param):
    openai_error(http.post("/tokenize", json=body), 400, param)


# ------------------------------------------------------------------------------------------ metrics

def scrape(http) -> dict:
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_latency_histograms_and_kv_gauges():
    engine = FakeEngine(token_delay=0.01)
    with live_server(engine) as s, s.http() as http:
        empty = scrape(http)
        assert empty[("moestream_kv_blocks_used", ())] == 0 and empty[("moestream_kv_blocks_total", ())] == 256
        assert empty[("moestream_time_to_first_token_seconds_count", ())] == 0
        replies = [http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": m, "n": n,
                                                           "temperature": 0}).json()
                   for m, n in ((5, 1), (4, 1), (3, 2))]
        s.wait_idle()
        after = scrape(http)
        kv_tokens = len(engine._kv_tokens)
    tokens = [c for r in replies for c in [r["usage"]["completion_tokens"] // len(r["choices"])] * len(r["choices"])]
    assert tokens == [5, 4, 3, 3]
    # one first token per request (its first choice), every later token one gap
    assert after[("moestream_time_to_first_token_seconds_count", ())] == 3
    assert after[("moestream_time_to_first_token_seconds_sum", ())] >= 3 * 0.01
    gaps = sum(t - 1 for t in tokens)
    assert after[("moestream_inter_token_latency_seconds_count", ())] == gaps
    assert after[("moestream_inter_token_latency_seconds_sum", ())] >= gaps * 0.009
    assert after[("moestream_inter_token_latency_seconds_bucket", (("le", "0.005"),))] == 0
    assert after[("moestream_queue_seconds_count", ())] == 3
    # the pool holds the last request's tokens (blocks of 16), as the engine reports it
    assert after[("moestream_kv_blocks_used", ())] == -(-kv_tokens // 16) > 0
    assert after[("moestream_kv_usage_ratio", ())] == pytest.approx(-(-kv_tokens // 16) / 256)


def test_the_anthropic_sdk_with_its_own_header(keyed):
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=keyed.url, api_key=API_KEY, max_retries=0) as claude:  # sends x-api-key
        counted = claude.messages.count_tokens(model="m", system="Be brief.", messages=USER)
        assert counted.input_tokens == len(fake_prompt([{"role": "system", "content": "Be brief."}, *USER]))
        reply = claude.messages.create(**MESSAGES)
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
        with claude.messages.stream(**MESSAGES) as stream:
            final = stream.get_final_message()
        # the same prompt again: the stream's final usage reads the cache
        assert final.usage.cache_read_input_tokens == counted.input_tokens - 1 and final.usage.input_tokens == 1
    with anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(**MESSAGES)
    assert info.value.body["error"]["type"] == "authentication_error"
