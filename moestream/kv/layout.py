"""What a family's layers keep per token (`ModelArgs.kv_layout()` -> [LayerKV], one per layer)."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.kv.recurrent import RecurrentState


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: `heads` rows of `k_dim` keys and `v_heads` rows of `v_dim` values per
    token (v_dim 0: no values, e.g. a latent cache; heads 0: no cache at all). A sliding-window
    layer (`window`) only ever reads its last `window` positions, so the pool keeps only those."""

    heads: int
    k_dim: int
    v_heads: int = -1  # -1: as many as key heads
    v_dim: int = -1  # -1: as wide as keys
    state: tuple[int, ...] = ()  # a recurrent layer's float32 state (heads, k_dim, v_dim); () for attention
    conv: tuple[int, int] = ()  # a recurrent layer's convolution history (width - 1, channels)
    window: int | None = None

    @property
    def recurrent(self) -> bool:
        return bool(self.state)

    @property
    def paged(self) -> bool:
        """Whether the layer keeps per-token rows in the pool's blocks."""
        return not self.recurrent and self.heads > 0

    @property
    def value_heads(self) -> int:
        return self.heads if self.v_heads < 0 else self.v_heads

    @property
    def value_dim(self) -> int:
        return self.k_dim if self.v_dim < 0 else self.v_dim

    def bytes_per_token(self, item: int) -> int:
        return (self.heads * self.k_dim + self.value_heads * self.value_dim) * item

    def state_bytes(self, max_tokens: int, item: int) -> int:
        """A recurrent layer's states for one sequence (0 for attention)."""
        return RecurrentState.nbytes_for(self.state, self.conv, max_tokens, item) if self.recurrent else 0
