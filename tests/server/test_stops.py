"""Stop-string matching with hold-back, and detokenization that never splits a character."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_engine import FakeTokenizer, PIECES, FIRST_PIECE
from moestream.server.stops import IncrementalDecoder, StopMatcher
from stop_reference import cut_at_first_stop

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

ALPHABET = "ab é😀\n"


def run_matcher(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_inside_one_piece():
    assert run_matcher(["hello world"], ["o w"]) == ("hell", True)


def test_stop_across_pieces_is_held_back():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("text </") == "text "  # "</" could still become the stop string
    assert matcher.feed("en") == ""
    assert matcher.feed("d> more") == ""
    assert matcher.stopped and matcher.matched == "</end>"


def test_false_start_is_released():
    matcher = StopMatcher(["abc"])
    assert matcher.feed("xab") == "x"
    assert matcher.feed("d") == "abd"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_tail_released_at_the_end():
    assert run_matcher(["xa", "b"], ["abc"]) == ("xab", False)


def test_earliest_ending_stop_wins_whatever_the_split():
    # "c" is complete before "abcd" is: a reader going character by character stops at "c"
    for pieces in (["abcd"], ["ab", "cd"], list("abcd"), ["a", "bcd"]):
        assert run_matcher(pieces, ["abcd", "c"]) == ("ab", True), pieces
    # on a tie in the end, the longer (earlier-starting) one wins
    assert run_matcher(["xabc"], ["bc", "abc"]) == ("x", True)


def test_no_stops_passes_text_through():
    matcher = StopMatcher([])
    assert matcher.feed("abc") == "abc"
    assert StopMatcher(["", ""]).feed("abc") == "abc"  # empty stop strings are ignored


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4))
def test_streamed_matching_equals_the_reference_cut(text, cuts, stops):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run_matcher(pieces, stops) == cut_at_first_stop(text, stops)
    # and the same as feeding one character at a time
    assert run_matcher(list(text), stops) == cut_at_first_stop(text, stops)


# ------------------------------------------------------------------------------ incremental decoding

def stream_decode(ids: list[int]) -> list[str]:
    tokenizer = FakeTokenizer()
    decoder = IncrementalDecoder(tokenizer.decode)
    out = [decoder.push(i) for i in ids]
    out.append(decoder.flush())
    return out


def test_multibyte_character_waits_for_its_last_byte():
    ids = list("é😀".encode())
    deltas = stream_decode(ids)
    assert deltas == ["", "é", "", "", "", "😀", ""]


def test_truncated_character_is_flushed_as_replacement():
    ids = list("a😀".encode())[:-1]
    deltas = stream_decode(ids)
    assert "".join(deltas) == "a\ufffd" and deltas[0] == "a"


token_ids = st.lists(st.one_of(st.integers(0, 255), st.integers(FIRST_PIECE, FIRST_PIECE + len(PIECES) - 1)),
                     max_size=40)


@settings(max_examples=300, deadline=None)
@given(ids=token_ids)
def test_deltas_join_to_the_whole_decode_and_never_end_mid_character(ids):
    deltas = stream_decode(ids)
    assert "".join(deltas) == FakeTokenizer().decode(ids)
    for delta in deltas[:-1]:
        assert not delta.endswith("\ufffd") or delta == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30))
def test_valid_utf8_in_byte_tokens_never_shows_a_replacement(text):
    deltas = stream_decode(list(text.encode()))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text
