// A stand-in for libcudart that CudaRuntime::Load accepts, for testing the CUDA copier's
// threading and bookkeeping on machines without a GPU (and under the sanitizers): one "device"
// whose memory is host memory, streams that run their work in order on a thread of their own
// (so copies really complete later, as on a GPU), events and host functions. A pointer below
// 4096 on either side of a copy is refused at once with cudaErrorInvalidValue, as the runtime
// refuses memory it does not know. Only what CudaRuntime resolves is here, with the same
// signatures it calls through (error codes as int, handles as void*).
//
// Device memory is shared memory (a memfd per cudaMalloc), so CUDA IPC works between processes
// as on a GPU: a handle names the owner's pid and descriptor, and another process opens it
// through /proc/<pid>/fd and maps it (the same handle opened twice maps once, and needs two
// closes, as the runtime does). tv_fake_cudart_counts() tells a test how many allocations are
// live and how many IPC opens are not closed yet, so leaks show.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

// This library stands alone (it is loaded as a CUDA runtime), so it spells out the ASan check
// that src/common/sanitizers.h makes for the project.
#if defined(__SANITIZE_ADDRESS__)
#define TV_FAKE_CUDART_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TV_FAKE_CUDART_ASAN 1
#endif
#endif
#ifdef TV_FAKE_CUDART_ASAN
#include <sanitizer/lsan_interface.h>
#endif

namespace {

constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kNotReady = 600;

bool Bad(const void* p) { return reinterpret_cast<uintptr_t>(p) < 4096; }

class Stream {
 public:
  Stream() : thread_([this] { Run(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Push(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      work_.push_back(std::move(work));
    }
    cv_.notify_all();
  }
  // Waits until the work pushed so far has run.
  void Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return work_.empty() && !busy_; });
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;
      std::function<void()> w = std::move(work_.front());
      work_.pop_front();
      busy_ = true;
      lock.unlock();
      w();
      lock.lock();
      busy_ = false;
      cv_.notify_all();  // a drainer may wait for this
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> work_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

// Every live stream, so that freeing memory can wait for the copies queued on them first, as
// cudaFree synchronizes the device.
struct Streams {
  std::mutex mu;
  std::set<Stream*> all;
};
// The registries below outlive the runtime's users at exit, so they are never destroyed. A
// test that unloads this library (CudaRuntime closes it) unmaps the only pointer to them,
// which LeakSanitizer would take for a leak: they are marked as meant to live on.
template <typename T>
T* Immortal() {
  T* object = new T;
#ifdef TV_FAKE_CUDART_ASAN
  __lsan_ignore_object(object);
#endif
  return object;
}

Streams& streams() {
  static Streams* s = Immortal<Streams>();
  return *s;
}
void DrainStreams() {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mu);
  for (Stream* stream : s.all) stream->Drain();
}

struct Event {
  std::atomic<bool> done{true};
};

// What a handle carries (cudaIpcMemHandle_t is 64 opaque bytes).
struct IpcHandle {
  char bytes[64];
};
// The owner's pid and descriptor say where to open the memory; the inode says which memory it
// must be (a descriptor number is reused once the allocation is freed).
struct IpcName {
  uint32_t magic;
  int32_t pid;
  int32_t fd;
  uint64_t size;
  uint64_t dev;
  uint64_t ino;
};
constexpr uint32_t kIpcMagic = 0x54564643;  // "TVFC"
static_assert(sizeof(IpcName) <= sizeof(IpcHandle));

struct Allocation {
  int fd;
  size_t size;
};
struct Opened {
  void* base;
  size_t size;
  int refs;
};
using OpenedKey = std::pair<uint64_t, uint64_t>;  // (dev, ino) of the owner's memfd

// Waits for the legacy default stream, counted so that tests see a sender wait for the work a
// producer queued before handing its memory over.
std::atomic<long> default_stream_syncs{0};

// Every allocation by base, and every opened peer allocation by its memfd's identity.
struct Books {
  std::mutex mu;
  std::map<uintptr_t, Allocation> allocations;
  std::map<OpenedKey, Opened> opened;
  long opens_not_closed = 0;
};
Books& books() {
  static Books* b = Immortal<Books>();
  return *b;
}

}  // namespace

