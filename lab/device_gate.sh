#!/usr/bin/env bash
# The device tool's driver (issue 54's gates): run from the repository root on the GPU machine,
# with .whl (../shared/device/prepare-wheels.sh) and the carried kernel cache (.cache/cache.txz.*)
# in the tree:
#   LIMIT=540 bash lab/device_gate.sh 'pre=python -m numbaflash.precompile --arch sm_90a' \
#       '&san=python benchmarks/sanitize.py --tools memcheck,racecheck,synccheck --configs 3,4 --jobs 12' \
#       '&st0=bash lab/device_gate.sh --selftest 1129 0 3 --decode' \
#       'suite=bash lab/device_gate.sh --suite'
# A stage is 'name=command'; a leading '&' runs it in the background. Every stage is killed at
# LIMIT seconds, so the cache is always packed back into $OUT/cache.txz.* (xz -6 on 16 threads);
# copy the parts into .cache/ for the next call, or first re-pack them here at -9 (one block: the
# cubins share much; 5679 cubins 40 MB -> 22 MB, two minutes on two cores):
#   mkdir x && cat PARTS | xz -d | tar xf - -C x && tar cf - -C x . | xz -T2 -9 | split -b 15M - .cache/cache.txz.
# Every log goes into one $OUT/logs.tgz (a call returns at most 8 files). `--selftest SEED PART
# PARTS FLAGS...` runs the cases PART, PART + PARTS, ... of `selftest --seed SEED --cases 300
# FLAGS`: PARTS processes together run the same 300 cases as one.
if [[ ${1:-} == --suite ]]; then  # the GPU suite, resumable: `--suite [PYTEST ARGS...]` as a stage
  # runs every "gpu or hopper" item not listed in .cache/suite_done.txt (carry it from the last
  # call's $OUT) with -v into $OUT/suite.txt, so a stopped run still names its failures, and
  # writes $OUT/suite_done.txt: the items finished so far (passed, failed or skipped).
  # .cache/suite_only.txt, where carried, limits the run to the ids it lists. Items marked
  # `timing` (wall-clock bounds) run alone after the rest, as benchmarks/gpu_check.sh runs them.
  shift
  exec python - "$@" <<'PY'
import os, re, signal, subprocess, sys
out = os.environ["OUT"]
done = set()
if os.path.exists(".cache/suite_done.txt"):
    done = {line.strip() for line in open(".cache/suite_done.txt") if line.strip()}
marker = ["-m", "gpu or hopper", "-p", "no:cacheprovider"]
def collect(expression):
    listed = subprocess.run([sys.executable, "-m", "pytest", "-m", expression, "-p", "no:cacheprovider", "-q",
                             "--collect-only", "tests/"], capture_output=True, text=True).stdout.splitlines()
    return [line.strip() for line in listed if line.startswith("tests/") and "::" in line]
items = collect("gpu or hopper")
timing = set(collect("(gpu or hopper) and timing"))  # wall-clock bounds: alone, after the rest
if os.path.exists(".cache/suite_only.txt"):  # a subset to run: one id per line, as collected
    only = {line.strip() for line in open(".cache/suite_only.txt") if line.strip()}
    items = [item for item in items if item in only]
left = [item for item in items if item not in done]
print(f"{len(items)} items, {len(done)} done before, {len(left)} to run", flush=True)
status = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
finished = re.compile(rf"({status}) (tests/.+?)\s*$")  # xdist's -v line; ids may hold spaces
finished_alone = re.compile(rf"^(tests/.+?) ({status})(?: +\[ *\d+%\])?\s*$")  # without xdist
with open(f"{out}/suite_done.txt", "w") as record:  # appended as items finish: a stopped run keeps it
    record.write("".join(f"{item}\n" for item in sorted(done)))
rc = 0
runs = [(["-n", "14", *sys.argv[1:]], [item for item in left if item not in timing]),
        (["-p", "no:xdist"], [item for item in left if item in timing])]
