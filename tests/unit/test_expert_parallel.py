"""Expert parallelism over gloo (CPU): 2 and 3 spawned ranks give one process's tokens and logprobs
bit for bit, each rank reads only its own experts, and a rank that fails stops the others at once."""
from __future__ import annotations

import json
import time

import pytest
import torch

from ep_workers import engine_for, rank_main, run_generation
from moestream.engine.expert_setup import placement_from_trace
from moestream.format.reader import PackedModel
from moestream.layers.expert_parallel import ExpertPlacement, owners_balanced, owners_by_modulo

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
EXACT = dict(device="cpu", threads=1, cache_size="all", on_demand=True)  # every miss is one distinct expert
STREAMED = dict(device="cpu", threads=1, cache_size="min")  # evictions, batches, early reads


def spawn(world: int, jobs: list, out_dir, *, fail_rank: int = -1, timeout_s: float = 60) -> dict[int, dict]:
    import torch.multiprocessing as mp

    ctx = mp.spawn(rank_main, args=(world, f"file://{out_dir}/store", jobs, str(out_dir), fail_rank, timeout_s),
                   nprocs=world, join=False)
    for p in ctx.processes:
        p.join(timeout_s + 30)
        assert not p.is_alive(), "a rank hung"
    return {r: json.loads((out_dir / f"rank{r}.json").read_text())
            for r in range(world) if (out_dir / f"rank{r}.json").exists()}


def reference(model_dir, fields: dict) -> tuple[dict, dict[int, set[int]]]:
    """One process: the generation, and the experts each MoE layer routed to."""
    before = torch.get_num_threads()
    engine = engine_for(model_dir, fields)
    used: dict[int, set[int]] = {}
    trace = engine.experts.on_route

    def route(layer, ids):
        used.setdefault(layer, set()).update(ids.flatten().tolist())
        if trace is not None:
            trace(layer, ids)
    engine.experts.on_route = route
    try:
        return run_generation(engine), used
    finally:
        engine.close()
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tiny_packed_model):
    return {f: str(tiny_packed_model(f, quant="q4")) for f in FAMILIES}


@pytest.fixture(scope="module")
def refs(models, tmp_path_factory):
    """Per family: one process's generation, the experts it routed to, its routing trace. The bits
    are the same for every cache size and source, so one reference serves every rank count."""
    folder = tmp_path_factory.mktemp("traces")
    out = {}
    for f in FAMILIES:
        trace = folder / f"{f}.npz"
        ref, used = reference(models[f], {**EXACT, "trace_routing": str(trace)})
        out[f] = (ref, used, str(trace))
    return out


def owners_of(model_dir, world: int, trace: str | None = None) -> ExpertPlacement:
    counts = {e.layer: e.num_experts for e in PackedModel(model_dir).manifest.expert_layers}
    return placement_from_trace(trace, counts, world) if trace else ExpertPlacement.modulo(counts, world)


def test_placements():
    assert owners_by_modulo(5, 2) == [0, 1, 0, 1, 0]
    # greedy by load: the two busiest experts on different ranks, then the light ones fill in
    assert owners_balanced([10, 1, 9, 1, 1, 1], 2) == [0, 1, 1, 0, 1, 0]
    assert owners_balanced([0, 0, 0], 3) == [0, 1, 2]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_give_one_process_bits_and_read_only_their_experts(models, refs, world, tmp_path):
    """2 ranks: a slot for every expert, no early reads (each miss is one routed expert of the rank);
    3 ranks: a small cache (evictions, batches, early reads), and one run balanced by a trace."""
    fields = EXACT if world == 2 else STREAMED
    jobs = [(f, models[f], fields) for f in FAMILIES]
    if world == 3:
        jobs.append(("balanced", models["qwen2_moe"], {**fields, "expert_placement": refs["qwen2_moe"][2]}))
    ranks = spawn(world, jobs, tmp_path)
    assert sorted(ranks) == list(range(world)), ranks
    for name, model_dir, job_fields in jobs:
        f = "qwen2_moe" if name == "balanced" else name
        ref, used, _ = refs[f]
        placement = owners_of(model_dir, world, job_fields.get("expert_placement"))
        assert len(ref["tokens"]) == 16
        for r, out in ranks.items():
            got = out[name]
            assert got["tokens"] == ref["tokens"], (name, r)
            assert got["logprobs"] == ref["logprobs"], (name, r)  # exact floats
            mine = {(layer, e) for layer in used for e in used[layer] if placement.owners[layer][e] == r}
            cached = {tuple(k) for k in got["keys"]}
            assert all(placement.owners[layer][e] == r for layer, e in cached), (name, r, "read another rank's expert")
            if fields is EXACT:
                assert cached == mine, (name, r)
                assert got["receipt"]["misses"] == len(mine)
        parallel = ranks[0][name]["receipt"]["parallel"]
        assert parallel["placement"] == job_fields.get("expert_placement", "modulo")
        assert [p["rank"] for p in parallel["ranks"]] == list(range(world))
        assert all(p["exchanges"] > 0 and p["collective_s"] > 0 for p in parallel["ranks"])
        if fields is EXACT:  # each routed expert read once, by its owner (one process holds them all resident)
            routed = sum(len(experts) for experts in used.values())
            record = max(e.record_size for e in PackedModel(model_dir).manifest.expert_layers)
            assert sum(p["misses"] for p in parallel["ranks"]) == routed
            assert sum(p["bytes_read_disk"] for p in parallel["ranks"]) == routed * record
    # the trace's counts moved experts: the balanced placement is not the modulo one
    assert owners_of(models["qwen2_moe"], 3, refs["qwen2_moe"][2]).owners != owners_of(models["qwen2_moe"], 3).owners


def test_a_failing_rank_stops_the_others_fast(models, tmp_path):
    timeout_s = 40
    t0 = time.perf_counter()
    ranks = spawn(2, [("qwen3_moe", models["qwen3_moe"], EXACT)], tmp_path, fail_rank=1, timeout_s=timeout_s)
    assert 1 not in ranks  # the failing rank raised
    error = ranks[0]["error"]
    assert error["type"] == "ExpertParallelError", error
    assert "another rank stopped" in error["message"] and "\n" not in error["message"]
    assert error["after_s"] < timeout_s / 2 and time.perf_counter() - t0 < timeout_s
