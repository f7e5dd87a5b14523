#!/usr/bin/env bash
# bench/report.py composes docs/perf/current/headline.md from the benchmarks' JSON: given the
# JSON of a recorded run (docs/perf/issue49_*), its tables must carry that run's figures and
# ratios. Runs nothing but the composer, in a temporary directory.
# Usage: bench_report_test.sh SOURCE_DIR
set -euo pipefail
src=$1
out=$(mktemp -d -t tv-bench-report.XXXXXX)
trap 'rm -rf "$out"' EXIT
cp "$src/docs/perf/issue49_p2p_after.json" "$out/p2p.json"
cp "$src/docs/perf/issue49_rate_after.json" "$out/rate.json"
cp "$src/docs/perf/issue49_ucx_peers.json" "$out/ucx.json"
cp "$src/docs/perf/issue49_torch_after.json" "$out/torch.json"
python3 "$src/bench/report.py" --out "$out" --from-json
headline="$out/headline.md"
failures=0
expect() {
  if grep -qF -- "$1" "$headline"; then
    echo "ok   $2"
  else
    echo "FAIL $2: no '$1' in headline.md"; failures=$((failures + 1))
  fi
}
expect '| 1 MiB | 28.5 [27.8-28.8] | 0.74 | 0.99 | 16.82 us | 0.22 |' "grpc+verbs at 1 MiB against the raw write and memcpy"
expect '| 4 B | 8, 32 | 697k [654k-705k] | 2.54 us |' "the rate of 4 B tensors, 8 slots and batches of 32"
expect '| 16 MiB | 21.64 | 8.11 | 13.10 | 2.74 [2.36-2.74] | 1.65 |' "the ratio to UCX at 16 MiB"
expect '| 64 MiB | 50257 us | 144592 us | 2.88 |' "all_reduce of 64 MiB against gloo"
expect 'DDP step' "the DDP step"
if grep -q 'grpc+verbs-copy\|| grpc |' "$headline"; then
  echo "FAIL the p2p table holds other protocols' rows"; failures=$((failures + 1))
fi
# --into: the tables go between the markers of a page, one heading level down, its images
# linked from the page's folder; the text around them stays, and a second run replaces them.
mkdir -p "$out/page"
printf '# Performance\n\nTEXT-BEFORE\n\n<!-- bench-report: begin -->\nSTALE-TABLE\n<!-- bench-report: end -->\n\nTEXT-AFTER\n' \
  > "$out/page/PERF.md"
touch "$out/p2p.png"
for run in 1 2; do
  python3 "$src/bench/report.py" --out "$out" --from-json --into "$out/page/PERF.md" > /dev/null
done
page="$out/page/PERF.md"
check_page() {
  if [[ $(grep -cF -- "$1" "$page") == "$2" ]]; then
    echo "ok   $3"
  else
    echo "FAIL $3: '$1' is not in the page $2 time(s)"; failures=$((failures + 1))
  fi
}
check_page '| 1 MiB | 28.5 [27.8-28.8] | 0.74 | 0.99 | 16.82 us | 0.22 |' 1 "the page holds the p2p row once after two runs"
check_page '## Headline figures' 1 "the headline's title is one level down"
check_page '](../p2p.png)' 1 "the plot is linked from the page's folder"
check_page TEXT-BEFORE 1 "the text before the markers stays"
check_page TEXT-AFTER 1 "the text after the markers stays"
check_page STALE-TABLE 0 "what was between the markers is replaced"
printf 'no markers\n' > "$out/page/NONE.md"
python3 "$src/bench/report.py" --out "$out" --from-json --into "$out/page/NONE.md" \
  > /dev/null 2>&1 && { echo "FAIL a page without markers was accepted"; failures=$((failures + 1)); }
python3 "$src/bench/report.py" --out "$out/empty" --from-json 2>/dev/null && {
  echo "FAIL composing from a folder without JSON succeeded"; failures=$((failures + 1)); }
[[ $failures -eq 0 ]]
