"""The paged KV pool: every layer's per-token rows in fixed-size blocks shared by all sequences.

Layers with the same window (a group) share a block table, int32 [S, MB] on the device with a host
mirror: position p of sequence s lies in block table[s, p // BS], row p % BS. A full block of known
tokens is published under a chained hash of its ids, so a prompt starting like an earlier one shares
those blocks (reference counted); a freed published block stays reusable until its room is needed.
Recurrent layers keep a state per sequence instead (moestream.kv.recurrent).

Sizing (`full_blocks`): the context is a limit per sequence, not a reservation per slot; a caller
admits a sequence only where its whole length fits (`KVPool.room`), so none runs out mid-generation.

Legend: NB blocks, BS block size, S sequences, MB blocks per sequence, Nkv heads, D head size."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.kv.blocks import BlockAllocator, common_prefix
from moestream.kv.layout import LayerKV
from moestream.kv.recurrent import RECENT_STATES, RecurrentState, StateBook

BLOCK_SIZE = 16
FURTHER_SLOT_SHARE = 4  # each slot past the first gets 1/4 of the context's blocks
ROLLBACK_MARGIN = 32  # positions behind a window that stay kept: a rollback of a step or two finds them
MAX_STEP_TOKENS = RECENT_STATES - 1  # a step's rows at most (moestream.engine.decoder)


@dataclass
class KVRoom:
    """Whether a sequence of `tokens` positions fits the pool's full-attention blocks beside the open ones."""

    need: int  # blocks it would take (its prompt's full blocks open sequences hold are free to it)
    free: int  # blocks free now, less what the open sequences may still take
    total: int  # the pool's blocks (a full-attention group's)
    block_size: int
    reserved: bool = False  # every slot holds its whole context: any sequence fits

    @property
    def fits(self) -> bool:
        return self.reserved or self.need <= self.free

    @property
    def ever(self) -> bool:
        """Whether it fits alone, nothing else running."""
        return self.reserved or self.need <= self.total


