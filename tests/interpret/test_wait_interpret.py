"""The device's wait for the CPU's answer (moestream.kernels.triton_wait) under Triton's CPU
interpreter: the answer there gives 1; a failure mark (the negative) or a budget spent without an
answer gives 0 and counts one late call; where the device asked nothing it gives 1 at once whatever
the host wrote, and counts nothing."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter import interpreted_module  # noqa: E402


@pytest.mark.parametrize("answer, asked, ok", [(7, 2, 1), (-7, 1, 0), (6, 1, 0), (0, 3, 0), (0, 0, 1), (-7, 0, 1)],
                         ids=["answered", "failed", "older", "none", "nothing-asked", "nothing-asked-old-failure"])
def test_the_wait_reads_the_answer(answer, asked, ok):
    tw = interpreted_module("moestream.kernels.triton_wait")
    ack = torch.tensor([answer], dtype=torch.int64)
    seq = torch.tensor([7, 3, 1, 8], dtype=torch.int64)  # the header: sequence number first
    flag = torch.tensor([5], dtype=torch.int32)
    late = torch.tensor([2], dtype=torch.int64)
    tw.wait_for_host(ack, seq, flag, late, torch.tensor([asked, 6], dtype=torch.int64), 50)
    assert int(flag) == ok
    assert int(late) == 2 + (1 - ok)
