"""Replacement policies: hand-made sequences where each policy's definition decides the victim,
and property tests that drive the bare policies with random admit/hit/forget/evict sequences."""

from __future__ import annotations

import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from moestream.experts.policy import (
    POLICY_NAMES,
    ARCPolicy,
    ClockPolicy,
    LFUPolicy,
    LRUPolicy,
    ReplacementPolicy,
    make_policy,
)


def anything(slot: int) -> bool:
    return True


def fill(policy: ReplacementPolicy, keys: str) -> None:
    for slot, key in enumerate(keys):
        policy.admit(slot, key)


# -- make_policy ---------------------------------------------------------------------------------


def test_make_policy_builds_every_name():
    for name in POLICY_NAMES:
        policy = make_policy(name, 4)
        assert policy.name == name
        assert policy.capacity == 4
        assert len(policy) == 0


def test_make_policy_unknown_name_lists_the_names():
    with pytest.raises(ValueError) as info:
        make_policy("fifo", 4)
    for name in POLICY_NAMES:
        assert name in str(info.value)


def test_make_policy_options():
    assert make_policy("lfu", 4, half_life=8).half_life == 8.0
    with pytest.raises(ValueError, match="half_life"):
        make_policy("clock", 4, half_life=8)
    with pytest.raises(ValueError):
        make_policy("lfu", 4, half_life=0)
    with pytest.raises(ValueError):
        make_policy("lru", 0)


# -- CLOCK ---------------------------------------------------------------------------------------


def test_clock_admit_sets_the_bit_so_a_full_pool_sweeps_once_and_takes_the_hand_slot():
    clock = ClockPolicy(3)
    fill(clock, "ABC")
    clock.hit(0)
    # Every bit is set (admit and hit both set it): the first sweep clears all three and the
    # hand comes back to slot 0.
    assert clock.evict("D", anything) == 0
    assert clock.hand == 1
    assert not clock.referenced(1) and not clock.referenced(2)


def test_clock_second_chance():
    clock = ClockPolicy(3)
    fill(clock, "ABC")
    assert clock.evict("D", anything) == 0  # clears every bit, takes A
    clock.admit(0, "D")  # bits: D=1, B=0, C=0; hand at 1
    clock.hit(1)  # B used again
    assert clock.evict("E", anything) == 2  # B gets its second chance, C goes
    assert clock.hand == 0
    assert not clock.referenced(1)
    clock.admit(2, "E")
    assert clock.evict("F", anything) == 1  # D's bit cleared, B (no longer referenced) goes
    assert clock.hand == 2
    assert not clock.referenced(0)


def test_clock_skips_non_evictable_slots_without_clearing_their_bit():
    clock = ClockPolicy(3)
    fill(clock, "ABC")
    assert clock.evict("D", lambda s: s != 0) == 1
    assert clock.referenced(0)  # skipped, bit kept
    assert clock.hand == 2


def test_clock_returns_none_when_nothing_is_evictable_and_keeps_state():
    clock = ClockPolicy(3)
    fill(clock, "AB")  # slot 2 free
    assert clock.evict("D", lambda s: False) is None
    assert len(clock) == 2
    assert clock.referenced(0) and clock.referenced(1)
    clock.forget(0)
    clock.forget(1)
    assert clock.evict("D", anything) is None  # nothing occupied


# -- LRU -----------------------------------------------------------------------------------------


def test_lru_order():
    lru = LRUPolicy(3)
    fill(lru, "ABC")
    lru.hit(0)  # order B C A
    assert lru.order() == [1, 2, 0]
    assert lru.evict("D", anything) == 1
    lru.admit(1, "D")  # order C A D
    assert lru.evict("E", lambda s: s != 2) == 0  # C not evictable: next oldest, A
    assert lru.order() == [2, 1]
    lru.forget(2)
    assert lru.evict("E", anything) == 1
    assert lru.evict("E", anything) is None


# -- ARC -----------------------------------------------------------------------------------------


def scan(policy: ReplacementPolicy, keys, resident: dict) -> None:
    """Request each key once, as the cache does on a miss: free slot first, else evict."""
    for key in keys:
        free = [s for s in range(policy.capacity) if s not in resident]
        slot = free[0] if free else policy.evict(key, anything)
        resident.pop(slot, None)
        policy.admit(slot, key)
        resident[slot] = key


