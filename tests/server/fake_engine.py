"""A deterministic stand-in for moestream.engine.Engine, with the same interface, for server tests.

Tokenizer: ids 0..255 are bytes, then BOS and EOS, then a few multi-character pieces (so a token
can hold several characters, and a character can span several byte tokens). Generation: each
token is a seeded function of the whole prefix (prompt plus generated tokens), so a reply depends
only on the prompt, the seed and whether sampling is on. It keeps the last request's tokens as its
"KV cache" and reports how many prompt tokens it reused, like the real engine.
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable

from moestream.engine.types import GenerationResult, SamplingParams, TokenEvent
from moestream.errors import MoestreamError

BOS = 256
EOS = 257
PIECES = ["ab", " the", "é", "😀", "\n\n", "ba", "aa", "<|", "|>", "日本"]
FIRST_PIECE = 258
VOCAB_SIZE = FIRST_PIECE + len(PIECES)
# What the toy "model" writes: short units, many overlapping, some split into byte tokens.
UNITS = ["a", "b", "a", "b", " ", "ab", "ba", "aa", " the", "é", "😀", "\n", "\n\n", ".", "x", "日本", "<|", "|>"]
PREFILL_CHUNK = 16
KV_BLOCK = 16  # tokens per block of the engine's paged KV pool


class FakeTokenizer:
    # a test sets these for a model whose template shows its reply format (think tags, harmony's
    # channels) or whose generation prompt opens a think block ("<assistant><think>\n")
    chat_template: str | None = None
    generation_prompt = "<assistant>"

    def __init__(self) -> None:
        self.eos_token_ids = frozenset({EOS})
        self.bos_token_id = BOS
        self.vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS] if add_special_tokens else []
        return ids + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif i >= FIRST_PIECE:
                out += PIECES[i - FIRST_PIECE].encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = ""
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise MoestreamError(f"the chat template has no role {m['role']!r}")
            text += f"<{m['role']}>{m['content']}</s>"
        if add_generation_prompt:
            text += self.generation_prompt
        return self.encode(text)


def _unit_tokens(unit: str, split: bool) -> list[int]:
    if unit in PIECES and not split:
        return [FIRST_PIECE + PIECES.index(unit)]
    return list(unit.encode("utf-8"))


def prefix_state(ids: list[int], state: int = 0) -> int:
    """A rolling hash of a token prefix: each token's unit is a function of the whole prefix."""
    for token in ids:
        state = (state * 1_000_003 + token + 1) % (1 << 61)
    return state


def next_tokens(state: int, sampling: SamplingParams, eos_every: int, at_start: bool) -> list[int]:
    """The tokens of the next unit after the prefix whose rolling hash is `state` (seeded when sampling)."""
    seed = -1 if sampling.greedy else sampling.seed
    h = int.from_bytes(hashlib.blake2b(f"{state}:{seed}".encode(), digest_size=8).digest(), "little")
    if eos_every and h % eos_every == 0 and not at_start:
        return [EOS]
    unit = UNITS[(h >> 8) % len(UNITS)]
    return _unit_tokens(unit, split=bool((h >> 20) & 1))


class FakeGeneration:
    """Iterates TokenEvents; `result` is set once the loop ends or `close()` is called."""

    def __init__(self, engine: "FakeEngine", prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams, logprobs: int, should_stop: Callable[[], bool] | None):
        self._engine = engine
        self._prompt = list(prompt_ids)
        self._max_new = max_new_tokens
        self._sampling = sampling
        self._logprobs = logprobs
        self._should_stop = should_stop or (lambda: False)
        self._generated: list[int] = []
        self._state = prefix_state(self._prompt)
        self._pending: list[int] = []
        self._started = False
        self._t0 = 0.0
        self._t_prefill = 0.0
        self._reused = 0
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def _prefill(self) -> None:
        eng = self._engine
        self._t0 = time.perf_counter()
        cached = eng._kv_tokens
        common = 0
        for a, b in zip(cached, self._prompt):
            if a != b:
                break
            common += 1
        self._reused = min(common, len(self._prompt) - 1)
        todo = len(self._prompt) - self._reused
        for start in range(0, todo, PREFILL_CHUNK):
            if self._should_stop():
                return
            n = min(PREFILL_CHUNK, todo - start)
            if eng.prefill_delay:
                time.sleep(eng.prefill_delay * n)
        eng._kv_tokens = list(self._prompt)
        self._t_prefill = time.perf_counter()

    def __next__(self) -> TokenEvent:
        if self.result is not None:
            raise StopIteration
        if not self._started:
            self._started = True
            self._engine._set_active(True)
            if self._engine.fail_on_prompt is not None and self._engine.fail_on_prompt in self._prompt:
                self._finish("error")
                raise MoestreamError("the fake engine was told to fail on this prompt")
            self._prefill()
        if self._should_stop():
            self._finish("cancelled")
            raise StopIteration
        if len(self._generated) >= self._max_new:
            self._finish("length")
            raise StopIteration
        if not self._pending and self._engine.script is not None:  # a fixed reply, then EOS
            done = FakeTokenizer().decode(self._generated)
            rest = self._engine.script[len(done):]
            self._pending = list(rest[:1].encode("utf-8")) if rest else [EOS]
        if not self._pending:
            self._pending = next_tokens(self._state, self._sampling, self._engine.eos_every, not self._generated)
        token = self._pending.pop(0)
        if self._engine.token_delay:
            time.sleep(self._engine.token_delay)
        if token == EOS:
            self._finish("stop")
            raise StopIteration
        self._generated.append(token)
        self._state = prefix_state([token], self._state)
        if len(self._generated) > 1:  # the previous token was fed to produce this one: KV = prompt + generated[:-1]
            self._engine._kv_tokens.append(self._generated[-2])
        event = TokenEvent(token_id=token)
        if self._logprobs:  # like the engine: K >= 1 gives the logprob and the top K; 0 none
            event.logprob = -0.25
            alternatives = [(token, -0.25)] + [((token + k) % 256, -1.0 - k) for k in range(1, self._logprobs)]
            event.top_logprobs = alternatives[: self._logprobs]
        return event

    def close(self) -> None:
        # like the engine: a generation closed early keeps its default end, "length"
        if self.result is None:
            self._finish("length")

    def _finish(self, reason: str) -> None:
        now = time.perf_counter()
        if not self._t_prefill:
            self._t_prefill = now
        if not self._t0:
            self._t0 = now
        prefill_s = self._t_prefill - self._t0
        decode_s = now - self._t_prefill
        n_gen = len(self._generated)
        prefilled = len(self._prompt) - self._reused
        receipt = {
            "prompt_tokens": len(self._prompt),
            "prefill_tokens": prefilled,
            "reused_tokens": self._reused,
            "generated_tokens": n_gen,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": prefilled / prefill_s if prefill_s > 0 else 0.0,
            "decode_tok_s": n_gen / decode_s if decode_s > 0 else 0.0,
            "hit_rate": 0.75,
            "misses": 3 * n_gen,
            "bytes_read_disk": 1000 * n_gen,
            "bytes_read_host": 500 * n_gen,
            "read_wait_s": 0.0,
            "memory": {"gpu_bytes": 0, "host_bytes": 0},
        }
        self.result = GenerationResult(token_ids=list(self._generated), finish_reason=reason, receipt=receipt)
        self._engine.requests += 1
        self._engine.last_sampling = self._sampling
        if self._started:
            self._engine._set_active(False)