@dataclass
class LayerCache:
    """One layer's part of the pool, what its attention forward reads and writes."""

    keys: torch.Tensor | None  # [NB, BS, Nkv, D] (None: a recurrent layer)
    values: torch.Tensor | None  # [NB, BS, Nkv, Dv] (None: no values, e.g. a latent cache)
    block_table: torch.Tensor | None  # [S, MB] int32 on the device
    host_table: torch.Tensor | None  # [S, MB] int32, the host's copy
    block_size: int
    window: int | None
    states: RecurrentState | None = None  # a recurrent layer's states

    def write(self, positions: torch.Tensor, sequences: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Rows k [T, Nkv, D], v [T, Nkv, Dv] at positions [T] of sequences [T] (device values: no host read)."""
        blocks = self.block_table[sequences, torch.div(positions, self.block_size, rounding_mode="floor")].long()
        rows = torch.remainder(positions, self.block_size)
        self.keys[blocks, rows] = k.to(self.keys.dtype)
        if v is not None:
            self.values[blocks, rows] = v.to(self.values.dtype)

    def gather(self, seq: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys [end - start, Nkv, D] and values of positions start..end-1 of sequence `seq` (host values)."""
        bs = self.block_size
        ids = self.host_table[seq, start // bs:(end - 1) // bs + 1].to(self.keys.device, torch.long)
        lo = start % bs
        # index_select, not indexing: the same copy, a quarter of the call's cost
        keys = self.keys.index_select(0, ids).flatten(0, 1)[lo:lo + end - start]
        values = None if self.values is None else self.values.index_select(0, ids).flatten(0, 1)[lo:lo + end - start]
        return keys, values

    def first_visible(self, position: int) -> int:
        return 0 if self.window is None else max(0, position - self.window + 1)


class _Group:
    """Layers with the same window: one allocator and one block table."""

    def __init__(self, window: int | None, num_blocks: int, sequences: int, max_blocks: int, device: torch.device):
        self.window = window
        self.allocator = BlockAllocator(num_blocks)
        self.host = torch.zeros((sequences, max_blocks), dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self.table = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.held: list[list[int]] = [[] for _ in range(sequences)]  # per sequence its blocks (-1: given back)
        self.layers: list[int] = []
        self.dirty = False


class KVPool:
    def __init__(self, layout: list[LayerKV], *, max_sequences: int, max_context: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = BLOCK_SIZE, num_blocks: int | None = None,
                 prefill_chunk: int = 0):
        """num_blocks: blocks of a full-attention group (default: `full_blocks`)."""
        if block_size < 1:
            raise ValueError(f"the KV block size must be at least 1, got {block_size}")
        self.layout, self.block_size, self.max_context = layout, block_size, max_context
        self.max_sequences, self.dtype, self.device = max_sequences, dtype, device
        self.max_blocks = -(-max_context // block_size)
        self.groups: dict[int | None, _Group] = {}
        self.layers: list[LayerCache] = []
        for i, spec in enumerate(layout):
            if not spec.paged:
                states = RecurrentState(spec.state, spec.conv, max_sequences, max_context, dtype=dtype,
                                        device=device) if spec.recurrent else None
                self.layers.append(LayerCache(None, None, None, None, block_size, None, states))
                continue
            if spec.window not in self.groups:
                blocks = num_blocks if spec.window is None and num_blocks is not None else \
                    group_blocks(layout, spec.window, sequences=max_sequences, max_context=max_context,
                                 block_size=block_size, prefill_chunk=prefill_chunk)
                self.groups[spec.window] = _Group(spec.window, blocks, max_sequences, self.max_blocks, device)
            group = self.groups[spec.window]
            group.layers.append(i)
            nb = group.allocator.num_blocks
            keys = torch.zeros((nb, block_size, spec.heads, spec.k_dim), dtype=dtype, device=device)
            values = None if spec.value_dim == 0 else \
                torch.zeros((nb, block_size, spec.value_heads, spec.value_dim), dtype=dtype, device=device)
            self.layers.append(LayerCache(keys, values, group.table, group.host, block_size, spec.window))
        self.recurrent = [c.states for c in self.layers if c.states is not None]
        self.sequences = [SequenceKV(self, s) for s in range(max_sequences)]

    def layer(self, i: int) -> LayerCache:
        return self.layers[i]

    def sync(self) -> None:
        """Bring the device's block tables up to the host's (before a step or prefill reads them)."""
        for group in self.groups.values():
            if group.dirty and group.table is not group.host:
                group.table.copy_(group.host)
            group.dirty = False

    def forget_published(self) -> None:
        """No block answers a hash any more: the next prompts are computed whole (Engine.reset)."""
        for group in self.groups.values():
            group.allocator.forget_all()

    def usage(self) -> tuple[int, int]:
        """(blocks held by sequences, blocks) over every layer group. A free block that still answers
        a prefix's hash is not held: it is taken whenever room is needed."""
        groups = list(self.groups.values())
        total = sum(g.allocator.num_blocks for g in groups)
        return total - sum(g.allocator.free for g in groups), total

    def room(self, prompt: list[int], tokens: int, open_seqs: list[int], *, share: bool = True) -> KVRoom:
        """Whether a new sequence starting with `prompt` and reaching `tokens` positions fits beside the
        open sequences `open_seqs`, each of which may still grow to its `promise`. `share` False: it
        computes its whole prompt (e.g. to score it), so it shares no block."""
        bs = self.block_size
        need = -(-min(tokens, self.max_context) // bs)
        full = [g for g in self.groups.values() if g.window is None]
        if not full:  # window and recurrent layers only: every sequence's share is set aside
            return KVRoom(need, need, need, bs, reserved=True)
        total = min(g.allocator.num_blocks for g in full)
        if total >= self.max_sequences * self.max_blocks:
            return KVRoom(need, total, total, bs, reserved=True)
        # its prompt's full blocks before the first it writes, where an open sequence holds them: shared
        kept = min(self.shared_blocks(prompt, len(prompt) - 1), (len(prompt) - 1) // bs) if share else 0
        chain = _chain(prompt, kept, bs)
        need -= sum(all(g.allocator.refs[g.allocator.by_hash[d]] > 0 for g in full) for d in chain)
        free = min(g.allocator.free - sum(self.sequences[s].to_take(g) for s in open_seqs) for g in full)
        return KVRoom(need, free, total, bs)

    def shared_blocks(self, prompt: list[int], limit: int) -> int:
        """How many full blocks of prompt's start the pool can share (none with recurrent layers:
        their states are a sequence's own)."""
        if self.recurrent or not self.groups:
            return 0
        bs = self.block_size
        chain = _chain(prompt, -(-limit // bs) if limit > 0 else 0, bs)
        full = [g for g in self.groups.values() if g.window is None]
        n = 0
        while n < len(chain) and all(chain[n] in g.allocator.by_hash for g in full):
            n += 1
        while n > 0:  # a window group needs the blocks its window sees at the end
            end = n * bs
            if all(chain[j] in g.allocator.by_hash for g in self.groups.values() if g.window is not None
                   for j in range(max(0, end - g.window) // bs, n)):
                return n
            n -= 1
        return 0

    @property
    def nbytes(self) -> int:
        tensors = [t for c in self.layers for t in (c.keys, c.values) if t is not None]
        tensors += [t for state in self.recurrent for t in state.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def bytes_for(layout: list[LayerKV], *, sequences: int, max_context: int, dtype: torch.dtype,
                  block_size: int = BLOCK_SIZE, prefill_chunk: int = 0) -> int:
        """What a pool for `layout` allocates (the ledger's KV line)."""
        item = torch.finfo(dtype).bits // 8
        total = 0
        for spec in layout:
            if spec.paged:
                total += group_blocks(layout, spec.window, sequences=sequences, max_context=max_context,
                                      block_size=block_size, prefill_chunk=prefill_chunk) * \
                    block_size * spec.bytes_per_token(item)
            total += sequences * spec.state_bytes(max_context, item)
        return total


def group_blocks(layout: list[LayerKV], window: int | None, *, sequences: int, max_context: int, block_size: int,
                 prefill_chunk: int) -> int:
    """Blocks of the layer group of `window`: `full_blocks` for full attention, else `window_blocks`."""
    if window is None:
        return full_blocks(sequences, -(-max_context // block_size), recurrent=any(s.recurrent for s in layout))
    return window_blocks(window, max_context=max_context, block_size=block_size, sequences=sequences,
                         prefill_chunk=prefill_chunk)


def full_blocks(sequences: int, max_blocks: int, *, recurrent: bool = False) -> int:
    """Blocks of a full-attention group: one sequence's whole context, and FURTHER_SLOT_SHARE's part
    of it for each further slot (every slot's whole context with recurrent layers, see above)."""
    if recurrent:
        return sequences * max_blocks
    return min(sequences * max_blocks, max_blocks + (sequences - 1) * -(-max_blocks // FURTHER_SLOT_SHARE))


def window_blocks(window: int, *, max_context: int, block_size: int, sequences: int, prefill_chunk: int) -> int:
    """Blocks a window group needs: every sequence's window (and the margin a rollback and a step
    reach), and one prefill chunk's rows written before the window slides past them."""
    span = min(max_context, window + ROLLBACK_MARGIN + MAX_STEP_TOKENS)
    per_sequence = min(-(-max_context // block_size), -(-span // block_size) + 2)
    return sequences * per_sequence + -(-min(prefill_chunk, max_context) // block_size) + 1


def _digest(parent: int, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


def _chain(prompt: list[int], blocks: int, bs: int) -> list[int]:
    """The chained digests of prompt's first `blocks` full blocks of `bs` tokens."""
    out: list[int] = []
    for j in range(blocks):
        out.append(_digest(out[-1] if out else 0, prompt[j * bs:(j + 1) * bs]))
    return out


class SequenceKV:
    """One sequence slot of the pool: the token ids whose rows it holds (the one record of what is
    cached: prefix reuse and rollback only ask it), its blocks in every group, its recurrent states."""

    def __init__(self, pool: KVPool, seq: int):
        self.pool, self.seq = pool, seq
        self.max_tokens = pool.max_context
        self.promise = pool.max_context  # the positions it may reach while open (KVPool.room)
        self.tokens: list[int] = []
        self.hashes: list[int] = []  # chained digest of each full block of known tokens
        self.book = StateBook(pool.max_context) if pool.recurrent else None

    @property
    def length(self) -> int:
        return len(self.tokens)

    # -- blocks -----------------------------------------------------------------------------------
    def _set(self, group: _Group, j: int, block: int) -> None:
        held = group.held[self.seq]
        while len(held) <= j:
            held.append(-1)
        held[j] = block
        group.host[self.seq, j] = max(block, 0)
        group.dirty = True

    def reserve(self, start: int, end: int) -> None:
        """Blocks this sequence alone holds for positions start..end-1, before a step writes them: a
        missing one is taken, a shared one copied first (its other holders keep its content)."""
        if end > self.max_tokens:
            raise ValueError(f"{end} tokens exceed the KV cache's {self.max_tokens}")
        bs = self.pool.block_size
        for group in self.pool.groups.values():
            held = group.held[self.seq]
            for j in range(start // bs, (end - 1) // bs + 1):
                block = held[j] if j < len(held) else -1
                if block < 0:
                    self._set(group, j, group.allocator.take())
                elif group.allocator.refs[block] > 1:
                    fresh = group.allocator.take()
                    for i in group.layers:
                        layer = self.pool.layers[i]
                        layer.keys[fresh].copy_(layer.keys[block])
                        if layer.values is not None:
                            layer.values[fresh].copy_(layer.values[block])
                    group.allocator.release(block)
                    self._set(group, j, fresh)
                else:
                    group.allocator.forget(block)

    def to_take(self, group: _Group) -> int:
        """Blocks of `group` this sequence may still take on its way to `promise` positions: those it
        does not hold, and a held one it will write while another holds it too (copied first)."""
        bs, held = self.pool.block_size, group.held[self.seq]
        blocks = -(-min(self.promise, self.max_tokens) // bs)
        done = sum(1 for j in range(min(blocks, len(held)))
                   if held[j] >= 0 and (j < self.length // bs or group.allocator.refs[held[j]] == 1))
        return max(0, blocks - done)

    def _drop(self, group: _Group, j: int) -> None:
        held = group.held[self.seq]
        if j < len(held) and held[j] >= 0:
            group.allocator.release(held[j])
            held[j] = -1

    def _publish(self) -> None:
        """Publish every full block of known tokens not published yet (in every group that holds it)."""
        bs, n = self.pool.block_size, len(self.hashes)
        while (n + 1) * bs <= self.length:
            block_tokens = self.tokens[n * bs:(n + 1) * bs]
            if any(t < 0 for t in block_tokens):  # a token the host has not read yet (Engine.step_unread)
                return
            self.hashes.append(_digest(self.hashes[-1] if self.hashes else 0, block_tokens))
            for group in self.pool.groups.values():
                held = group.held[self.seq]
                if n < len(held) and held[n] >= 0:
                    group.allocator.publish(held[n], self.hashes[n])
            n += 1

    def _slide(self) -> None:
        """Give back the blocks no window can see any more (ROLLBACK_MARGIN kept for rollbacks)."""
        bs = self.pool.block_size
        for group in self.pool.groups.values():
            if group.window is None:
                continue
            first = self.length - group.window + 1 - ROLLBACK_MARGIN
            for j in range(max(0, first) // bs):
                self._drop(group, j)

    def append(self, ids: list[int]) -> None:
        """Record that the rows of `ids` (at the next positions) are now stored in every layer."""
        if self.length + len(ids) > self.max_tokens:
            raise ValueError(f"{self.length + len(ids)} tokens exceed the KV cache's {self.max_tokens}")
        if self.book is not None:  # the recurrent layers wrote their states for the new lengths
            self.book.ran(self.length, self.length + len(ids))
        self.tokens.extend(ids)
        self._publish()
        self._slide()

    def name(self, position: int, token: int) -> None:
        """The id of a token run before the host knew it (Engine.name_token)."""
        self.tokens[position] = token
        self._publish()

    def truncate(self, length: int) -> int:
        """Forget every position from `length` on and return the length kept: with recurrent layers
        the longest length <= `length` whose state is kept, with a window the longest whose window's
        blocks are still held (else 0); the caller recomputes the tokens after it (Engine.rollback)."""
        length = max(0, min(length, self.length))
        if self.book is not None:
            length = self.book.restore(length, self.pool.recurrent, self.seq)
        if not self._window_held(length):
            length = 0
            if self.book is not None:
                length = self.book.restore(0, self.pool.recurrent, self.seq)
        bs = self.pool.block_size
        for group in self.pool.groups.values():
            for j in range(-(-length // bs), len(group.held[self.seq])):
                self._drop(group, j)
        del self.tokens[length:]
        del self.hashes[length // bs:]
        return length

    def _window_held(self, length: int) -> bool:
        """Whether every window group holds (or can share back) the blocks position `length` sees."""
        bs = self.pool.block_size
        for group in self.pool.groups.values():
            if group.window is None or length == 0:
                continue
            held = group.held[self.seq]
            for j in range(max(0, length - group.window) // bs, (length - 1) // bs + 1):
                if j < len(held) and held[j] >= 0:
                    continue
                block = group.allocator.share(self.hashes[j]) if j < len(self.hashes) else None
                if block is None:
                    return False
                self._set(group, j, block)
        return True

    def release(self) -> None:
        """Give every block back (published ones stay reusable) and forget the tokens."""
        self.truncate(0)
        for group in self.pool.groups.values():
            group.held[self.seq] = []
        if self.book is not None:
            for state in self.pool.recurrent:
                state.clear(self.seq)
            self.book = StateBook(self.pool.max_context)

    # -- prefix reuse --------------------------------------------------------------------------------
    def reuse(self, prompt: list[int], limit: int) -> int:
        """Keep as much of `prompt` (at most `limit` tokens) as this sequence, another open one or the
        pool's published blocks hold, and return the length kept (the prefill computes the rest).
        Another sequence's blocks are held as they are (copied before either writes them): the kept
        positions have the bits they were computed with."""
        own = common_prefix(self.tokens, prompt[:limit])
        shared = self.pool.shared_blocks(prompt, limit) * self.pool.block_size
        donor, beside = self._donor(prompt[:limit])
        if beside > max(own, shared):
            self.release()
            self._hold_from(donor, beside)
            own = beside
        elif shared > own:
            self.release()
            self._adopt(prompt, shared // self.pool.block_size)
            own = min(shared, limit)
        return self.truncate(own)

    def _donor(self, prompt: list[int]) -> tuple["SequenceKV | None", int]:
        """The other sequence whose known tokens share the longest start with `prompt`, and that length
        (none with recurrent layers: their states are a sequence's own)."""
        if self.pool.recurrent:
            return None, 0
        best, n = None, 0
        for other in self.pool.sequences:
            if other is not self and other.length > n:
                common = common_prefix(other.tokens, prompt)
                if common > n and other._holds(common):
                    best, n = other, common
        return best, n

    def _holds(self, length: int) -> bool:
        """Whether every group holds the blocks a sequence of `length` positions sees (a window's only)."""
        bs = self.pool.block_size
        for group in self.pool.groups.values():
            held = group.held[self.seq]
            first = 0 if group.window is None else max(0, length - group.window) // bs
            if any(j >= len(held) or held[j] < 0 for j in range(first, -(-length // bs))):
                return False
        return True

    def _hold_from(self, donor: "SequenceKV", length: int) -> None:
        bs = self.pool.block_size
        for group in self.pool.groups.values():
            first = 0 if group.window is None else max(0, length - group.window) // bs
            for j in range(first, -(-length // bs)):
                self._set(group, j, group.allocator.hold(group.held[donor.seq][j]))
        self.tokens = list(donor.tokens[:length])
        self.hashes = donor.hashes[:length // bs]
        self._slide()

    def _adopt(self, prompt: list[int], blocks: int) -> None:
        bs = self.pool.block_size
        chain = _chain(prompt, blocks, bs)
        for group in self.pool.groups.values():
            first = 0 if group.window is None else max(0, blocks * bs - group.window) // bs
            for j in range(first, blocks):
                self._set(group, j, group.allocator.share(chain[j]))
        self.tokens = list(prompt[:blocks * bs])
        self.hashes = chain
        self._slide()
