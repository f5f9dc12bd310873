"""Tool calls in each family's own format (gpt-oss harmony, DeepSeek-V3, Gemma 4, Hermes/Mistral):
read whole and streamed in random pieces alike; malformed calls stay text."""
from __future__ import annotations

import json
import random

import pytest

from moestream.server.tools import ToolCallParser, parse_tool_calls, tool_format

DS = {w: "<\uff5c" + w.replace(" ", "\u2581") + "\uff5c>" for w in
      ("tool calls begin", "tool calls end", "tool call begin", "tool call end", "tool sep")}

HARMONY = ("<|channel|>analysis<|message|>The user wants weather.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
           '{"city": "Paris"}<|call|>')
HARMONY_HEADER_RECIPIENT = ('<|channel|>analysis<|message|>think<|end|><|start|>assistant to=functions.get_weather'
                            '<|channel|>commentary json<|message|>{"city": "Rome"}')  # <|call|> was the stop token
HARMONY_FINAL = "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"
DEEPSEEK = ("Checking." + DS["tool calls begin"] + DS["tool call begin"] + "function" + DS["tool sep"] +
            'get_weather\n```json\n{"city": "Paris"}\n```' + DS["tool call end"] + "\n" + DS["tool call begin"] +
            "function" + DS["tool sep"] + 'get_weather\n```json\n{"city": "Rome"}\n```' + DS["tool call end"] +
            DS["tool calls end"])
DEEPSEEK_V31 = (DS["tool calls begin"] + DS["tool call begin"] + "get_weather" + DS["tool sep"] + '{"city": "Oslo"}' +
                DS["tool call end"] + DS["tool calls end"])
GEMMA = ('Sure.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,metric:true,'
         'hours:[1,2.5],extra:{note:<|"|>a:b<|"|>}}<tool_call|>')

CASES = [
    ("harmony", HARMONY, "", [("get_weather", {"city": "Paris"})]),
    ("harmony", HARMONY_HEADER_RECIPIENT, "", [("get_weather", {"city": "Rome"})]),
    ("harmony", HARMONY_FINAL, "Hello there!", []),
    ("harmony", HARMONY_FINAL + "<|return|>", "Hello there!", []),
    ("deepseek", DEEPSEEK, "Checking.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("deepseek", DEEPSEEK_V31, "", [("get_weather", {"city": "Oslo"})]),
    ("gemma", GEMMA, "Sure.", [("get_weather", {"city": "Paris, FR", "days": 3, "metric": True, "hours": [1, 2.5],
                                                "extra": {"note": "a:b"}})]),
    ("hermes", 'Hi<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Hi", [("f", {"a": 1})]),
    ("hermes", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(fmt: str, text: str, rng: random.Random):
    parser, parts, i = ToolCallParser(fmt), [], 0
    while i < len(text):
        step = rng.randint(1, 6)
        parts += parser.feed(text[i:i + step])
        i += step
    parts += parser.finish()
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if not isinstance(p, str)]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_and_streamed_agree(fmt, text, content, calls):
    whole_content, whole_calls = parse_tool_calls(text, fmt)
    assert (whole_content, _calls(whole_calls)) == (content, calls)
    rng = random.Random(len(text))
    for _ in range(30):
        got_content, got_calls = _streamed(fmt, text, rng)
        assert (got_content, _calls(got_calls)) == (content, calls)


def test_harmony_final_content_streams_before_the_end():
    parser = ToolCallParser("harmony")
    out = parser.feed(HARMONY_FINAL[:-3])
    assert "".join(out) == "Hello the"  # sent as it comes, not held to the end


MALFORMED = [
    ("harmony", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": <|call|>'),
    ("harmony", "<|channel|>mystery<|message|>x<|end|>"),
    ("deepseek", DS["tool call begin"] + "function" + DS["tool sep"] + "f\n```json\n{oops}\n```" + DS["tool call end"]),
    ("deepseek", DS["tool call begin"] + "no separator" + DS["tool call end"]),
    ("gemma", '<|tool_call>call:f{a:<|"|>unclosed}<tool_call|>'),
    ("gemma", "<|tool_call>not a call<tool_call|>"),
    ("gemma", "<|tool_call>call:f{a:1"),
]


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_calls_stay_text(fmt, text):
    content, calls = parse_tool_calls(text, fmt)
    assert calls == [] and content == text
    assert _streamed(fmt, text, random.Random(1)) == (text, [])


def test_plain_text_passes_through_every_format():
    text = "No calls here: <| not a marker, [TOOL or <tool_ either."
    for fmt in ("hermes", "harmony", "deepseek", "gemma"):
        assert parse_tool_calls(text, fmt) == (text, [])


def test_format_is_read_off_the_template_then_the_family():
    tools = "{% for t in tools %}{% endfor %}{{ m.tool_calls }}"
    assert tool_format(tools + "<|start|>assistant<|channel|>final<|message|>") == "harmony"
    assert tool_format(tools + DS["tool call begin"]) == "deepseek"
    assert tool_format(tools + "<|tool_call>call:") == "gemma"
    assert tool_format(tools, "gpt_oss") == "harmony"
    assert tool_format(tools, "qwen3_moe") == "hermes"
    # a template that does not know tools: they are described in Hermes form, so replies are read so
    assert tool_format("{{ messages }}", "gpt_oss") == "hermes"
    assert tool_format(None, "deepseek_v3") == "hermes"
