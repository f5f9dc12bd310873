#!/usr/bin/env bash
# Every GPU step in one go, on a machine with an NVIDIA GPU and torch/triton/transformers installed.
# Usage: scripts/gpu/run_all.sh OUTDIR [tests] [kernels] [bench] [cold] [transformers]
set -u
out=${1:?output folder}; shift
steps=${*:-tests kernels bench cold transformers}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=python3
mkdir -p "$out"
has() { [[ " $steps " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
if has tests; then
  timeout 300 $py -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -40 > "$out/gpu_tests.log"
fi
if has kernels; then
  timeout 120 $py scripts/bench_kernels.py --out "$out/kernels.json" > "$out/kernels.log" 2>&1
fi
model=/tmp/q30
if has bench || has cold; then
  [ -f $model/moestream.json ] || $py -m moestream synth --shape qwen3-30b-a3b $model --force > "$out/synth.log" 2>&1
fi
if has bench; then
  # experts not in the device cache sit in a host tier that holds them all (read from disk once, in the warmup)
  timeout 420 $py -m moestream bench --model $model --cache-sizes 100%,50%,25%,10% --host-cache-size all \
    --prefill-tokens 512,2048 --decode-tokens 128 --warmup --out "$out/bench_q30.json" --plot "$out/bench_q30.png" \
    > "$out/bench_q30.log" 2>&1
fi
if has cold; then
  timeout 240 $py -m moestream bench --model $model --cache-sizes 10% --cold --prefill-tokens 512 --decode-tokens 64 \
    --out "$out/bench_cold.json" > "$out/bench_cold.log" 2>&1
fi
if has transformers; then
  $py -m moestream synth --shape qwen3-30b-a3b --layers 4 /tmp/q30l4 --force > /dev/null 2>&1
  timeout 300 $py -m moestream bench --model /tmp/q30l4 --cache-size 100% --prefill-tokens 2048 --decode-tokens 64 \
    --warmup --compare-transformers --out "$out/bench_tf.json" > "$out/bench_tf.log" 2>&1
fi
ls -la "$out"
