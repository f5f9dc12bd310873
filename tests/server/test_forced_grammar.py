"""Forced calls and JSON schemas as the grammar holds them: objects closed unless the schema opens
them, and a forced call that is complete within its token budget whatever the model would write."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

llguidance = pytest.importorskip("llguidance")
np = pytest.importorskip("numpy")

from moestream.server.closed_schema import closed  # noqa: E402
from moestream.server.closing import OUTSIDE, Closing  # noqa: E402
from moestream.server.grammar import GrammarMask, GrammarTokenizer, json_schema_grammar, tool_call_grammar  # noqa: E402
from tool_replies import parse_tool_calls  # noqa: E402

ORDINARY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NESTED = {"type": "object", "properties": {
    "city": {"type": "string"},
    "when": {"type": "object", "properties": {"day": {"type": "integer"}}, "required": ["day"]},
    "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
    "unit": {"anyOf": [{"type": "object", "properties": {"c": {"type": "boolean"}}}, {"type": "null"}]},
    "home": {"$ref": "#/$defs/Place"}},
    "required": ["city", "when"], "$defs": {"Place": {"type": "object", "properties": {"name": {"type": "string"}}}}}


def _tool(parameters: dict, name: str = "get_weather") -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": parameters}}]


def _call(arguments: str, name: str = "get_weather") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>\n'


@dataclass
class Vocab:
    tok: Any  # a transformers tokenizer
    grammar: GrammarTokenizer
    eos: list[int]


def _vocab(tok, ends: list[str]) -> Vocab:
    eos = [tok.convert_tokens_to_ids(e) for e in ends]
    return Vocab(tok, GrammarTokenizer(type("Tokenizer", (), {"backend": tok})(), eos), eos)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Vocab:
    from tiny import build_tokenizer
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return _vocab(PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")), ["<|im_end|>"])


def _accepts(vocab: Vocab, grammar: str, text: str) -> bool:
    matcher = vocab.grammar.matcher(grammar)
    return matcher.consume_tokens(vocab.tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def _forced(parameters: dict) -> str:
    return tool_call_grammar(_tool(parameters), "get_weather", parallel=False)[0]


def test_an_ordinary_schema_allows_no_other_keys(vocab):
    grammar = _forced(ORDINARY)
    assert _accepts(vocab, grammar, _call('{"city": "Paris"}'))
    assert not _accepts(vocab, grammar, _call('{"city": "cry", "keywords": {}}'))
    assert not _accepts(vocab, json_schema_grammar(ORDINARY), '{"city": "cry", "keywords": {}}')
    assert _accepts(vocab, json_schema_grammar(ORDINARY), '{"city": "cry"}')


def test_an_explicit_additional_properties_is_kept(vocab):
    assert _accepts(vocab, _forced({**ORDINARY, "additionalProperties": True}), _call('{"city": "a", "k": [1]}'))
    typed = _forced({**ORDINARY, "additionalProperties": {"type": "integer"}})
    assert _accepts(vocab, typed, _call('{"city": "a", "k": 1}'))
    assert not _accepts(vocab, typed, _call('{"city": "a", "k": "x"}'))
    # an object that names none of its keys is a map, not an empty object
    assert _accepts(vocab, json_schema_grammar({"type": "object"}), '{"any": 1}')


@pytest.mark.parametrize("extra", [
    '{"city": "a", "when": {"day": 1, "hour": 2}}',
    '{"city": "a", "when": {"day": 1}, "tags": [{"k": "x", "v": 1}]}',
    '{"city": "a", "when": {"day": 1}, "unit": {"c": true, "f": false}}',
    '{"city": "a", "when": {"day": 1}, "home": {"name": "x", "zip": "y"}}',
    '{"city": "a", "when": {"day": 1}, "more": 1}',
])
def test_objects_are_closed_at_every_depth(vocab, extra):
    """Nested objects, array items, anyOf branches and $defs (reached through a $ref inside the
    call object) all refuse a key they do not list; the same arguments without it are a call."""
    grammar = _forced(NESTED)
    assert _accepts(vocab, grammar, _call('{"city": "a", "when": {"day": 1}, "tags": [{"k": "x"}], "unit": '
                                          '{"c": true}, "home": {"name": "x"}}'))
    assert not _accepts(vocab, grammar, _call(extra))
    several = tool_call_grammar(_tool(NESTED) + _tool(NESTED, "other"), "*", parallel=False)[0]
    assert _accepts(vocab, several, _call('{"city": "a", "when": {"day": 1}, "home": {"name": "x"}}', "other"))
    assert not _accepts(vocab, several, _call(extra, "other"))


def test_joined_branches_keep_each_others_keys(vocab):
    """allOf branches (and anyOf beside the parent's own properties) are intersected: closing each
    would forbid the other's keys, so the parent is closed over them all."""
    a = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    both = json_schema_grammar({"allOf": [a, b]})
    assert _accepts(vocab, both, '{"a": 1, "b": 2}') and not _accepts(vocab, both, '{"a": 1, "b": 2, "c": 3}')
    refs = json_schema_grammar({"$defs": {"A": a, "B": b}, "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]})
    assert _accepts(vocab, refs, '{"a": 1, "b": 2}') and not _accepts(vocab, refs, '{"a": 1, "b": 2, "c": 3}')
    beside = json_schema_grammar({"type": "object", "properties": {"x": {"type": "integer"}}, "anyOf": [a, b]})
    assert _accepts(vocab, beside, '{"x": 1, "b": 2}') and not _accepts(vocab, beside, '{"x": 1, "b": 2, "c": 3}')


def test_closing_copies_the_schema():
    schema = json.loads(json.dumps(NESTED))
    out = closed(schema)
    assert schema == NESTED and out is not schema
    assert out["additionalProperties"] is False and out["$defs"]["Place"]["additionalProperties"] is False
    assert closed({"type": "object"}) == {"type": "object"}


def _stubborn(tok, rng: random.Random):
    """A model that never ends what it may go on with: it avoids quotes, closing brackets and the
    end tokens whenever the grammar leaves it any other token."""
    def pick(allowed: np.ndarray, eos: list[int]) -> int:
        ids = [int(i) for i in np.flatnonzero(allowed) if i not in eos]
        open_ended = [i for i in ids if not set(tok.decode([i])) & set('"}]\\')]
        return rng.choice(open_ended or ids or eos)
    return pick


def _generate(vocab: Vocab, grammar: str, budget: int, *, closing: bool, seed: int = 0) -> tuple[list[int], bool]:
    """The tokens a stubborn model writes under the mask, and whether it drew an end token within
    the budget (the engine stops there; at the budget it stops for length)."""
    matcher = vocab.grammar.matcher(grammar)
    mask = GrammarMask(matcher, Closing(vocab.grammar.closing_vocab(), budget) if closing else None)
    pick, out = _stubborn(vocab.tok, random.Random(seed)), []
    while len(out) < budget:
        token = pick(mask(out), vocab.eos)
        if token in vocab.eos:
            return out, True
        out.append(token)
    return out, False


def _minimal(vocab: Vocab, grammar: str) -> int:
    return vocab.grammar.closing_vocab().need(vocab.grammar.matcher(grammar), OUTSIDE, 10_000)


@pytest.mark.parametrize("parameters", [ORDINARY, NESTED])
@pytest.mark.parametrize("extra", [0, 1, 5, 40, 200])
def test_a_forced_call_is_complete_within_its_budget(vocab, parameters, extra):
    grammar = _forced(parameters)
    budget = _minimal(vocab, grammar) + extra
    tokens, ended = _generate(vocab, grammar, budget, closing=True, seed=extra)
    assert ended and len(tokens) < budget
    (call,) = parse_tool_calls(vocab.tok.decode(tokens))[1]
    arguments = json.loads(call.arguments)
    assert call.name == "get_weather" and isinstance(arguments["city"], str)
    assert set(arguments) <= set(parameters["properties"]) and set(parameters["required"]) <= set(arguments)
    if parameters is NESTED:
        assert set(arguments["when"]) == {"day"} and isinstance(arguments["when"]["day"], int)


@pytest.mark.parametrize("fmt", ["harmony", "deepseek"])
@pytest.mark.parametrize("extra", [0, 30])
def test_calls_in_the_model_format_finish_too(fmt, extra):
    """gpt-oss ends its one call with <|call|> (an end token), DeepSeek its run of calls with a
    marker of its own, which the walk prefers to another call."""
    from test_tool_formats import DS, HARMONY_SPECIALS, _special_tokenizer

    specials, ends = {"harmony": (HARMONY_SPECIALS, ["<|call|>", "<|return|>"]),
                      "deepseek": (list(DS.values()), ["<|endoftext|>"])}[fmt]
    tok = _special_tokenizer(specials)
    vocab = _vocab(tok, ends)
    token_id = {s: tok.convert_tokens_to_ids(s) for s in specials}.get
    grammar, used = tool_call_grammar(_tool(ORDINARY), "get_weather", parallel=True, fmt=fmt, token_id=token_id)
    assert used == fmt
    budget = _minimal(vocab, grammar) + extra
    tokens, ended = _generate(vocab, grammar, budget, closing=True, seed=extra)
    assert ended and len(tokens) < budget
    calls = parse_tool_calls(tok.decode(tokens), fmt)[1]
    assert calls and all(c.name == "get_weather" and set(json.loads(c.arguments)) == {"city"} for c in calls)


def test_without_the_look_ahead_a_stubborn_model_never_finishes(vocab):
    tokens, ended = _generate(vocab, _forced(ORDINARY), 200, closing=False)
    assert not ended and len(tokens) == 200 and parse_tool_calls(vocab.tok.decode(tokens))[1] == []


def test_the_look_ahead_follows_rollbacks(vocab):
    """The masks depend only on the tokens so far: going back and forth (as speculative decoding
    does) gives the masks a straight run gives."""
    grammar = _forced(ORDINARY)
    budget = _minimal(vocab, grammar) + 12
    tokens, _ = _generate(vocab, grammar, budget, closing=True, seed=3)

    def fresh() -> GrammarMask:
        return GrammarMask(vocab.grammar.matcher(grammar), Closing(vocab.grammar.closing_vocab(), budget))

    straight = fresh()
    expected = [straight(tokens[:k]).copy() for k in range(len(tokens) + 1)]
    jumpy, rng = fresh(), random.Random(1)
    for k in [rng.randrange(len(tokens) + 1) for _ in range(60)]:
        assert (jumpy(tokens[:k]) == expected[k]).all()


def test_a_vocabulary_given_as_bytes_compiles_grammars():
    """A tokenizer without a transformers backend lists its tokens' bytes instead."""
    from moestream.server.grammar import json_object_grammar

    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    class Bytes:
        bos_token_id = None
        special_token_ids = [256]

        def token_bytes(self) -> list[bytes]:
            return tokens

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return list(text.encode())

    matcher = GrammarTokenizer(Bytes(), [256]).matcher(json_object_grammar())
    assert matcher.consume_tokens(list(b'{"a": 1}')) and matcher.is_accepting()


def test_a_ref_beside_own_properties_is_intersected_with_them(vocab):
    """{"$ref": X, "properties": ...}: the object's own keys and the ref's, no others (as allOf; the
    grammar writes keys in that order)."""
    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    beside = {"$defs": {"B": base}, "$ref": "#/$defs/B", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    grammar = json_schema_grammar(beside)
    assert _accepts(vocab, grammar, '{"x": 2, "a": 1}')
    assert not _accepts(vocab, grammar, '{"x": 2, "a": 1, "c": 3}')
    forced = _forced(beside)  # inside the call object, its refs rebased
    assert _accepts(vocab, forced, _call('{"x": 2, "a": 1}'))
    assert not _accepts(vocab, forced, _call('{"x": 2, "a": 1, "c": 3}'))


def test_anchor_refs_resolve_wherever_the_schema_sits(vocab):
    place = {"$anchor": "place", "type": "object", "properties": {"name": {"type": "string"}}}
    schema = {"type": "object", "properties": {"home": {"$ref": "#place"}}, "required": ["home"],
              "$defs": {"Place": place}}
    for grammar, wrap in ((json_schema_grammar(schema), lambda t: t), (_forced(schema), _call)):
        assert _accepts(vocab, grammar, wrap('{"home": {"name": "x"}}'))
        assert not _accepts(vocab, grammar, wrap('{"home": {"name": "x", "zip": 1}}'))
    beside = {"$defs": {"Place": place}, "$ref": "#place", "properties": {"x": {"type": "integer"}}}
    grammar = json_schema_grammar(beside)
    assert _accepts(vocab, grammar, '{"x": 2, "name": "n"}')
    assert not _accepts(vocab, grammar, '{"x": 2, "name": "n", "c": 3}')