@pytest.mark.parametrize("name,survives", [("arc", True), ("lru", False)])
def test_arc_scan_does_not_flush_a_frequently_used_key(name, survives):
    policy = make_policy(name, 4)
    resident: dict[int, object] = {}
    scan(policy, ["hot"], resident)
    policy.hit(0)
    policy.hit(0)
    scan(policy, [f"once{i}" for i in range(20)], resident)
    assert (resident.get(0) == "hot") is survives


def test_arc_ghost_hit_in_b1_raises_p_and_readmits_into_t2():
    arc = ARCPolicy(2)
    fill(arc, "AB")
    arc.hit(1)  # T1 = {A}, T2 = {B}
    assert arc.evict("C", anything) == 0  # |T1| = 1 > p = 0: A leaves T1 and becomes a B1 ghost
    assert list(arc.b1) == ["A"]
    arc.admit(0, "C")
    assert arc.p == 0
    # A comes back: p rises by max(1, |B2|/|B1|) = 1, so T1 (|T1| = 1, not above p) is spared
    # and T2's oldest, B, goes (with p still 0 it would have been C).
    assert arc.evict("A", anything) == 1
    arc.admit(1, "A")
    assert arc.p == 1
    assert dict(arc.t2) == {1: "A"}
    assert dict(arc.t1) == {0: "C"}
    assert list(arc.b1) == [] and list(arc.b2) == ["B"]


def test_arc_adapts_p_with_the_ghost_sizes_seen_at_the_miss():
    arc = ARCPolicy(3)
    fill(arc, "YZX")
    arc.hit(0)
    arc.hit(1)  # T1 = {X}, T2 = {Y, Z}
    assert arc.evict("W", anything) == 2  # X -> B1
    arc.admit(2, "W")
    arc.hit(2)  # T1 = {}, T2 = {Y, Z, W}
    assert arc.evict("V", anything) == 0  # Y -> B2
    arc.admit(0, "V")
    arc.hit(0)
    assert arc.evict("U", anything) == 1  # Z -> B2
    arc.admit(1, "U")  # T1 = {U}, T2 = {W, V}, B1 = {X}, B2 = {Y, Z}
    assert (list(arc.b1), list(arc.b2), arc.p) == (["X"], ["Y", "Z"], 0)
    # X returns: p += max(1, |B2|/|B1|) = 2 with the sizes before W's eviction adds a B2 ghost.
    assert arc.evict("X", anything) == 2  # |T1| = 1 <= p: T2's oldest, W
    arc.admit(2, "X")
    assert arc.p == 2
    assert list(arc.b2) == ["Y", "Z", "W"] and dict(arc.t2) == {0: "V", 2: "X"}


def test_arc_one_time_keys_filling_t1_leave_no_ghost():
    # With T1 holding the whole cache, ARC drops T1's oldest without remembering it.
    arc = ARCPolicy(2)
    fill(arc, "AB")
    assert arc.evict("C", anything) == 0
    arc.admit(0, "C")
    assert list(arc.b1) == []


def test_arc_ghost_hit_in_b2_lowers_p():
    arc = ARCPolicy(2)
    fill(arc, "AB")
    arc.hit(0)
    arc.hit(1)  # both in T2
    arc.p = 2.0
    # |T1| = 0: the victim must come from T2 (oldest: A), which becomes a B2 ghost.
    assert arc.evict("C", anything) == 0
    assert list(arc.b2) == ["A"]
    arc.admit(0, "C")  # T1 = {C}, T2 = {B}
    assert arc.evict("A", anything) == 0  # p drops to 1 = |T1| and A is in B2: victim from T1
    arc.admit(0, "A")
    assert arc.p == 1
    assert dict(arc.t2) == {1: "B", 0: "A"}
    assert list(arc.b1) == ["C"]


def test_arc_falls_back_to_the_other_list_when_the_preferred_one_is_not_evictable():
    arc = ARCPolicy(3)
    fill(arc, "ABC")
    arc.hit(2)  # T1 = {A, B}, T2 = {C}; p = 0 prefers T1
    assert arc.evict("D", lambda s: s == 2) == 2
    assert list(arc.b2) == ["C"]
    assert arc.evict("D", lambda s: False) is None


def test_arc_ghost_lists_stay_bounded():
    arc = ARCPolicy(3)
    resident: dict[int, object] = {}
    scan(arc, range(50), resident)
    assert len(arc.t1) + len(arc.b1) <= 3
    assert len(arc) + len(arc.b1) + len(arc.b2) <= 6


