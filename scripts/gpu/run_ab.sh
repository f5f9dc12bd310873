#!/usr/bin/env bash
# Before/after on the H200 in one call: the Qwen3-30B-A3B shape (synthesized once), `moestream bench`
# with the package at BEFORE (a copy of an older tree's moestream/) and with this tree, interleaved.
# Usage: scripts/gpu/run_ab.sh OUTDIR BEFORE_DIR [CACHE_SIZES] [EXTRA_BENCH_FLAGS...]
set -u
out=${1:?output folder}; before=${2:?folder holding the old moestream/}; sizes=${3:-100%,25%}; shift 3 || shift $#
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p "$out"
start=$(date +%s)
[ -f /tmp/q30/moestream.json ] || python3 -m moestream synth --shape qwen3-30b-a3b /tmp/q30 --force > "$out/synth.log" 2>&1
echo "synth: $(( $(date +%s) - start )) s"
for side in before after; do
  if [ "$side" = before ]; then pp=$before; else pp=$PWD; fi
  PYTHONPATH=$pp timeout 280 python3 -m moestream bench --model /tmp/q30 --cache-sizes "$sizes" --host-cache-size all \
    --prefill-tokens 512,2048 --decode-tokens 128 --warmup --out "$out/bench_$side.json" "$@" > "$out/bench_$side.log" 2>&1
  echo "$side: rc=$? $(( $(date +%s) - start )) s"; grep -E "cache|error|Error" "$out/bench_$side.log" | tail -6
done
