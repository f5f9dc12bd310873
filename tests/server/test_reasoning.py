"""Reasoning split from the content: think blocks (also opened by the prompt, also unterminated),
gpt-oss's harmony channels, tool calls after the reasoning, the same parts for any split of the
reply into deltas (tags cut between them), reasoning tokens, and which format a model gets."""
from __future__ import annotations

import json
import random

import pytest

from moestream.server.reasoning import (Reasoning, ReasoningMode, ReplyReader, opens_think, reasoning_format,
                                        split_reply)
from moestream.server.tools import ParsedCall

THINK = ReasoningMode("think")
INSIDE = ReasoningMode("think", inside=True)
HARMONY = ReasoningMode("harmony")


def _split(mode, text: str, tools: str = "") -> tuple[str, str, list]:
    reasoning, content, calls = split_reply(ReplyReader(mode, tools).read([(text, 0)]))
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


def _pieces(mode, pieces: list[str], tools: str = "") -> list:
    """The parts of a reply fed in `pieces`, neighbours of one kind joined (pieces split them anywhere)."""
    reader = ReplyReader(mode, tools)
    parts = [p for piece in pieces for p in reader.feed(piece)] + reader.finish()
    out: list = []
    for part in parts:
        if isinstance(part, ParsedCall):
            out.append(("call", part.name, part.arguments))
        elif isinstance(part, Reasoning) and out and out[-1][0] == "reasoning":
            out[-1] = ("reasoning", out[-1][1] + part.text)
        elif isinstance(part, str) and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + part)
        elif isinstance(part, Reasoning):
            out.append(("reasoning", part.text))
        elif part:
            out.append(("content", part))
    return out


