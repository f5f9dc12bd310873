"""The batch scheduler's greedy choice for a step's rows on CUDA: one stacked argmax and one copy
to the host give the indices choose_token gives each row alone (ties, NaN and bfloat16-rounded
logits included), with one wait for the device, not one per row."""
import pytest
import torch

from moestream.engine.sampling import argmax_rows, choose_token
from moestream.engine.types import SamplingParams

pytestmark = pytest.mark.gpu
V = 151_936


def test_argmax_rows_on_cuda_equal_each_row_alone():
    g = torch.Generator(device="cuda").manual_seed(7)
    rows = []
    for k in range(16):
        row = torch.randn(V, device="cuda", generator=g).to(torch.bfloat16).float()
        if k % 3 == 0:
            row[[k, 1000 + k, 150_000]] = row.max() + 1  # equal maxima
        if k == 5:
            row[[17, 99]] = float("nan")
        rows.append(row.clone())  # separate tensors, as step_many returns a slot's logits
    rows.append(torch.full((V,), float("-inf"), device="cuda"))
    expected = [int(torch.argmax(row)) for row in rows]
    assert expected == [choose_token(row, SamplingParams(), position=3) for row in rows]
    assert argmax_rows(rows) == expected
    views = [torch.stack(rows[:4])[i] for i in range(4)]
    assert argmax_rows(views) == expected[:4]
