"""Stop strings through the real HTTP path: streamed == whole == the reference cut of the full text
at the first stop occurrence, for stop strings that span token boundaries and split characters."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import MODEL_ID
from fake_engine import FakeTokenizer, reference_ids
from moestream.engine.types import SamplingParams
from stop_reference import cut_at_first_stop

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

MAX_TOKENS = 40
# the fake model writes from these characters, so stop strings made of them occur often
STOP_ALPHABET = "ab \n.xé😀日本<|>the"


def reference(prompt_ids: list[int], stops: list[str], sampling: SamplingParams) -> tuple[str, str]:
    tokenizer = FakeTokenizer()
    full = tokenizer.decode(reference_ids(prompt_ids, MAX_TOKENS, sampling))
    text, found = cut_at_first_stop(full, stops)
    return text, "stop" if found else "length"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(alphabet="abcxyz", min_size=1, max_size=12),
       stops=st.lists(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
       seed=st.one_of(st.none(), st.integers(0, 1000)))
def test_chat_stop_strings(client, prompt, stops, seed):
    messages = [{"role": "user", "content": prompt}]
    sampling = SamplingParams(temperature=0.0) if seed is None else SamplingParams(temperature=1.0, seed=seed)
    kw = dict(model=MODEL_ID, messages=messages, max_tokens=MAX_TOKENS, stop=stops,
              temperature=sampling.temperature, seed=seed)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    expected_text, expected_finish = reference(FakeTokenizer().chat_ids(messages), stops, sampling)
    assert whole.choices[0].message.content == streamed == expected_text
    assert finish == [whole.choices[0].finish_reason] == [expected_finish]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(alphabet="abc", max_size=8),
       stop=st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=6))
def test_completion_single_stop_string(client, prompt, stop):
    kw = dict(model=MODEL_ID, prompt=prompt, max_tokens=MAX_TOKENS, stop=stop, temperature=0)
    whole = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    expected_text, expected_finish = reference(FakeTokenizer().encode(prompt), [stop], SamplingParams())
    assert whole.choices[0].text == streamed == expected_text
    assert whole.choices[0].finish_reason == expected_finish


def test_stop_string_split_across_tokens_and_inside_a_character(client):
    # find a reply with a multi-byte character and stop on a string ending in it
    messages = [{"role": "user", "content": "q"}]
    ids = FakeTokenizer().chat_ids(messages)
    full = FakeTokenizer().decode(reference_ids(ids, MAX_TOKENS, SamplingParams()))
    position = next(i for i, ch in enumerate(full) if ord(ch) > 127 and i >= 2)
    stop = full[position - 2: position + 1]
    whole = client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                           stop=[stop])
    assert whole.choices[0].message.content == full[: full.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    # generation stopped at the stop string: fewer tokens than the limit
    assert whole.usage.completion_tokens < MAX_TOKENS
