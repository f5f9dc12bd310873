#!/usr/bin/env bash
# Lookahead off / on / off at 25 % with uniform routing (a fresh process each), and --memory-budget 8GiB.
# Usage: scripts/gpu/run_lookahead_ab.sh OUTDIR
set -u
out=${1:?output folder}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
start=$(date +%s)
[ -f /tmp/q30/moestream.json ] || python3 -m moestream synth --shape qwen3-30b-a3b /tmp/q30 --force > /dev/null 2>&1
echo "synth: $(( $(date +%s) - start )) s"
bench() {
  local name=$1; shift
  timeout 70 python3 -m moestream bench --model /tmp/q30 --host-cache-size all --decode-tokens 128 --warmup \
    --routing uniform --prefill-tokens 256 --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - start )) s"; grep -E "^cache|error" "$out/$name.log" | tail -2
}
bench budget8 --memory-budget 8GiB
bench off1 --cache-sizes 25% --prefetch none
bench on --cache-sizes 25% --prefetch next-layer
bench off2 --cache-sizes 25% --prefetch none
