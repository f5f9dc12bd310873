"""The device's side of the CPU share's mailbox (moestream.kernels.triton_mailbox) under Triton's
CPU interpreter: where the lookup withheld nothing, no program writes anything to the mailbox, the
sequence number stands, the rows are not taken and the fallback's lookup is gated off; where it
withheld some, the request is posted whole with the next sequence number, the answered rows land on
the withheld pairs only, and a missing answer names exactly the withheld pairs for the fallback."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter import interpreted_module  # noqa: E402

H, P, E = 40, 6, 10  # hidden (not a power of two: masked tails), pairs (3 tokens x 2 picks), experts


def mailbox():
    return dict(x_out=torch.full((4, H), -9.0, dtype=torch.bfloat16), ids_out=torch.full((8,), -9, dtype=torch.int32),
                w_out=torch.full((8,), -9.0), mask_out=torch.full((8,), -9, dtype=torch.int8),
                head_out=torch.full((5,), -9, dtype=torch.int64))


def request():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)  # the engine's dtype: the worker's, no rounding
    ids = torch.tensor([4, 1, 7, 4, 2, 9], dtype=torch.int64)
    w = torch.rand(P, generator=g)
    table = torch.tensor([0, -1, 3, -1, 5, -1, -1, 2, -1, -1], dtype=torch.int32)  # 1 and 9 withheld, 4 2 7 held
    return x, ids, w, table


@pytest.mark.parametrize("withheld", [0, 2], ids=["empty", "two-withheld"])
def test_post_and_publish_write_only_a_non_empty_request(withheld):
    tm = interpreted_module("moestream.kernels.triton_mailbox")
    x, ids, w, table = request()
    box, seq = mailbox(), torch.tensor([11], dtype=torch.int64)
    empty = torch.zeros(1, dtype=torch.int64)
    count = torch.tensor([withheld, 5], dtype=torch.int64)
    before = {k: v.clone() for k, v in box.items()}
    tm.post(count, seq, x, ids, w, table, 3, box["x_out"], box["ids_out"], box["w_out"], box["mask_out"], box["head_out"])
    tm.publish(count, seq, box["head_out"], empty)
    if not withheld:
        assert int(seq) == 11 and int(empty) == 1
        assert all(torch.equal(box[k], before[k]) for k in box)
        return
    assert int(seq) == 12 and int(empty) == 0
    assert box["head_out"].tolist() == [12, 3, 3, P, 5]
    assert torch.equal(box["x_out"][:3], x) and torch.equal(box["x_out"][3], before["x_out"][3])
    assert box["ids_out"][:P].tolist() == ids.tolist() and torch.equal(box["w_out"][:P], w)
    assert box["mask_out"][:P].tolist() == [0, 1, 0, 0, 0, 1]


@pytest.mark.parametrize("withheld, ok", [(0, 1), (2, 1), (2, 0)], ids=["empty", "answered", "late"])
def test_rows_are_taken_for_the_withheld_pairs_only_where_answered(withheld, ok):
    tm = interpreted_module("moestream.kernels.triton_mailbox")
    _, ids, _, table = request()
    rows = torch.randn(8, H)
    o = torch.full((P, H), 5.0)
    tm.take_rows(torch.tensor([withheld, 4]), torch.tensor([ok], dtype=torch.int32), ids, table, rows, o)
    taken = [p for p in range(P) if torch.equal(o[p], rows[p])]
    assert taken == ([1, 5] if withheld and ok else [])
    assert all(torch.equal(o[p], torch.full((H,), 5.0)) for p in range(P) if p not in taken)


@pytest.mark.parametrize("withheld, ok", [(0, 1), (0, 0), (2, 1), (2, 0)], ids=["empty", "empty-flag-0", "answered", "late"])
def test_the_fallback_names_the_withheld_pairs_only_where_the_answer_is_missing(withheld, ok):
    tm = interpreted_module("moestream.kernels.triton_mailbox")
    _, ids, _, table = request()
    lookup, lost = torch.full((P,), -5, dtype=torch.int64), torch.full((P,), -5, dtype=torch.int64)
    gate, count = torch.tensor([7], dtype=torch.int32), torch.tensor([3], dtype=torch.int64)
    tm.lost_pairs(torch.tensor([withheld, 4]), torch.tensor([ok], dtype=torch.int32), ids, table, lookup, lost, gate,
                  count)
    failed = bool(withheld) and not ok
    assert lost.tolist() == ([-1, 1, -1, -1, -1, 9] if failed else [-1] * P)
    assert lookup.tolist() == ([4, 1, 4, 4, 4, 9] if failed else [4] * P)  # the first held pair's expert elsewhere
    assert int(gate) == int(failed) and int(count) == 3 + 2 * failed
    # after the fallback's lookup gave 1 and 9 slots: the table for those only
    after = table.clone()
    after[1], after[9] = 6, 8
    redo = torch.full((E,), -5, dtype=torch.int32)
    tm.redo_table(gate, lost, after, redo)
    want = [-1] * E
    if failed:
        want[1], want[9] = 6, 8
    assert redo.tolist() == want