for options, run in runs:
    if not run:
        continue
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *options, *marker, "-v", "-rfEs", "--durations=30",
                             *run], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    signal.signal(signal.SIGTERM, lambda *_: (proc.kill(), sys.exit(124)))
    with open(f"{out}/suite.txt", "a") as log, open(f"{out}/suite_done.txt", "a") as record:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            m = finished.search(line)
            found = (m.group(2), m.group(1)) if m else None  # (id, status)
            if found is None and (m := finished_alone.search(line)):
                found = m.groups()
            if found and found[0] not in done:
                done.add(found[0])
                record.write(found[0] + "\n")
                record.flush()
                if found[1] in ("FAILED", "ERROR"):
                    print(line.rstrip(), flush=True)
    rc = proc.wait() or rc
print(f"{sum(item in done for item in items)} of {len(items)} items done", flush=True)
sys.exit(rc)
PY
fi
if [[ ${1:-} == --selftest ]]; then
  seed=$2; part=$3; n=$4; shift 4
  cases=$(python3 -c "print(','.join(str(i) for i in range($part, 300, $n)))")
  exec python -m numbaflash.selftest --seed "$seed" --cases 300 --case "$cases" "$@"
fi
set -uo pipefail
start=$(date +%s)
LIMIT=${LIMIT:-540}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NUMBAFLASH_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NUMBAFLASH_CACHE_DIR=/tmp/nfcache
mkdir -p "$NUMBAFLASH_CACHE_DIR"
if ls .cache/cache.txz.* >/dev/null 2>&1; then cat .cache/cache.txz.* | xz -d -T8 | tar xf - -C "$NUMBAFLASH_CACHE_DIR"; fi
echo "cache entries at start: $(find "$NUMBAFLASH_CACHE_DIR" -type f | wc -l)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
declare -A pids names
i=0
for spec in "$@"; do
  bg=0; [[ $spec == \&* ]] && { bg=1; spec=${spec:1}; }
  name=${spec%%=*}; cmd=${spec#*=}
  left=$(( LIMIT - ($(date +%s) - start) ))
  (( left < 5 )) && { echo "$name: no time left" | tee "$OUT/$name.log"; continue; }
  echo "== $name (bg=$bg, ${left}s left): $cmd"
  if (( bg )); then
    ( s=$(date +%s); timeout -k 5 "$left" bash -c "$cmd" > "$OUT/$name.log" 2>&1; rc=$?; echo "rc=$rc wall=$(( $(date +%s) - s ))s" >> "$OUT/$name.log"; echo $rc > "$OUT/$name.rc" ) &
    pids[$i]=$!; names[$i]=$name; i=$((i+1))
  else
    s=$(date +%s); timeout -k 5 "$left" bash -c "$cmd" > "$OUT/$name.log" 2>&1; rc=$?
    echo "rc=$rc wall=$(( $(date +%s) - s ))s" >> "$OUT/$name.log"; echo $rc > "$OUT/$name.rc"
  fi
done
wait
echo "cache entries at end: $(find "$NUMBAFLASH_CACHE_DIR" -type f | wc -l)"
tar cf - -C "$NUMBAFLASH_CACHE_DIR" . | xz -T16 -6 | split -b 15M - "$OUT/cache.txz."
for spec in "$@"; do
  spec=${spec#&}; name=${spec%%=*}
  echo "---- $name rc=$(cat "$OUT/$name.rc" 2>/dev/null)"; tail -n "${TAILN:-8}" "$OUT/$name.log"
done
# few files come back: everything but the cache goes into one tarball
(cd "$OUT" && tar czf /tmp/logs.tgz --exclude='cache.txz.*' . && find . -mindepth 1 -maxdepth 1 ! -name 'cache.txz.*' -exec rm -rf {} + && mv /tmp/logs.tgz .)
