#!/usr/bin/env bash
# Runs chosen tests many times under load and reports how often each failed: the way to find a
# flaky test before CI does, and to show that a fix holds.
#
#   scripts/flake-hunt.sh [-b BUILD_DIR] [-n RUNS] [-j JOBS] [-H HOGS] [-L LABEL] [-R REGEX]
#
# Each run is one `ctest` over the selection, with JOBS tests at once (default: twice the
# cores) while HOGS busy loops (default: the number of cores) compete for the CPU, as a loaded
# CI machine would. Failed tests' output stays in a temporary directory, named at the end.
# Exit status: 0 when every run passed, 1 otherwise.
set -euo pipefail

build_dir=build
runs=10
cores=$(nproc)
jobs=$((2 * cores))
hogs=$cores
label=""
regex=""
while getopts "b:n:j:H:L:R:h" opt; do
  case "$opt" in
    b) build_dir=$OPTARG ;;
    n) runs=$OPTARG ;;
    j) jobs=$OPTARG ;;
    H) hogs=$OPTARG ;;
    L) label=$OPTARG ;;
    R) regex=$OPTARG ;;
    *) sed -n '2,10p' "$0"; exit 2 ;;
  esac
done
if [[ -z "$label" && -z "$regex" ]]; then
  echo "flake-hunt: name the tests with -L LABEL and/or -R REGEX" >&2
  exit 2
fi
if [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
  echo "flake-hunt: $build_dir is not a configured build directory (make build first)" >&2
  exit 2
fi

out=$(mktemp -d -t tv-flake-hunt.XXXXXX)
hog_pids=()
stop_hogs() {
  for pid in "${hog_pids[@]:-}"; do
    [[ -n "$pid" ]] && kill "$pid" 2>/dev/null || true
  done
}
trap stop_hogs EXIT
for ((i = 0; i < hogs; i++)); do
  (while :; do :; done) &
  hog_pids+=($!)
done

select_args=()
[[ -n "$label" ]] && select_args+=(-L "$label")
[[ -n "$regex" ]] && select_args+=(-R "$regex")

failed_runs=0
for ((run = 1; run <= runs; run++)); do
  log="$out/run-$run.log"
  if (cd "$build_dir" && ctest -j "$jobs" "${select_args[@]}" --output-on-failure) >"$log" 2>&1; then
    echo "run $run/$runs: passed"
  else
    failed_runs=$((failed_runs + 1))
    echo "run $run/$runs: FAILED ($log)"
  fi
  # ctest's summary lines: "  123 - Name (Failed)" / "(Timeout)".
  grep -E '^[[:space:]]*[0-9]+ - .* \((Failed|Timeout|SEGFAULT|Exception|Child aborted)' "$log" |
    sed -E 's/^[[:space:]]*[0-9]+ - //' >>"$out/failures" || true
done

stop_hogs
echo
echo "$runs runs of: ${select_args[*]}; $jobs tests at once beside $hogs busy loops"
if [[ -s "$out/failures" ]]; then
  echo "failures per test:"
  sort "$out/failures" | uniq -c | sort -rn
  echo "logs: $out"
else
  echo "no test failed"
  rm -rf "$out"
fi
[[ $failed_runs -eq 0 ]]
