"""The slot directory: free slots first, pinned and loading slots never evicted, failed loads freed,
one pool that busy layers borrow from; checked by hand and by random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from moestream.experts.directory import CacheFullError, Reservation, SlotDirectory
from moestream.experts.policy import POLICY_NAMES


def load(directory: SlotDirectory, *keys) -> list[Reservation]:
    """Reserve and finish loading each key, as the cache does on a miss."""
    out = []
    for key in keys:
        out.append(directory.reserve(key))
        directory.mark_ready(key)
    return out


def test_free_slots_are_used_before_any_eviction():
    d = SlotDirectory(3)
    filled = load(d, (0, 1), (0, 2), (0, 3))
    assert [(r.slot, r.evicted) for r in filled] == [(0, None), (1, None), (2, None)]
    assert d.occupied() == 3 and d.loading_count() == 0
    r = d.reserve((0, 4))
    assert r.evicted in {(0, 1), (0, 2), (0, 3)}
    assert d.lookup(r.evicted) is None
    assert d.lookup((0, 4)) == r.slot
    assert d.is_loading((0, 4))
    assert len(d.keys()) == 3 and d.keys()[(0, 4)] == r.slot


def test_clock_second_chance_through_the_directory():
    d = SlotDirectory(3, policy="clock")
    load(d, "A", "B", "C")
    assert d.reserve("D") == Reservation(0, "A")  # every bit set: a full sweep, then A
    d.mark_ready("D")
    d.touch("B")
    assert d.reserve("E") == Reservation(2, "C")  # B was used again: second chance
    d.mark_ready("E")
    assert d.reserve("F") == Reservation(1, "B")


def test_abort_frees_the_slot_and_forgets_the_key():
    d = SlotDirectory(2)
    load(d, "A")
    r = d.reserve("B")
    d.pin("B")
    d.abort("B")
    assert d.lookup("B") is None
    assert d.occupied() == 1 and d.loading_count() == 0 and d.pinned_count() == 0
    with pytest.raises(KeyError):
        d.is_loading("B")
    assert d.reserve("C") == Reservation(r.slot, None)  # the freed slot, no eviction


def test_pinned_and_loading_slots_are_never_victims():
    d = SlotDirectory(3, policy="lru")
    load(d, "A", "B")
    d.reserve("C")  # loading
    d.pin("A")
    d.pin("A")
    assert d.reserve("D") == Reservation(1, "B")  # A pinned, C loading
    with pytest.raises(CacheFullError) as info:
        d.reserve("E")  # A pinned, C and D loading
    assert isinstance(info.value, RuntimeError)
    assert "1 pinned" in str(info.value) and "2 loading" in str(info.value)
    assert d.occupied() == 3 and d.lookup("E") is None
    d.unpin("A")
    with pytest.raises(CacheFullError):
        d.reserve("E")  # pin counts: still pinned once
    d.unpin("A")
    assert d.pinned_count() == 0
    assert d.reserve("E") == Reservation(0, "A")
    with pytest.raises(KeyError):
        d.unpin("A")  # evicted


def test_misuse_is_reported():
    d = SlotDirectory(2)
    load(d, "A")
    with pytest.raises(ValueError):
        d.reserve("A")
    with pytest.raises(ValueError):
        d.mark_ready("A")
    with pytest.raises(ValueError):
        d.abort("A")
    with pytest.raises(ValueError):
        d.unpin("A")
    for method in (d.touch, d.pin, d.mark_ready, d.abort, d.is_loading):
        with pytest.raises(KeyError):
            method("missing")
    with pytest.raises(ValueError, match="clock"):
        SlotDirectory(4, policy="nope")
    with pytest.raises(ValueError):
        SlotDirectory(0)


def test_policy_options_reach_the_policy():
    d = SlotDirectory(4, policy="lfu", half_life=8)
    assert d.policy.half_life == 8.0
    with pytest.raises(ValueError):
        SlotDirectory(4, policy="lru", half_life=8)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_busy_layers_borrow_slots_from_quiet_ones(policy):
    d = SlotDirectory(4, policy=policy)
    load(d, (1, 0), (1, 1))
    evicted = [r.evicted for r in load(d, *[(0, e) for e in range(10)])]
    assert sorted(k for k in evicted if k is not None and k[0] == 1) == [(1, 0), (1, 1)]


def test_full_error_counts_the_pinned_and_loading_slots():
    d = SlotDirectory(2)
    load(d, (0, 0))
    d.pin((0, 0))
    d.reserve((0, 1))
    with pytest.raises(CacheFullError, match=r"all 2 slots are pinned or loading \(1 pinned, 1 loading\)"):
        d.reserve((0, 2))


# -- random operation sequences ------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        # "load" is a reserve that finishes at once, the common case; plain reserves stay loading.
        st.sampled_from(["load"] * 4 + ["reserve", "touch", "pin", "unpin", "unpin", "ready", "abort"]),
        st.integers(0, 2),  # layer
        st.integers(0, 5),  # expert
    ),
    min_size=10,
    max_size=80,
)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 7),
    ops=ops,
)
def test_directory_properties(policy, capacity, ops):
    num_layers = 3
    options = {"half_life": 4.0} if policy == "lfu" else {}
    d = SlotDirectory(capacity, policy=policy, **options)
    # The model: key -> [slot, loading, pins].
    model: dict[tuple[int, int], list] = {}

    for kind, layer, expert in ops:
        key = (layer % num_layers, expert)
        present = key in model
        if kind in ("load", "reserve") and not present:
            usable = set(range(capacity))
            held = {v[0] for v in model.values()}
            evictable = {k for k, v in model.items() if v[0] in usable and not v[1] and v[2] == 0}
            if not usable - held and not evictable:
                with pytest.raises(CacheFullError):
                    d.reserve(key)
                event("cache full")
                continue
            r = d.reserve(key)
            assert r.slot in usable
            if usable - held:
                assert r.evicted is None and r.slot not in held  # free slots first
            else:
                assert r.evicted in evictable  # never pinned, never loading
                event("eviction")
                assert model.pop(r.evicted)[0] == r.slot
            model[key] = [r.slot, True, 0]
            if kind == "load":
                d.mark_ready(key)
                model[key][1] = False
        elif kind in ("load", "reserve"):
            with pytest.raises(ValueError):
                d.reserve(key)
        elif not present:
            continue
        elif kind == "touch":
            d.touch(key)
        elif kind == "pin":
            d.pin(key)
            model[key][2] += 1
        elif kind == "unpin" and model[key][2]:
            d.unpin(key)
            model[key][2] -= 1
        elif kind == "ready" and model[key][1]:
            d.mark_ready(key)
            model[key][1] = False
        elif kind == "abort" and model[key][1]:
            d.abort(key)
            del model[key]

        snapshot = d.keys()
        assert snapshot == {k: v[0] for k, v in model.items()}
        assert len(set(snapshot.values())) == len(snapshot) == d.occupied() <= capacity
        assert all(0 <= s < capacity for s in snapshot.values())
        assert len(d.policy) == len(snapshot)  # the policy tracks the same slots
        assert d.loading_count() == sum(v[1] for v in model.values())
        assert d.pinned_count() == sum(v[2] > 0 for v in model.values())
        for k, v in model.items():
            assert d.is_loading(k) == v[1]
            assert d.lookup(k) == v[0]
