"""The blocks of one layer group of the KV pool: who holds each, which are free, and which hold a
known prefix (by content hash), kept for reuse until their room is needed (least recently freed first)."""
from __future__ import annotations

from collections import OrderedDict

from moestream.errors import MoestreamError


class KVPoolFullError(MoestreamError):
    pass


def common_prefix(a, b) -> int:
    """How many leading token ids a and b share (prefix reuse: a KV cache's tokens against a prompt)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.empty = list(range(num_blocks - 1, -1, -1))  # free blocks holding nothing known (a stack)
        self.cached: OrderedDict[int, None] = OrderedDict()  # free blocks with a hash, least recently freed first
        self.hash_of: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}

    @property
    def free(self) -> int:
        return len(self.empty) + len(self.cached)

    def take(self) -> int:
        """A block for new content (held once): an empty one, else the least recently freed cached one."""
        if self.empty:
            block = self.empty.pop()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            self.forget(block)
        else:
            raise KVPoolFullError(f"the KV pool's {self.num_blocks} blocks are all in use "
                                  "(fewer sequences, a shorter context or more --memory-budget)")
        self.refs[block] = 1
        return block

    def share(self, digest: int) -> int | None:
        """Hold the block with content `digest` once more, or None where no block has it."""
        block = self.by_hash.get(digest)
        if block is None:
            return None
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1
        return block

    def hold(self, block: int) -> int:
        """Hold `block` (held by another sequence) once more: it is copied before either writes it."""
        self.refs[block] += 1
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.empty.append(block)

    def publish(self, block: int, digest: int) -> None:
        """`block` holds the content `digest` (a full block of a known prefix) from now on."""
        if block in self.hash_of or digest in self.by_hash:
            return
        self.hash_of[block], self.by_hash[digest] = digest, block

    def forget(self, block: int) -> None:
        """`block`'s content is about to change: it no longer answers its hash."""
        digest = self.hash_of.pop(block, None)
        if digest is not None:
            del self.by_hash[digest]

    def forget_all(self) -> None:
        """Every block forgets its hash; the free ones among them become empty."""
        self.empty.extend(self.cached)
        self.cached.clear()
        self.hash_of.clear()
        self.by_hash.clear()
