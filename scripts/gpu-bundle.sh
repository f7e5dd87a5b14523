#!/usr/bin/env bash
# Packs what the GPU checks need for a machine that has a GPU, CUDA and a driver but none of this
# project's Debian libraries: the `tensorverbs` tool and the gpu test binaries, stripped, with
# every shared library they load (ldd) except glibc's and the GPU driver's, plus the CUDA
# runtime, into build-gpu-bundle/ (git-ignored; under 64 MiB). There, run
#   build-gpu-bundle/run-gpu-checks.sh
# which runs them with LD_LIBRARY_PATH pointing into the bundle.
#
# Usage: scripts/gpu-bundle.sh [BUILD_DIR]   (default build/, built first with `make build`)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
out="$root/build-gpu-bundle"
make -C "$root" build BUILD_DIR="$(realpath --relative-to="$root" "$build")" >/dev/null

binaries=("$build/tools/tensorverbs" "$build/tests/unit/cuda_gpu_test"
          "$build/tests/unit/cuda_transfer_gpu_test" "$build/tests/unit/device_test"
          "$build/tests/unit/api_test" "$build/tests/integration/device_two_process_test"
          "$build/tests/integration/tv_device_echo_peer"
          "$build/tests/conformance/fabric_conformance_test")
# The RDMA check's tools (rdma-core's device listing, iproute2's `rdma` to add a software RoCE
# device), where this machine has them.
tools=()
for t in /usr/bin/rdma /usr/bin/ibv_devinfo; do [ -x "$t" ] && tools+=("$t"); done
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in "${binaries[@]}"; do
  [ -x "$b" ] || { echo "gpu-bundle: $b is missing: build it first" >&2; exit 1; }
  cp "$b" "$out/bin/"
  strip --strip-unneeded "$out/bin/$(basename "$b")"
done

# Shared libraries, from the binaries' ldd, less glibc (the target has its own, as every Linux
# does) and the driver's libcuda (it must match the target's kernel module).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libcuda\.so)'
for b in "${binaries[@]}" "${tools[@]}"; do
  ldd "$b" | awk '/=> \// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ "$name" =~ $skip ]]; then continue; fi
  cp -L "$path" "$out/lib/$name"
  strip --strip-unneeded "$out/lib/$name" 2>/dev/null || true
done

