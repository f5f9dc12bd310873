"""The device map's one-program Triton lookup under Triton's CPU interpreter: after every call it
leaves exactly the state the torch version leaves (table, owners, stamps, counts) and asks for the
same record copies, for one-token and multi-token calls, with evictions."""
import pytest
import torch

pytest.importorskip("triton")

from interpret import interpreted_module, run_file_interpreted  # noqa: E402

from moestream.experts.device_map import DeviceMap, copy_records  # noqa: E402


def test_slot_map_under_the_interpreter():
    run_file_interpreted(__file__)


def make(seed=0, slots=24, layers=(0, 2, 3), experts=10, width=8):
    g = torch.Generator().manual_seed(seed)
    keys = [(layer, e) for layer in layers for e in range(experts)]
    order = torch.randperm(len(keys), generator=g).tolist()
    host = torch.randint(0, 256, (len(keys), width), dtype=torch.uint8, generator=g)
    pool = torch.zeros((slots, width), dtype=torch.uint8)
    return DeviceMap(pool, host, {k: order[i] for i, k in enumerate(keys)}, {l: experts for l in layers},
                     {l: width for l in layers})


@pytest.mark.parametrize("share", [None, 512, 1024], ids=["all", "half-withheld", "all-but-one-withheld"])
def test_the_program_decides_what_the_torch_version_decides(share):
    sm = interpreted_module("moestream.kernels.triton_slot_map")
    a, b = make(), make()
    withhold = None if share is None else torch.tensor([share], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    for step in range(60):
        layer = a.layers[step % 3]
        tokens = 1 if step % 5 else 4  # multi-token calls repeat experts
        ids = torch.stack([torch.randperm(10, generator=g)[:3] for _ in range(tokens)])
        count = step % 4 != 3
        src, dst, todo = sm.slot_map(a, layer, ids, withhold=withhold, count=count)
        copy_records(a.host_pool, a.pool, src, dst, todo.bool())
        b.ensure(layer, ids, withhold=withhold, count=count)
        for name in ("table", "owner", "last_used", "clock", "hits", "misses", "away", "pool"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
    assert int(a.misses.sum()) > a.slots  # slots were reused
    assert (int(a.away.sum()) > 0) == (share is not None)
