#!/usr/bin/env bash
# On a GPU machine: every GPU test file (each in its own pytest process with its own time limit, so
# one slow file cannot hide the others' results), then each family's shape resident at batch 1
# (uniform routing, prefill 512 and 2048), one process per shape.
#   scripts/gpu_families.sh OUT [SHAPE...]   (default: the shapes below; BEFORE=DIR also benches the
#                                             same shapes with an older checkout's moestream/ beside it;
#                                             TESTS=0 skips the tests, FILE_LIMIT=s per test file,
#                                             FILES='a b' only those test files, JOBS=n files at once;
#                                             the shape 'none' skips the benches; SYNTH=0 reuses
#                                             the models an earlier run left in /tmp)
# OUT gets run.log (a line per file and per bench), gpu-tests.log (failures in full) and
# benches.json (every bench's JSON, keyed by shape and side): few files, as a device call returns.
set -u
out=${1:?output folder}; shift
shapes=${*:-gemma-4-26b-a4b gpt-oss-20b qwen3-30b-a3b qwen3.5-35b-a3b qwen3-next-80b-a3b}
mkdir -p "$out"; root=$PWD; tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH=$root
log() { echo "[$(date +%T)] $*" | tee -a "$out/run.log"; }
([ "$shapes" = none ] || [ "${SYNTH:-1}" = 0 ] || for s in $shapes; do python3 -m moestream synth --shape "$s" "/tmp/$s" --force > "$tmp/synth-$s.log" 2>&1 & done
 wait; log "synth done") &
one_file() {  # one test file in its own process; its log kept only where it failed
  local f=$1 t; t=$(mktemp)
  timeout "${FILE_LIMIT:-150}" python3 -m pytest -o addopts="" -q -p no:cacheprovider -rfE --tb=short "$f" > "$t" 2>&1
  local rc=$?
  log "$(basename "$f") rc=$rc $(tail -1 "$t")"
  [ $rc = 0 ] || { echo "=== $f (rc $rc)"; cat "$t"; } >> "$out/gpu-tests.log"
}
export -f one_file log; export out
if [ "${TESTS:-1}" != 0 ]; then
  files=${FILES:-$(ls tests/gpu/test_*.py)}
  for f in $files; do echo "$f"; done | xargs -P "${JOBS:-1}" -I{} bash -c 'one_file {}'
fi
wait
[ "$shapes" = none ] && shapes=""
for s in $shapes; do
  for side in after ${BEFORE:+before}; do
    d=$root; [ "$side" = before ] && d=$BEFORE
    (cd "$d" && PYTHONPATH=$d timeout 300 python3 -m moestream bench --model "/tmp/$s" --cache-size 100% --decode-tokens 64 \
      --warmup --routing uniform --prefill-tokens 512,2048 --out "$tmp/$s-$side.json" > "$tmp/bench.log" 2>&1)
    log "$s $side rc=$? $(grep -aE '^ *cache|rror' "$tmp/bench.log" | tail -2 | tr '\n' ' ')"
  done
done
python3 - "$tmp" "$out/benches.json" <<'EOF'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
EOF
