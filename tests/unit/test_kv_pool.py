"""KVCache.pooled: several sequences' caches as slices of one tensor, so a decode kernel reaches any
of them with the sequence slot as a device value; each slot behaves like a cache of its own."""
import pytest
import torch

from moestream.layers.kv_cache import KVCache, LayerKV

LAYOUT = [LayerKV(heads=2, k_dim=8)] * 3


def test_slots_are_slices_of_one_pool_and_behave_like_separate_caches():
    caches = KVCache.pooled(3, LAYOUT, 16, dtype=torch.float32, device=torch.device("cpu"))
    alone = KVCache.for_layout(LAYOUT, 16, dtype=torch.float32, device=torch.device("cpu"))
    keys, values = caches[0].pool
    assert keys.shape == (3, 3, 2, 16, 8) and all(c.pool is caches[0].pool for c in caches)
    for s, cache in enumerate(caches):
        assert cache.keys.shape == alone.keys.shape and cache.keys.is_contiguous()
        assert cache.keys.data_ptr() == keys[s].data_ptr() and cache.nbytes == alone.nbytes
    k, v = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    got = caches[1].update(2, 3, k, v)
    want = alone.update(2, 3, k, v)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(keys[1, 2, :, 3:7], k) and keys[0].abs().sum() == 0 and keys[2].abs().sum() == 0
    caches[1].append([5, 6, 7, 8])
    assert caches[1].length == 4 and caches[0].length == 0 and caches[1].truncate(2) == 2


@pytest.mark.parametrize("layout,count", [([LayerKV(heads=2, k_dim=8), LayerKV(heads=1, k_dim=8)], 2),
                                          ([LayerKV(heads=2, k_dim=8, v_dim=4)] * 2, 2),
                                          (LAYOUT, 1)])
def test_other_layouts_and_one_sequence_keep_separate_caches(layout, count):
    caches = KVCache.pooled(count, layout, 8, dtype=torch.float32, device=torch.device("cpu"))
    assert len(caches) == count and all(c.pool is None for c in caches)


def test_rows_at_once_on_the_cpu_are_refused_by_name(tiny_packed_model):
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    engine = Engine.load(tiny_packed_model("qwen3_moe", "q4"), options=EngineOptions(device="cpu"))
    layer = engine.model.layers[0]
    x = torch.zeros(16, engine.model.hidden_size, dtype=engine.model.dtype)
    assert not engine.decoder.rows_at_once
    with pytest.raises(ValueError, match="rows at once need CUDA"):
        layer.attn.rows(x, torch.zeros(16, dtype=torch.long), engine.cache, 0, 2)
    engine.close()
