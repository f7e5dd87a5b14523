#!/bin/bash
# The installed package, used from outside the tree: installs the build into a temporary
# prefix, builds tests/package/consumer against it with find_package (shared and static
# library) and with pkg-config, and runs each build as a two-task job over each PROTOCOL.
#   package_test.sh BUILD_DIR SOURCE_DIR PROTOCOL...
set -euo pipefail
build_dir=$1
src_dir=$2
shift 2
protocols=("$@")
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

prefix=$tmp/prefix
cmake --install "$build_dir" --prefix "$prefix" >"$tmp/install.log"
for f in include/tensorverbs/task.h include/tensorverbs/tensorverbs.h bin/tensorverbs; do
  [[ -e $prefix/$f ]] || { echo "not installed: $f"; exit 1; }
done
if find "$prefix/include" -name '*.h' -exec grep -l '#include "src/' {} + | grep .; then
  echo "an installed header includes an internal one"
  exit 1
fi
"$prefix/bin/tensorverbs" --version

cmake -S "$src_dir/tests/package/consumer" -B "$tmp/cmake" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >"$tmp/configure.log"
cmake --build "$tmp/cmake" >"$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }

libdir=$(dirname "$(find "$prefix" -name 'libtensorverbs.so' | head -1)")
export PKG_CONFIG_PATH=$libdir/pkgconfig
echo "pkg-config: tensorverbs $(pkg-config --modversion tensorverbs)"
# shellcheck disable=SC2046
${CXX:-c++} -std=c++17 -O1 "$src_dir/tests/package/consumer/main.cc" -o "$tmp/consumer_pc" \
  $(pkg-config --cflags --libs tensorverbs) -Wl,-rpath,"$libdir"

run_job() {
  local binary=$1 protocol=$2
  read -r p0 p1 < <("$binary" ports)
  local cluster="worker=127.0.0.1:$p0,127.0.0.1:$p1"
  "$binary" "$cluster" 1 "$protocol" >"$tmp/t1.log" 2>&1 &
  pids=($!)
  if ! timeout 120 "$binary" "$cluster" 0 "$protocol" >"$tmp/t0.log" 2>&1; then
    echo "task 0 of $binary failed:"; cat "$tmp/t0.log"; exit 1
  fi
  if ! wait "${pids[0]}"; then
    echo "task 1 of $binary failed:"; cat "$tmp/t1.log"; exit 1
  fi
  pids=()
  grep -h ': ok' "$tmp/t0.log" "$tmp/t1.log"
}
for protocol in "${protocols[@]}"; do
  run_job "$tmp/cmake/consumer" "$protocol"
  run_job "$tmp/cmake/consumer_static" "$protocol"
  run_job "$tmp/consumer_pc" "$protocol"
done
if ldd "$tmp/cmake/consumer_static" | grep -q libtensorverbs; then
  echo "consumer_static loads libtensorverbs.so"
  exit 1
fi
echo "package ok"
