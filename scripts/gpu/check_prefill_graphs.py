"""Prefill graphs against the same padded chunk run eagerly (no CUDA graphs; and at a 25 % expert cache
where the rest streams from the host tier) and against the unpadded prefill, one length at a time with
a sync after each (run with CUDA_LAUNCH_BLOCKING=1 to name a failing kernel): the logits must be equal
bit for bit to the padded eager runs, and close to the unpadded ones. The hit counts are read after
every prefill, as each generate reads them, so a length whose bucket was captured before replays its
graph after a read.
Usage: python scripts/gpu/check_prefill_graphs.py MODEL_DIR LENGTH... (MODEL_DIR 'tiny': a tiny qwen3_moe)"""
import sys
import tempfile
import time
from pathlib import Path

import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions


def tiny() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny import build_checkpoint

    from moestream.convert.main import convert

    root = Path(tempfile.mkdtemp())
    return convert(build_checkpoint(root / "hf", "qwen3_moe", dtype="bfloat16"), root / "packed", quant="q4")


def main():
    model, lengths = sys.argv[1], [int(n) for n in sys.argv[2:]]
    model = tiny() if model == "tiny" else model
    results = {}
    runs = {"graphs": dict(prefill_graphs="on"), "padded-eager": dict(prefill_graphs="auto", cuda_graphs=False),
            "padded-25%": dict(prefill_graphs="auto", cache_size="25%", host_cache_size="all"),
            "unpadded": dict(prefill_graphs="off")}
    for mode, options in runs.items():
        options = {"cache_size": "all", **options}
        engine = Engine.load(model, options=EngineOptions(device="cuda", max_context=4096, **options))
        vocab = engine.args.vocab_size
        for n in lengths:
            prompt = [(11 * i + n) % vocab for i in range(n)]
            for rep in range(2):
                engine.reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits, _ = engine.prefill(prompt)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                engine.expert_stats()
                print(f"{mode} T={n} run {rep}: {dt * 1e3:.1f} ms", flush=True)
            results[(mode, n)] = logits.clone()
        graphs = engine.prefill_graphs
        print(mode, "graphs", sorted(graphs.graphs) if graphs else None, flush=True)
        engine.close()
    failed = False
    for n in lengths:
        a = results[("graphs", n)]
        for mode in list(runs)[1:]:
            b = results[(mode, n)]
            equal = torch.equal(a, b)
            failed |= not equal and mode != "unpadded"
            print(f"T={n} graphs vs {mode}: equal {equal} max diff {(a - b).abs().max().item():.3g} "
                  f"argmax {int(a.argmax())} {int(b.argmax())}", flush=True)
    print("FAILED: a padded run's bits differ" if failed else "ok: every padded run has the graphs' bits", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
