"""The demo model's own predictions over token windows: what its draft model learns to agree with.

The teacher is the packed demo model itself (moestream/demo/model, 4-bit experts), run through
moestream's Engine on the CPU with every expert resident: its logits are exactly those that
speculative decoding verifies against. For each window position we keep the teacher's top-K
log-probabilities and token ids (K = 8 holds almost all of its probability on this corpus), which is
what distillation needs and small enough to keep (K·4 bytes per token).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Labels:
    inputs: np.ndarray  # [N, S] int32 window tokens
    targets: np.ndarray  # [N, S] int32 the corpus's next tokens
    top_ids: np.ndarray  # [N, S, K] int16 the teacher's most likely next tokens, best first
    top_logp: np.ndarray  # [N, S, K] float16 their log-probabilities

    def save(self, path: str) -> None:
        np.savez(path, inputs=self.inputs, targets=self.targets, top_ids=self.top_ids, top_logp=self.top_logp)

    @classmethod
    def load(cls, path: str) -> "Labels":
        z = np.load(path)
        return cls(z["inputs"], z["targets"], z["top_ids"], z["top_logp"])


def window_starts(n_tokens: int, seq_len: int, count: int, seed: int) -> np.ndarray:
    """`count` window starts drawn from the seed (distinct, sorted), each with seq_len + 1 tokens."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_tokens - seq_len - 1, size=count, replace=False))


def teacher(model_dir: str | None, threads: int):
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    torch.set_num_threads(threads)
    return Engine.load(model_dir, options=EngineOptions(device="cpu", cache_size="all", threads=threads))


def label_windows(engine, tokens: np.ndarray, starts: np.ndarray, *, seq_len: int, top_k: int,
                  time_budget_s: float | None = None, log=print) -> Labels:
    """Teacher top-k over tokens[s:s+seq_len] for each start (stops early at the time budget)."""
    inputs, targets, ids, logps = [], [], [], []
    t0 = time.time()
    for n, s in enumerate(starts):
        window = tokens[s:s + seq_len + 1].astype(np.int64)
        engine.reset()
        logits, _ = engine.prefill(window[:-1].tolist(), all_logits=True)  # [S, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logp, top_k, dim=-1)
        inputs.append(window[:-1])
        targets.append(window[1:])
        ids.append(top.indices.to(torch.int16).numpy())
        logps.append(top.values.to(torch.float16).numpy())
        elapsed = time.time() - t0
        if (n + 1) % 20 == 0:
            log(f"label: {n + 1}/{len(starts)} windows, {(n + 1) * seq_len / elapsed:,.0f} tok/s, {elapsed:.0f}s")
        if time_budget_s is not None and elapsed > time_budget_s:
            log(f"label: time budget reached after {n + 1} windows")
            break
    return Labels(np.stack(inputs).astype(np.int32), np.stack(targets).astype(np.int32),
                  np.stack(ids), np.stack(logps))
