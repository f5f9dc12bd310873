"""Prefill graphs against the eager prefill, one length at a time with a sync after each (run with
CUDA_LAUNCH_BLOCKING=1 to name a failing kernel): logits bit for bit, and the time of each. The hit
counts are read after every prefill, as each generate reads them, so a length whose bucket was
captured before replays its graph after a read.
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
    for mode in ("off", "auto"):
        engine = Engine.load(model, options=EngineOptions(device="cuda", cache_size="all", max_context=4096,
                                                          prefill_graphs=mode))
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
    for n in lengths:
        a, b = results[("off", n)], results[("auto", n)]
        print(f"T={n}: equal {torch.equal(a, b)} max diff {(a - b).abs().max().item():.3g} "
              f"argmax {int(a.argmax())} {int(b.argmax())}", flush=True)


if __name__ == "__main__":
    main()
