"""What a verification step of T tokens costs, and what speculation could gain from it (`bench --step-tokens`).

Speculative decoding trades drafted tokens for longer steps: a step of T tokens verifies T - 1
drafts. With MoE each extra token may route to other experts (and, streamed, to other misses), so
how step time grows with T is measured, not assumed: each T is timed over `repeats` steps of
random tokens after a short prompt (the cache rolled back after each, so every step runs at the
same position), the first step of each T untimed (its kernels' first use). From those costs the
speedup a drafter with acceptance a could give is predicted for each a: the best draft length k of
E(k) / (step(k + 1) / step(1)) tokens per step time, where E(k) = (1 - a^(k+1)) / (1 - a) is the
expected tokens of a verification (moestream.engine.draft_policy.AdaptivePolicy); the drafter's own
time is left out (an upper bound for a model drafter, about right for prompt lookup)."""
from __future__ import annotations

import random
import statistics
import time

ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9)


def measure_step_costs(engine, sizes: list[int], *, repeats: int = 8, seed: int = 0, prompt_tokens: int = 64) -> dict:
    """{"step_ms": {T: median ms}, "step_ms_all": {T: [ms...]}, "predicted": [...]} for steps of each T in sizes."""
    from moestream.engine.draft_policy import AdaptivePolicy

    rng = random.Random(seed)
    vocab = engine.args.vocab_size
    engine.reset()
    engine.prefill([rng.randrange(vocab) for _ in range(min(prompt_tokens, engine.max_context // 2))])
    length = engine.cache.length
    times: dict[int, list[float]] = {}
    for T in sizes:
        if length + T >= engine.max_context:
            continue
        runs = []
        for r in range(repeats + 1):
            tokens = [rng.randrange(vocab) for _ in range(T)]
            engine._sync()
            t0 = time.perf_counter()
            engine.step(tokens)
            engine._sync()
            if r:  # the first is the kernels' first use at this T
                runs.append((time.perf_counter() - t0) * 1000.0)
            engine.rollback(length)
        times[T] = runs
    step_ms = {T: round(statistics.median(v), 4) for T, v in times.items()}
    predicted = []
    if 1 in step_ms:
        for a in ACCEPTANCE:
            best_k, best = 0, 1.0
            for T, ms in step_ms.items():
                k = T - 1
                gain = AdaptivePolicy.expected_tokens(a, k) / (ms / step_ms[1])
                if gain > best:
                    best_k, best = k, gain
            predicted.append({"acceptance": a, "best_draft": best_k, "speedup": round(best, 3)})
    engine.reset()
    return {"step_ms": {str(T): v for T, v in step_ms.items()},
            "step_ms_all": {str(T): [round(x, 4) for x in v] for T, v in times.items()},
            "repeats": repeats, "predicted": predicted,
            "note": "speedup = best over k of E(k) / (step(k+1) / step(1)); the drafter's own time left out"}
