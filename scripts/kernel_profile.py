"""Where a decode step's GPU time goes: the CUDA kernels of N decode steps (graphs off, so each kernel
is seen), grouped by name, with their share of the step's time and the wall time per step.

    python scripts/kernel_profile.py MODEL_DIR [--tokens N] [--routing uniform] [--top K]

A maintainer's tool (CUDA only): it prints a table; the figures to publish come from `moestream bench`."""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moestream.bench.routing import parse_routing, rerouter
from moestream.engine.engine import load_engine
from moestream.engine.options import EngineOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--routing", default="uniform")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    engine = load_engine(args.model, EngineOptions(device="cuda", cache_size="100%"),
                         reroute=rerouter(parse_routing(args.routing), seed=0))
    prompt = list(range(5, 21))

    def run() -> None:
        engine.reset()
        list(engine.generate(prompt, max_new_tokens=args.tokens, stop_at_eos=False))

    run()  # warm up, capture
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    graphs_ms = (time.perf_counter() - t0) * 1e3 / args.tokens
    engine.decoder.use_graphs = False
    run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:90]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in kernels.values())
    n = sum(v[0] for v in kernels.values())
    print(f"wall with graphs {graphs_ms:.3f} ms/token; kernels {n / args.tokens:.0f}/token, "
          f"{total / 1e3 / args.tokens:.3f} ms/token of kernel time (prompt's prefill included)")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{us / 1e3 / args.tokens:8.3f} ms/tok {count / args.tokens:7.1f}/tok {us / count:8.2f} us  {name}")


if __name__ == "__main__":
    main()
