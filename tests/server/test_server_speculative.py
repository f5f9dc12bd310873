"""`serve --speculative` on the real engine and the demo model, the official openai SDK as the
client: every answer's text (and logprobs) is the plain server's, greedy and seeded, streamed and
whole; usage and timings say how many drafted tokens were kept."""
from __future__ import annotations

import pytest

from conftest import live_server

pytest.importorskip("torch")
from moestream.engine.engine import DEMO_MODEL, Engine  # noqa: E402
from moestream.engine.hot_head import DRAFT_TOKENS, HotHeadDrafter  # noqa: E402
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.engine.speculative import NGramDrafter, SpeculativeOptions  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not (DEMO_MODEL / "moestream.json").is_file(), reason="the demo model is not built")]

MODEL_ID = "demo"
CODE = ("class Vector:\n    def add(self, other):\n        return Vector(self.x + other.x, self.y + other.y)\n"
        "    def sub(self, other):\n        return Vector(self.x - other.x, self.y - other.y)\n    def mul(self, other):\n")
CHAT = [{"role": "user", "content": "Write a Python function that adds two vectors, then one that subtracts them."}]
SETTINGS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=7),
            dict(temperature=0.7, seed=3, frequency_penalty=0.5, presence_penalty=0.2)]


def load():
    return Engine.load(options=EngineOptions(device="cpu", threads=1))


@pytest.fixture(scope="module")
def plain():
    with live_server(load=load, model_id=MODEL_ID) as s, s.client() as c:
        yield c


@pytest.fixture(scope="module")
def ngram():
    with live_server(load=load, model_id=MODEL_ID,
                     speculation=lambda engine: SpeculativeOptions(drafter=NGramDrafter(), draft_tokens=None)) as s, \
            s.client() as c:
        yield c


@pytest.fixture(scope="module")
def ngram_fixed():
    with live_server(load=load, model_id=MODEL_ID,
                     speculation=lambda engine: SpeculativeOptions(drafter=NGramDrafter(), draft_tokens=4)) as s, \
            s.client() as c:
        yield c


@pytest.fixture(scope="module")
def hot():
    with live_server(load=load, model_id=MODEL_ID,
                     speculation=lambda engine: SpeculativeOptions(drafter=HotHeadDrafter(engine, base_tokens=512),
                                                                   draft_tokens=DRAFT_TOKENS)) as s, \
            s.client() as c:
        yield c


def fresh(*clients, prompts=(CODE,)):
    """Give every server the same cached prefix blocks of the prompts the tests send: a request then
    reuses the same prefix on each and computes the same rest (how many rows a prefill chunk has
    changes a row's last bits, so both sides must prefill the same chunk)."""
    for client in clients:
        for prompt in prompts:
            client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2, temperature=0)
        client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=2, temperature=0)


def completion(client, **kw):
    r = client.completions.create(model=MODEL_ID, prompt=CODE, max_tokens=64, logprobs=2, **kw)
    return r, r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.model_extra["timings"]


@pytest.mark.parametrize("setting", SETTINGS, ids=["greedy", "seeded", "penalties"])
def test_ngram_server_gives_the_plain_text(setting, plain, ngram):
    fresh(plain, ngram)
    _, text, logprobs, _ = completion(plain, **setting)
    r, spec_text, spec_logprobs, timings = completion(ngram, **setting)
    assert spec_text == text and len(text) > 0
    assert spec_logprobs == logprobs
    assert timings["speculative"] == "ngram" and timings["speculative_off"] is None
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == timings["draft_n_accepted"]
    assert details.rejected_prediction_tokens == timings["draft_n"] - timings["draft_n_accepted"]
    assert timings["tokens_per_step"] >= 1.0


def test_fixed_length_ngram_drafts_are_kept_on_repeating_code(plain, ngram_fixed):
    # (the adaptive policy drafts from measured step costs, which a loaded machine moves: a fixed
    # draft length makes the acceptance itself the thing tested)
    fresh(plain, ngram_fixed)
    _, text, logprobs, _ = completion(plain, temperature=0)
    r, spec_text, spec_logprobs, timings = completion(ngram_fixed, temperature=0)
    assert spec_text == text and spec_logprobs == logprobs
    assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0 and timings["tokens_per_step"] > 1.0


