"""Tool calls in each family's own format (gpt-oss harmony, DeepSeek-V3, Gemma 4, Hermes/Mistral):
read whole and streamed in random pieces alike; malformed calls stay text."""
from __future__ import annotations

import json
import random

import pytest

from moestream.server.tools import ToolCallParser, tool_format
from tool_replies import parse_tool_calls

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


HARMONY_PLAIN = [
    "Just text, no channels at all: a <| b |> c <|end of nothing",
    "<|channel|>analysis<|message|>Think <b>hard</b>.<|end|><|start|>assistant<|channel|>final<|message|>4 < 5, and 2|3.",
]


@pytest.mark.parametrize("text", HARMONY_PLAIN)
def test_harmony_reply_without_tools(text):
    """A harmony reply is read even without tools: the final channel is the content, analysis is
    dropped, and text without channel markers passes through unchanged; any split gives the same."""
    content, calls = parse_tool_calls(text, "harmony")
    assert calls == []
    assert content == (text if "<|channel|>" not in text else "4 < 5, and 2|3.")
    for seed in range(20):
        assert _streamed("harmony", text, random.Random(seed)) == (content, [])


def _special_tokenizer(specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"] + specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(['commentary to=functions json {"city": "Paris"} function get_weather'] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
HARMONY_SPECIALS = ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|return|>", "<|start|>", "<|end|>"]


@pytest.mark.parametrize("fmt,specials,eos,good", [
    ("harmony", HARMONY_SPECIALS, ["<|call|>", "<|return|>"],
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
    ("deepseek", list(DS.values()), ["<|endoftext|>"],
     DS["tool calls begin"] + DS["tool call begin"] + "function" + DS["tool sep"] +
     'get_weather\n```json\n{"city": "Paris"}\n```' + DS["tool call end"] + DS["tool calls end"]),
])
def test_forced_call_grammar_follows_the_model_format(fmt, specials, eos, good):
    """A required call is constrained to the model's own format, and what it allows parses as a call;
    the Hermes form and a wrong argument are refused."""
    import llguidance
    import llguidance.hf

    from moestream.server.grammar import tool_call_grammar

    tok = _special_tokenizer(specials)
    ll = llguidance.hf.from_tokenizer(tok, eos_token=[tok.convert_tokens_to_ids(e) for e in eos])
    token_id = {s: tok.convert_tokens_to_ids(s) for s in specials}.get
    grammar, used = tool_call_grammar(FORCED_TOOLS, "*", parallel=False, fmt=fmt, token_id=token_id)
    assert used == fmt

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts(good)
    assert not accepts(good.replace('"city"', '"town"'))
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n')
    assert _calls(parse_tool_calls(good, fmt)[1]) == [("get_weather", {"city": "Paris"})]
    # markers that are not single tokens: the Hermes grammar, and the reply is read as Hermes
    assert tool_call_grammar(FORCED_TOOLS, "noop", parallel=False, fmt=fmt)[1] == "hermes"
    assert tool_call_grammar(FORCED_TOOLS, "noop", parallel=False, fmt="gemma", token_id=token_id)[1] == "hermes"
