"""Device-driven streaming (moestream.experts.device_map): the map stays consistent and holds the
right bytes under any sequence of lookups, its hit and miss counts are those of its policy (LRU, or
the cycle rule against a plain-Python reference), the cycle rule hits what a layer's share of the
pool promises under uniform routing where LRU falls short, and an engine
streaming this way gives the bits of every other way (on the CPU, where the same device ops run)."""
from collections import OrderedDict

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.experts.device_map import DeviceMap, DeviceMapUnavailable
from moestream.format.reader import PackedModel

FAMILY = "qwen3_moe"


def make_map(slots=10, layers=(1, 3, 4), experts=5, width=16, seed=0, policy="lru"):
    g = torch.Generator().manual_seed(seed)
    keys = [(layer, e) for layer in layers for e in range(experts)]
    order = torch.randperm(len(keys) + 3, generator=g).tolist()  # host slots in any order, some unused
    host_slots = {key: order[i] for i, key in enumerate(keys)}
    host = torch.randint(0, 256, (len(keys) + 3, width), dtype=torch.uint8, generator=g)
    pool = torch.zeros((slots, width), dtype=torch.uint8)
    dm = DeviceMap(pool, host, host_slots, {layer: experts for layer in layers}, {layer: width for layer in layers},
                   policy=policy)
    return dm, pool, host, host_slots


def check_consistent(dm: DeviceMap, pool, host, host_slots) -> None:
    table = dm.table[:-1].tolist()
    owner = dm.owner[:-1].tolist()
    flat = [(layer, e) for layer in dm.layers for e in range(dm.num_experts[layer])]
    held = {i: s for i, s in enumerate(table) if s >= 0}
    assert len(set(held.values())) == len(held)  # no slot holds two experts
    for i, slot in held.items():
        assert owner[slot] == i
        assert torch.equal(pool[slot], host[host_slots[flat[i]]])
    for slot, i in enumerate(owner):
        assert i == dm.total or table[i] == slot


def test_every_lookup_leaves_a_consistent_map_with_the_right_bytes_and_lru_counts():
    dm, pool, host, host_slots = make_map()
    g = torch.Generator().manual_seed(1)
    lru: OrderedDict = OrderedDict()
    hits = misses = 0
    for step in range(200):
        layer = dm.layers[step % 3]
        tokens = 1 if step % 7 else 3  # a multi-token step repeats experts
        ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(tokens)])
        dm.ensure(layer, ids)
        check_consistent(dm, pool, host, host_slots)
        table = dm.layer_table(layer)
        assert bool((table[ids] >= 0).all())
        for e in sorted(set(ids.view(-1).tolist())):  # the reference: LRU over the same slots
            key = (layer, e)
            if key in lru:
                hits += 1
                lru.move_to_end(key)
            else:
                misses += 1
        for e in sorted(set(ids.view(-1).tolist())):
            key = (layer, e)
            if key not in lru:
                lru[key] = True
            lru.move_to_end(key)
        while len(lru) > dm.slots:
            lru.popitem(last=False)
    counted = dm.counts()
    assert sum(h for h, _ in counted.values()) == hits
    assert sum(m for _, m in counted.values()) == misses
    assert misses > dm.slots  # evictions happened


class CycleReference:
    """The cycle rule in plain Python: evict the slot whose layer was looked up most often since
    the slot's last use, then the one whose layer comes next latest (this layer's own first), then
    the lowest slot; empty slots first, in order."""

    def __init__(self, slots: int, layers: int):
        self.slots, self.layers = slots, layers
        self.held: dict = {}  # (layer index, expert) -> slot
        self.owner: dict = {}  # slot -> (layer index, expert)
        self.last: dict = {}  # slot -> its layer's lookups at its last use
        self.calls = [0] * layers

    def lookup(self, li: int, experts: list[int]) -> tuple[int, int]:
        self.calls[li] += 1
        keys = [(li, e) for e in sorted(set(experts))]
        hit_slots = {self.held[k] for k in keys if k in self.held}
        misses = [k for k in keys if k not in self.held]

        def order(slot):
            if slot not in self.owner:
                return (0, 0, slot)
            layer = self.owner[slot][0]
            ahead = (layer - li) % self.layers or self.layers
            return (1, -((self.calls[layer] - self.last[slot]) * (self.layers + 1) + ahead), slot)

        victims = sorted((s for s in range(self.slots) if s not in hit_slots), key=order)
        for slot in hit_slots:
            self.last[slot] = self.calls[li]
        for key, slot in zip(misses, victims):
            if slot in self.owner:
                del self.held[self.owner[slot]]
            self.held[key], self.owner[slot], self.last[slot] = slot, key, self.calls[li]
        return len(hit_slots), len(misses)


def test_the_cycle_rule_counts_what_its_reference_counts():
    dm, pool, host, host_slots = make_map(slots=11, layers=(1, 3, 4, 6), policy="cycle")
    ref = CycleReference(11, 4)
    g = torch.Generator().manual_seed(2)
    want = [0, 0]
    for step in range(300):
        li = step % 4 if step % 11 else (step // 11) % 4  # mostly in order, now and then out of it
        layer = dm.layers[li]
        tokens = 1 if step % 7 else 3
        ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(tokens)])
        dm.ensure(layer, ids)
        check_consistent(dm, pool, host, host_slots)
        h, m = ref.lookup(li, ids.view(-1).tolist())
        want[0] += h
        want[1] += m
    counted = dm.counts()
    assert [sum(h for h, _ in counted.values()), sum(m for _, m in counted.values())] == want
    assert want[1] > dm.slots


