"""A stand-in engine for measuring the batch scheduler's host work: the interface
`server/batching.py` uses, with every step and prefill answered at once (or after a fixed wait
without the interpreter lock, as a device step would be) by precomputed float32 logits rows of a
realistic vocabulary. Its greedy choices are printable bytes and depend only on the sequence, so a
request's text is the same whatever runs beside it (the tests)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from moestream.engine.emitter import Emitter
from moestream.engine.sampling import argmax_rows
from moestream.engine.types import common_prefix
from moestream.errors import MoestreamError

VOCAB = 151_936
BANK = 64  # distinct logits rows; a row's greedy choice is a printable byte


class BytesTokenizer:
    """Ids 0..255 are bytes; the rest decode to nothing (the bench only chooses printable bytes)."""

    eos_token_ids = frozenset({VOCAB - 1})
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class _Cache:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)


class InstantEngine:
    """The engine interface the batch scheduler uses; every step and prefill returns at once."""

    def __init__(self, slots: int, tokenizer, *, vocab: int = VOCAB, max_context: int = 4096,
                 step_s: float = 0.0, misses_per_row: int = 0, prompt_steps: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.bank = torch.randn(BANK, vocab, generator=g)
        self.bank_tokens = [32 + (k * 37) % 95 for k in range(BANK)]  # printable ASCII
        self.bank[torch.arange(BANK), torch.tensor(self.bank_tokens)] = 20.0
        self.tokenizer = tokenizer
        self.caches = [_Cache() for _ in range(slots)]
        self.open_sequences: list[int] = []
        self.max_context = max_context
        self.model_name = "instant"
        self.device = torch.device("cpu")
        self.options = SimpleNamespace(verify=False)
        self.plan = SimpleNamespace(prefill_chunk=2048)
        self.args = SimpleNamespace(vocab_size=vocab)
        self.step_s = step_s  # a device's step time, waited for without the interpreter lock (as a CUDA sync waits)
        self.steps = self.prefills = self.rows = 0
        self.layers = 48
        self.prompt_steps = prompt_steps  # short prompts may join a step (Engine.prompt_step on CUDA)
        self.misses_per_row = misses_per_row  # counted cache misses (a test of the server's accounting)
        self._hits = self._misses = 0
        self.stats_reads = 0

    def _row(self, slot: int, rows: int = 1) -> torch.Tensor:
        """Logits [rows, V] of the slot's last `rows` positions: each a function of its prefix alone."""
        tokens = self.caches[slot].tokens
        picks = [((n + 1) * 7 + tokens[n]) % BANK for n in range(len(tokens) - rows, len(tokens))]
        return self.bank[picks[0]].unsqueeze(0) if rows == 1 else self.bank[picks]

    def open_sequence(self, prefix=None, *, slot=None) -> int:
        cache = self.caches[slot]
        cache.tokens = cache.tokens[:common_prefix(cache.tokens, prefix or [])]
        self.open_sequences.append(slot)
        return slot

    def close_sequence(self, seq: int) -> None:
        self.open_sequences.remove(seq)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise MoestreamError("the prompt is empty")

    def prefill(self, prompt_ids, *, seq=0, should_stop=None, all_logits=False):
        cache = self.caches[seq]
        reuse = min(common_prefix(cache.tokens, prompt_ids), len(prompt_ids) - 1)
        cache.tokens = list(prompt_ids)
        self.prefills += 1
        if self.step_s:
            time.sleep(self.step_s)
        self._count(len(prompt_ids) - reuse)
        return self._row(seq), reuse

    def greedy_choices(self, rows: list[torch.Tensor]) -> list[int]:
        return argmax_rows(rows)

    def prompt_step(self, prompt_ids, *, seq, beside):
        cache = self.caches[seq]
        reuse = min(common_prefix(cache.tokens, prompt_ids), len(prompt_ids) - 1)
        if not self.prompt_steps or len(prompt_ids) - reuse > 16 - beside:
            return None
        del cache.tokens[reuse:]
        return list(prompt_ids[reuse:])

    def step_many(self, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        self.steps += 1
        self.rows += sum(len(t) for t in batch.values())
        if self.step_s:
            time.sleep(self.step_s)
        out = {}
        for seq, tokens in batch.items():
            self.caches[seq].tokens += tokens
            out[seq] = self._row(seq, len(tokens))
        self._count(sum(len(t) for t in batch.values()))
        return out

    def _count(self, rows: int) -> None:
        self._hits += self.layers * 8 * rows
        self._misses += self.misses_per_row * rows

    def emitter(self, prompt_ids, state, *, sampling, logprobs=0, should_stop=None) -> Emitter:
        return Emitter(list(prompt_ids), state, sampling=sampling, logprobs=logprobs,
                       eos_ids=self.tokenizer.eos_token_ids, should_stop=should_stop, stop_at_eos=True)

    def rollback(self, length: int, *, seq: int = 0) -> None:
        del self.caches[seq].tokens[length:]

    def expert_stats(self) -> dict:
        self.stats_reads += 1
        return self._expert_stats()

    def _expert_stats(self) -> dict:
        """The shape of the expert cache's statistics, built as it builds them (all experts resident)."""
        per_layer = {str(layer): 1.0 for layer in range(self.layers)}
        return {"source": "file", "verify": False, "policy": "lru", "streaming": "resident",
                "slots": 6144, "slot_bytes": 6144 << 20, "total_experts": 6144, "host_slots": 0,
                "hits": self._hits, "misses": self._misses, "hit_rate": 1.0, "hit_rate_per_layer": per_layer,
                "evictions": 0, "bytes_read_disk": 0, "bytes_read_host": 0, "read_wait_s": 0.0,
                "disk_read_gb_s": None, "prefetch_issued": 0, "prefetch_used": 0}

    def memory_ledger(self) -> dict:
        return {"weights_bytes": 1 << 30, "kv_bytes": 1 << 28}

    def stats(self) -> dict:
        return {"model": self.model_name, "device": "cpu", "max_context": self.max_context,
                "experts": self._expert_stats()}

    def close(self) -> None:
        pass
