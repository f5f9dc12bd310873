"""The receipt of a run: what was generated, how fast, what the expert cache did, the memory ledger.

Benchmarks, `generate --receipt` and the server's responses report these same fields. A Receipt
reads like the JSON object it writes (`receipt["decode_tok_s"]`, `dict(receipt)`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

COUNTERS = ("hits", "misses", "bytes_read_disk", "bytes_read_host", "read_wait_s")


@dataclass
class Receipt(Mapping):
    prompt_tokens: int
    prefill_tokens: int
    reused_tokens: int
    generated_tokens: int
    finish_reason: str
    prefill_s: float
    decode_s: float
    prefill_tok_s: float | None
    decode_tok_s: float | None
    hit_rate: float
    misses: int
    bytes_read_disk: int
    bytes_read_host: int
    read_wait_s: float
    experts: dict = field(default_factory=dict)  # the cache's cumulative statistics
    memory: dict = field(default_factory=dict)  # the memory ledger
    device: str = ""
    model: str = ""
    threads: int = 0  # CPU compute threads
    verify: bool = True  # records and resident files checked against the manifest
    lookahead: dict = field(default_factory=dict)  # guesses of later layers' experts: accuracy per layer and depth
    speculative: dict | None = None  # drafter, drafted, accepted, accept_rate, tokens_per_step (None: off)
    # expert parallel: world_size, placement, and per rank its hit rate, bytes read and time in
    # collectives (None: one process; the figures above are then this rank's own)
    parallel: dict | None = None

    @classmethod
    def of_run(cls, *, prompt_tokens: int, reused: int, generated: int, finish: str, prefill_s: float,
               decode_s: float, before: dict, after: dict, **context) -> "Receipt":
        """From the run's counts and times, and the cache statistics before and after it."""
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
        lookups = delta["hits"] + delta["misses"]
        prefilled = prompt_tokens - reused
        return cls(prompt_tokens=prompt_tokens, prefill_tokens=prefilled, reused_tokens=reused,
                   generated_tokens=generated, finish_reason=finish,
                   prefill_s=round(prefill_s, 6), decode_s=round(decode_s, 6),
                   prefill_tok_s=round(prefilled / prefill_s, 3) if prefill_s > 0 else None,
                   decode_tok_s=round(generated / decode_s, 3) if decode_s > 0 and generated else None,
                   hit_rate=round(delta["hits"] / lookups, 6) if lookups else 1.0, misses=delta["misses"],
                   bytes_read_disk=delta["bytes_read_disk"], bytes_read_host=delta["bytes_read_host"],
                   read_wait_s=round(delta["read_wait_s"], 6), experts=after, **context)

    def to_json(self) -> dict:
        return asdict(self)

    # field by field: `dict(receipt)` reads every key, and a whole to_json() per key cost the
    # batch scheduler milliseconds per finished request
    def __getitem__(self, key: str):
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)


_FIELDS = tuple(f.name for f in fields(Receipt))
