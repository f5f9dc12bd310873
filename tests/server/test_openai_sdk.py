"""The official openai SDK against a really started server (fake engine)."""
from __future__ import annotations

import openai
import pytest

from conftest import MODEL_ID
from fake_engine import FakeTokenizer, reference_ids
from moestream.engine.types import SamplingParams

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say something."}]


def stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL_ID, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def stream_completion(client, **kw):
    chunks = list(client.completions.create(model=MODEL_ID, stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    # completions accept any model name, so a lookup by any name finds the served model
    assert client.models.retrieve("no-such-model").id == MODEL_ID


@pytest.mark.parametrize("prompt", ["Say something.", "é😀 日本", "x" * 300])
def test_chat_stream_equals_whole_at_temperature_0(client, prompt):
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=48)
    text, chunks = stream_chat(client, messages=messages, temperature=0, max_tokens=48)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 48 and whole.choices[0].finish_reason == "length"
    # and it is what the model says for these tokens
    ids = FakeTokenizer().chat_ids(messages)
    assert text == FakeTokenizer().decode(reference_ids(ids, 48, SamplingParams()))


def test_chat_stream_shape(client):
    text, chunks = stream_chat(client, messages=CHAT, temperature=0, max_tokens=20)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishes) == 1 and finishes[0] is chunks[-1]
    assert finishes[0].choices[0].finish_reason == "length"
    # without include_usage there is no usage-only chunk, but the last chunk still reports usage
    assert all(c.choices for c in chunks)
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 20
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    for c in chunks[1:-1]:
        assert c.choices[0].delta.content and "\ufffd" not in c.choices[0].delta.content


def test_include_usage(client):
    text, chunks = stream_chat(client, messages=CHAT, temperature=0, max_tokens=12,
                               stream_options={"include_usage": True})
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    assert all(c.usage is None for c in chunks[:-1])
    assert last.model_extra["timings"]["prompt_n"] + last.model_extra["timings"]["reused_tokens"] == \
        last.usage.prompt_tokens
    text2, chunks2 = stream_completion(client, prompt="abc", temperature=0, max_tokens=5,
                                       stream_options={"include_usage": True})
    assert chunks2[-1].choices == [] and chunks2[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("prompt", ["Once upon", "", "😀😀"])
def test_completion_stream_equals_whole(client, prompt):
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=40)
    text, chunks = stream_completion(client, prompt=prompt, temperature=0, max_tokens=40)
    assert text == whole.choices[0].text
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0].choices[0].finish_reason == "length"
    ids = FakeTokenizer().encode(prompt)
    assert text == FakeTokenizer().decode(reference_ids(ids, 40, SamplingParams()))


def test_completion_token_ids_prompt(client):
    ids = FakeTokenizer().encode("Once upon")
    by_text = client.completions.create(model=MODEL_ID, prompt="Once upon", temperature=0, max_tokens=16)
    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, temperature=0, max_tokens=16)
    nested = client.completions.create(model=MODEL_ID, prompt=[ids], temperature=0, max_tokens=16)
    assert by_ids.choices[0].text == by_text.choices[0].text == nested.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(messages=CHAT, temperature=0.9, max_tokens=40)
    a = client.chat.completions.create(model=MODEL_ID, seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(model=MODEL_ID, seed=7, **kw).choices[0].message.content
    streamed, _ = stream_chat(client, seed=7, **kw)
    others = {client.chat.completions.create(model=MODEL_ID, seed=s, **kw).choices[0].message.content
              for s in (8, 9, 10)}
    greedy = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=40)
    assert a == b == streamed
    assert len(others | {a}) > 1 and a != greedy.choices[0].message.content


def test_sampling_fields_reach_the_engine(server, client):
    client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=2, temperature=0.7, top_p=0.9, seed=42,
                                   extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    s = server.engine.last_sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.seed) == (0.7, 0.9, 20, 0.05, 1.1, 42)
    client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=2, extra_body={"top_k": -1})
    s = server.engine.last_sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.2, 0.95, 0)  # the server's defaults; -1 means off


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=30,
                                       max_completion_tokens=7)
    assert r.usage.completion_tokens == 7


def test_roles_and_text_parts(client):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]
    r1 = client.chat.completions.create(
        model=MODEL_ID, temperature=0, max_tokens=10,
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts},
                  {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}])
    expected_ids = FakeTokenizer().chat_ids([{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "Say\nsomething."},
                                             {"role": "assistant", "content": "ok"},
                                             {"role": "user", "content": "again"}])
    assert r1.usage.prompt_tokens == len(expected_ids)
    assert r1.choices[0].message.content == FakeTokenizer().decode(reference_ids(expected_ids, 10, SamplingParams()))


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].token == content[0].token
    _, chunks = stream_chat(client, messages=CHAT, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    plain = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=6)
    assert plain.choices[0].logprobs is None
    c = client.completions.create(model=MODEL_ID, prompt="ab", temperature=0, max_tokens=5, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_every_response_has_usage_and_timings(client):
    r = client.completions.create(model=MODEL_ID, prompt="hello", temperature=0, max_tokens=4)
    t = r.model_extra["timings"]
    for key in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second",
                "expert_hit_rate", "prefill_tokens", "reused_tokens"):
        assert key in t, key
    assert t["predicted_n"] == 4 and t["expert_hit_rate"] == 0.75
    assert r.usage.prompt_tokens == t["prefill_tokens"] + t["reused_tokens"]


def test_max_tokens_zero_and_default(client, server):
    r = client.completions.create(model=MODEL_ID, prompt="hi", temperature=0, max_tokens=0)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0


def test_context_clamps_completion(server):
    from conftest import live_server
    from fake_engine import FakeEngine
    with live_server(FakeEngine(max_context=4096), max_context=40) as small, small.client() as c:
        r = c.completions.create(model=MODEL_ID, prompt="0123456789", temperature=0, max_tokens=1000)
        assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 29
        assert r.choices[0].finish_reason == "length"
        assert c.models.list().data[0].model_extra["max_context"] == 40
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=MODEL_ID, prompt="x" * 39, max_tokens=1)
        assert info.value.body["code"] == "context_length_exceeded"
