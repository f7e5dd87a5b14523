#!/usr/bin/env bash
# Shows that each rule the build checks fails on a deliberate violation, and names it: the
# layering of includes (cmake/CheckLayers.cmake), file sizes and readers of the environment
# (cmake/CheckSourceRules.cmake), and the README's settings tables
# (cmake/CheckSettingsTable.cmake). Each case builds a small tree of its own in a temporary
# directory. Usage: build_checks_test.sh SOURCE_DIR TENSORVERBS_TOOL
set -euo pipefail
src=$1
tool=$2
work=$(mktemp -d -t tv-build-checks.XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0

# expect pass|fail NAME TEXT SCRIPT ARGS...: runs `cmake ARGS -P SCRIPT`; with fail, the
# output must contain TEXT.
expect() {
  local want=$1 name=$2 text=$3 script=$4
  shift 4
  local out rc=0
  out=$(cmake "$@" -P "$src/cmake/$script" 2>&1) || rc=$?
  if [[ $want == pass && $rc -ne 0 ]]; then
    echo "FAIL $name: expected the check to pass, it said:"; echo "$out"; failures=$((failures + 1))
  elif [[ $want == fail && $rc -eq 0 ]]; then
    echo "FAIL $name: expected the check to refuse the tree, it passed"; failures=$((failures + 1))
  elif [[ $want == fail && $out != *"$text"* ]]; then
    echo "FAIL $name: the refusal does not name '$text':"; echo "$out"; failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}

# A fresh tree with one file: tree NAME PATH CONTENT.
tree() {
  local root="$work/$1"
  mkdir -p "$root/$(dirname "$2")"
  printf '%s\n' "$3" > "$root/$2"
  echo "$root"
}

# --- layers ---
root=$(tree down src/server/ok.cc '#include "src/protocol/channel_table.h"')
expect pass "a layer includes one below it" "" CheckLayers.cmake -DROOT="$root"
root=$(tree up src/protocol/bad.cc '#include "src/server/server.h"')
expect fail "the protocol includes the server" "src/protocol/bad.cc (layer protocol) includes src/server/server.h" \
  CheckLayers.cmake -DROOT="$root"
root=$(tree tools_inside tools/bad.cc '#include "src/protocol/channel_table.h"')
expect fail "a tool includes the protocol's insides" "tools/bad.cc (layer tools)" \
  CheckLayers.cmake -DROOT="$root"
root=$(tree python_server python/src/bad.cc '#include "src/server/server.h"')
expect fail "the bindings include the server" "python/src/bad.cc (layer python)" \
  CheckLayers.cmake -DROOT="$root"
root=$(tree python_common python/src/ok.cc '#include "src/common/config.h"')
expect pass "the bindings include common" "" CheckLayers.cmake -DROOT="$root"

# --- file sizes and readers of the environment ---
root=$(tree at_limit src/common/long.cc "$(printf '// line\n%.0s' $(seq 600))")
expect pass "a file of 600 lines" "" CheckSourceRules.cmake -DROOT="$root"
root=$(tree over_limit python/src/long.cc "$(printf '// line\n%.0s' $(seq 601))")
expect fail "a file of 601 lines" "python/src/long.cc has 601 lines" CheckSourceRules.cmake -DROOT="$root"
root="$work/no_newline"
mkdir -p "$root/src/common"
{ printf '// line\n%.0s' $(seq 600); printf '// the 601st, without its newline'; } > "$root/src/common/long.cc"
expect fail "601 lines, the last without its newline" "src/common/long.cc has 601 lines" \
  CheckSourceRules.cmake -DROOT="$root"
root=$(tree getenv tools/env.cc 'const char* v = std::getenv("TENSORVERBS_X");')
expect fail "a tool calls getenv" "tools/env.cc reads the environment" CheckSourceRules.cmake -DROOT="$root"
root=$(tree environ src/server/env.cc 'extern char** environ;')
expect fail "a layer walks environ" "src/server/env.cc reads the environment" \
  CheckSourceRules.cmake -DROOT="$root"
root=$(tree config src/common/config.cc 'extern char** environ;')
expect pass "the configuration reads the environment" "" CheckSourceRules.cmake -DROOT="$root"

# --- the README's settings tables ---
cp "$src/README.md" "$work/README.md"
expect pass "the README as it is" "" CheckSettingsTable.cmake -DTOOL="$tool" -DREADME="$work/README.md"
sed -i 's/^| `TENSORVERBS_PUSH_MAX` | \(.*\) | 1024 |$/| `TENSORVERBS_PUSH_MAX` | \1 | 2048 |/' "$work/README.md"
if cmp -s "$src/README.md" "$work/README.md"; then
  echo "FAIL the README edit did not apply (TENSORVERBS_PUSH_MAX's row changed shape?)"
  failures=$((failures + 1))
fi
expect fail "a default edited in the README" "(tensorverbs) differ from" \
  CheckSettingsTable.cmake -DTOOL="$tool" -DREADME="$work/README.md"
expect pass "make settings-table rewrites it" "" CheckSettingsTable.cmake -DTOOL="$tool" \
  -DREADME="$work/README.md" -DUPDATE=ON
if ! cmp -s "$src/README.md" "$work/README.md"; then
  echo "FAIL the rewritten README differs from the original"; failures=$((failures + 1))
fi
grep -v 'settings:rdma' "$src/README.md" > "$work/README.md"
expect fail "a README without a table's marker" "no '<!-- settings:rdma -->" \
  CheckSettingsTable.cmake -DTOOL="$tool" -DREADME="$work/README.md"

if [[ $failures -ne 0 ]]; then
  echo "$failures case(s) failed"
  exit 1
fi