@pytest.mark.parametrize("share", [0.1, 0.25])
def test_under_uniform_routing_the_cycle_rule_hits_the_pools_share_and_lru_does_not(share):
    """Uniform routing over 24 layers of 32 experts, 4 a token: each layer's expected hits are the
    slots it holds when it is asked, so a rule that keeps every layer's share until its turn hits
    the pool's share; LRU evicts the slots of the layers coming next (they were used longest ago)."""
    layers, experts, picks = tuple(range(24)), 32, 4
    slots = int(share * len(layers) * experts)
    rates = {}
    for policy in ("cycle", "lru"):
        dm = make_map(slots=slots, layers=layers, experts=experts, width=4, policy=policy)[0]
        g = torch.Generator().manual_seed(3)
        for token in range(140):
            if token == 40:
                dm.reset_counts()  # the pool full and settled
            for layer in layers:
                dm.ensure(layer, torch.randperm(experts, generator=g)[:picks].view(1, picks))
        counted = dm.counts().values()
        hits, misses = sum(h for h, _ in counted), sum(m for _, m in counted)
        rates[policy] = hits / (hits + misses)
    assert rates["cycle"] > share - 0.02, rates
    assert rates["cycle"] > rates["lru"] + 0.01, rates


def test_a_large_pool_never_gives_a_lookups_hit_away():
    # 32,768 slots: the torch rule's keys must not overflow where the Triton lookup does not run
    dm, pool, host, host_slots = make_map(slots=32768, layers=tuple(range(300)), experts=128, width=1,
                                          policy="cycle")
    dm.ensure(0, torch.tensor([[0]]))
    held = int(dm.table[0])
    dm.ensure(0, torch.tensor([[0, 1]]))
    assert int(dm.table[0]) == held and int(dm.table[1]) not in (-1, held)
    check_consistent(dm, pool, host, host_slots)


def test_a_pool_smaller_than_twice_a_layer_or_a_partial_host_tier_is_refused():
    with pytest.raises(DeviceMapUnavailable, match="at least 10"):
        make_map(slots=9)
    pool, host = torch.zeros((10, 4), dtype=torch.uint8), torch.zeros((4, 4), dtype=torch.uint8)
    with pytest.raises(DeviceMapUnavailable, match="lacks 1 expert records"):
        DeviceMap(pool, host, {(0, e): e for e in range(4)}, {0: 5}, {0: 4})


@pytest.fixture(scope="module")
def model(tiny_packed_model):
    return tiny_packed_model(FAMILY, "q4", num_hidden_layers=5)  # 4 MoE layers of 8 experts


def run(model, *, max_new=12, streaming="auto", **opts):
    """opts: EngineOptions fields; no CPU share unless asked (its rows round otherwise: its own tests)."""
    opts = {"cpu_experts": "off", **opts}
    engine = Engine.load(model, options=EngineOptions(device="cpu", prefill_chunk_tokens=5, **opts),
                         streaming=streaming)
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    gen = engine.generate(prompt, max_new_tokens=max_new, logprobs=4)
    out = [(e.token_id, e.top_logprobs) for e in gen]
    mode = engine.streaming
    engine.close()
    return out, gen.result.receipt, mode


def slots(model, n: int) -> str:
    packed = PackedModel(model)
    return str(n * max(e.record_size for e in packed.manifest.expert_layers))


@pytest.mark.parametrize("n", [16, 20, 31])
def test_device_driven_streaming_gives_the_bits_of_the_host_path(model, n):
    reference, _, _ = run(model, cache_size="all")
    out, receipt, mode = run(model, cache_size=slots(model, n), host_cache_size="all", streaming="device")
    assert mode == "device" and receipt["experts"]["streaming"] == "device"
    assert out == reference  # bitwise
    assert receipt["misses"] > 0 and 0 < receipt["hit_rate"] < 1 and receipt["bytes_read_host"] > 0
    if n == 16:
        assert receipt["misses"] > n  # slots were reused
    host, _, host_mode = run(model, cache_size=slots(model, n), host_cache_size="all", streaming="host")
    assert host_mode == "host" and host == reference


def test_streaming_device_where_it_cannot_run_names_why(model):
    with pytest.raises(MoestreamError, match="host tier holds 0 of the 32"):
        run(model, cache_size=slots(model, 16), streaming="device")
    with pytest.raises(MoestreamError, match="needs at least 16"):
        run(model, cache_size=slots(model, 12), host_cache_size="all", streaming="device")
    _, receipt, mode = run(model, cache_size=slots(model, 16), host_cache_size="all")  # auto on the CPU: the host
    assert mode == "host" and receipt["experts"]["streaming"] == "host"


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe"])
def test_other_families_stream_device_driven_with_the_same_bits(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", num_hidden_layers=6)  # room for two layers' experts, not all: streamed
    reference, _, _ = run(packed, cache_size="all")
    layers = PackedModel(packed).manifest.expert_layers
    need = 2 * max(e.num_experts for e in layers)
    out, receipt, mode = run(packed, cache_size=slots(packed, need), host_cache_size="all", streaming="device")
    assert mode == "device" and out == reference
    assert receipt["misses"] > 0


def test_a_step_of_several_tokens_equals_single_steps_when_device_driven(model):
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size=slots(model, 16), host_cache_size="all",
                                                      cpu_experts="off"), streaming="device")
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    engine.prefill(prompt)
    draft = [5, 17, 300, 42, 9]
    together = engine.step(draft).clone()
    engine.rollback(len(prompt))
    singles = torch.cat([engine.step([t]).clone() for t in draft])
    assert engine.streaming == "device"
    engine.close()
    assert torch.equal(together, singles)
