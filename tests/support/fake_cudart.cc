// A stand-in for libcudart that CudaRuntime::Load accepts, for testing the CUDA copier's
// threading and bookkeeping on machines without a GPU (and under the sanitizers): one "device"
// whose memory is host memory, streams that run their work in order on a thread of their own
// (so copies really complete later, as on a GPU), events and host functions. A pointer below
// 4096 on either side of a copy is refused at once with cudaErrorInvalidValue, as the runtime
// refuses memory it does not know. Only what CudaRuntime resolves is here, with the same
// signatures it calls through (error codes as int, handles as void*).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

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

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;
      std::function<void()> w = std::move(work_.front());
      work_.pop_front();
      lock.unlock();
      w();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> work_;
  bool stopping_ = false;
  std::thread thread_;
};

struct Event {
  std::atomic<bool> done{true};
};

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
  *p = std::malloc(bytes);
  return *p != nullptr ? kSuccess : 2;
}
int cudaFree(void* p) {
  std::free(p);
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
  *stream = new Stream;
  return kSuccess;
}
int cudaStreamDestroy(void* stream) {
  delete static_cast<Stream*>(stream);
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
int cudaHostRegister(void*, size_t, unsigned) { return kSuccess; }
int cudaHostUnregister(void*) { return kSuccess; }
int cudaIpcGetMemHandle(void* handle, void* p) {
  std::memset(handle, 0, 64);
  std::memcpy(handle, &p, sizeof(p));
  return kSuccess;
}
struct IpcHandle {
  char bytes[64];
};
int cudaIpcOpenMemHandle(void** p, IpcHandle h, unsigned) {
  std::memcpy(p, h.bytes, sizeof(*p));
  return kSuccess;
}
int cudaIpcCloseMemHandle(void*) { return kSuccess; }

}  // extern "C"
