"""The paged KV pool: rows land where the block table says, whatever the block size; prefix blocks
are shared by content and survive their sequence until evicted; a shared block is copied before a
write; a window group keeps only what its window sees; a full pool says so."""
import pytest
import torch

from moestream.kv.blocks import KVPoolFullError
from moestream.kv.layout import LayerKV
from moestream.kv.pool import ROLLBACK_MARGIN, KVPool

CPU = torch.device("cpu")


def pool_for(layout, *, sequences=2, context=64, block_size=4, num_blocks=None, chunk=0):
    return KVPool(layout, max_sequences=sequences, max_context=context, dtype=torch.float32, device=CPU,
                  block_size=block_size, num_blocks=num_blocks, prefill_chunk=chunk)


def fill(pool, seq, tokens, start=0):
    """Write rows whose keys encode (sequence, position) for tokens at start.., then record them."""
    cache = pool.sequences[seq]
    end = start + len(tokens)
    cache.reserve(start, end)
    pos = torch.arange(start, end)
    for layer in pool.layers:
        if layer.keys is None:
            continue
        k = (pos.float()[:, None, None] + 1000 * (seq + 1)).expand(-1, *layer.keys.shape[2:]).clone()
        layer.write(pos, torch.full_like(pos, seq), k, k[..., :layer.values.shape[-1]] * 2)
    cache.append(tokens)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_rows_come_back_from_their_blocks_whatever_the_block_size(block_size):
    pool = pool_for([LayerKV(2, 8), LayerKV(1, 8, v_dim=4)], block_size=block_size)
    fill(pool, 1, list(range(10)))
    fill(pool, 0, list(range(7)))
    fill(pool, 1, [5, 6, 7], start=10)
    for layer in pool.layers:
        keys, values = layer.gather(1, 2, 13)
        assert torch.equal(keys[:, 0, 0], torch.arange(2, 13).float() + 2000)
        assert torch.equal(values[:, 0, 0], 2 * keys[:, 0, 0])
        keys, _ = layer.gather(0, 0, 7)
        assert torch.equal(keys[:, 0, 0], torch.arange(7).float() + 1000)


def test_a_prompt_shares_the_published_blocks_and_copies_one_before_writing_it():
    pool = pool_for([LayerKV(1, 4)])
    prompt = list(range(100, 110))
    fill(pool, 0, prompt)
    group = pool.groups[None]
    assert len(pool.sequences[0].hashes) == 2  # two full blocks of 4
    # a running sequence's blocks are held as they are, its partly filled last one too
    kept = pool.sequences[1].reuse(prompt[:9] + [7, 7], limit=10)
    assert kept == 9 and pool.sequences[1].tokens == prompt[:9]
    shared = group.held[0][:3]
    assert group.held[1][:3] == shared and all(group.allocator.refs[b] == 2 for b in shared)
    # where the sequence is gone, its published (full) blocks still serve
    assert pool.sequences[1].truncate(0) == 0
    pool.sequences[0].release()
    kept = pool.sequences[1].reuse(prompt[:9] + [7, 7], limit=10)
    assert kept == 8 and pool.sequences[1].tokens == prompt[:8]
    assert pool.sequences[0].reuse(prompt, limit=10) == 8  # sequence 0 again, on the same blocks
    fill(pool, 0, prompt[8:], start=8)
    shared = group.held[0][:2]
    assert group.held[1][:2] == shared and all(group.allocator.refs[b] == 2 for b in shared)
    # rolling sequence 1 back into a shared block: the write goes to its own copy
    assert pool.sequences[1].truncate(6) == 6
    fill(pool, 1, [1, 2], start=6)
    assert group.held[1][1] != shared[1] and group.allocator.refs[shared[1]] == 1
    keys, _ = pool.layers[0].gather(0, 0, 10)
    assert torch.equal(keys[:, 0, 0], torch.arange(10).float() + 1000)  # sequence 0 untouched
    keys, _ = pool.layers[0].gather(1, 0, 8)
    assert torch.equal(keys[:6, 0, 0], torch.arange(6).float() + 1000)
    assert torch.equal(keys[6:, 0, 0], torch.tensor([2006.0, 2007.0]))


def test_freed_blocks_stay_reusable_until_evicted_least_recently_freed_first():
    pool = pool_for([LayerKV(1, 4)], sequences=1, context=16, num_blocks=4)
    first, second = list(range(8)), list(range(50, 58))
    fill(pool, 0, first)
    pool.sequences[0].release()
    fill(pool, 0, second)  # takes the two empty blocks: first's stay cached
    pool.sequences[0].release()
    assert pool.sequences[0].reuse(first + [1], limit=8) == 8
    pool.sequences[0].release()
    fill(pool, 0, list(range(90, 102)))  # three blocks: evicts the least recently freed (second's)
    pool.sequences[0].release()
    assert pool.sequences[0].reuse(second + [1], limit=8) == 0
    pool.sequences[0].release()
    small = pool_for([LayerKV(1, 4)], sequences=1, context=16, num_blocks=1)
    with pytest.raises(KVPoolFullError, match="blocks are all in use"):
        small.sequences[0].reserve(0, 8)


def test_a_window_group_keeps_only_what_its_window_sees():
    window = 8
    pool = pool_for([LayerKV(1, 4), LayerKV(1, 4, window=window)], sequences=1, context=200, block_size=4, chunk=150)
    fill(pool, 0, list(range(150)))
    full, windowed = pool.groups[None], pool.groups[window]
    assert sum(b >= 0 for b in full.held[0]) == 38
    kept = [j for j, b in enumerate(windowed.held[0]) if b >= 0]
    assert kept[0] * 4 <= 150 - window - ROLLBACK_MARGIN + 4 and len(kept) <= (window + ROLLBACK_MARGIN) // 4 + 2
    keys, _ = pool.layers[1].gather(0, 150 - window, 150)
    assert torch.equal(keys[:, 0, 0], torch.arange(150 - window, 150).float() + 1000)
    # a rollback far behind the window finds its blocks only by content: here published, so shared back
    assert pool.sequences[0].truncate(60) == 60
    keys, _ = pool.layers[1].gather(0, 60 - window, 60)
    assert torch.equal(keys[:, 0, 0], torch.arange(60 - window, 60).float() + 1000)


def test_recurrent_layers_keep_their_states_per_sequence_and_share_no_prefix():
    layout = [LayerKV(0, 0, state=(2, 3, 3), conv=(3, 5)), LayerKV(1, 4)]
    pool = pool_for(layout)
    assert len(pool.recurrent) == 1 and pool.recurrent[0].recent.shape[:2] == (2, 17)
    fill(pool, 0, list(range(12)))
    assert pool.sequences[1].reuse(list(range(12)), limit=11) == 0
    assert KVPool.bytes_for(layout, sequences=2, max_context=64, dtype=torch.float32, block_size=4) == pool.nbytes
