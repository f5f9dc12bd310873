"""Choosing the next token. Every sampled draw is the Gumbel-max of (logit / T + noise) over the
tokens the filters allow, where the noise depends only on (seed, position, token id). So a seed
fixes the text whatever the batching or chunking, and a verifier can reproduce any draw exactly."""
from __future__ import annotations

from typing import Sequence

import torch

from moestream.engine.types import SamplingParams

MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors; multipliers stay below 2^31 so nothing overflows."""
    x = x & MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & MASK32
    x = ((x ^ (x >> 16)) * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: int | torch.Tensor, position: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise [V] in float64 for one (seed, position); for int64 seeds [N], the
    noise of each seed at once, [N, V] (row i equals the noise of seed i alone)."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=device)
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=device, dtype=torch.int64).reshape(-1, 1)  # [N, 1]: broadcasts over tokens
        low, high = seed & MASK32, (seed >> 32) & MASK32
    else:
        low = torch.tensor([seed & MASK32], dtype=torch.int64, device=device)
        high = torch.tensor([(seed >> 32) & MASK32], dtype=torch.int64, device=device)
    key = _mix32(low ^ _mix32(high + position))
    bits = _mix32(_mix32(tokens * 0x9E3779B + key) ^ key)
    u = (bits.to(torch.float64) + 0.5) / 4294967296.0  # in (0, 1)
    return -torch.log(-torch.log(u))


def apply_repetition_penalty(logits: torch.Tensor, previous: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' rule: seen tokens' positive logits are divided by the penalty, negative multiplied."""
    if penalty == 1.0 or previous.numel() == 0:
        return logits
    logits = logits.clone()
    seen = torch.unique(previous)
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    return logits


def allowed_mask(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tokens top-k, top-p and min-p allow, from tempered logits [V] (float64). Never empty."""
    allowed = torch.ones_like(scaled, dtype=torch.bool)
    if params.top_k and 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        allowed &= scaled >= kth
    probs = torch.softmax(torch.where(allowed, scaled, torch.full_like(scaled, -torch.inf)), dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        keep_sorted = before < params.top_p
        keep_sorted[0] = True
        keep = torch.zeros_like(allowed)
        keep[order] = keep_sorted
        allowed &= keep
    if params.min_p > 0.0:
        allowed &= probs >= params.min_p * probs.max()
    return allowed


def apply_penalties(logits: torch.Tensor, generated: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's frequency and presence penalties over the generated tokens, then logit_bias."""
    if (params.frequency_penalty or params.presence_penalty) and len(generated):
        ids, counts = torch.unique(torch.tensor(list(generated), dtype=torch.long, device=logits.device),
                                   return_counts=True)
        logits = logits.clone()
        penalty = params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        logits[ids] -= penalty
    if params.logit_bias:
        logits = logits.clone()
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
        logits[ids] += bias
    return logits


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, *, position: int,
                    previous: torch.Tensor | None = None, generated: Sequence[int] | None = None) -> torch.Tensor:
    """The logits choose_token picks from: repetition penalty (over `previous`), frequency and
    presence penalties (over `generated`), logit_bias, then the allowed-token mask."""
    if previous is not None:
        logits = apply_repetition_penalty(logits, previous, params.repetition_penalty)
    if params.uses_generated and generated is None:
        generated = params.history.before(position) if params.history is not None else []
    logits = apply_penalties(logits, generated or (), params)
    if params.allowed_tokens is not None:
        allowed = params.allowed_tokens(list(generated or ()))
        if allowed is not None:
            mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
            n = min(len(allowed), logits.shape[-1])
            mask[:n] = torch.from_numpy(allowed[:n].astype(bool))
            logits = logits.masked_fill(~mask.to(logits.device), float("-inf"))
    return logits


def plain_argmax(params: SamplingParams) -> bool:
    """Whether choose_token's choice is the argmax of the raw logits row, with nothing recorded: greedy,
    no penalties, bias, mask or history. Such rows may be chosen many at once (`argmax_rows`)."""
    return (params.greedy and params.repetition_penalty == 1.0 and not params.frequency_penalty
            and not params.presence_penalty and not params.logit_bias and params.allowed_tokens is None
            and params.history is None)


def argmax_index(row: torch.Tensor) -> int:
    """torch.argmax of a row; on the CPU through numpy, ten times faster on a 150k-token row and the
    same index (the first of equal ones, a NaN counting as largest)."""
    if row.device.type == "cpu" and row.dtype in (torch.float32, torch.float64) and not row.requires_grad:
        return int(row.numpy().argmax())
    return int(torch.argmax(row))


def argmax_rows(rows: list[torch.Tensor]) -> list[int]:
    """Each logits row's argmax_index (choose_token's choice for plain_argmax settings); off the CPU one
    reduction and one transfer for all rows, the same indices."""
    if not rows:
        return []
    if rows[0].device.type == "cpu" or len(rows) == 1:  # (one row: no stacking copy)
        return [argmax_index(row) for row in rows]
    return torch.argmax(torch.stack(rows), dim=-1).tolist()


def choose_token(logits: torch.Tensor, params: SamplingParams, *, position: int,
                 previous: torch.Tensor | None = None, generated: Sequence[int] | None = None) -> int:
    """logits [V] float32 -> token id. `position` is the index the token will have in the sequence;
    `generated` the tokens generated before it (when None: `params.history`, which this records)."""
    logits = adjusted_logits(logits, params, position=position, previous=previous, generated=generated)
    if params.greedy:
        token = argmax_index(logits)
    else:
        scaled = logits.to(torch.float64) / params.temperature
        allowed = allowed_mask(scaled, params)
        noisy = scaled + gumbel_noise(params.seed, position, scaled.numel(), scaled.device)
        token = int(torch.argmax(torch.where(allowed, noisy, torch.full_like(noisy, -torch.inf))))
    if params.history is not None:
        params.history.record(position, token)
    return token
