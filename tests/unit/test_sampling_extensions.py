"""Frequency and presence penalties, logit_bias and the logits processor in choose_token."""
from __future__ import annotations

import torch

from moestream.engine.sampling import adjusted_logits, choose_token
from moestream.engine.types import SamplingParams, TokenHistory


def test_penalties_follow_openai_formula():
    logits = torch.zeros(6)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, logit_bias=((5, 3.0), (0, -100.0)))
    out = adjusted_logits(logits, params, position=10, generated=[1, 1, 1, 2])
    # token 1 seen 3 times: -(0.5*3 + 1); token 2 once: -(0.5 + 1); bias on 5 and 0
    assert out.tolist() == [-100.0, -2.5, -1.5, 0.0, 0.0, 3.0]
    assert logits.tolist() == [0.0] * 6  # the input is left alone


def test_history_records_choices_and_rolls_back():
    history = TokenHistory()
    params = SamplingParams(presence_penalty=2.0, history=history)
    logits = torch.tensor([1.0, 0.9, 0.0])
    chosen = [choose_token(logits, params, position=p) for p in range(7, 10)]
    assert chosen == [0, 1, 2]  # each pick is penalized once generated, so the next best follows
    assert history.before(9) == [0, 1]
    history.record(8, 2)  # re-choosing position 8 (a rollback) forgets what came after it
    assert history.before(10) == [0, 2] and history.before(8) == [0]


def test_allowed_tokens_sees_generated_tokens_and_masks():
    import numpy as np

    seen = []

    def only_even(generated):
        seen.append(list(generated))
        return np.arange(4) % 2 == 0

    params = SamplingParams(temperature=1.0, seed=3, allowed_tokens=only_even, history=TokenHistory())
    logits = torch.tensor([0.0, 5.0, 0.1, 5.0])
    tokens = [choose_token(logits, params, position=p) for p in range(4)]
    assert all(t % 2 == 0 for t in tokens)
    assert seen == [tokens[:i] for i in range(4)]
    # an explicit generated list wins over the history
    choose_token(logits, SamplingParams(allowed_tokens=only_even), position=0, generated=[9, 9])
    assert seen[-1] == [9, 9]


def test_equal_params_ignore_processor_and_history():
    a = SamplingParams(seed=1, history=TokenHistory())
    assert a == SamplingParams(seed=1) and hash(a) == hash(SamplingParams(seed=1))


def test_a_verifications_greedy_choices_read_at_once_equal_one_row_at_a_time():
    """Emitter.choices (one argmax and one host read for all rows) picks what choose_token picks
    row by row, ties included (the first maximal index), and declines where a choice needs more
    than its row."""
    from moestream.engine.emitter import Emitter

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(9, 500, generator=g)
    rows[2, 7] = rows[2, 300] = rows[2].max() + 1  # a tie: the first index wins
    rows[5] = 0.0  # all equal
    plain = SamplingParams()
    emit = Emitter([1, 2], {"tokens": []}, sampling=plain, logprobs=0, eos_ids=(), should_stop=None,
                   stop_at_eos=False)
    expected = [choose_token(rows[i], plain, position=i) for i in range(9)]
    assert emit.choices(rows) == expected and expected[2] == 7 and expected[5] == 0
    for params in (SamplingParams(temperature=0.7), SamplingParams(repetition_penalty=1.2),
                   SamplingParams(frequency_penalty=0.5), SamplingParams(logit_bias=((3, 5.0),))):
        other = Emitter([1, 2], {"tokens": []}, sampling=params, logprobs=0, eos_ids=(), should_stop=None,
                        stop_at_eos=False)
        assert other.choices(rows) is None
    event = emit(rows[0], expected[0])
    assert event.token_id == expected[0]
