#!/usr/bin/env bash
# On a GPU machine: the attention path's GPU tests, then every family's shape resident at batch 1
# (uniform routing, prefill 512 and 2048), one process per shape, JSON per shape into OUT.
#   scripts/gpu_families.sh OUT [SHAPE...]      (default: the shapes below; BEFORE=DIR also benches
#                                                the same shapes with an older checkout's moestream/)
set -u
out=${1:?output folder}; shift
shapes=${*:-gemma-4-26b-a4b gpt-oss-20b qwen3-30b-a3b qwen3.5-35b-a3b qwen3-next-80b-a3b}
mkdir -p "$out"; root=$PWD
export PYTHONUNBUFFERED=1 PYTHONPATH=$root
log() { echo "[$(date +%T)] $*" | tee -a "$out/run.log"; }
for s in $shapes; do python3 -m moestream synth --shape "$s" "/tmp/$s" --force > "$out/synth-$s.log" 2>&1 & done
timeout 600 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_paged_attention_cuda.py tests/gpu/test_paged_kv_cuda.py \
  tests/gpu/test_gemma4_gpt_oss_cuda.py tests/gpu/test_decoder.py tests/gpu/test_batching.py > "$out/gpu-tests.log" 2>&1
log "gpu tests rc=$? $(tail -1 "$out/gpu-tests.log")"
wait
for s in $shapes; do
  for side in after ${BEFORE:+before}; do
    d=$root; [ "$side" = before ] && d=$BEFORE
    (cd "$d" && PYTHONPATH=$d timeout 300 python3 -m moestream bench --model "/tmp/$s" --cache-size 100% --decode-tokens 64 \
      --warmup --routing uniform --prefill-tokens 512,2048 --out "$out/$s-$side.json" > "$out/$s-$side.log" 2>&1)
    log "$s $side rc=$? $(grep -aE '^ *cache|rror' "$out/$s-$side.log" | tail -2 | tr '\n' ' ')"
  done
done
