# Every dependency comes from a Debian 12 package (scripts/install-deps.sh installs them).
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(Protobuf REQUIRED)          # Debian's protobuf ships no CMake config: FindProtobuf.
find_package(gRPC CONFIG REQUIRED)       # Needs protobuf-compiler-grpc for gRPC::grpc_cpp_plugin.
find_package(PkgConfig REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(OpenSSL REQUIRED)           # libcrypto: the cluster secret's HMAC (libssl-dev).
find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)

# libfabric and libibverbs are detected here; the fabric layer uses them. The build succeeds
# without libibverbs.
pkg_check_modules(LIBFABRIC IMPORTED_TARGET libfabric)
pkg_check_modules(IBVERBS IMPORTED_TARGET libibverbs)

if(TENSORVERBS_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)
  find_package(benchmark CONFIG)
endif()