CASES = [
    # (mode, tools, reply, reasoning, content, calls)
    (THINK, "", "<think>\nThe user asks 2+2.\nThat is 4.\n</think>\n\nIt is 4.", "The user asks 2+2.\nThat is 4.",
     "It is 4.", []),
    (THINK, "", "  <think>x < y</think>Done", "x < y", "Done", []),
    (THINK, "", "No thoughts, and a <think> tag later </think> stays.", "",
     "No thoughts, and a <think> tag later </think> stays.", []),
    (THINK, "", "<think>\nstill thinking when the tokens ran out", "still thinking when the tokens ran out", "", []),
    (THINK, "", "<thin", "", "<thin", []),
    (INSIDE, "", "The prompt opened it.\n</think>\n\nAnswer.", "The prompt opened it.", "Answer.", []),
    (INSIDE, "", "cut short inside the prompt's block", "cut short inside the prompt's block", "", []),
    (INSIDE, "", "</think>Straight to it.", "", "Straight to it.", []),
    (THINK, "hermes", '<think>\nNeed the weather.\n</think>\n\nChecking.<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}\n</tool_call>', "Need the weather.", "Checking.",
     [("get_weather", {"city": "Paris"})]),
    (INSIDE, "hermes", 'I should call it.</think><tool_call>{"name": "f", "arguments": {}}</tool_call>',
     "I should call it.", "", [("f", {})]),
    (HARMONY, "harmony", "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hello there!", "The user greets.", "Hello there!", []),
    (HARMONY, "harmony", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>', "Need weather.", "",
     [("get_weather", {"city": "Rome"})]),
    (HARMONY, "harmony", "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>commentary"
     "<|message|>Let me look.<|end|><|start|>assistant<|channel|>analysis<|message|> Second.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "First. Second.", "Let me look.Done.", []),
    (HARMONY, "harmony", "<|channel|>analysis<|message|>cut off mid-thought", "cut off mid-thought", "", []),
    (HARMONY, "harmony", "Plain text <| without | channels", "", "Plain text <| without | channels", []),
    # a built-in tool's call on the analysis channel is no reasoning: the call reader gets it
    (HARMONY, "harmony", "<|channel|>analysis to=browser.search<|message|>{}<|call|>", "",
     "<|channel|>analysis to=browser.search<|message|>{}<|call|>", []),
]


@pytest.mark.parametrize("mode,tools,text,reasoning,content,calls", CASES)
def test_whole_reply_split(mode, tools, text, reasoning, content, calls):
    assert _split(mode, text, tools) == (reasoning, content, calls)


@pytest.mark.parametrize("mode,tools,text,reasoning,content,calls", CASES)
def test_any_split_into_deltas_reads_the_same(mode, tools, text, reasoning, content, calls):
    whole = _pieces(mode, [text], tools)
    for cut in range(1, len(text)):  # every single cut, so every tag is split in every place
        assert _pieces(mode, [text[:cut], text[cut:]], tools) == whole, cut
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _pieces(mode, pieces, tools) == whole, pieces
    assert _pieces(mode, list(text), tools) == whole  # one character at a time


def test_reasoning_streams_while_it_is_written():
    reader = ReplyReader(THINK)
    assert reader.feed("<thi") == []  # maybe the tag: held
    assert reader.feed("nk>\nStep one") == [Reasoning("Step one")]
    assert reader.feed(", step two.\n</th") == [Reasoning(", step two.")]  # the tag's start and the newline held
    assert reader.feed("ink>\n\nAns") == ["Ans"]
    assert reader.feed("wer") == ["wer"]
    assert reader.finish() == []
    harmony = ReplyReader(HARMONY, "harmony")
    assert harmony.feed("<|channel|>analysis<|mess") == []
    assert harmony.feed("age|>Thinking") == [Reasoning("Thinking")]
    assert harmony.feed(" on<|en") == [Reasoning(" on")]
    assert harmony.feed("d|><|start|>assistant<|channel|>final<|message|>Hi") == ["Hi"]


def test_reasoning_tokens_are_the_deltas_that_start_in_it():
    reader = ReplyReader(THINK, "hermes")
    deltas = [("<think>", 1), ("\n", 1), ("Hmm", 1), (".", 1), ("\n", 1), ("</think>", 1), ("\n\n", 1), ("Hi", 1)]
    assert split_reply(reader.read(deltas))[:2] == ("Hmm.", "Hi")
    assert reader.reasoning_tokens == 6
    # tokens whose text was held back (a stop string's start) come with the delta that carries it
    reader = ReplyReader(INSIDE)
    reader.read([("ab", 3), ("</think>", 1), ("c", 0), ("d", 2)])
    assert reader.reasoning_tokens == 4
    unterminated = ReplyReader(THINK)
    unterminated.read([("<think>", 1), ("a", 1), ("b", 2)])
    assert unterminated.reasoning_tokens == 4
    harmony = ReplyReader(HARMONY, "harmony")
    harmony.read([("<|channel|>", 1), ("analysis", 1), ("<|message|>", 1), ("Hm", 1), ("<|end|>", 1),
                  ("<|start|>", 1), ("assistant", 1), ("<|channel|>", 1), ("final", 1), ("<|message|>", 1),
                  ("Yes", 1)])
    assert harmony.reasoning_tokens == 5
    plain = ReplyReader(THINK)
    plain.read([("Just", 1), (" an answer", 2)])
    assert plain.reasoning_tokens == 0


def test_the_format_follows_the_model():
    qwen3 = "{%- if enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    assert reasoning_format(qwen3, None, "hermes") == "think"
    assert reasoning_format("{{ messages }}", "deepseek_v3", "deepseek") == "think"  # the family, without the tag
    assert reasoning_format("{{ messages }}", "mixtral", "hermes") == ""
    assert reasoning_format("{{ tools }}{{ tool_calls }}<|channel|>", "gpt_oss", "harmony") == "harmony"
    assert reasoning_format(None, "olmoe", "hermes") == ""


def test_the_prompt_may_open_the_block():
    assert opens_think("<|im_start|>assistant\n<think>\n")
    assert opens_think("<｜Assistant｜><think>")
    assert not opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not opens_think("<|im_start|>assistant\n")
