#!/usr/bin/env bash
# What has not yet run on a GPU, in priority order, in parts that each fit one device call (≤ 10 min).
# Next (in this order; run new GPU test files first and alone: a device-side fault poisons the process):
# 1. the decode profile with PDL (scripts/gpu/profile_decode.py --model /tmp/q30 --prefill 512): what the gaps left.
# 2. server at 25 % with SERVER_REQUESTS=2 and SERVER_LIMIT=300 (its 32-client round).
# 3. tuned-kernels (TUNED_BITS=4,8: the kernel table, 8-bit included).
# 4. the device map's lookup at 50 % (scripts/bench_slot_map.py: 11.6 µs with the cycle rule against 6.3 with LRU)
#    once its scan is split across programs.
# Start the q30 synth in the background first (`python3 -m moestream synth --shape qwen3-30b-a3b
# /tmp/q30 --force & SP=$!` ... `wait $SP`: never wait with pgrep -f, which matches its own command).
# rows-products then rows-products-ab (--rows-products triton: the row tile's Triton products; two calls).
# Usage: scripts/gpu/run_pending.sh OUTDIR PART...
#   PART: synth | kernel-shapes | sweep | tuned | tests | stream | lookahead | resident | profile | families | cpu-share
#         | native-share | native-share-bench | share-conditions | share-ab | native-int8 | native-int8-bench | server
#         | rows-products | rows-products-ab | policy-ab
#   synth:    every shape the other parts read, side by side (one core each), so later calls find them
#   kernel-shapes: the grouped kernels' product shapes (swapped, gathered codes, tiles) against the reference
#   sweep:    the expert kernels' block sizes tried at the 30B shape (scripts/bench_kernels.py --sweep); the
#             grouped ones (SWEEP_TOKENS=512,2048) with uniform and skewed routing; best into /tmp/best-config.json
#   tuned:    resident bench with the default block sizes, then with the sweep's (its best-config.json, else /tmp's)
#   decode-ahead: resident and 25 % uniform decode with --decode-ahead off, then auto (AHEAD_MODES, AHEAD_STREAMED_MODES)
#   fused-prefill: test_fused_prefill_cuda, then resident prefill with --prefill-kernels torch, then fused
#   workspace: resident prefill at 128..8192 tokens with --prefill-workspace keep, then release
#   tuned-kernels: the kernel table (4 and 8 bits) with the sweep's block sizes, and the kernel tests with them
#   tests:    the GPU tests written or changed since the last GPU run (one pytest, TESTS_LIMIT seconds in all;
#             --step-rows off beside the default auto); server: SITE=/tmp/site
#             after installing the carried wheels, and BATCH_GRAPHS=rows for the new batched graphs
#   stream:   Qwen3-30B-A3B shape, uniform routing: 50 % and 10 % with the Triton slot map, the device path's
#             CPU share (auto / 0.3) at 25 %
#   lookahead: --device-lookahead off/on at 25 % (uniform: its gates must close; model routing: its copies must pay)
#   resident: the prefill's fixed cost profiled (512 tokens), the demo model's drafters on CUDA, the speculation tests
#   families: bench on the gemma-4-26b-a4b and DeepSeek-V3 (first 5 layers) shapes (FAMILIES overrides) at 100 % and
#             25 % with uniform routing
#   cpu-share: the device path's CPU share, CUDA tests and `--cpu-experts auto` at 25 % uniform
#   native-share: the native CPU share's extension built, its CPU and CUDA tests, scripts/bench_cpu_experts.py on 16
#             and 15 threads (native beside torch), the native worker's hand-over on 15 threads
#   native-share-bench: `--cpu-experts off` and `auto` at 25 % uniform, device-driven (NATIVE_SHARES)
#   share-ab: the conditions bench (COND_FLAGS), SHARE_TESTS, then the uniform step per SHARE_AB entry
#             (name:share:threads:cache[:ENV=V,...]; each with its environment)
#   policy-ab: the device map's victim rule (cycle, lru) and the share's counts per number of misses: POLICY_TESTS,
#             SLOT_MAP_BENCH=1: scripts/bench_slot_map.py, then the uniform step per POLICY_AB entry
#             (name:share:cache:policy; cache 25% or budget8GiB), RESIDENT=1: the resident step
#   share-conditions: scripts/bench_cpu_share_conditions.py (gaps, DMA, per team), the share's tests, then the 25 %
#             uniform step per team and thread count (SHARE_RUNS)
#   native-int8: the native kernels' int8 activations (AVX-512 VNNI): built, their CPU tests, the kernels on 1, 14
#             and 16 threads with float and int8 activations side by side
#   native-int8-bench: `--cpu-experts auto` at 25 % uniform, device-driven, with float then int8 activations
#   rows:     --step-rows auto (a step's rows at once): its GPU tests, then resident decode and step costs against off
#   drafters: the batching GPU test with warmed steps, the demo's drafters on CUDA on the held-out prompts
#   server:   scripts/bench_server_batching.py at 100 % and 25 % (needs .whl: scripts/gpu/fetch_wheels.sh here,
#             `carry: [".whl"]` in the call)
#   rows-products: its GPU tests (NO_TESTS=1: none), the cuBLAS/Triton table at the 30B shapes and the kernel's
#             block-size sweep (best into $out/rows-best-config.json and /tmp/rows-best-config.json)
#   pdl:      PDL's GPU tests, the fused boundaries' tests, resident decode without / with / without PDL
#   rows-split: the row products' classes with K splits: GPU tests, the rows sweep, decode defaults vs swept sizes
#   rows-products-ab: resident decode with --rows-products cublas, triton, and triton with the sweep's block sizes
#             (ROWS_CONFIG: their JSON, where the machine is not the one the sweep ran on)
set -u
out=${1:?output folder}; shift
export PYTHONPATH=${SITE:+$SITE:}$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p "$out"
start=$(date +%s)
say() { echo "$1: $(( $(date +%s) - start )) s ${2:-}"; }
model=/tmp/q30
synth() { [ -f $model/moestream.json ] || python3 -m moestream synth --shape qwen3-30b-a3b $model --force > "$out/synth.log" 2>&1; say synth; }
bench() {  # name, seconds, flags...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m moestream bench --model $model --host-cache-size all --expert-source mmap \
    --decode-tokens 128 --warmup --prefill-repeats ${PREFILL_REPEATS:-3} --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  say "$name" "rc=$?"; grep -E "^cache|rror" "$out/$name.log" | tail -3
}
for part in "$@"; do
  case $part in
  synth)
    synth &
    for spec in ${FAMILIES:-gemma-4-26b-a4b: deepseek-v3:5}; do
      shape=${spec%%:*} layers=${spec#*:} dir=/tmp/fam-${spec%%:*}
      [ -f $dir/moestream.json ] || python3 -m moestream synth --shape $shape $dir --force ${layers:+--layers $layers} \
        > "$out/synth-$shape.log" 2>&1 &
    done
    wait; say synth-all; df -h /tmp | tail -1 ;;
  sweep)  # the fastest block sizes into $out/best-config.json (MOESTREAM_KERNEL_CONFIG for the tuned part)
    timeout ${SWEEP_LIMIT:-330} python3 scripts/bench_kernels.py --out "$out/kernels-sweep.json" --bits ${SWEEP_BITS:-4} \
      --tokens 1,4,512,2048 --no-reference --sweep --sweep-tokens ${SWEEP_TOKENS:-1,512} \
      --sweep-seconds ${SWEEP_SECONDS:-260} --best-out "$out/best-config.json" > "$out/kernels-sweep.log" 2>&1
    say sweep "rc=$?"; grep -E "bit T=|sweep|rror" "$out/kernels-sweep.log" | tail -12; cat "$out/best-config.json"
    cp "$out/best-config.json" /tmp/best-config.json ;;  # for a later call's tuned part on the same machine
  tuned)  # resident decode and prefill with the default block sizes, then with the sweep's (one process each)
    synth
    best=${BEST:-$out/best-config.json}; [ -f "$best" ] || best=/tmp/best-config.json
    lengths=${PREFILL_LENGTHS:-128,512,2048,8192}
    bench resident-default 150 --cache-sizes all --prefill-tokens $lengths
    if [ -f "$best" ]; then
      cp "$best" "$out/tuned-config.json"
      MOESTREAM_KERNEL_CONFIG="$best" bench resident-tuned 150 --cache-sizes all --prefill-tokens $lengths
    fi ;;
  workspace)  # resident prefill at every length with the prefill workspace kept (the default) and given back
    synth
    for mode in ${WORKSPACE_MODES:-keep release}; do
      bench "resident-workspace-$mode" 120 --cache-sizes all --prefill-tokens ${PREFILL_LENGTHS:-128,512,2048,8192} \
        --prefill-workspace $mode
    done ;;
  fused-prefill)  # --prefill-kernels fused: its GPU tests (NO_TESTS=1: none), then resident prefill at every length against torch
    [ -z "${NO_TESTS:-}" ] && timeout -s ABRT 120 python3 -m pytest tests/gpu/test_fused_prefill_cuda.py -q -p no:cacheprovider -rfE \
      > "$out/fused-prefill-tests.log" 2>&1
    say fused-prefill-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$out/fused-prefill-tests.log" | tail -4
    synth
    for kernels in torch fused; do
      bench "resident-prefill-$kernels" 120 --cache-sizes all --prefill-tokens ${PREFILL_LENGTHS:-128,512,2048,8192} \
        --prefill-kernels $kernels
    done ;;
  decode-ahead)  # greedy decode with each step queued before its token is read, against one step at a time
    synth
    for mode in ${AHEAD_MODES:-off auto}; do
      bench "resident-ahead-$mode" 120 --cache-sizes all --prefill-tokens ${PREFILL_LENGTHS:-512,2048} --decode-ahead $mode
    done
    for mode in ${AHEAD_STREAMED_MODES:-off auto}; do
      bench "stream-25pct-uniform-ahead-$mode" 120 --routing uniform --cache-sizes 25% --prefill-tokens 512 \
        --decode-ahead $mode
    done ;;
  tuned-kernels)  # the kernel table with the sweep's block sizes (the sweep part's table has the defaults), their tests
    best=${BEST:-$out/best-config.json}; [ -f "$best" ] || best=/tmp/best-config.json
    if [ -f "$best" ]; then
      MOESTREAM_KERNEL_CONFIG="$best" timeout 150 python3 scripts/bench_kernels.py --out "$out/kernels-tuned.json" \
        --bits ${TUNED_BITS:-4,8} --tokens 1,4,512,2048 --no-reference > "$out/kernels-tuned.log" 2>&1
      say kernels-tuned "rc=$?"; grep -E "bit T=|rror" "$out/kernels-tuned.log" | tail -8
      [ -n "${TUNED_TESTS-1}" ] && MOESTREAM_KERNEL_CONFIG="$best" timeout -s ABRT 120 python3 -m pytest tests/gpu/test_kernels.py \
        tests/gpu/test_mxfp4_kernels_cuda.py -q -p no:cacheprovider \
        -k "matches_reference or kernel_shapes or same_bits or 30b_a3b or mixed_bits or mxfp4" \
        > "$out/tuned-kernel-tests.log" 2>&1
      say tuned-kernel-tests "rc=$?"; tail -2 "$out/tuned-kernel-tests.log"
    fi ;;
  profile)
    synth
    timeout 150 python3 scripts/gpu/profile_decode.py --model $model --prefill 512 > "$out/profile-512.log" 2>&1
    say profile-512 "rc=$?" ;;
  kernel-shapes)  # the grouped kernels' product shapes the sweep may choose, against the reference
    timeout -s ABRT ${SHAPES_LIMIT:-120} python3 -m pytest tests/gpu/test_kernels.py -k grouped_product -q \
      -p no:cacheprovider -rfE > "$out/kernel-shapes.log" 2>&1
    say kernel-shapes "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/kernel-shapes.log" | tail -8 ;;
  tests)  # one pytest process (one CUDA start), capped as a whole; --durations says what to trim next time
    files=""
    for f in ${TEST_FILES:-test_batching test_speculative_cuda test_server_batching_cuda test_device_cpu_share_cuda \
             test_decode_kernels test_greedy_rows_cuda test_prompt_step_cuda} ${EXTRA_TESTS:-}; do
      [ -f tests/gpu/$f.py ] && files="$files tests/gpu/$f.py"
    done
    timeout -s ABRT ${TESTS_LIMIT:-300} python3 -m pytest $files -q -p no:cacheprovider -rfE --durations=15 \
      > "$out/gpu-tests.log" 2>&1
    say tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Timeout|Fatal" "$out/gpu-tests.log" | tail -25 ;;
  stream)  # the Triton slot map (default) at 50 % and 10 %, and the device path's CPU share at 25 %
    synth
    bench stream-sizes 150 --routing uniform --prefill-tokens 512 --cache-sizes 50%,10%
    for share in ${CPU_SHARES:-auto 0.3}; do bench "device-cpu-share-$share" 120 --routing uniform --prefill-tokens 512 \
      --cache-sizes 25% --streaming device --cpu-experts $share; done ;;
  lookahead)
    synth
    for routing in uniform model; do for look in off on; do
      bench "lookahead-$routing-$look" 150 --routing $routing --prefill-tokens 512 --cache-sizes 25% --slot-map triton \
        $([ $look = on ] && echo --device-lookahead)
    done; done ;;
  resident)  # what is left of it: the prefill's fixed cost profiled, the demo's drafters on CUDA
    synth
    timeout 150 python3 scripts/gpu/profile_decode.py --model $model --prefill 512 > "$out/profile-512.log" 2>&1
    say profile-512 "rc=$?"
    for d in ngram auto; do  # the demo model's drafters (auto: its shipped draft model)
      timeout 120 python3 -m moestream bench --device cuda --draft $d --prompt "$(head -c 400 moestream/engine/engine.py)" \
        --prefill-tokens "" --decode-tokens 256 --cache-sizes 100%,30% --warmup --out "$out/demo-draft-$d.json" \
        > "$out/demo-draft-$d.log" 2>&1
      say "demo draft $d" "rc=$?"; grep -E "speculative|rror" "$out/demo-draft-$d.log" | tail -2
    done
    timeout -s ABRT 300 python3 -m pytest tests/gpu/test_speculative_cuda.py -q -p no:cacheprovider -rfE --durations=10 \
      > "$out/speculative-tests.log" 2>&1
    say speculative-tests "rc=$?" ;;
  families)  # synthesized side by side (one core each), then benched one at a time
    specs=${FAMILIES:-gemma-4-26b-a4b: deepseek-v3:5}
    for spec in $specs; do
      shape=${spec%%:*} layers=${spec#*:} dir=/tmp/fam-${spec%%:*}
      [ -f $dir/moestream.json ] || python3 -m moestream synth --shape $shape $dir --force ${layers:+--layers $layers} \
        > "$out/synth-$shape.log" 2>&1 &
    done
    wait; say synth-families
    for spec in $specs; do
      shape=${spec%%:*} dir=/tmp/fam-${spec%%:*}
      timeout 150 python3 -m moestream bench --model $dir --host-cache-size all --expert-source mmap --decode-tokens 64 \
        --warmup --routing uniform --cache-sizes 100%,25% --prefill-tokens 512 --out "$out/family-$shape.json" \
        > "$out/family-$shape.log" 2>&1
      say "bench $shape" "rc=$?"; grep -E "^cache|rror" "$out/family-$shape.log" | tail -3
    done ;;
  cpu-share)  # the device path's CPU share: its CUDA tests (NO_TESTS=1: none), then auto at 25 % (fixed shares with CPU_SHARES)
    [ -z "${NO_TESTS:-}" ] && timeout -s ABRT ${TESTS_LIMIT:-120} python3 -m pytest tests/gpu/test_device_cpu_share_cuda.py -q -p no:cacheprovider \
      -rfE > "$out/cpu-share-tests.log" 2>&1
    say cpu-share-tests "rc=$?"; grep -E "passed|failed|FAILED|Fatal" "$out/cpu-share-tests.log" | tail -6
    synth
    for share in ${CPU_SHARES:-auto}; do bench "device-cpu-share-$share" 90 --routing uniform --prefill-tokens 512 \
      --cache-sizes 25% --streaming device --cpu-experts $share; done ;;
  native-share)  # the native CPU share: the extension built, its tests (CPU and CUDA), then the kernels on 16 and 15
    # threads against torch's and the worker's hand-over on 15; the q30 synth beside the tests (for native-share-bench)
    synth & sp=$!
    timeout 300 python3 -c "from moestream.cpu_share import kernels as n; m = n.load(); print('native:', m or n.reason())" \
      > "$out/native-build.log" 2>&1
    say native-build "rc=$?"; tail -1 "$out/native-build.log"
    timeout -s ABRT ${TESTS_LIMIT:-300} python3 -m pytest tests/unit/test_native_experts.py tests/unit/test_native_worker.py \
      tests/gpu/test_device_cpu_share_cuda.py -q -p no:cacheprovider -rfE --durations=5 > "$out/native-share-tests.log" 2>&1
    say native-share-tests "rc=$?"; grep -E "passed|failed|FAILED|Fatal" "$out/native-share-tests.log" | tail -6
    wait $sp
    timeout 150 python3 scripts/bench_cpu_experts.py --threads 16 15 --experts 48 --out "$out/native-cpu-experts-kernel.json" \
      > "$out/native-cpu-experts-kernel.log" 2>&1
    say native-kernel "rc=$?"; grep experts_per_job "$out/native-cpu-experts-kernel.log" | tail -16
    timeout 60 python3 scripts/bench_native_share_handover.py --threads 15 --out "$out/native-share-handover.json"
    say native-handover "rc=$?" ;;
  share-conditions)  # the share's kernels under a step's conditions (gaps, DMA; per team), its tests, then the step
    # per team: SHARE_RUNS of share:team:threads (team spin-free = spinning, not pinned), one process each
    synth & sp=$!
    { lscpu; grep -m1 flags /proc/cpuinfo; } > "$out/lscpu.log" 2>&1
    timeout 300 python3 -c "from moestream.cpu_share import kernels as n; m = n.load(); print('native:', m or n.reason())" \
      > "$out/native-build.log" 2>&1
    say native-build "rc=$?"; tail -1 "$out/native-build.log"
    timeout 150 python3 scripts/bench_cpu_share_conditions.py --threads ${COND_THREADS:-9 14} --out "$out/share-conditions.json" \
      > "$out/share-conditions.log" 2>&1
    say share-conditions "rc=$?"; grep -c condition "$out/share-conditions.log"
    timeout -s ABRT ${TESTS_LIMIT:-240} python3 -m pytest tests/unit/test_native_experts.py tests/unit/test_native_worker.py \
      tests/gpu/test_device_cpu_share_cuda.py -q -p no:cacheprovider -rfE --durations=5 > "$out/share-tests.log" 2>&1
    say share-tests "rc=$?"; grep -E "passed|failed|FAILED|Fatal" "$out/share-tests.log" | tail -6
    wait $sp
    for run in ${SHARE_RUNS:-off:spin:14 auto:spin:14 auto:omp:9 auto:spin-free:14}; do
      IFS=: read -r share team threads <<< "$run"
      pin=1; [ "$team" = spin-free ] && { team=spin; pin=0; }
      MOESTREAM_NATIVE_TEAM=$team MOESTREAM_NATIVE_PIN=$pin bench "share-$share-$team$([ $pin = 0 ] && echo -free)-$threads" 150 \
        --routing uniform --prefill-tokens '' --cache-sizes ${SHARE_CACHE:-25%} --streaming device --cpu-experts $share \
        --threads $threads
    done ;;
  share-ab)  # the 25 % uniform step with the CPU share, one process per SHARE_AB entry name:share:threads[:ENV=V,...]
    synth & sp=$!
    timeout 300 python3 -c "from moestream.cpu_share import kernels as n; m = n.load(); print('native:', m or n.reason())" \
      > "$out/native-build.log" 2>&1
    say native-build "rc=$?"; tail -1 "$out/native-build.log"
    cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag > "$out/thp.log" 2>&1
    timeout ${COND_LIMIT:-150} python3 scripts/bench_cpu_share_conditions.py --threads ${COND_THREADS:-8 14} ${COND_FLAGS:-} \
      --out "$out/share-conditions.json" > "$out/share-conditions.log" 2>&1
    say share-conditions "rc=$?"; cat "$out/thp.log"
    [ -n "${SHARE_TESTS:-}" ] && { timeout -s ABRT 240 python3 -m pytest $SHARE_TESTS -q -p no:cacheprovider -rfE \
      > "$out/share-tests.log" 2>&1; say share-tests "rc=$?"; tail -2 "$out/share-tests.log"; }
    wait $sp
    export -f bench say; export out model start
    for run in ${SHARE_AB:-off:off:14:25% auto:auto:14:25%}; do
      IFS=: read -r name share threads cache envs <<< "$run"
      env ${envs//,/ } bash -c "bench share-$name 150 --routing uniform --prefill-tokens '' --cache-sizes $cache \
        --streaming device --cpu-experts $share --threads $threads"
    done ;;
  native-int8)  # the int8 activations: VNNI compiled in?, their tests, float vs int8 per job size
    synth & sp=$!
    timeout 300 python3 -c "from moestream.cpu_share import kernels as n; m = n.load(); \
print('native:', m or n.reason(), 'VNNI:', n.vnni(), 'default activations:', n.activations())" > "$out/native-int8-build.log" 2>&1
    say native-int8-build "rc=$?"; tail -1 "$out/native-int8-build.log"; grep -o -m1 'avx512_vnni' /proc/cpuinfo
    timeout -s ABRT ${TESTS_LIMIT:-300} python3 -m pytest tests/unit/test_native_int8.py tests/unit/test_native_experts.py \
      tests/unit/test_native_worker.py -q -p no:cacheprovider -rfE > "$out/native-int8-tests.log" 2>&1
    say native-int8-tests "rc=$?"; grep -E "passed|failed|FAILED|Fatal" "$out/native-int8-tests.log" | tail -6
    wait $sp
    timeout 360 python3 scripts/bench_cpu_experts.py --threads 1 14 16 --experts 48 --out "$out/native-int8-kernel.json" \
      > "$out/native-int8-kernel.log" 2>&1
    say native-int8-kernel "rc=$?"; grep experts_per_job "$out/native-int8-kernel.log" | tail -24 ;;
  native-int8-bench)  # 25 % uniform, device-driven, auto: float then int8 activations (NATIVE_ACTIVATIONS), one process each
    synth
    for acts in ${NATIVE_ACTIVATIONS:-float int8}; do MOESTREAM_NATIVE_ACTIVATIONS=$acts bench "native-cpu-share-auto-$acts" 120 \
      --routing uniform --prefill-tokens '' --cache-sizes 25% --streaming device --cpu-experts auto; done ;;
  native-share-bench)  # 25 % uniform, device-driven: no share, then auto (NATIVE_SHARES), one process each
    synth
    for share in ${NATIVE_SHARES:-off auto}; do bench "native-cpu-share-$share" 120 --routing uniform --prefill-tokens '' \
      --cache-sizes 25% --streaming device --cpu-experts $share; done ;;
  rows)  # the q30 synth runs beside the tests (CPU), the benches after both
    synth &
    timeout -s ABRT ${TESTS_LIMIT:-270} python3 -m pytest tests/gpu/test_decode_kernels.py tests/gpu/test_batching.py \
      tests/gpu/test_decoder.py tests/gpu/test_speculative_cuda.py ${EXTRA_TESTS:-} -q -p no:cacheprovider -rfE \
      --maxfail=10 --durations=10 > "$out/rows-tests.log" 2>&1
    say rows-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Timeout|Fatal" "$out/rows-tests.log" | tail -25
    wait
    for rows in ${ROWS_MODES:-auto off}; do
      bench "resident-rows-$rows" 140 --cache-sizes all --prefill-tokens 512 --step-tokens 1,2,4,8,16 --step-rows $rows
    done ;;
  drafters)
    timeout -s ABRT 90 python3 -m pytest tests/gpu/test_batching.py -k one_graph_per_row -q -p no:cacheprovider -rfE \
      > "$out/warm-test.log" 2>&1
    say warm-test "rc=$?"; tail -3 "$out/warm-test.log"
    timeout ${DRAFT_LIMIT:-200} python3 scripts/bench_draft.py --device cuda --prompts-from docs/bench/cpu/demo-drafters.json \
      --out "$out/demo-drafters-cuda.json" > "$out/demo-drafters-cuda.log" 2>&1
    say demo-drafters "rc=$?"; tail -4 "$out/demo-drafters-cuda.log" ;;
  server)
    synth
    for size in ${SERVER_SIZES:-all 25%}; do
      timeout ${SERVER_LIMIT:-240} python3 scripts/bench_server_batching.py --model $model --parallel ${SERVER_PARALLEL:-1,16} --clients 1,4,16,32 \
        --baseline-clients ${BASELINE_CLIENTS:-1,16} --requests ${SERVER_REQUESTS:-2} \
        --max-tokens ${SERVER_TOKENS:-32} --server-args "--device cuda --cache-size $size --host-cache-size all --step-rows ${STEP_ROWS:-auto}" \
        --out "$out/server-batching-${size%\%}${SERVER_TAG:-}.json" > "$out/server-batching-${size%\%}${SERVER_TAG:-}.log" 2>&1
      say "server $size" "rc=$?"; tail -6 "$out/server-batching-${size%\%}${SERVER_TAG:-}.log"
    done ;;
  new-defaults)  # the padded prefill (graphs or not, every cache size) and the Triton row products as defaults:
    # the prefill graphs' tests alone, the bit check tiny and at the 30B shape, then the GPU tests that load engines
    synth &
    CUDA_LAUNCH_BLOCKING=1 timeout -s ABRT 150 python3 -m pytest tests/gpu/test_prefill_graphs_cuda.py -q -p no:cacheprovider \
      -rfE > "$out/prefill-graphs-tests.log" 2>&1
    say prefill-graphs-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/prefill-graphs-tests.log" | tail -6
    timeout 100 python3 scripts/gpu/check_prefill_graphs.py tiny 23 30 64 100 200 > "$out/check-graphs-tiny.log" 2>&1
    say check-tiny "rc=$?"; tail -2 "$out/check-graphs-tiny.log"
    timeout -s ABRT ${TESTS_LIMIT:-200} python3 -m pytest tests/gpu/test_cuda_engine.py tests/gpu/test_prefill_workspace_cuda.py \
      tests/gpu/test_fused_prefill_cuda.py tests/gpu/test_decoder.py tests/gpu/test_speculative_cuda.py -q -p no:cacheprovider \
      -rfE --durations=8 > "$out/default-tests.log" 2>&1
    say default-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Timeout|Fatal" "$out/default-tests.log" | tail -12
    wait; say synth
    timeout 200 python3 scripts/gpu/check_prefill_graphs.py $model ${CHECK_LENGTHS:-100 300 700 1500} > "$out/check-graphs-q30.log" 2>&1
    say check-q30 "rc=$?"; grep -E "^T=|ok|FAILED" "$out/check-graphs-q30.log" | tail -14 ;;
  fused-boundaries)  # fewer kernels per decode layer: its GPU test alone, the tests it touches, then resident decode
    # with the build before it (BEFORE: a folder holding that build's moestream/) and this one, one process each
    synth &
    timeout -s ABRT 120 python3 -m pytest tests/gpu/test_fused_boundaries_cuda.py -q -p no:cacheprovider -rfE \
      > "$out/fused-boundaries-tests.log" 2>&1
    say fused-boundaries-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/fused-boundaries-tests.log" | tail -8
    timeout -s ABRT ${TESTS_LIMIT:-120} python3 -m pytest tests/gpu/test_decoder.py tests/gpu/test_prefill_graphs_cuda.py \
      tests/gpu/test_decode_ahead_cuda.py -q -p no:cacheprovider -rfE --durations=5 > "$out/touched-tests.log" 2>&1
    say touched-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Timeout|Fatal" "$out/touched-tests.log" | tail -8
    wait; say synth
    [ -n "${BEFORE:-}" ] && PYTHONPATH=$BEFORE bench resident-before-fused 100 --cache-sizes all --prefill-tokens 512
    bench resident-fused 100 --cache-sizes all --prefill-tokens 512 ;;
  rows-products)  # the q30 synth runs beside the tests and the kernel bench, for the A/B part
    synth &
    [ -z "${NO_TESTS:-}" ] && timeout -s ABRT ${TESTS_LIMIT:-150} python3 -m pytest tests/gpu/test_rows_products_cuda.py \
      -q -p no:cacheprovider -rfE --durations=5 > "$out/rows-products-tests.log" 2>&1
    say rows-products-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/rows-products-tests.log" | tail -8
    timeout ${ROWS_SWEEP_LIMIT:-360} python3 scripts/bench_kernels.py --out "$out/rows-products.json" --no-experts \
      --rows-products --rows-sweep --rows-sweep-seconds ${ROWS_SWEEP_SECONDS:-240} \
      --best-out "$out/rows-best-config.json" > "$out/rows-products.log" 2>&1
    say rows-products-bench "rc=$?"; grep -E "^rows|rror" "$out/rows-products.log" | tail -10
    [ -f "$out/rows-best-config.json" ] && cat "$out/rows-best-config.json" && cp "$out/rows-best-config.json" /tmp/
    wait ;;
  rows-products-ab)  # one process per mode; the sweep's sizes where an earlier call left them
    synth
    for products in cublas triton; do
      bench "resident-rows-products-$products" 150 --cache-sizes all --prefill-tokens 512 --rows-products $products
    done
    cfg=${ROWS_CONFIG:-}  # the sweep's sizes: JSON text (a fresh machine) or a file an earlier part wrote
    for f in "$out/rows-best-config.json" /tmp/rows-best-config.json; do [ -z "$cfg" ] && [ -f "$f" ] && cfg=$f; done
    [ -n "$cfg" ] && MOESTREAM_KERNEL_CONFIG="$cfg" bench resident-rows-products-triton-tuned 150 --cache-sizes all \
      --prefill-tokens 512 --rows-products triton ;;
  rows-split)  # the row products' three classes (narrow / deep / wide) with K splits: their GPU tests, the rows
    # sweep, then resident decode with the defaults and with the sweep's sizes, one process each
    synth &
    timeout -s ABRT ${TESTS_LIMIT:-150} python3 -m pytest tests/gpu/test_rows_products_cuda.py -q -p no:cacheprovider \
      -rfE > "$out/rows-split-tests.log" 2>&1
    say rows-split-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/rows-split-tests.log" | tail -6
    timeout ${ROWS_SWEEP_LIMIT:-300} python3 scripts/bench_kernels.py --out "$out/rows-split.json" --no-experts \
      --rows-products --rows-sweep --rows-sweep-seconds ${ROWS_SWEEP_SECONDS:-210} \
      --best-out "$out/rows-split-best-config.json" > "$out/rows-split.log" 2>&1
    say rows-split-sweep "rc=$?"; grep -E "^rows|rror" "$out/rows-split.log" | tail -8
    wait
    bench rows-split-defaults 120 --cache-sizes all --prefill-tokens 512
    [ -f "$out/rows-split-best-config.json" ] && cat "$out/rows-split-best-config.json" && \
      MOESTREAM_KERNEL_CONFIG="$out/rows-split-best-config.json" bench rows-split-swept 120 --cache-sizes all --prefill-tokens 512
    [ -n "${ABA:-}" ] && bench rows-split-defaults-again 120 --cache-sizes all --prefill-tokens 512 ;;
  pdl)  # programmatic dependent launch of the decode step's Triton kernels: its GPU test alone, the fused boundaries'
    # tests (the router's split defaults), then resident decode without / with / without PDL, one process each
    synth &
    timeout -s ABRT 120 python3 -m pytest tests/gpu/test_pdl_cuda.py -q -p no:cacheprovider -rfE > "$out/pdl-tests.log" 2>&1
    say pdl-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/pdl-tests.log" | tail -6
    timeout -s ABRT ${TESTS_LIMIT:-150} python3 -m pytest tests/gpu/test_fused_boundaries_cuda.py -q -p no:cacheprovider \
      -rfE > "$out/pdl-fused-tests.log" 2>&1
    say fused-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/pdl-fused-tests.log" | tail -6
    wait
    MOESTREAM_KERNEL_CONFIG='{"pdl": 0}' bench pdl-off 120 --cache-sizes all --prefill-tokens 512
    bench pdl-on 120 --cache-sizes all --prefill-tokens 512
    MOESTREAM_KERNEL_CONFIG='{"pdl": 0}' bench pdl-off-again 120 --cache-sizes all --prefill-tokens 512 ;;
  policy-ab)  # the device map's victim rule and the share's counts per number of misses: the build, POLICY_TESTS,
    # then the uniform step per POLICY_AB entry (name:share:cache:policy; policy lru, or auto: the cycle rule), one
    # process each; with RESIDENT=1 the resident step last
    synth & sp=$!
    timeout 300 python3 -c "from moestream.cpu_share import kernels as n; m = n.load(); print('native:', m or n.reason())" \
      > "$out/native-build.log" 2>&1
    say native-build "rc=$?"; tail -1 "$out/native-build.log"
    [ -n "${POLICY_TESTS:-}" ] && { timeout -s ABRT ${TESTS_LIMIT:-240} python3 -m pytest $POLICY_TESTS -q -p no:cacheprovider \
      -rfE > "$out/policy-tests.log" 2>&1; say policy-tests "rc=$?"; grep -E "passed|failed|FAILED|ERROR|Fatal" "$out/policy-tests.log" | tail -6; }
    [ -n "${SLOT_MAP_BENCH:-}" ] && { timeout 120 python3 scripts/bench_slot_map.py --out "$out/slot-map.json" > "$out/slot-map.log" 2>&1
      say slot-map "rc=$?"; cat "$out/slot-map.log" | tail -6; }
    wait $sp
    for run in ${POLICY_AB:-auto:auto:25%:auto off:off:25%:auto off-lru:off:25%:lru auto-lru:auto:25%:lru}; do
      IFS=: read -r name share cache policy <<< "$run"
      size=(--cache-sizes $cache); [ "${cache#budget}" != "$cache" ] && size=(--memory-budget ${cache#budget})  # budget8GiB
      bench "policy-$name" 150 --routing uniform --prefill-tokens '' "${size[@]}" --streaming device \
        --cpu-experts $share --threads 14 --cache-policy $policy
    done
    [ -n "${RESIDENT:-}" ] && bench policy-resident 120 --cache-sizes all --prefill-tokens 512 ;;
  esac
done
