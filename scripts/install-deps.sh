#!/usr/bin/env bash
# Installs, from Debian 12 packages only, everything tensorverbs needs to build, test and run its
# demo. Idempotent and non-interactive: it runs `apt-get update` only when a package is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libfabric-dev libfabric-bin
  libibverbs-dev ibverbs-utils
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev
  libcli11-dev
  libssl-dev openssl
  clang libclang-rt-14-dev
  nlohmann-json3-dev
  iproute2 procps
  gnuplot-nox ucx-utils
  slurmctld slurmd slurm-client munge
  python3-dev pybind11-dev python3-numpy python3-pytest python3-torch libtorch-dev python3-venv python3-setuptools python3-wheel
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
