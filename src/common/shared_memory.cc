#include "src/common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/common/mutex.h"

namespace tensorverbs {
namespace {

struct Live {
  size_t size;
  int fd;
};

Mutex& RegistryMutex() {
  static auto* mu = new Mutex;
  return *mu;
}
// base address -> mapping; lookups are rare (registration), so a map under a mutex serves.
std::map<uintptr_t, Live>& Registry() {
  static auto* registry = new std::map<uintptr_t, Live>;
  return *registry;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(size_t size,
                                                                   absl::string_view name) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (size == 0 || size > (size_t{1} << 46)) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory of ", size, " bytes"));
  }
  size = (size + page - 1) / page * page;
  const std::string label(name);
  const int fd = memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create(", label, "): ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int e = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("sizing shared memory ", label, " to ", size, " bytes: ", std::strerror(e)));
  }
  // Sealed before any peer can see the descriptor.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int e = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("sealing shared memory ", label, ": ", std::strerror(e)));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int e = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("mapping ", size, " bytes of shared memory ", label, ": ", std::strerror(e)));
  }
  {
    MutexLock lock(&RegistryMutex());
    Registry()[reinterpret_cast<uintptr_t>(base)] = Live{size, fd};
  }
  return std::unique_ptr<SharedMemory>(new SharedMemory(base, size, fd));
}

SharedMemory::~SharedMemory() {
  {
    MutexLock lock(&RegistryMutex());
    Registry().erase(reinterpret_cast<uintptr_t>(base_));
  }
  munmap(base_, size_);
  close(fd_);
}

bool SharedMemory::Find(const void* addr, size_t len, Location* location) {
  const auto a = reinterpret_cast<uintptr_t>(addr);
  MutexLock lock(&RegistryMutex());
  auto it = Registry().upper_bound(a);
  if (it == Registry().begin()) return false;
  --it;
  const uintptr_t base = it->first;
  const size_t size = it->second.size;
  if (a - base > size || len > size - (a - base)) return false;
  const int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return false;
  location->fd = fd;
  location->offset = a - base;
  location->file_size = size;
  return true;
}

}  // namespace tensorverbs