@pytest.mark.parametrize("setting", SETTINGS[:2], ids=["greedy", "seeded"])
def test_ngram_chat_streamed_equals_whole_equals_plain(setting, plain, ngram):
    fresh(plain, ngram)
    expected = plain.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=48, **setting)
    whole = ngram.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=48, **setting)
    chunks = list(ngram.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=48, stream=True,
                                                stream_options={"include_usage": True}, **setting))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == expected.choices[0].message.content == streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].model_extra["timings"]["speculative"] == "ngram"
    # the second request reused the first's prompt from the KV cache after its drafts were rolled back
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_plain_server_reports_no_drafts(plain):
    r, _, _, timings = completion(plain, temperature=0)
    assert timings["speculative"] is None and timings["draft_n"] is None
    assert r.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_hot_head_server_greedy_and_sampled(plain, hot):
    fresh(plain, hot)
    _, text, logprobs, _ = completion(plain, temperature=0)
    _, hot_text, hot_logprobs, timings = completion(hot, temperature=0)
    assert hot_text == text and hot_logprobs == logprobs
    assert timings["speculative"] == "hot-head"
    # sampled: the hot head cannot decode it; the server decodes plainly and says why
    fresh(plain, hot)
    _, text, _, _ = completion(plain, temperature=0.8, seed=5)
    _, hot_text, _, timings = completion(hot, temperature=0.8, seed=5)
    assert hot_text == text
    assert timings["speculative"] is None and "greedily only" in timings["speculative_off"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "size": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"},
                                                                                 "maxItems": 3}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a symbol",
                                           "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}},
                                                          "required": ["symbol"]}}}]


@pytest.mark.parametrize("setting", SETTINGS[:2], ids=["greedy", "seeded"])
@pytest.mark.parametrize("constraint", [
    dict(response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}),
    dict(response_format={"type": "json_object"}),
    dict(tools=TOOLS, tool_choice="required"),
], ids=["json_schema", "json_object", "forced_tool"])
def test_constrained_decoding_with_drafts_gives_the_plain_reply(setting, constraint, plain, ngram_fixed):
    """Grammar-constrained replies (structured output, forced tool calls) with the n-gram drafter
    (a fixed draft length: drafts are made whatever the timings): drafts are checked through the
    grammar's mask, so the reply is the plain server's, bit for bit."""
    ngram = ngram_fixed
    fresh(plain, ngram)
    kw = dict(model=MODEL_ID, messages=CHAT, max_tokens=40, logprobs=True, **setting, **constraint)
    expected = plain.chat.completions.create(**kw)
    fresh(plain, ngram)
    got = ngram.chat.completions.create(**kw)
    e, g = expected.choices[0], got.choices[0]
    assert g.message.content == e.message.content
    assert [(c.function.name, c.function.arguments) for c in g.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in e.message.tool_calls or []]
    assert [t.logprob for t in g.logprobs.content] == [t.logprob for t in e.logprobs.content]
    assert got.model_extra["timings"]["speculative"] == "ngram"
    assert got.usage.completion_tokens == expected.usage.completion_tokens > 0
    timings = got.model_extra["timings"]
    if "tools" in constraint:  # the call's JSON repeats the prompt's: drafts are kept
        assert timings["draft_n_accepted"] > 0


def load_batched():
    return Engine.load(options=EngineOptions(device="cpu", threads=1, max_sequences=4))


@pytest.fixture(scope="module", params=[4, None], ids=["k4", "adaptive"])
def ngram_batched(request):
    """k4: a fixed draft length (which drafts are made does not depend on timings, so neither do the
    counts); adaptive: each request's own policy."""
    k = request.param
    with live_server(load=load_batched, model_id=MODEL_ID, parallel=4,
                     speculation=lambda engine: SpeculativeOptions(drafter=NGramDrafter(), draft_tokens=k)) as s, \
            s.client() as c:
        yield c, k


def test_drafts_in_a_batch_give_every_request_its_plain_text(plain, ngram_batched):
    """Four requests at once on a --parallel 4 server that drafts by prompt lookup: each returns what
    the plain one-at-a-time server returns for it, bit for bit (greedy, seeded, penalties), with
    drafts kept and refused in the batched steps. (Both servers first cache the prompts' prefix blocks,
    so each request reuses the same prefix on both.)"""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [CODE, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
               "import os\nimport sys\nimport re\nimport json\nimport time\n",
               "# points\n" + CODE.replace("Vector", "Point")]
    settings = [SETTINGS[0], SETTINGS[1], SETTINGS[2], SETTINGS[0]]

    def ask(client, i):
        r = client.completions.create(model=MODEL_ID, prompt=prompts[i], max_tokens=48, logprobs=1, **settings[i])
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.model_extra["timings"]

    client, k = ngram_batched
    fresh(plain, client, prompts=prompts)
    expected = [ask(plain, i)[:2] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: ask(client, i), range(4)))
    assert [g[:2] for g in got] == expected
    assert all(g[2]["speculative"] == "ngram" for g in got)
    accepted = sum(g[2]["draft_n_accepted"] for g in got)
    drafted = sum(g[2]["draft_n"] for g in got)
    assert accepted > 0
    if k is not None:
        assert accepted < drafted  # drafts refused too, and rolled back
