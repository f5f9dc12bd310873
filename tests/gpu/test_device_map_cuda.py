"""Device-driven streaming on CUDA: the map pulls records out of pinned host RAM with the GPU's own
loads (the same bytes), and a streamed model decodes with one CUDA graph per step and the bits of
the resident and host-driven paths."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.experts.buffers import aligned_buffer, pin_if_cuda
from moestream.experts.device_map import DeviceMap, copy_records
from moestream.experts.uva import device_view
from moestream.format.reader import PackedModel

pytestmark = pytest.mark.gpu


def test_device_map_on_cuda_keeps_the_right_bytes_in_every_slot():
    layers, experts, width = (0, 2, 5), 16, 8192
    keys = [(layer, e) for layer in layers for e in range(experts)]
    host = pin_if_cuda(aligned_buffer(len(keys) * width).view(len(keys), width))
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    view = device_view(host)
    assert view is not None and view.is_cuda
    pool = torch.zeros((40, width), dtype=torch.uint8, device="cuda")
    dm = DeviceMap(pool, view, {k: i for i, k in enumerate(keys)}, {l: experts for l in layers},
                   {l: width for l in layers})
    g = torch.Generator().manual_seed(0)
    for step in range(300):
        layer = layers[step % 3]
        ids = torch.stack([torch.randperm(experts, generator=g)[:4] for _ in range(1 + step % 3)]).cuda()
        dm.ensure(layer, ids)
        table = dm.layer_table(layer)
        slots = table[ids.view(-1)].tolist()
        assert min(slots) >= 0
        for e, slot in zip(ids.view(-1).tolist(), slots):
            assert torch.equal(pool[slot].cpu(), host[keys.index((layer, e))])
    hits, misses = (sum(x) for x in zip(*dm.counts().values()))
    assert misses > 40 and hits > 0


def slots(packed, n: int) -> str:
    return str(n * max(e.record_size for e in PackedModel(packed).manifest.expert_layers))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_driven_decode_gives_the_bits_of_resident_and_host_paths(tiny_packed_model, dtype):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16", num_hidden_layers=5)  # 32 experts
    runs = {}
    for name, size, streaming, graphs in (("resident", "all", "auto", True), ("host", slots(packed, 16), "host", True),
                                          ("device", slots(packed, 16), "device", True),
                                          ("device-eager", slots(packed, 20), "device", False)):
        engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype=dtype, cache_size=size,
                                                           host_cache_size="all", prefill_chunk_tokens=7,
                                                           max_context=512, cpu_experts="off"), graphs=graphs,
                             streaming=streaming)
        prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
        gen = engine.generate(prompt, max_new_tokens=64, logprobs=3, stop_at_eos=False)
        runs[name] = [(e.token_id, e.top_logprobs) for e in gen]
        assert engine.streaming == ("resident" if name == "resident" else streaming)
        if name == "device":  # no host half: one graph per step, as when resident
            assert ("step", 1) in engine.decoder.graphs
            assert gen.result.receipt["misses"] > 16
        engine.close()
    for name, out in runs.items():
        assert out == runs["resident"], name


@pytest.mark.parametrize("policy", ["cycle", "lru"])
def test_the_triton_lookup_decides_what_the_torch_version_decides_on_cuda(policy):
    layers, experts, width = (0, 1, 3), 64, 4096
    keys = [(layer, e) for layer in layers for e in range(experts)]
    host = pin_if_cuda(aligned_buffer(len(keys) * width).view(len(keys), width))
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    maps = [DeviceMap(torch.zeros((150, width), dtype=torch.uint8, device="cuda"), device_view(host),
                      {k: i for i, k in enumerate(keys)}, {l: experts for l in layers}, {l: width for l in layers},
                      policy=policy) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    for step in range(400):
        layer = layers[step % 3]
        ids = torch.stack([torch.randperm(experts, generator=g)[:8] for _ in range(1 + 15 * (step % 9 == 0))]).cuda()
        maps[0].ensure(layer, ids)  # the Triton program (where it takes the call)
        src, dst, todo = maps[1].decide(layer, ids)  # the torch rule
        copy_records(maps[1].host_pool, maps[1].pool, src, dst, todo)
        for name in ("table", "owner", "last_used", "clock", "hits", "misses", "pool", "calls", "slot_layer"):
            assert torch.equal(getattr(maps[0], name), getattr(maps[1], name)), (step, name)
