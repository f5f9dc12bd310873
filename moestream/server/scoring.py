"""Log-probabilities of a prompt's own tokens (echo with logprobs): what evaluation harnesses use
to score a continuation. Runs on the worker thread; the only server module that touches tensors."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def prompt_logprobs(engine: Any, prompt_ids: list[int], k: int, *,
                    should_stop: Optional[Callable[[], bool]] = None
                    ) -> Optional[list[tuple[int, Optional[float], list[tuple[int, float]]]]]:
    """[(token id, its logprob given the tokens before it, the k most likely there)] for every
    prompt token; the first has no logprob (None) and no alternatives. None if stopped."""
    logits, _ = engine.prefill(list(prompt_ids), should_stop=should_stop, all_logits=True)
    if logits is None:
        return None
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]: row i predicts token i + 1
    out: list[tuple[int, Optional[float], list[tuple[int, float]]]] = [(int(prompt_ids[0]), None, [])]
    if len(prompt_ids) > 1:
        targets = torch.tensor(prompt_ids[1:], dtype=torch.long, device=logp.device)
        chosen = logp[:-1].gather(1, targets[:, None])[:, 0].tolist()
        tops = torch.topk(logp[:-1], min(k, logp.shape[-1])) if k else None
        for i, token in enumerate(prompt_ids[1:]):
            top = [] if tops is None else list(zip(tops.indices[i].tolist(), tops.values[i].tolist()))
            out.append((int(token), float(chosen[i]), top))
    return out
