"""A CPU job's experts computed in parallel (moestream.kernels.cpu_expert_jobs): the bits of one
after another for every thread count and job size (4- and 8-bit records, threads finishing in any
order), each expert's pairs on one thread, experts running side by side, errors raised to the caller
with the runner still usable."""
import random
import threading
import time

import pytest
import torch

from moestream.kernels.cpu_expert_jobs import ExpertJobs, default_job_threads, group_by_expert
from moestream.kernels.cpu_experts import repack
from moestream.quant.affine import QuantSpec, quantize

HIDDEN, INTER, GROUP = 256, 128, 64
PROJS = ("gate_proj", "up_proj", "down_proj")


def expert(bits, seed):
    g = torch.Generator().manual_seed(seed)
    rec = {}
    for proj, (rows, cols) in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}.items():
        w, s, b = quantize(torch.randn(rows, cols, generator=g, dtype=torch.bfloat16), bits, GROUP)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return repack(rec, {p: QuantSpec(bits, GROUP) for p in PROJS}, torch.bfloat16)


@pytest.fixture(scope="module")
def experts():
    return {bits: [expert(bits, seed) for seed in range(12)] for bits in (4, 8)}


class Jittery:
    """An expert that sleeps a random while before each row, so threads finish in any order."""

    def __init__(self, inner, rng):
        self.inner, self.rng = inner, rng

    def weighted_row_into(self, x, out, weight):
        time.sleep(self.rng.random() * 0.002)
        self.inner.weighted_row_into(x, out, weight)


def job(experts, tokens, picks, seed):
    """T tokens' picks (distinct experts per token, overlapping between tokens) and weights."""
    rng = random.Random(seed)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ids = [rng.sample(range(len(experts)), picks) for _ in range(tokens)]
    w = [[rng.random() for _ in range(picks)] for _ in range(tokens)]
    return x, ids, w


def sequential(experts, x, ids, w):
    """The rows as the host path computed them before: one pair after another, on the caller's threads."""
    rows = [experts[e].ffn(x[t:t + 1])[0].float() * torch.tensor(w[t][a]) for t in range(len(ids))
            for a, e in enumerate(ids[t])]
    return torch.stack(rows)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("tokens,picks", [(1, 1), (1, 8), (3, 4), (4, 8)])
def test_rows_and_sums_have_the_bits_of_one_after_another(experts, bits, threads, tokens, picks):
    pool = experts[bits]
    x, ids, w = job(pool, tokens, picks, seed=tokens * 10 + picks)
    want = sequential(pool, x, ids, w)
    rng = random.Random(threads)
    jittery = [Jittery(e, rng) for e in pool]
    runner = ExpertJobs(threads)
    try:
        for round_ in range(2):  # the same job twice: threads finish in another order
            rows = torch.full((tokens * picks, HIDDEN), float("nan"))
            runner.run([(jittery[e], x[t:t + 1], rows[t * picks + a], w[t][a]) for t in range(tokens)
                        for a, e in enumerate(ids[t])])
            assert torch.equal(rows, want), f"round {round_}"
            sums = rows.view(tokens, picks, HIDDEN).sum(1)  # the caller's per-token sum, in its fixed order
            assert torch.equal(sums, want.view(tokens, picks, HIDDEN).sum(1))
    finally:
        runner.close()


def test_the_kernels_bits_do_not_depend_on_the_intra_op_threads(experts):
    """The assumption the job threads rest on: one intra-op thread gives the bits of several."""
    saved = torch.get_num_threads()
    x = torch.randn(1, HIDDEN).to(torch.bfloat16)
    try:
        outs = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            outs.append([e.ffn(x) for e in experts[4] + experts[8]])
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))


def test_an_experts_pairs_stay_on_one_thread_most_pairs_first():
    a, b, c = object(), object(), object()
    pairs = [(b, 0), (a, 1), (c, 2), (a, 3), (b, 4), (a, 5)]
    assert group_by_expert(pairs) == [[(a, 1), (a, 3), (a, 5)], [(b, 0), (b, 4)], [(c, 2)]]

    seen: dict[int, set] = {}

    class Noting:
        def weighted_row_into(self, x, out, weight):
            seen.setdefault(id(self), set()).add(threading.get_ident())
            time.sleep(0.001)

    runner = ExpertJobs(3)
    try:
        noting = [Noting() for _ in range(4)]
        runner.run([(noting[i % 4], None, None, 0.0) for i in range(24)])
    finally:
        runner.close()
    assert len(seen) == 4 and all(len(threads) == 1 for threads in seen.values())


def test_experts_run_side_by_side():
    """Three experts that each wait for the other two: done only if three threads run them at once."""
    all_three = threading.Barrier(3, timeout=10)

    class Waiting:
        def weighted_row_into(self, x, out, weight):
            all_three.wait()

    runner = ExpertJobs(3)
    try:
        runner.run([(Waiting(), None, None, 0.0) for _ in range(3)])
    finally:
        runner.close()
    assert not all_three.broken


def test_an_error_reaches_the_caller_and_the_runner_goes_on(experts):
    class Failing:
        def weighted_row_into(self, x, out, weight):
            raise RuntimeError("broken expert")

    pool = experts[4]
    x, ids, w = job(pool, 1, 6, seed=1)
    runner = ExpertJobs(2)
    try:
        rows = torch.zeros(6, HIDDEN)
        pairs = [(pool[e], x[0:1], rows[a], w[0][a]) for a, e in enumerate(ids[0])]
        with pytest.raises(RuntimeError, match="broken expert"):
            runner.run(pairs + [(Failing(), None, None, 0.0)])
        runner.run(pairs)  # the next job is computed as ever
        assert torch.equal(rows, sequential(pool, x, ids, w))
    finally:
        runner.close()


def test_close_stops_the_helpers_and_the_caller_keeps_its_threads():
    saved = torch.get_num_threads()
    runner = ExpertJobs(3)
    assert torch.get_num_threads() == saved  # the helpers set their own count, not the caller's
    helpers = list(runner._helpers)
    runner.close()
    assert not any(t.is_alive() for t in helpers)
    default = ExpertJobs(0)
    default.close()
    assert default.threads == default_job_threads() >= 1
