"""Greedy choices many rows at a time (the batch scheduler's step): the same indices as
choose_token one row at a time, ties and NaN included; a Receipt read key by key is its JSON."""
from __future__ import annotations

import pytest
import torch

from moestream.engine.emitter import Emitter
from moestream.engine.receipt import Receipt
from moestream.engine.sampling import argmax_index, argmax_rows, choose_token, plain_argmax
from moestream.engine.types import SamplingParams, TokenHistory

V = 151_936


def awkward_rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = []
    tied = torch.randn(V, generator=g)
    tied[[9, 70_000, 151_000]] = 40.0  # equal maxima: the first wins
    rows.append(tied)
    nan = torch.randn(V, generator=g)
    nan[[11, 5000]] = float("nan")  # a NaN counts as the largest, as in torch.argmax
    nan[3] = 1e9
    rows.append(nan)
    rows.append(torch.full((V,), float("-inf")))
    inf = torch.full((V,), float("-inf"))
    inf[[123, 124]] = float("inf")
    rows.append(inf)
    rows.append(torch.zeros(V))
    for _ in range(20):  # bfloat16-rounded logits tie often
        row = torch.randn(V, generator=g).to(torch.bfloat16).float()
        row[torch.randint(0, V, (3,), generator=g)] = row.max()
        rows.append(row)
    return rows


def test_argmax_rows_equal_torch_argmax_one_row_at_a_time():
    rows = awkward_rows()
    expected = [int(torch.argmax(row)) for row in rows]
    assert [argmax_index(row) for row in rows] == expected
    assert argmax_rows(rows) == expected
    assert argmax_rows([r.view(1, -1)[-1] for r in rows[:3]]) == expected[:3]  # views, as a step's last rows
    assert argmax_rows([]) == []
    # decode-ahead's argmax over the last logits row, [1, V] -> [1], chooses the same
    assert [int(torch.argmax(row.view(1, -1), dim=-1)[0]) for row in rows] == expected
    greedy = SamplingParams()
    assert [choose_token(row, greedy, position=5) for row in rows] == expected


def test_plain_argmax_only_without_anything_that_changes_the_row():
    assert plain_argmax(SamplingParams())
    for params in (SamplingParams(temperature=0.7), SamplingParams(repetition_penalty=1.1),
                   SamplingParams(frequency_penalty=0.5), SamplingParams(presence_penalty=0.5),
                   SamplingParams(logit_bias=((3, 5.0),)), SamplingParams(history=TokenHistory())):
        assert not plain_argmax(params), params


def emitter(sampling: SamplingParams, logprobs: int = 0) -> tuple[Emitter, dict]:
    state: dict = {"tokens": [], "finish": "length"}
    return Emitter([1, 2, 3], state, sampling=sampling, logprobs=logprobs, eos_ids={0}, should_stop=None,
                   stop_at_eos=True), state


def test_emitter_with_a_chosen_token_gives_the_event_it_chooses_itself():
    rows = awkward_rows()[5:10]
    chosen = argmax_rows(rows)
    (a, sa), (b, sb) = emitter(SamplingParams(), logprobs=3), emitter(SamplingParams(), logprobs=3)
    for row, token in zip(rows, chosen):
        ea, eb = a(row), b(row, token)
        assert (ea.token_id, ea.logprob, ea.top_logprobs) == (eb.token_id, eb.logprob, eb.top_logprobs)
    assert sa == sb and a.seq == b.seq
    eos, state = emitter(SamplingParams())
    assert eos(rows[0], 0) is None and state["finish"] == "stop"  # a chosen EOS ends it as its own choice would
    sampled, _ = emitter(SamplingParams(temperature=0.8, seed=1))
    with pytest.raises(ValueError):
        sampled(rows[0], 5)


def test_receipt_reads_like_its_json():
    receipt = Receipt.of_run(prompt_tokens=16, reused=4, generated=8, finish="length", prefill_s=0.5, decode_s=1.0,
                             before={"hits": 10, "misses": 1}, after={"hits": 30, "misses": 3,
                                                                      "hit_rate_per_layer": {"0": 0.5}},
                             device="cpu", model="m")
    as_json = receipt.to_json()
    assert dict(receipt) == as_json and list(receipt) == list(as_json) and len(receipt) == len(as_json)
    assert receipt["misses"] == 2 and receipt["experts"]["hit_rate_per_layer"] == {"0": 0.5}
    assert receipt.get("nothing") is None and "to_json" not in receipt
    with pytest.raises(KeyError):
        receipt["to_json"]
