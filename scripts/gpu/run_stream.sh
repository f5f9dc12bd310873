#!/usr/bin/env bash
# Streamed decode on the Qwen3-30B-A3B shape at known hit rates (--routing uniform), lookahead on and
# off, and a run under --memory-budget 8GiB. Usage: scripts/gpu/run_stream.sh OUTDIR
set -u
out=${1:?output folder}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
start=$(date +%s)
[ -f /tmp/q30/moestream.json ] || python3 -m moestream synth --shape qwen3-30b-a3b /tmp/q30 --force > /dev/null 2>&1
echo "synth: $(( $(date +%s) - start )) s"
bench() {  # name, flags...
  local name=$1; shift
  timeout 200 python3 -m moestream bench --model /tmp/q30 --host-cache-size all --decode-tokens 128 --warmup \
    --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - start )) s"; grep -E "^cache|error" "$out/$name.log" | tail -5
}
bench uniform --routing uniform --cache-sizes 100%,50%,25%,10% --prefill-tokens 512,2048 --plot "$out/uniform.png"
bench uniform_noprefetch --routing uniform --cache-sizes 25% --prefill-tokens 512 --prefetch none
bench budget8 --routing uniform --memory-budget 8GiB --prefill-tokens 512,2048
bench model_noprefetch --cache-sizes 25% --prefill-tokens 512 --prefetch none
bench model_prefetch --cache-sizes 25% --prefill-tokens 512
