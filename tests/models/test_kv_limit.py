"""The KV pool's size with several sequence slots: the context is a limit per sequence, not a
reservation per slot. One slot keeps the whole context; several share fewer blocks than slots ×
context, one sequence still reaches the whole context, and `room` says whether one more sequence
fits beside the open ones (each of which may still grow to the length it was opened for)."""
import torch

from moestream.engine.sequences import SequenceSlots
from moestream.kv.layout import LayerKV
from moestream.kv.pool import BLOCK_SIZE, KVPool

LAYOUT = [LayerKV(heads=2, k_dim=4), LayerKV(heads=2, k_dim=4, window=32), LayerKV(heads=2, k_dim=4)]
CONTEXT = 256  # 16 blocks
BLOCKS = CONTEXT // BLOCK_SIZE


def pool(sequences: int, **kw) -> KVPool:
    return KVPool(LAYOUT, max_sequences=sequences, max_context=CONTEXT, dtype=torch.float32,
                  device=torch.device("cpu"), **kw)


def slots(count: int, **kw) -> SequenceSlots:
    s = SequenceSlots(LAYOUT, CONTEXT, count=count, dtype=torch.float32, device=torch.device("cpu"), **kw)
    s.close(0)  # open from the start (the default sequence)
    return s


def full(p: KVPool) -> int:
    return p.groups[None].allocator.num_blocks


def test_one_slot_keeps_the_whole_context():
    p = pool(1)
    assert full(p) == BLOCKS
    assert p.nbytes == KVPool.bytes_for(LAYOUT, sequences=1, max_context=CONTEXT, dtype=torch.float32)


def test_several_slots_share_fewer_blocks_and_one_sequence_reaches_the_context():
    for n in (2, 4, 8):
        p = pool(n)
        assert BLOCKS <= full(p) < n * BLOCKS
        assert full(p) == BLOCKS + (n - 1) * BLOCKS // 4
        # the ledger counts what is allocated
        assert p.nbytes == KVPool.bytes_for(LAYOUT, sequences=n, max_context=CONTEXT, dtype=torch.float32)
        seq = p.sequences[n - 1]
        for start in range(0, CONTEXT, BLOCK_SIZE):  # as steps do (the window group slides)
            seq.reserve(start, start + BLOCK_SIZE)
            seq.append(list(range(start, start + BLOCK_SIZE)))
        assert seq.length == CONTEXT
        assert p.usage()[0] >= BLOCKS


def test_recurrent_layers_keep_every_slots_context():
    layout = LAYOUT + [LayerKV(heads=0, k_dim=0, state=(2, 4, 4), conv=(3, 8))]
    p = KVPool(layout, max_sequences=3, max_context=CONTEXT, dtype=torch.float32, device=torch.device("cpu"))
    assert p.groups[None].allocator.num_blocks == 3 * BLOCKS


def test_room_counts_what_open_sequences_may_still_take():
    s = slots(4)
    total = full(s.pool)  # 16 + 3 * 4 = 28 blocks
    assert s.room([1] * 10, CONTEXT).fits
    a = s.open(None, slot=1, tokens=CONTEXT)  # may take 16 blocks, holds none yet
    s.caches[a].reserve(0, 40)  # 3 held, 13 to come
    s.caches[a].append(list(range(1, 41)))
    room = s.room([1] * 10, 12 * BLOCK_SIZE)
    assert (room.need, room.free, room.total) == (12, total - 16, total)
    assert room.fits
    assert not s.room([1] * 10, 13 * BLOCK_SIZE).fits
    assert s.room([1] * 10, 13 * BLOCK_SIZE).ever
    s.close(a)  # its blocks back: the whole pool again
    assert s.room([1] * 10, CONTEXT).free == total


def test_prompt_blocks_an_open_sequence_holds_are_free_to_the_next():
    s = slots(2)  # 16 + 4 = 20 blocks
    prompt = [(7 * i) % 97 for i in range(5 * BLOCK_SIZE + 3)]
    a = s.open(prompt, slot=0, tokens=CONTEXT)
    s.caches[a].reserve(0, len(prompt))
    s.caches[a].append(prompt)  # its 5 full blocks are published
    alone = s.room([9] * len(prompt), 8 * BLOCK_SIZE)
    shared = s.room(prompt, 8 * BLOCK_SIZE)
    assert alone.need == 8 and shared.need == 3
    assert shared.free == alone.free == 20 - 16
    assert shared.fits and not alone.fits
    b = s.open(prompt, slot=1, tokens=8 * BLOCK_SIZE)  # holds a's blocks: takes none of the free ones
    assert s.caches[b].length == len(prompt) - 1  # the partly filled sixth one too
    # the sixth, which both will write, counts as a copy for each of them (one more than needed: the
    # safe side)
    assert s.room([3], 1).free == 20 - 16 - 3 - 1


def test_a_pool_smaller_than_a_context_says_so():
    s = slots(2, num_blocks=4)
    room = s.room([1, 2, 3], 5 * BLOCK_SIZE)
    assert not room.ever and not room.fits and room.total == 4


def grow(s: SequenceSlots, seq: int, end: int) -> None:
    """Run sequence `seq` to `end` positions, a block at a time, as steps do."""
    cache = s.caches[seq]
    while cache.length < end:
        stop = min(end, (cache.length // BLOCK_SIZE + 1) * BLOCK_SIZE)
        cache.reserve(cache.length, stop)
        cache.append([1000 + seq] * (stop - cache.length))


def test_a_wholly_shared_prompt_counts_the_copy_of_its_last_block():
    s = slots(3)  # 16 + 2 * 4 = 24 blocks
    prompt = [(7 * i) % 97 for i in range(5 * BLOCK_SIZE)]  # 5 full blocks, its last token in the 5th
    a = s.open(prompt, slot=0, tokens=CONTEXT)
    s.caches[a].reserve(0, len(prompt))
    s.caches[a].append(prompt)
    assert s.room(prompt, 8 * BLOCK_SIZE).need == 4  # the 5th is copied: prefill runs the last token again
    b = s.open(prompt, slot=1, tokens=8 * BLOCK_SIZE)
    assert s.caches[b].length == len(prompt) - 1  # not prefilled yet: it shares all 5
    room = s.room([3] * 10, 5 * BLOCK_SIZE)
    assert room.free == 24 - 16 - 4 and not room.fits
    if room.fits:  # what the scheduler does: open only where it fits, then every sequence may reach its length
        c = s.open([3] * 10, slot=2, tokens=5 * BLOCK_SIZE)
        grow(s, c, 5 * BLOCK_SIZE)
    s.caches[b].truncate(len(prompt) - 1)  # b's prefill: its last prompt token, then its tokens
    grow(s, b, 8 * BLOCK_SIZE)
    grow(s, a, CONTEXT)