for t in "${tools[@]}"; do cp "$t" "$out/bin/"; done
# libibverbs loads its NIC providers (rxe, mlx5, ...) from a directory fixed at its build; a GPU
# machine without rdma-core lacks them, so they travel too and are named by path in
# RDMAV_DRIVERS.
providers=/usr/lib/x86_64-linux-gnu/libibverbs
if [ -d "$providers" ]; then
  mkdir -p "$out/lib/ibverbs"
  for p in "$providers"/*-rdmav*.so; do cp -L "$p" "$out/lib/ibverbs/"; done
fi

# The CUDA runtime is loaded at run time (dlopen), so ldd does not list it.
cudart="$(ldconfig -p | awk '/libcudart\.so\.[0-9]+ / {print $NF; exit}')"
if [ -z "$cudart" ] && [ -e /usr/local/cuda/lib64/libcudart.so ]; then
  cudart="$(readlink -f /usr/local/cuda/lib64/libcudart.so)"
fi
if [ -n "$cudart" ]; then cp -L "$cudart" "$out/lib/"; fi
# device_test's stand-in runtime, loaded by path (TV_FAKE_CUDART).
cp "$build/tests/unit/libtv_fake_cudart.so" "$out/lib/"

cat > "$out/run-gpu-checks.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU checks from this bundle (see scripts/gpu-bundle.sh): the gpu tests, then
# `bench p2p` with device tensors (direct over CUDA IPC, and the proxy path) beside host
# tensors, in one run. Results go
# to stdout, and the benchmarks' JSON rows into $1 (default: the current folder).
#   run-gpu-checks.sh [OUT_DIR] [tests|bench|rdma|all]
# `rdma` (also part of `all`, first) looks for an RDMA device without touching the GPU: one the
# machine has, else a software RoCE device (rdma_rxe) it can add over a network interface; where
# one is found it runs the fabric conformance suite and the benches over ibverbs.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-.}"
what="${2:-all}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
tv="$here/bin/tensorverbs"
rc=0
rdma_check() {
  echo "== RDMA check: kernel $(uname -r)"
  local drivers=""
  for p in "$here"/lib/ibverbs/*.so; do [ -e "$p" ] && drivers="${drivers:+$drivers:}$p"; done
  [ -d /usr/lib/x86_64-linux-gnu/libibverbs ] || export RDMAV_DRIVERS="$drivers"
  echo "-- /sys/class/infiniband: $(ls /sys/class/infiniband 2>&1 | tr '\n' ' ')"
  echo "-- /dev/infiniband: $(ls /dev/infiniband 2>&1 | tr '\n' ' ')"
  echo "-- network interfaces: $(ls /sys/class/net 2>&1 | tr '\n' ' ')"
  if [ -r /proc/modules ]; then
    echo "-- loaded RDMA modules: $(grep -E '^(ib_|rdma|mlx|rxe|siw)' /proc/modules | awk '{print $1}' | tr '\n' ' ')"
  else
    echo "-- loaded modules: /proc/modules unreadable"
  fi
  local added=""
  if [ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
    local dev=""
    for n in /sys/class/net/*; do
      n="$(basename "$n")"
      [ "$n" = lo ] && continue
      [ "$(cat /sys/class/net/$n/operstate 2>/dev/null)" = up ] && { dev="$n"; break; }
    done
    [ -z "$dev" ] && [ -e /sys/class/net/lo ] && dev=lo
    echo "-- no RDMA device; trying a software RoCE device over ${dev:-no interface}"
    if command -v modprobe >/dev/null; then
      modprobe rdma_rxe 2>&1 | sed 's/^/   modprobe: /'; echo "   modprobe rdma_rxe: exit ${PIPESTATUS[0]}"
    else
      echo "   modprobe: not on this machine"
    fi
    if [ -n "$dev" ]; then
      "$here/bin/rdma" link add tvrxe0 type rxe netdev "$dev" 2>&1 | sed 's/^/   rdma link add: /'
      echo "   rdma link add tvrxe0 type rxe netdev $dev: exit ${PIPESTATUS[0]}"
      [ -e /sys/class/infiniband/tvrxe0 ] && added=tvrxe0
    fi
  fi
  "$here/bin/rdma" link show 2>&1 | sed 's/^/   rdma link: /'
  "$here/bin/ibv_devinfo" 2>&1 | head -40 | sed 's/^/   ibv_devinfo: /'
  "$tv" info 2>&1 | grep -iE -A3 'rdma|ibverbs' | head -30
  if [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
    echo "-- fabric conformance suite on ibverbs"
    timeout 180 "$here/bin/fabric_conformance_test" --gtest_filter='*ibverbs*' || rc=1
    echo "-- bench fabric over ibverbs"
    timeout 120 "$tv" bench fabric --backend ibverbs --sizes 4KiB,64KiB,1MiB,16MiB || rc=1
    echo "-- bench p2p over ibverbs"
    TENSORVERBS_FABRIC=ibverbs timeout 180 "$tv" bench p2p --protocols grpc+verbs \
      --sizes 4KiB,1MiB,16MiB --json "$out/p2p-ibverbs.json" || rc=1
  else
    echo "-- no RDMA device here: the ibverbs suite and benches did not run"
  fi
  if [ -n "$added" ]; then "$here/bin/rdma" link delete "$added" 2>&1; fi
}
if [ "$what" = all ] || [ "$what" = rdma ]; then rdma_check; fi
if [ "$what" != bench ] && [ "$what" != rdma ]; then
  "$tv" --version || rc=1
  "$tv" info || rc=1
  TV_FAKE_CUDART="$here/lib/libtv_fake_cudart.so" "$here/bin/device_test" || rc=1
  "$here/bin/cuda_gpu_test" || rc=1
  "$here/bin/cuda_transfer_gpu_test" || rc=1
  "$here/bin/api_test" || rc=1  # the public API, with GPU recvs where a GPU is
  # Two processes on the GPU: CUDA IPC between them, direct and proxy, every dtype to 1 GiB.
  echo "== [${SECONDS}s] two processes on the GPU"
  TV_DEVICE_ECHO_PEER="$here/bin/tv_device_echo_peer" "$here/bin/device_two_process_test" \
    --gtest_filter='Routes/Gpu*' || rc=1
  # The demo with weights and gradients on the GPU: direct, then through host memory.
  echo "== [${SECONDS}s] the demo on the GPU"
  "$tv" demo --device cuda --steps 20 || rc=1
  TENSORVERBS_GPU_DIRECT=off "$tv" demo --device cuda --steps 20 || rc=1
fi
if [ "$what" != tests ] && [ "$what" != rdma ]; then
  sizes=4KiB,1MiB,16MiB,64MiB,256MiB
  echo "== [${SECONDS}s] bench p2p --device cuda: grpc+verbs direct (CUDA IPC), grpc through host memory"
  "$tv" bench p2p --device cuda --protocols grpc+verbs,grpc --sizes "$sizes" \
    --json "$out/p2p-cuda.json" || rc=1
  # The proxy path against its slowest stage (D2H, the fabric write, H2D, all measured in this
  # invocation), in chunks of the default TENSORVERBS_PROXY_CHUNK_KB.
  echo "== the same with TENSORVERBS_GPU_DIRECT=off: grpc+verbs over the proxy path"
  TENSORVERBS_GPU_DIRECT=off "$tv" bench p2p --device cuda --protocols grpc+verbs \
    --sizes "$sizes" --json "$out/p2p-cuda-proxy.json" || rc=1
  # Whole tensors (0: the stages one after another, as before the pipeline) and two other chunk
  # sizes, to choose the default from.
  for kb in 0 1024 16384; do
    echo "== [${SECONDS}s] the proxy path with TENSORVERBS_PROXY_CHUNK_KB=$kb"
    TENSORVERBS_PROXY_CHUNK_KB=$kb TENSORVERBS_GPU_DIRECT=off "$tv" bench p2p --device cuda \
      --protocols grpc+verbs --sizes 1MiB,16MiB,64MiB,256MiB --no-baselines \
      --json "$out/p2p-cuda-proxy-chunk$kb.json" || rc=1
  done
  # Where a proxy recv's time goes: each recv's phases (Perfetto / chrome://tracing JSON, one
  # file per process), at a size where the stream falls short of its slowest stage.
  echo "== [${SECONDS}s] the proxy path traced at 1 and 16 MiB"
  TENSORVERBS_GPU_DIRECT=off TENSORVERBS_TRACE="$out/trace-proxy-%p.json" "$tv" bench p2p \
    --device cuda --protocols grpc+verbs --sizes 1MiB,16MiB --no-baselines --repeat 1 \
    --json "$out/p2p-cuda-proxy-traced.json" || rc=1
  echo "== [${SECONDS}s] host tensors into the GPU, then host tensors"
  "$tv" bench p2p --device cpu,cuda --protocols grpc+verbs --sizes "$sizes" --no-baselines \
    --json "$out/p2p-cpu-to-cuda.json" || rc=1
  "$tv" bench p2p --device cpu --protocols grpc+verbs --sizes "$sizes" \
    --json "$out/p2p-cpu.json" || rc=1
fi
echo "== [${SECONDS}s] done, exit $rc"
exit $rc
RUN
chmod +x "$out/run-gpu-checks.sh"

size=$(du -sb "$out" | cut -f1)
echo "gpu-bundle: $out, $((size / 1048576)) MiB"
if [ "$size" -ge $((64 << 20)) ]; then
  echo "gpu-bundle: over 64 MiB" >&2
  exit 1
fi
