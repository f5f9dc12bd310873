#!/usr/bin/env bash
# Device-driven against host-driven streaming on the Qwen3-30B-A3B shape at known hit rates
# (--routing uniform), A-B-A at 25 %, every cache size, and --memory-budget 8GiB; GPU tests first.
# Usage: scripts/gpu/run_device_stream.sh OUTDIR [TESTS...]
set -u
out=${1:?output folder}; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p "$out"
start=$(date +%s)
if [ $# -gt 0 ]; then
  timeout -s ABRT 300 python3 -m pytest "$@" -q -p no:cacheprovider --durations=5 > "$out/gpu_tests.log" 2>&1
  echo "tests: $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|Timeout|Fatal" "$out/gpu_tests.log" | tail -12
fi
[ -f /tmp/q30/moestream.json ] || python3 -m moestream synth --shape qwen3-30b-a3b /tmp/q30 --force > /dev/null 2>&1
echo "synth: $(( $(date +%s) - start )) s"
bench() {  # name, flags... (the page cache holds the model after synth: mmap fills the host tier fast)
  local name=$1; shift
  timeout 240 python3 -m moestream bench --model /tmp/q30 --host-cache-size all --expert-source mmap \
    --decode-tokens 128 --warmup --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - start )) s"; grep -E "^cache|rror" "$out/$name.log" | tail -5
}
sizes=${SIZES:-50%,25%,10%}
bench device_uniform --routing uniform --cache-sizes $sizes --prefill-tokens 512 --plot "$out/device_uniform.png"
bench host_uniform25 --routing uniform --cache-sizes 25% --prefill-tokens 512 --streaming host
bench device_uniform25 --routing uniform --cache-sizes 25% --prefill-tokens 512 --streaming device
bench device_budget8 --routing uniform --memory-budget 8GiB --prefill-tokens 512
bench device_model25 --cache-sizes 25% --prefill-tokens 512
ls "$out"
