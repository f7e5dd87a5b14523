// SharedMemory: anonymous memory that another process on this host can map, because it lives in
// a memfd rather than in this process's private pages.
//
// The pool allocator creates its regions here when the chosen fabric is the same-host one
// (src/fabric/shmem), and message buffers do on such a fabric, so that a peer's write into them is
// one memcpy through its own mapping instead of a cross-memory copy by the kernel. Find() is how
// the fabric learns which descriptor and offset lie behind an address it is asked to register;
// nothing else needs to know where memory came from. A memfd has no name in any file system:
// nothing is left behind when the process dies, however it dies.
//
// Create and destruction may happen on any thread; Find is thread-safe. The mapping is sealed
// against resizing, so a peer holding the descriptor can neither shrink it under us (which
// would turn our accesses into SIGBUS) nor grow it.
#ifndef TENSORVERBS_COMMON_SHARED_MEMORY_H_
#define TENSORVERBS_COMMON_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

class SharedMemory {
 public:
  // `size` is rounded up to whole pages. `name` shows in /proc/<pid>/fd and maps, for debugging.
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(size_t size, absl::string_view name);
  ~SharedMemory();  // unmaps; peers' mappings keep the memory alive until they unmap too
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  void* data() const { return base_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }

  // Where [addr, addr+len) lies inside a live SharedMemory of this process: a duplicate of its
  // descriptor (the caller closes it) and the offset of `addr` in it. False otherwise.
  struct Location {
    int fd = -1;
    uint64_t offset = 0;
    uint64_t file_size = 0;
  };
  static bool Find(const void* addr, size_t len, Location* location);

 private:
  SharedMemory(void* base, size_t size, int fd) : base_(base), size_(size), fd_(fd) {}
  void* const base_;
  const size_t size_;
  const int fd_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_SHARED_MEMORY_H_