class FakeEngine:
    """The engine interface the server codes against, with knobs for tests."""

    def __init__(self, *, max_context: int = 4096, token_delay: float = 0.0, prefill_delay: float = 0.0,
                 eos_every: int = 0, model_name: str = "fake-moe") -> None:
        self.tokenizer = FakeTokenizer()
        self.max_context = max_context
        self.model_name = model_name
        self.token_delay = token_delay
        self.prefill_delay = prefill_delay
        self.eos_every = eos_every
        self.fail_on_prompt: int | None = None  # a token id whose presence in a prompt raises
        self.script: str | None = None  # when set, every reply is this text
        self.requests = 0
        self.last_sampling: SamplingParams | None = None
        self._kv_tokens: list[int] = []
        self._active = 0
        self.max_active = 0  # the most generations ever running at once (must stay 1)
        self._lock = threading.Lock()
        self.owner_thread: int | None = None  # the thread that called generate, checked by tests
        self.closed_by: int | None = None  # the thread that called close (None: still open)
        self.closed_while_active = False
        self.on_close: Callable[[], None] | None = None

    @classmethod
    def load(cls, model_dir=None, *, options=None, load_delay: float = 0.0, **knobs) -> "FakeEngine":
        if load_delay:
            time.sleep(load_delay)
        return cls(**knobs)

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams | None = None,
                 logprobs: int = 0, should_stop: Callable[[], bool] | None = None) -> FakeGeneration:
        if not prompt_ids:
            raise MoestreamError("empty prompt")
        if len(prompt_ids) + max_new_tokens > self.max_context:
            raise MoestreamError("prompt plus max_new_tokens exceeds the context")
        ident = threading.get_ident()
        if self.owner_thread is None:
            self.owner_thread = ident
        assert self.owner_thread == ident, "generate called from two threads"
        return FakeGeneration(self, prompt_ids, max_new_tokens, sampling or SamplingParams(), logprobs, should_stop)

    @property
    def active(self) -> bool:
        with self._lock:
            return self._active > 0

    def _set_active(self, on: bool) -> None:
        with self._lock:
            self._active += 1 if on else -1
            self.max_active = max(self.max_active, self._active)

    def close(self) -> None:
        if self.closed_by is not None:
            raise RuntimeError("the engine was closed twice")
        self.closed_by = threading.get_ident()
        self.closed_while_active = self.active
        if self.on_close is not None:
            self.on_close()

    def prompt_logprobs(self, prompt_ids: list[int], k: int, *, should_stop: Callable[[], bool] | None = None):
        """Echo scoring: each prompt token after the first at a logprob that depends only on it (the
        real engine's shape: (token, logprob or None, [(token, logprob)] * k))."""
        if not prompt_ids:
            raise MoestreamError("empty prompt")
        out = [(prompt_ids[0], None, [])]
        for t in prompt_ids[1:]:
            lp = -1.0 - (t % 7) / 10
            out.append((t, lp, [(t, lp)] + [((t + j) % 256, lp - j) for j in range(1, k)]))
        return out

    def stats(self) -> dict:
        # like the engine's paged pool: blocks of 16 tokens, the cached tokens' blocks held
        return {"requests": self.requests, "hit_rate": 0.75, "slots": 16, "kv_tokens": len(self._kv_tokens),
                "kv": {"blocks_used": -(-len(self._kv_tokens) // KV_BLOCK),
                       "blocks_total": -(-self.max_context // KV_BLOCK)}}


def reference_ids(prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, eos_every: int = 0) -> list[int]:
    """The tokens a generation produces without stop strings, computed without an engine."""
    out: list[int] = []
    state = prefix_state(prompt_ids)
    while len(out) < max_new_tokens:
        for token in next_tokens(state, sampling, eos_every, not out):
            if token == EOS:
                return out
            out.append(token)
            state = prefix_state([token], state)
            if len(out) >= max_new_tokens:
                break
    return out