# -- LFU -----------------------------------------------------------------------------------------


def test_lfu_evicts_the_least_used_and_breaks_ties_by_age():
    lfu = LFUPolicy(3, half_life=math.inf)  # no decay, so equal counts tie exactly
    fill(lfu, "ABC")
    lfu.hit(0)
    lfu.hit(2)
    lfu.hit(2)
    assert lfu.evict("D", anything) == 1  # B used once
    lfu.admit(1, "D")
    lfu.hit(1)  # A and D both at 2: A is older
    assert lfu.evict("E", anything) == 0


@pytest.mark.parametrize("half_life,victim", [(1e12, "recent"), (4.0, "old")])
def test_lfu_decay_ages_out_an_old_favourite(half_life, victim):
    lfu = LFUPolicy(2, half_life=half_life)
    lfu.admit(0, "old")
    for _ in range(19):
        lfu.hit(0)  # 20 uses, long ago
    lfu.admit(1, "recent")
    for _ in range(4):
        lfu.hit(1)  # 5 uses, just now
    # Without decay the old favourite's 20 uses win. With a half-life of 4 accesses its score
    # is at most about 6.1, and 5 accesses later about 2.6, below the recent key's 3.6.
    if victim == "old":
        assert lfu.score(0) == pytest.approx(2.56, abs=0.01)
        assert lfu.score(1) == pytest.approx(3.64, abs=0.01)
    else:
        assert lfu.score(0) == pytest.approx(20) and lfu.score(1) == pytest.approx(5)
    assert lfu.evict("new", anything) == {"old": 0, "recent": 1}[victim]


# -- properties of the bare policies -------------------------------------------------------------

policy_ops = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.integers(0, 24), st.frozensets(st.integers(0, 7), max_size=2)),
        st.tuples(st.just("hit"), st.integers(0, 1000)),
        st.tuples(st.just("forget"), st.integers(0, 1000)),
        st.tuples(st.just("evict"), st.integers(0, 24), st.frozensets(st.integers(0, 7))),
    ),
    min_size=10,
    max_size=80,
)


def check_arc(arc: ARCPolicy, resident: dict) -> None:
    c = arc.capacity
    assert 0 <= arc.p <= c
    assert len(arc.t1) + len(arc.b1) <= c
    assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 2 * c
    assert not set(arc.t1) & set(arc.t2)
    assert not set(arc.b1) & set(arc.b2)
    keys_in_cache = set(arc.t1.values()) | set(arc.t2.values())
    assert not keys_in_cache & (set(arc.b1) | set(arc.b2))
    assert {**arc.t1, **arc.t2} == resident


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 8),
    half_life=st.sampled_from([1.0, 4.0, 64.0]),
    ops=policy_ops,
)
def test_policy_properties(name, capacity, half_life, ops):
    options = {"half_life": half_life} if name == "lfu" else {}
    policy = make_policy(name, capacity, **options)
    resident: dict[int, object] = {}  # slot -> key, what the policy should be tracking

    def evict(key, blocked):
        can = lambda s: s not in blocked  # noqa: E731
        expect_none = not any(can(s) for s in resident)
        victim = policy.evict(key, can)
        assert (victim is None) == expect_none
        event("nothing evictable" if expect_none else "eviction")
        if victim is not None:
            assert victim in resident and can(victim)
            assert victim not in policy
            del resident[victim]
        return victim

    for op in ops:
        kind = op[0]
        if kind == "request":
            key, blocked = op[1], op[2]
            if key in resident.values():
                policy.hit(next(s for s, k in resident.items() if k == key))
            else:
                free = [s for s in range(capacity) if s not in resident]
                slot = free[0] if free else evict(key, blocked)
                if slot is not None:
                    policy.admit(slot, key)
                    resident[slot] = key
        elif kind in ("hit", "forget") and resident:
            slot = sorted(resident)[op[1] % len(resident)]
            if kind == "hit":
                policy.hit(slot)
            else:
                policy.forget(slot)
                del resident[slot]
        elif kind == "evict":
            evict(op[1], op[2])
        assert len(policy) == len(resident) <= capacity
        assert all(s in policy for s in resident)
        if isinstance(policy, ARCPolicy):
            check_arc(policy, resident)
        if isinstance(policy, ClockPolicy):
            assert 0 <= policy.hand < capacity
