#!/usr/bin/env bash
# GPU tests of the streamed paths, then the Qwen3-30B-A3B-shape benches under uniform routing:
# device-driven streaming at 50/25/10 %, the host path at 25 %, --memory-budget 8GiB, the CPU share
# of the misses (auto, 0.5), model routing; and the CPU expert kernel alone on this machine's cores.
# Usage: scripts/gpu/run_final.sh OUTDIR [TESTS...]
set -u
out=${1:?output folder}; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p "$out"
start=$(date +%s)
if [ $# -gt 0 ]; then
  timeout -s ABRT 150 python3 -m pytest "$@" -q -p no:cacheprovider --durations=5 > "$out/gpu_tests.log" 2>&1
  echo "tests: $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|Timeout|Fatal|^E " "$out/gpu_tests.log" | tail -12
fi
timeout 60 python3 scripts/bench_cpu_experts.py --threads 8 16 --out "$out/cpu_kernel.json" > "$out/cpu_kernel.log" 2>&1
echo "cpu kernel: $(( $(date +%s) - start )) s"; tail -4 "$out/cpu_kernel.log"
[ -f /tmp/q30/moestream.json ] || python3 -m moestream synth --shape qwen3-30b-a3b /tmp/q30 --force > /dev/null 2>&1
echo "synth: $(( $(date +%s) - start )) s"
bench() {  # name, flags...
  local name=$1; shift
  timeout 120 python3 -m moestream bench --model /tmp/q30 --host-cache-size all --expert-source mmap \
    --decode-tokens 128 --warmup --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - start )) s"; grep -E "^cache|rror" "$out/$name.log" | tail -4
}
bench device_uniform --routing uniform --cache-sizes 50%,25%,10% --prefill-tokens 512 --plot "$out/device_uniform.png"
bench budget8 --routing uniform --memory-budget 8GiB --prefill-tokens 512
bench cpu_auto25 --routing uniform --cache-sizes 25% --prefill-tokens 512 --cpu-experts auto
bench model25 --cache-sizes 25% --prefill-tokens 512
bench cpu_half25 --routing uniform --cache-sizes 25% --prefill-tokens 512 --cpu-experts 0.5
# many clients at once on the resident model (random weights: routing collapses, batching looks better than on a trained model)
timeout 100 python3 scripts/bench_server_batching.py --model /tmp/q30 --parallel 1,16 --clients 1,16 --max-tokens 32 \
  --server-args "--device cuda --cache-size all" --out "$out/server_batching.json" > "$out/server_batching.log" 2>&1
echo "server batching: rc=$? $(( $(date +%s) - start )) s"; tail -6 "$out/server_batching.log"
