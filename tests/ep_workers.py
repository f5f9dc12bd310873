"""Expert-parallel ranks for tests/unit/test_expert_parallel.py, started by torch.multiprocessing
(spawned processes import their target by module name, so it lives outside the test module)."""
from __future__ import annotations

import json
import time
from pathlib import Path

PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 16


def engine_for(model_dir, fields: dict, **more):
    """An Engine of a job's fields: EngineOptions fields, and "on_demand" (no lookahead copies, so every
    miss is one distinct expert)."""
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.format.reader import PackedModel

    options = {k: v for k, v in fields.items() if k != "on_demand"}
    return Engine(PackedModel(model_dir), EngineOptions(**options, **more), prefetch=not fields.get("on_demand"))


def run_generation(engine) -> dict:
    """Greedy tokens and top-2 logprobs (exact floats) of NEW_TOKENS generated tokens."""
    gen = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, logprobs=2, stop_at_eos=False)
    events = list(gen)
    return {"tokens": [e.token_id for e in events],
            "logprobs": [[[t, lp] for t, lp in e.top_logprobs] for e in events],
            "receipt": dict(gen.result.receipt)}


def cached_keys(engine) -> list[list[int]]:
    """(layer, expert) of every record in the rank's slot cache."""
    cache = getattr(engine.provider, "provider", engine.provider)
    return sorted([cache.moe_layers[li], e] for (li, e) in cache.directory.keys())


def rank_main(rank: int, world: int, init_method: str, jobs: list, out_dir: str, fail_rank: int,
              timeout_s: float) -> None:
    """Run each job (name, model dir, EngineOptions fields) as one rank; write rank<N>.json.
    fail_rank: that rank raises at its 3rd expert fetch (the others must stop with a clear error)."""
    import torch

    torch.set_num_threads(1)
    from moestream.commands.launch import init_group, leave_group

    group = init_group(rank, world, device="cpu", init_method=init_method, timeout_s=timeout_s)
    results: dict = {}
    t0 = time.perf_counter()
    try:
        for name, model_dir, fields in jobs:
            engine = engine_for(model_dir, fields, expert_parallel=group)
            try:
                if rank == fail_rank:
                    fetch, calls = engine.provider.fetch, [0]

                    def failing(layer, experts, **kw):
                        calls[0] += 1
                        if calls[0] == 3:
                            raise RuntimeError("injected failure")
                        return fetch(layer, experts, **kw)
                    engine.provider.fetch = failing
                results[name] = {**run_generation(engine), "keys": cached_keys(engine)}
            finally:
                engine.close()
    except Exception as exc:
        if rank == fail_rank:
            raise
        results["error"] = {"type": type(exc).__name__, "message": str(exc), "after_s": time.perf_counter() - t0}
    finally:
        if "error" not in results:
            leave_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
