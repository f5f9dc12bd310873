#!/usr/bin/env bash
# GPU tests, then decode with and without CUDA graphs on the Qwen3-30B-A3B shape.
set -u
out=${1:?output folder}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 150 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -30 > "$out/gpu_tests.log"
python3 -m moestream synth --shape qwen3-30b-a3b /tmp/q30 --force > /dev/null 2>&1
timeout 200 python3 -m moestream bench --model /tmp/q30 --cache-sizes 100%,25% --host-cache-size all \
  --prefill-tokens 512 --decode-tokens 128 --warmup --out "$out/bench_graphs.json" > "$out/bench_graphs.log" 2>&1
cat "$out/gpu_tests.log" | tail -15; grep cache "$out/bench_graphs.log"
