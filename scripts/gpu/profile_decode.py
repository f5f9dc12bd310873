"""Where decode and prefill time goes on CUDA: cProfile of the Python side and torch.profiler's
top CUDA kernels, on a synthetic model held fully in the slot cache."""
import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from moestream.bench.main import random_prompt
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--cache-size", default="all")
    p.add_argument("--no-cuda-graphs", dest="graphs", action="store_false")
    p.add_argument("--rows-products", default=EngineOptions.rows_products, choices=["cublas", "triton"])
    a = p.parse_args()
    engine = Engine.load(a.model, options=EngineOptions(device="cuda", cache_size=a.cache_size, max_context=4096,
                                                        cuda_graphs=a.graphs, host_cache_size="all",
                                                        rows_products=a.rows_products))
    vocab = engine.args.vocab_size
    for _ in engine.generate(random_prompt(64, vocab, 1), max_new_tokens=16, stop_at_eos=False):
        pass
    engine.prefill(random_prompt(a.prefill, vocab, 2))  # load every expert once
    engine.reset()
    torch.cuda.synchronize()
    for label, fn in (("decode", lambda: list(engine.generate(random_prompt(16, vocab, 3), max_new_tokens=a.tokens,
                                                                stop_at_eos=False))),
                      ("prefill", lambda: (engine.reset(), engine.prefill(random_prompt(a.prefill, vocab, 2))))):
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        torch.cuda.synchronize()
        prof.disable()
        dt = time.perf_counter() - t0
        print(f"== {label}: {dt:.3f} s", flush=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue()[-3500:])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
            fn()
            torch.cuda.synchronize()
        print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)[-9000:])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
