"""The device map's one-program Triton lookup under Triton's CPU interpreter: after every call it
leaves exactly the state the torch version leaves (table, owners, stamps, counts) and asks for the
same record copies, for one-token and multi-token calls, with evictions."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter import interpreted_module  # noqa: E402

from moestream.experts.device_map import DeviceMap, copy_records  # noqa: E402


def make(seed=0, slots=24, layers=(0, 2, 3), experts=10, width=8, policy="cycle"):
    g = torch.Generator().manual_seed(seed)
    keys = [(layer, e) for layer in layers for e in range(experts)]
    order = torch.randperm(len(keys), generator=g).tolist()
    host = torch.randint(0, 256, (len(keys), width), dtype=torch.uint8, generator=g)
    pool = torch.zeros((slots, width), dtype=torch.uint8)
    return DeviceMap(pool, host, {k: order[i] for i, k in enumerate(keys)}, {l: experts for l in layers},
                     {l: width for l in layers}, policy=policy)


@pytest.mark.parametrize("share", [None, [512], [1024], [0, 3], [0, 0], [0, 0, 0, 0, 1, 3, 2]],
                         ids=["all", "half-withheld", "all-but-one-withheld", "probe-every-3", "none-withheld",
                              "counts-per-misses"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("policy", ["cycle", "lru"])
def test_the_program_decides_what_the_torch_version_decides(share, gated, policy):
    sm = interpreted_module("moestream.kernels.triton_slot_map")
    a, b = make(policy=policy), make(policy=policy)
    withhold = None if share is None else torch.tensor(share, dtype=torch.int32)
    counts = [torch.full((2,), -1, dtype=torch.int64) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    probes = 0
    for step in range(80 if gated else 60):
        layer = a.layers[step % 3]
        tokens = 1 if step % 5 else 4  # multi-token calls repeat experts
        ids = torch.stack([torch.randperm(10, generator=g)[:3] for _ in range(tokens)])
        count = step % 7 != 3
        gate = torch.tensor([step % 4 != 1], dtype=torch.int32) if gated else None
        clock = int(a.clock)
        src, dst, todo = sm.slot_map(a, layer, ids, withhold=withhold, count=count, withheld=counts[0], gate=gate)
        copy_records(a.host_pool, a.pool, src, dst, todo.bool())
        b.ensure(layer, ids, withhold=withhold, count=count, withheld=counts[1], gate=gate)
        for name in ("table", "owner", "last_used", "clock", "hits", "misses", "away", "pool", "calls", "slot_layer"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
        if withhold is not None:
            assert torch.equal(counts[0], counts[1]), step
        if gate is not None and not int(gate):
            assert int(a.clock) == clock and not todo.any(), step  # gated off: nothing happened
        elif share == [0, 3] and (clock + 1) % 3 == 0 and int(counts[0][1]) and len(set(ids.view(-1).tolist())) > 1:
            assert int(counts[0][0]) == 1, step  # the probe: one miss withheld though the share is 0
            probes += 1
        elif share is not None and len(share) > 2:  # the count for this many misses (one expert stays)
            m, distinct = int(counts[0][1]), len(set(ids.view(-1).tolist()))
            assert int(counts[0][0]) == min(share[2 + min(m, len(share) - 3)], distinct - 1), step
        elif share is not None and share[0] == 0:
            assert int(counts[0][0]) == 0, step
    assert int(a.misses.sum()) > a.slots  # slots were reused
    assert (int(a.away.sum()) > 0) == (share is not None and share != [0, 0])
    assert (probes > 0) == (share == [0, 3])
