// A fabric peer in its own process, for fabric_two_process_test. It opens --backend/--provider,
// creates one endpoint and registers a 4 MiB buffer (from SharedMemory with --shared 1), then
// prints
//   address <hex> key <hex> base <decimal>
// reads the test's endpoint address (hex) from stdin, connects, and polls forever, echoing every
// immediate it receives as "imm <n> crc <crc32c of the first --check bytes>" so the test can
// check the data that landed.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "absl/strings/escaping.h"
#include "src/common/checksum.h"
#include "src/common/shared_memory.h"
#include "src/fabric/fabric.h"

int main(int argc, char** argv) {
  using namespace tensorverbs;
  std::string backend = "ofi", provider;
  size_t check = 0;
  bool shared = false;
  std::string source;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--backend") backend = argv[i + 1];
    if (flag == "--provider") provider = argv[i + 1];
    if (flag == "--source") source = argv[i + 1];
    if (flag == "--check") check = std::stoul(argv[i + 1]);
    if (flag == "--shared") shared = std::string(argv[i + 1]) == "1";
  }
  fabric::DomainOptions options;
  options.provider = provider;
  options.source_address = source;
  auto domain = fabric::OpenDomain(backend, options);
  if (!domain.ok()) {
    std::fprintf(stderr, "fabric_peer: %s\n", domain.status().ToString().c_str());
    return 1;
  }
  auto ep = *(*domain)->CreateEndpoint();
  constexpr size_t kSize = 4 << 20;
  std::unique_ptr<SharedMemory> shared_memory;
  void* buf;
  if (shared) {
    shared_memory = *SharedMemory::Create(kSize, "fabric-peer");
    buf = shared_memory->data();
  } else {
    buf = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  std::memset(buf, 0, kSize);
  auto mr = *(*domain)->RegisterMemory(buf, kSize, fabric::kAccessRemoteWrite | fabric::kAccessRemoteRead);
  std::printf("address %s key %s base %llu\n", absl::BytesToHexString(ep->LocalAddress()).c_str(),
              absl::BytesToHexString(mr->PackRemoteKey()).c_str(),
              static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(buf)));
  std::fflush(stdout);
  std::string peer_hex;
  if (!std::getline(std::cin, peer_hex)) return 1;
  absl::Status s = ep->Connect(absl::HexStringToBytes(peer_hex));
  if (!s.ok()) {
    std::fprintf(stderr, "fabric_peer: %s\n", s.ToString().c_str());
    return 1;
  }
  fabric::Completion c[16];
  while (true) {
    absl::StatusOr<size_t> n = (*domain)->Poll(absl::MakeSpan(c));
    if (!n.ok()) return 1;
    for (size_t i = 0; i < *n; ++i) {
      if (c[i].kind != fabric::CompletionKind::kRemoteWriteImm) continue;
      std::printf("imm %u crc %u\n", c[i].imm, Crc32c(buf, check));
      std::fflush(stdout);
    }
    if (*n == 0 && !(*domain)->Wait(absl::Seconds(1)).ok()) return 1;
  }
}
