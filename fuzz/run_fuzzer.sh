#!/usr/bin/env bash
# Runs one libFuzzer target for TENSORVERBS_FUZZ_SECONDS (default 5) from its seed corpus, as
# ctest's `fuzz` tests do. New inputs go to TENSORVERBS_FUZZ_CORPUS/<target> when that is set
# (to keep a growing corpus between runs), else to a temporary directory; crash files go to a
# temporary directory and are printed as hex, then removed: nothing is left behind.
# Usage: run_fuzzer.sh FUZZER SEED_DIR [libFuzzer flags...]
set -euo pipefail
fuzzer=$1
seeds=$2
shift 2
seconds=${TENSORVERBS_FUZZ_SECONDS:-5}
name=$(basename "$fuzzer" _fuzzer)
work=$(mktemp -d "${TMPDIR:-/tmp}/tv-fuzz-$name.XXXXXX")
trap 'rm -rf "$work"' EXIT
corpus="$work/corpus"
if [ -n "${TENSORVERBS_FUZZ_CORPUS:-}" ]; then corpus="$TENSORVERBS_FUZZ_CORPUS/$name"; fi
mkdir -p "$corpus"
status=0
"$fuzzer" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$work/" "$@" "$corpus" "$seeds" || status=$?
if [ "$status" -ne 0 ]; then
  for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* "$work"/slow-unit-*; do
    [ -e "$f" ] || continue
    echo "run_fuzzer: $(basename "$f") of $name; the input as hex (save its bytes as"
    echo "fuzz/corpus/$name/regression-<what> and add a unit test; see fuzz/README.md):"
    od -An -tx1 -v "$f" | tr -d ' \n'
    echo
  done
fi
exit "$status"
