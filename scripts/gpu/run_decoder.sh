#!/usr/bin/env bash
# GPU tests, the Qwen3-30B-A3B-shape bench at several cache sizes (a full host tier behind the device
# cache), and the comparison with transformers on a 4-layer model of the same shape.
# Usage: scripts/gpu/run_decoder.sh OUTDIR [CACHE_SIZES] [TEST_TIMEOUT_S]
set -u
out=${1:?output folder}; sizes=${2:-100%,50%,25%,10%}; test_s=${3:-260}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p "$out"
start=$(date +%s)
# SIGABRT on timeout: faulthandler prints every thread's stack, so a hang says where it is
timeout -s ABRT "$test_s" python3 -m pytest tests/gpu -q -p no:cacheprovider --durations=8 2>&1 | tail -60 > "$out/gpu_tests.log"
echo "tests: $(( $(date +%s) - start )) s"; grep -E "passed|failed|Timeout|Fatal" "$out/gpu_tests.log" | tail -5
[ -f /tmp/q30/moestream.json ] || python3 -m moestream synth --shape qwen3-30b-a3b /tmp/q30 --force > /dev/null 2>&1
timeout 300 python3 -m moestream bench --model /tmp/q30 --cache-sizes "$sizes" --host-cache-size all \
  --prefill-tokens 512,2048 --decode-tokens 128 --warmup --out "$out/bench_q30.json" --plot "$out/bench_q30.png" \
  > "$out/bench_q30.log" 2>&1
grep cache "$out/bench_q30.log"; echo "bench: $(( $(date +%s) - start )) s"
python3 -m moestream synth --shape qwen3-30b-a3b --layers 4 /tmp/q30l4 --force > /dev/null 2>&1
timeout 120 python3 -m moestream bench --model /tmp/q30l4 --cache-size 100% --prefill-tokens 2048 --decode-tokens 64 \
  --warmup --compare-transformers --out "$out/bench_tf.json" > "$out/bench_tf.log" 2>&1
grep -E "cache|transformers" "$out/bench_tf.log"; echo "all: $(( $(date +%s) - start )) s"
