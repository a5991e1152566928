#!/usr/bin/env bash
# What every kernel change must pass on a GPU, in one command:
#   bash benchmarks/gpu_check.sh [tests] [selftest] [sanitize] [nokey]   (default: all four)
# - tests:    the GPU test suite, NUMBAFLASH_REQUIRE_GPU=1 (a missing GPU fails, never skips),
#             parallel over kernels when pytest-xdist is installed; the tests marked ``timing``
#             (wall-clock bounds) run alone at the end
# - selftest: python -m numbaflash.selftest --cases $CASES (default 500), then its --variants,
#             --backward, --backward --variants, --decode and --decode --variants modes with
#             $MODE_CASES each (default 300), one after another in the background
# - sanitize: benchmarks/sanitize.py, memcheck/racecheck/synccheck/initcheck over every config
# - nokey:    benchmarks/no_key_rows.py, the shapes of the 34e1ab6 race report
# Logs go to $OUT (default ./gpu_logs); a summary table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu_logs}
mkdir -p "$out"
stages=${*:-tests selftest sanitize nokey}
export NUMBAFLASH_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
cores=$(nproc)
# The float64 references are numpy matmuls: each of the stages' processes (test workers, the
# self-test, sanitizer jobs) would start a BLAS thread per core and together oversubscribe the
# CPUs many times over, so each gets a share.
blas=$(( cores / (${TEST_WORKERS:-6} + ${SANITIZE_JOBS:-$((cores / 2))} + 1) ))
(( blas < 1 )) && blas=1
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$blas} OMP_NUM_THREADS=${OMP_NUM_THREADS:-$blas} \
  MKL_NUM_THREADS=${MKL_NUM_THREADS:-$blas}
declare -A rc

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"

if [[ " $stages " == *" selftest "* ]]; then
  (
    status=0
    for mode in "" "--variants" "--backward" "--backward --variants" "--decode" "--decode --variants"; do
      echo "== selftest ${mode:-(forward)}"
      # shellcheck disable=SC2086  # the mode's flags split into words
      $py -m numbaflash.selftest --cases "$([[ -z $mode ]] && echo "${CASES:-500}" || echo "${MODE_CASES:-300}")" \
        $mode || status=1
    done
    exit $status
  ) >"$out/selftest.log" 2>&1 &
  selftest_pid=$!
fi
if [[ " $stages " == *" sanitize "* ]]; then
  $py benchmarks/sanitize.py --jobs "${SANITIZE_JOBS:-$((cores / 2))}" --log-dir /tmp/sanitizer_logs \
    ${SANITIZE_ARGS:-} >"$out/sanitize.log" 2>&1 &
  sanitize_pid=$!
fi
if [[ " $stages " == *" tests "* ]]; then
  xdist=()
  $py -c "import xdist" 2>/dev/null && xdist=(-n "${TEST_WORKERS:-6}" --dist loadgroup)
  $py -m pytest -q -p no:cacheprovider "${xdist[@]}" -m "(gpu or hopper) and not timing" tests/ >"$out/pytest.log" 2>&1
  rc[tests]=$?
fi
if [[ " $stages " == *" nokey "* ]]; then
  $py benchmarks/no_key_rows.py >"$out/no_key_rows.log" 2>&1
  rc[nokey]=$?
fi
if [[ -n "${selftest_pid:-}" ]]; then wait "$selftest_pid"; rc[selftest]=$?; fi
if [[ -n "${sanitize_pid:-}" ]]; then
  wait "$sanitize_pid"; rc[sanitize]=$?
  tar czf "$out/sanitizer_logs.tgz" -C /tmp sanitizer_logs 2>/dev/null
fi

# Tests that assert a wall-clock bound run last, alone: nothing else on the GPU or the CPUs.
if [[ " $stages " == *" tests "* ]]; then
  $py -m pytest -q -p no:cacheprovider -m "timing" tests/ >"$out/pytest_timing.log" 2>&1
  rc[timing]=$?
fi

echo
echo "== $(head -1 "$out/gpu.txt")"
[[ -n "${rc[tests]:-}" ]] && echo "tests    rc=${rc[tests]}  $(tail -1 "$out/pytest.log")"
[[ -n "${rc[timing]:-}" ]] && echo "timing   rc=${rc[timing]}  $(tail -1 "$out/pytest_timing.log")"
[[ -n "${rc[nokey]:-}" ]] && { echo "nokey    rc=${rc[nokey]}"; grep '^|' "$out/no_key_rows.log"; }
[[ -n "${rc[selftest]:-}" ]] && { echo "selftest rc=${rc[selftest]}"; grep -E '^(== selftest|sm[0-9]+:|backward:|decode:|PASSED|FAILED)' "$out/selftest.log"; }
[[ -n "${rc[sanitize]:-}" ]] && { echo "sanitize rc=${rc[sanitize]}"; grep -E '^(\||sanitizer:)' "$out/sanitize.log"; }
status=0
for k in "${!rc[@]}"; do [[ ${rc[$k]} -ne 0 ]] && status=1; done
exit $status