extern "C" {

int cudaGetDeviceCount(int* n) {
  *n = 1;
  return kSuccess;
}
int cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return kSuccess;
}
int cudaDriverGetVersion(int* v) {
  *v = 13000;
  return kSuccess;
}
const char* cudaGetErrorName(int code) {
  return code == kInvalidValue ? "cudaErrorInvalidValue" : "cudaErrorUnknown";
}
const char* cudaGetErrorString(int code) {
  return code == kInvalidValue ? "invalid argument" : "unknown error";
}
int cudaSetDevice(int d) { return d == 0 ? kSuccess : 101; }
int cudaGetDeviceProperties(void* prop, int) {
  std::strcpy(static_cast<char*>(prop), "fake GPU");
  return kSuccess;
}
int cudaDeviceGetAttribute(int* v, int, int) {
  *v = 9;
  return kSuccess;
}
int cudaDeviceGetPCIBusId(char* bus, int len, int) {
  std::strncpy(bus, "0000:00:00.0", static_cast<size_t>(len));
  return kSuccess;
}
int cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *free_bytes = *total = size_t{1} << 30;
  return kSuccess;
}
int cudaMalloc(void** p, size_t bytes) {
  const size_t size = bytes == 0 ? 1 : bytes;
  const int fd = memfd_create("tv-fake-cuda", MFD_CLOEXEC);
  if (fd < 0) return 2;
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(size)) == 0) {
    base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (base == MAP_FAILED) {
    close(fd);
    return 2;  // cudaErrorMemoryAllocation
  }
  Books& b = books();
  std::lock_guard<std::mutex> lock(b.mu);
  b.allocations[reinterpret_cast<uintptr_t>(base)] = Allocation{fd, size};
  *p = base;
  return kSuccess;
}
int cudaFree(void* p) {
  if (p == nullptr) return kSuccess;
  DrainStreams();
  Books& b = books();
  std::lock_guard<std::mutex> lock(b.mu);
  auto it = b.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == b.allocations.end()) return kInvalidValue;
  munmap(p, it->second.size);
  close(it->second.fd);
  b.allocations.erase(it);
  return kSuccess;
}
int cudaMemcpy(void* dst, const void* src, size_t bytes, int) {
  if (Bad(dst) || Bad(src)) return kInvalidValue;
  std::memcpy(dst, src, bytes);
  return kSuccess;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int, void* stream) {
  if (Bad(dst) || Bad(src)) return kInvalidValue;
  static_cast<Stream*>(stream)->Push([=] { std::memcpy(dst, src, bytes); });
  return kSuccess;
}
int cudaStreamCreateWithFlags(void** stream, unsigned) {
  auto* s = new Stream;
  {
    std::lock_guard<std::mutex> lock(streams().mu);
    streams().all.insert(s);
  }
  *stream = s;
  return kSuccess;
}
int cudaStreamDestroy(void* stream) {
  auto* s = static_cast<Stream*>(stream);
  {
    std::lock_guard<std::mutex> lock(streams().mu);
    streams().all.erase(s);
  }
  delete s;
  return kSuccess;
}
int cudaEventCreateWithFlags(void** event, unsigned) {
  *event = new Event;
  return kSuccess;
}
int cudaEventDestroy(void* event) {
  delete static_cast<Event*>(event);
  return kSuccess;
}
int cudaEventRecord(void* event, void* stream) {
  auto* e = static_cast<Event*>(event);
  e->done.store(false);
  static_cast<Stream*>(stream)->Push([e] { e->done.store(true); });
  return kSuccess;
}
int cudaEventQuery(void* event) {
  return static_cast<Event*>(event)->done.load() ? kSuccess : kNotReady;
}
int cudaLaunchHostFunc(void* stream, void (*fn)(void*), void* arg) {
  static_cast<Stream*>(stream)->Push([fn, arg] { fn(arg); });
  return kSuccess;
}
// The legacy default stream (null) runs nothing asynchronously here; a copier's stream is
// drained.
int cudaStreamSynchronize(void* stream) {
  if (stream == nullptr) {
    default_stream_syncs.fetch_add(1);
    return kSuccess;
  }
  static_cast<Stream*>(stream)->Drain();
  return kSuccess;
}
int cudaHostRegister(void*, size_t, unsigned) { return kSuccess; }
int cudaHostUnregister(void*) { return kSuccess; }
int cudaIpcGetMemHandle(IpcHandle* handle, void* p) {
  Books& b = books();
  std::lock_guard<std::mutex> lock(b.mu);
  auto it = b.allocations.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == b.allocations.begin()) return kInvalidValue;
  --it;
  if (reinterpret_cast<uintptr_t>(p) >= it->first + it->second.size) return kInvalidValue;
  struct stat st {};
  if (fstat(it->second.fd, &st) != 0) return kInvalidValue;
  const IpcName name{
      kIpcMagic,       static_cast<int32_t>(getpid()),   it->second.fd,
      it->second.size, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  std::memset(handle->bytes, 0, sizeof(handle->bytes));
  std::memcpy(handle->bytes, &name, sizeof(name));
  return kSuccess;
}
int cudaIpcOpenMemHandle(void** p, IpcHandle h, unsigned) {
  IpcName name;
  std::memcpy(&name, h.bytes, sizeof(name));
  if (name.magic != kIpcMagic || name.size == 0) return kInvalidValue;
  Books& b = books();
  std::lock_guard<std::mutex> lock(b.mu);
  const OpenedKey key{name.dev, name.ino};
  auto it = b.opened.find(key);
  if (it == b.opened.end()) {
    const std::string path = "/proc/" + std::to_string(name.pid) + "/fd/" + std::to_string(name.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return kInvalidValue;
    struct stat st {};
    // The descriptor must still be the allocation the handle was made for.
    if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_dev) != name.dev ||
        static_cast<uint64_t>(st.st_ino) != name.ino ||
        static_cast<uint64_t>(st.st_size) < name.size) {
      close(fd);
      return kInvalidValue;
    }
    void* base = mmap(nullptr, name.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return kInvalidValue;
    it = b.opened.emplace(key, Opened{base, name.size, 0}).first;
  }
  ++it->second.refs;
  ++b.opens_not_closed;
  *p = it->second.base;
  return kSuccess;
}
int cudaIpcCloseMemHandle(void* p) {
  DrainStreams();  // copies still queued into the mapping run first
  Books& b = books();
  std::lock_guard<std::mutex> lock(b.mu);
  for (auto it = b.opened.begin(); it != b.opened.end(); ++it) {
    if (it->second.base != p) continue;
    if (--it->second.refs == 0) {
      munmap(it->second.base, it->second.size);
      b.opened.erase(it);
    }
    --b.opens_not_closed;
    return kSuccess;
  }
  return kInvalidValue;
}

// Not part of CUDA: live allocations and IPC opens not closed yet, for tests.
void tv_fake_cudart_counts(long* allocations, long* opens_not_closed) {
  Books& b = books();
  std::lock_guard<std::mutex> lock(b.mu);
  *allocations = static_cast<long>(b.allocations.size());
  *opens_not_closed = b.opens_not_closed;
}

// Not part of CUDA: how often the legacy default stream was waited for, for tests.
long tv_fake_cudart_default_stream_syncs() { return default_stream_syncs.load(); }

}  // extern "C"
