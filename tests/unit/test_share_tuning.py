"""`--cpu-experts auto` on the device-driven path (moestream.cpu_share.tuning) with made-up
timings: the count that finishes the CPU and the link together, the first jobs left out, a share
that falls to nothing for a slow CPU and rises again once its probes measure it fast."""
import pytest

from moestream.cpu_share.tuning import LINK_S, START_SHARE, ShareTuner, best_count

MB = 2_650_000  # one 4-bit Qwen3-30B-A3B expert record
US = 1e-6


@pytest.mark.parametrize("misses, cpu_each, handover, copy_each, want", [
    (6, 66, 20, 52, 2),  # H200-like: 2 take max(20 + 2*66, 4*52) = 208 us, 3 max(218, 156), none 312
    (6, 66, 400, 52, 0),  # a hand-over larger than the link's whole work: nothing
    (6, 5000, 20, 52, 0),  # a slow CPU: nothing
    (1, 10, 5, 100, 1),  # one miss, the CPU far quicker
    (0, 10, 5, 100, 0),
    (8, 52, 0, 52, 4),  # equal speeds, no hand-over: half
])
def test_the_best_count_finishes_both_sides_together(misses, cpu_each, handover, copy_each, want):
    assert best_count(misses, cpu_each * US, handover * US, copy_each * US) == want


def fast_job(tuner, misses=6, experts=1):
    tuner.record(job_s=(66 * experts + 15) * US, kernel_s=66 * US * experts, nbytes=MB * experts, experts=experts,
                 misses=misses)


def test_the_first_jobs_are_left_out():
    tuner = ShareTuner(copy_gb_s=51.0)
    for _ in range(tuner.warm_jobs):  # start-up: 0.72 GB/s over the job's whole latency
        tuner.record(job_s=MB / 0.72e9, kernel_s=MB / 0.9e9, nbytes=MB, experts=1, misses=6)
    assert not tuner.measured and tuner.share() == START_SHARE
    fast_job(tuner)
    assert tuner.kernel_gb_s == pytest.approx(MB / 66e-6 / 1e9)
    assert tuner.handover_s == pytest.approx(15 * US + LINK_S)
    assert tuner.share() == pytest.approx(2 / 6)  # max(25 + 2*66, 4*52) = 208 us; 3: max(223, 156)


def test_the_hand_over_is_measured_apart_from_the_kernels():
    tuner = ShareTuner(copy_gb_s=51.0, warm_jobs=0)
    for _ in range(20):  # kernels at 40 GB/s, 300 us of Python around them
        tuner.record(job_s=366 * US, kernel_s=66 * US, nbytes=MB, experts=1, misses=6)
    assert tuner.kernel_gb_s == pytest.approx(40.15, rel=0.01)
    assert tuner.handover_s == pytest.approx(310 * US)
    assert tuner.share() == 0  # 310 + 66 > 6 * 52: every expert is the link's


def test_a_share_that_fell_to_nothing_rises_again_with_the_probes():
    tuner = ShareTuner(copy_gb_s=51.0, warm_jobs=0)
    for _ in range(6):  # a CPU busy with something else: 5 ms per expert
        tuner.record(job_s=5100 * US, kernel_s=5000 * US, nbytes=MB, experts=1, misses=6)
    assert tuner.share() == 0
    shares = []
    for _ in range(24):  # the probes (one expert each) now find it at 40 GB/s
        fast_job(tuner)
        shares.append(tuner.share())
    assert shares[0] == 0 and shares[-1] == pytest.approx(2 / 6)
    assert shares == sorted(shares)  # rising, never back down


def test_the_share_follows_the_calls_misses():
    tuner = ShareTuner(copy_gb_s=51.0, warm_jobs=0)
    for _ in range(30):
        fast_job(tuner, misses=12)
    # 12 misses: 25 + 6*66 = 421 against 6*52 = 312, 5: 355 vs 364
    assert tuner.misses == pytest.approx(12, rel=0.01) and tuner.share() == pytest.approx(5 / 12)


def test_each_number_of_misses_gets_its_own_count():
    tuner = ShareTuner(copy_gb_s=51.0, warm_jobs=0)
    assert tuner.counts(4) == [0, 1, 1, 2, 2]  # unmeasured: half, rounded
    for _ in range(30):
        fast_job(tuner, misses=6)
    counts = tuner.counts(12)
    assert counts[6] == round(tuner.share() * 6) == 2 and counts[12] == 5  # as the tests above
    assert counts[1] == 0  # one miss: 25 + 66 us on the CPU against 52 on the link
    assert counts == sorted(counts) and all(c <= m for m, c in enumerate(counts))
    nbytes = MB
    for m, c in enumerate(counts):
        assert c == best_count(m, tuner.kernel_s_per_byte * nbytes, tuner.handover_s, nbytes / 51e9)
