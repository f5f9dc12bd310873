"""The states of a recurrent (linear-attention) layer, kept so that its cache can be truncated like
a KV cache.

A copy of the state per position would cost megabytes per token, so states are kept for the last
RECENT_STATES lengths in a ring (slot = length % RECENT_STATES: a step rolls back to any of its
positions for free) and at every `every`-th length (at most MAX_SNAPSHOTS + 1 snapshots: a deeper
truncation returns to the nearest one and the caller recomputes the tokens after it). Which lengths
are held is the host's `StateBook`, one per sequence, shared by its recurrent layers."""
from __future__ import annotations

import math

import torch

RECENT_STATES = 17  # MAX_STEP_TOKENS + 1: every length a step passes stays in the ring
MAX_SNAPSHOTS = 16  # snapshots per sequence, whatever the context (they bound the memory)
MIN_SNAPSHOT_EVERY = 32  # positions between snapshots at least


class StateBook:
    """Which lengths the states of a cache's recurrent layers hold (host side)."""

    def __init__(self, max_tokens: int):
        self.every = max(MIN_SNAPSHOT_EVERY, -(-max_tokens // MAX_SNAPSHOTS // MIN_SNAPSHOT_EVERY) * MIN_SNAPSHOT_EVERY)
        self.snapshots = max_tokens // self.every + 1  # lengths 0, every, 2 every, ... (0: the empty state)
        self.recent = [-1] * RECENT_STATES  # ring slot r holds the state of length recent[r] (-1: none)
        self.recent[0] = 0  # the ring starts at zeros: the empty sequence's state
        self.kept = [False] * self.snapshots
        self.kept[0] = True  # snapshot 0 stays zeros

    def ran(self, old: int, new: int) -> None:
        """The layers ran positions old..new-1 (see the module docstring for what they wrote)."""
        self.recent = [length if length <= old else -1 for length in self.recent]
        for length in range(max(old + 1, new - RECENT_STATES + 1), new + 1):
            self.recent[length % RECENT_STATES] = length
        for k in range(old // self.every + 1, new // self.every + 1):
            self.kept[k] = True

    def restore(self, length: int, states: list["RecurrentState"], seq: int) -> int:
        """Forget the states past `length`; bring the longest kept length <= `length` into sequence
        `seq`'s ring slot and return it."""
        self.recent = [held if held <= length else -1 for held in self.recent]
        self.kept = [kept and k * self.every <= length for k, kept in enumerate(self.kept)]
        recent = max(self.recent)  # -1 where the ring holds nothing kept; snapshot 0 is always kept
        snapshot = max(k for k, kept in enumerate(self.kept) if kept) * self.every
        if recent >= snapshot:
            return recent
        slot = snapshot % RECENT_STATES
        for state in states:
            state.load_snapshot(seq, snapshot // self.every, slot)
        self.recent[slot] = snapshot
        return snapshot


class RecurrentState:
    """One recurrent layer's states for every sequence slot: float32 states and convolution histories
    in the model's dtype, in a ring of RECENT_STATES and in snapshots (plus a scratch snapshot a step
    writes when its length is no multiple of `every`)."""

    def __init__(self, state_shape: tuple[int, ...], conv_shape: tuple[int, int], sequences: int, max_tokens: int, *,
                 dtype: torch.dtype, device: torch.device):
        book = StateBook(max_tokens)
        self.every, self.scratch = book.every, book.snapshots
        n = book.snapshots + 1
        self.recent = torch.zeros((sequences, RECENT_STATES, *state_shape), dtype=torch.float32, device=device)
        self.recent_conv = torch.zeros((sequences, RECENT_STATES, *conv_shape), dtype=dtype, device=device)
        self.snaps = torch.zeros((sequences, n, *state_shape), dtype=torch.float32, device=device)
        self.snaps_conv = torch.zeros((sequences, n, *conv_shape), dtype=dtype, device=device)

    @staticmethod
    def nbytes_for(state_shape: tuple[int, ...], conv_shape: tuple[int, int], max_tokens: int, item: int) -> int:
        """Bytes of one sequence's states."""
        copies = RECENT_STATES + StateBook(max_tokens).snapshots + 1
        return copies * (math.prod(state_shape) * 4 + math.prod(conv_shape) * item)

    def tensors(self) -> list[torch.Tensor]:
        return [self.recent, self.recent_conv, self.snaps, self.snaps_conv]

    def load_snapshot(self, seq: int, k: int, slot: int) -> None:
        self.recent[seq, slot].copy_(self.snaps[seq, k])
        self.recent_conv[seq, slot].copy_(self.snaps_conv[seq, k])

    def clear(self, seq: int) -> None:
        """Sequence `seq` back to the empty state (ring slot 0 and snapshot 0 hold zeros)."""
        for t in self.tensors():
            t[seq].zero_()

    # -- a run over positions start..end-1 of one sequence (host positions) -----------------------
    def read(self, seq: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state, conv) of sequence `seq` after `start` tokens, as copies."""
        slot = start % RECENT_STATES
        return self.recent[seq, slot].clone(), self.recent_conv[seq, slot].clone()

    def wants(self, length: int, end: int) -> bool:
        """Whether a run ending at `end` keeps the state of `length`."""
        return length > end - RECENT_STATES or length % self.every == 0

    def write(self, seq: int, length: int, end: int, state: torch.Tensor, conv: torch.Tensor) -> None:
        """Keep the state of `length` reached by a run ending at `end` (where `wants` says)."""
        if length > end - RECENT_STATES:
            self.recent[seq, length % RECENT_STATES].copy_(state)
            self.recent_conv[seq, length % RECENT_STATES].copy_(conv)
        if length % self.every == 0:
            self.snaps[seq, length // self.every].copy_(state)
            self.snaps_conv[seq, length // self.every].copy_(conv)

    # -- one token at device values (a sequence slot and a position) --------------------------------
    def read_at(self, seq: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(state, conv) of sequence seq [1] after pos [1] tokens."""
        flat = seq * RECENT_STATES + torch.remainder(pos, RECENT_STATES)
        return (self.recent.flatten(0, 1).index_select(0, flat)[0],
                self.recent_conv.flatten(0, 1).index_select(0, flat)[0])

    def write_at(self, seq: torch.Tensor, length: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> None:
        """Keep the state of `length` [1] of sequence seq [1] (its ring slot; its snapshot where
        `every` divides it)."""
        flat = seq * RECENT_STATES + torch.remainder(length, RECENT_STATES)
        self.recent.flatten(0, 1).index_copy_(0, flat, state[None])
        self.recent_conv.flatten(0, 1).index_copy_(0, flat, conv[None].to(self.recent_conv.dtype))
        snap = torch.where(torch.remainder(length, self.every) == 0, length // self.every,
                           torch.full_like(length, self.scratch))
        n = self.snaps.shape[1]
        self.snaps.flatten(0, 1).index_copy_(0, seq * n + snap, state[None])
        self.snaps_conv.flatten(0, 1).index_copy_(0, seq * n + snap, conv[None].to(self.snaps_conv.dtype))
