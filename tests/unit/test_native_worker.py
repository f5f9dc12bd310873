"""The native CPU-share worker (moestream.cpu_share.worker) against a mailbox of plain tensors,
the device played by the test: a request's withheld pairs come back as the native kernels' rows
(the same bits as a direct call), the answer is the sequence number after them; a request it cannot
serve (a layer without a share, an expert not in host RAM, an id out of range, a malformed header)
is answered with the number's negative and counted, and the next request is served again; the
per-job figures reach the ring; fault injection; stop and restart-free close."""
import time
from types import SimpleNamespace

import pytest
import torch

from moestream.cpu_share import kernels as native
from moestream.cpu_share.worker import NativeWorker
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")
HIDDEN, INTER, EXPERTS = 128, 64, 4


def record(seed):
    g, rec = torch.Generator().manual_seed(seed), {}
    for proj, (rows, cols) in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}.items():
        w, s, b = quantize(torch.randn(rows, cols, generator=g).bfloat16(), 4, 64)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return rec


@pytest.fixture
def mailbox():
    """A worker of two threads."""
    assert native.load() is not None, native.reason()
    blobs = [native.record_blob(record(s)) for s in range(EXPERTS)]
    layout = native.layout(blobs[0][1], {p: QuantSpec(4, 64) for p in PROJS})
    layouts = torch.zeros((3, native.LAYOUT_LEN), dtype=torch.int64)
    layouts[2] = layout  # layer 2 has a share; 0 and 1 none
    addresses = torch.zeros((3, EXPERTS), dtype=torch.int64)
    addresses[2, :EXPERTS - 1] = torch.tensor([b.data_ptr() for b, _ in blobs[:EXPERTS - 1]])  # the last: not in RAM
    box = SimpleNamespace(header=torch.zeros(5, dtype=torch.int64), x_in=torch.randn(4, HIDDEN).bfloat16(),
                          ids_in=torch.zeros(64, dtype=torch.int32), w_in=torch.zeros(64),
                          mask_in=torch.zeros(64, dtype=torch.int8), rows_out=torch.full((64, HIDDEN), float("nan")),
                          ack=torch.zeros(1, dtype=torch.int64))
    worker = NativeWorker(box, layouts, addresses, threads=2, busy_s=0.005, idle_sleep_s=0.0002, host_pool=torch.zeros(1))
    yield SimpleNamespace(box=box, worker=worker, blobs=[b for b, _ in blobs], layout=layout, seq=0)
    worker.close()


def post(m, layer, tokens, ids, weights, withheld, misses=3):
    """The device's request, the sequence number last; then its wait for the answer (its number or
    the negative)."""
    box, P = m.box, len(ids)
    box.ids_in[:P] = torch.tensor(ids, dtype=torch.int32)
    box.w_in[:P] = torch.tensor(weights)
    box.mask_in[:P] = torch.tensor(withheld, dtype=torch.int8)
    box.header[1:5] = torch.tensor([layer, tokens, P, misses])
    m.seq += 1
    box.header[0] = m.seq
    deadline = time.perf_counter() + 5
    while int(box.ack[0]) not in (m.seq, -m.seq) and time.perf_counter() < deadline:
        time.sleep(0)
    return int(box.ack[0])


def test_the_withheld_pairs_come_back_as_the_kernels_rows(mailbox):
    m = mailbox
    ids, weights, withheld = [0, 2, 1, 2], [0.5, 0.25, 1.5, -0.75], [1, 0, 0, 1]  # 2 tokens x 2 picks
    assert post(m, 2, 2, ids, weights, withheld) == m.seq == 1
    expect = torch.empty(2, HIDDEN)
    native.weighted_rows(native.load(), m.layout, m.blobs, [0, 2], [0, 1], [0.5, -0.75],
                                 m.box.x_in[:2].float(), expect, threads=1)
    assert torch.equal(m.box.rows_out[0], expect[0]) and torch.equal(m.box.rows_out[3], expect[1])
    assert m.box.rows_out[1:3].isnan().all()  # the device's own pairs are left alone
    time.sleep(0.01)
    assert m.worker.activations == native.activations()  # the layout's default, as the direct call's
    count = m.worker.count()
    assert count["jobs"] == 1 and count["experts"] == 2 and count["pairs"] == 2 and count["errors"] == 0
    assert count["bytes"] == 2 * int(m.layout[-1])
    (job,) = m.worker.new_jobs()
    assert job["experts"] == 2 and job["misses"] == 3 and job["layer"] == 2 and job["job_ns"] >= job["kernel_ns"] > 0
    assert m.worker.new_jobs() == []
    assert isinstance(m.worker.pinned(), bool)


@pytest.mark.parametrize("layer, ids, tokens, why", [
    (0, [1, 2], 1, "no CPU share in this layer"),
    (2, [3, 0], 1, "not in host RAM"),
    (2, [9, 0], 1, "out of range"),
    (2, [1, 2], 3, "malformed"),
])
def test_a_request_it_cannot_serve_is_answered_negative_and_the_next_is_served(mailbox, layer, ids, tokens, why):
    m = mailbox
    assert post(m, layer, tokens, ids, [1.0, 1.0], [1, 0]) == -1
    assert why in m.worker.last_error() and m.worker.count()["errors"] == 1
    assert post(m, 2, 1, [1, 2], [1.0, 1.0], [1, 1]) == 2  # served again
    assert not m.box.rows_out[:2].isnan().any()


def test_injected_faults_and_delays(mailbox):
    m = mailbox
    m.worker.set_faults(1, 0.0)  # the second job on fails
    assert post(m, 2, 1, [0, 1], [1.0, 1.0], [1, 0]) == 1
    assert post(m, 2, 1, [0, 1], [1.0, 1.0], [1, 0]) == -2
    assert "injected fault in CPU job 1" in m.worker.last_error()
    m.worker.set_faults(None, 0.02)
    t0 = time.perf_counter()
    assert post(m, 2, 1, [0, 1], [1.0, 1.0], [1, 0]) == 3
    assert time.perf_counter() - t0 >= 0.02


def test_close_stops_the_thread(mailbox):
    m = mailbox
    assert m.worker._worker.running()
    m.worker.close()
    assert not m.worker._worker.running()
    m.box.header[0] = 99  # nobody answers any more
    time.sleep(0.01)
    assert int(m.box.ack[0]) == 0


def test_the_team_leaves_cores_for_the_engine(monkeypatch):
    """A team never takes the engine's cores: at most the usable cores less RESERVED_CORES, at least one."""
    from moestream.cpu_share import worker as native_worker

    for cores, asked, team in ((16, 15, 14), (16, 9, 9), (16, 64, 14), (2, 8, 1), (1, 1, 1)):
        monkeypatch.setattr(native_worker.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)), raising=False)
        assert native_worker.team_size(asked) == team, (cores, asked)
