#include "src/device/cuda_runtime.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstring>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/config.h"

#ifdef TENSORVERBS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tensorverbs::device {
namespace {

// The runtime's ABI values this file uses: stable across CUDA releases, and checked against
// the toolkit's headers where the build has them.
constexpr int kCudaSuccess = 0;
constexpr int kErrorMemoryAllocation = 2;
constexpr int kErrorInsufficientDriver = 35;
constexpr int kErrorNoDevice = 100;
constexpr int kErrorInvalidDevice = 101;
constexpr int kErrorNotReady = 600;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr int kMemcpyHostToDevice = 1;
constexpr int kMemcpyDeviceToHost = 2;
constexpr int kMemcpyDeviceToDevice = 3;
constexpr int kAttrComputeMajor = 75;
constexpr int kAttrComputeMinor = 76;
constexpr unsigned kIpcLazyEnablePeerAccess = 1;
constexpr size_t kIpcHandleBytes = 64;
// cudaDeviceProp starts with `char name[256]` and is about 1 KiB; a newer runtime's may be
// larger, so the buffer leaves it room.
constexpr size_t kDevicePropBytes = 16384;

#ifdef TENSORVERBS_HAVE_CUDA
static_assert(kErrorMemoryAllocation == cudaErrorMemoryAllocation);
static_assert(kErrorInsufficientDriver == cudaErrorInsufficientDriver);
static_assert(kErrorNoDevice == cudaErrorNoDevice);
static_assert(kErrorInvalidDevice == cudaErrorInvalidDevice);
static_assert(kErrorNotReady == cudaErrorNotReady);
static_assert(kStreamNonBlocking == cudaStreamNonBlocking);
static_assert(kEventDisableTiming == cudaEventDisableTiming);
static_assert(kMemcpyHostToDevice == cudaMemcpyHostToDevice);
static_assert(kMemcpyDeviceToHost == cudaMemcpyDeviceToHost);
static_assert(kMemcpyDeviceToDevice == cudaMemcpyDeviceToDevice);
static_assert(kAttrComputeMajor == cudaDevAttrComputeCapabilityMajor);
static_assert(kAttrComputeMinor == cudaDevAttrComputeCapabilityMinor);
static_assert(kIpcLazyEnablePeerAccess == cudaIpcMemLazyEnablePeerAccess);
static_assert(kIpcHandleBytes == sizeof(cudaIpcMemHandle_t));
static_assert(sizeof(cudaDeviceProp) <= kDevicePropBytes);
#endif

int KindValue(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return kMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return kMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return kMemcpyDeviceToDevice;
  }
  return kMemcpyDeviceToDevice;
}

std::vector<std::string> DefaultCandidates() {
  const std::string& configured = Config::Get().cuda_runtime;
  if (!configured.empty()) return {configured};
  std::vector<std::string> out = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
#ifdef TENSORVERBS_CUDA_LIBDIR
  out.push_back(absl::StrCat(TENSORVERBS_CUDA_LIBDIR, "/libcudart.so"));
#endif
  return out;
}

}  // namespace

bool NvidiaDriverLoaded() {
  return access("/proc/driver/nvidia/version", F_OK) == 0 || access("/dev/nvidiactl", F_OK) == 0;
}

std::string BuildToolkit() {
#ifdef TENSORVERBS_HAVE_CUDA
  return absl::StrCat(CUDART_VERSION / 1000, ".", CUDART_VERSION % 1000 / 10);
#else
  return "";
#endif
}

absl::Status CudaErrorStatus(int code, absl::string_view error_name, absl::string_view error_text,
                             absl::string_view call, int device, absl::string_view key) {
  std::string where = device >= 0 ? absl::StrCat(" on cuda:", device) : std::string();
  if (!key.empty()) absl::StrAppend(&where, " for '", key, "'");
  const std::string message = absl::StrCat(
      "CUDA ", call, where, " failed: ", error_text, " (",
      error_name.empty() ? absl::StrCat("error ", code) : std::string(error_name), ")");
  switch (code) {
    case kErrorMemoryAllocation:
      return absl::ResourceExhaustedError(
          absl::StrCat(message,
                       "; the device is out of memory: free tensors on it or use "
                       "smaller ones"));
    case kErrorInsufficientDriver:
    case kErrorNoDevice:
      return absl::FailedPreconditionError(
          absl::StrCat(message, "; `tensorverbs info` shows the GPUs and driver found"));
    case kErrorInvalidDevice:
      return absl::InvalidArgumentError(
          absl::StrCat(message, "; `tensorverbs info` lists the device ordinals"));
    default:
      return absl::InternalError(message);
  }
}

// The entry points, resolved by name. Error codes are cudaError_t (an int enum); streams,
// events and the device property struct are not used through their types.
struct CudaRuntime::Api {
  int (*GetDeviceCount)(int*) = nullptr;
  int (*RuntimeGetVersion)(int*) = nullptr;
  int (*DriverGetVersion)(int*) = nullptr;
  const char* (*GetErrorName)(int) = nullptr;
  const char* (*GetErrorString)(int) = nullptr;
  int (*SetDevice)(int) = nullptr;
  int (*GetDeviceProperties)(void*, int) = nullptr;
  int (*DeviceGetAttribute)(int*, int, int) = nullptr;
  int (*DeviceGetPCIBusId)(char*, int, int) = nullptr;
  int (*MemGetInfo)(size_t*, size_t*) = nullptr;
  int (*Malloc)(void**, size_t) = nullptr;
  int (*Free)(void*) = nullptr;
  int (*Memcpy)(void*, const void*, size_t, int) = nullptr;
  int (*MemcpyAsync)(void*, const void*, size_t, int, void*) = nullptr;
  int (*StreamCreateWithFlags)(void**, unsigned) = nullptr;
  int (*StreamDestroy)(void*) = nullptr;
  int (*EventCreateWithFlags)(void**, unsigned) = nullptr;
  int (*EventDestroy)(void*) = nullptr;
  int (*EventRecord)(void*, void*) = nullptr;
  int (*EventQuery)(void*) = nullptr;
  int (*LaunchHostFunc)(void*, void (*)(void*), void*) = nullptr;
  int (*StreamSynchronize)(void*) = nullptr;
  int (*HostRegister)(void*, size_t, unsigned) = nullptr;
  int (*HostUnregister)(void*) = nullptr;
  int (*IpcGetMemHandle)(void*, void*) = nullptr;  // (cudaIpcMemHandle_t*, void*)
  // cudaIpcMemHandle_t is passed by value: a 64-byte struct, as the x86-64 ABI passes it (on
  // the stack), which a struct of the same size reproduces.
  struct IpcHandleBytes {
    char bytes[kIpcHandleBytes];
  };
  int (*IpcOpenMemHandle)(void**, IpcHandleBytes, unsigned) = nullptr;
  int (*IpcCloseMemHandle)(void*) = nullptr;
};

CudaRuntime::CudaRuntime(void* library_handle, std::string library, std::unique_ptr<Api> api)
    : handle_(library_handle), library_(std::move(library)), api_(std::move(api)) {}

CudaRuntime::~CudaRuntime() {
  if (handle_ != nullptr) dlclose(handle_);
}

absl::StatusOr<std::unique_ptr<CudaRuntime>> CudaRuntime::Load(
    const std::vector<std::string>& candidates) {
  void* handle = nullptr;
  std::string loaded;
  std::vector<std::string> errors;
  for (const std::string& name : candidates) {
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      loaded = name;
      break;
    }
    const char* e = dlerror();
    errors.push_back(e != nullptr ? e : name);
  }
  if (handle == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "no CUDA runtime library could be loaded (", absl::StrJoin(errors, "; "),
        "); install the CUDA runtime, add its folder to LD_LIBRARY_PATH, or name the library "
        "in TENSORVERBS_CUDA_RUNTIME"));
  }
  auto api = std::make_unique<Api>();
  std::vector<std::string> missing;
  auto resolve = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, symbol));
    if (fn == nullptr) missing.push_back(symbol);
  };
  resolve(api->GetDeviceCount, "cudaGetDeviceCount");
  resolve(api->RuntimeGetVersion, "cudaRuntimeGetVersion");
  resolve(api->DriverGetVersion, "cudaDriverGetVersion");
  resolve(api->GetErrorName, "cudaGetErrorName");
  resolve(api->GetErrorString, "cudaGetErrorString");
  resolve(api->SetDevice, "cudaSetDevice");
  resolve(api->GetDeviceProperties, "cudaGetDeviceProperties");
  resolve(api->DeviceGetAttribute, "cudaDeviceGetAttribute");
  resolve(api->DeviceGetPCIBusId, "cudaDeviceGetPCIBusId");
  resolve(api->MemGetInfo, "cudaMemGetInfo");
  resolve(api->Malloc, "cudaMalloc");
  resolve(api->Free, "cudaFree");
  resolve(api->Memcpy, "cudaMemcpy");
  resolve(api->MemcpyAsync, "cudaMemcpyAsync");
  resolve(api->StreamCreateWithFlags, "cudaStreamCreateWithFlags");
  resolve(api->StreamDestroy, "cudaStreamDestroy");
  resolve(api->EventCreateWithFlags, "cudaEventCreateWithFlags");
  resolve(api->EventDestroy, "cudaEventDestroy");
  resolve(api->EventRecord, "cudaEventRecord");
  resolve(api->EventQuery, "cudaEventQuery");
  resolve(api->LaunchHostFunc, "cudaLaunchHostFunc");
  resolve(api->StreamSynchronize, "cudaStreamSynchronize");
  resolve(api->HostRegister, "cudaHostRegister");
  resolve(api->HostUnregister, "cudaHostUnregister");
  resolve(api->IpcGetMemHandle, "cudaIpcGetMemHandle");
  resolve(api->IpcOpenMemHandle, "cudaIpcOpenMemHandle");
  resolve(api->IpcCloseMemHandle, "cudaIpcCloseMemHandle");
  if (!missing.empty()) {
    dlclose(handle);
    return absl::UnavailableError(absl::StrCat("the CUDA runtime ", loaded, " lacks ",
                                               absl::StrJoin(missing, ", "),
                                               "; it is not a CUDA runtime this build can use"));
  }
  std::unique_ptr<CudaRuntime> rt(new CudaRuntime(handle, loaded, std::move(api)));
  rt->api_->RuntimeGetVersion(&rt->runtime_version_);
  rt->api_->DriverGetVersion(&rt->driver_version_);  // 0 when no driver is installed
  int count = 0;
  const int code = rt->api_->GetDeviceCount(&count);
  if (code != kCudaSuccess && rt->driver_version_ == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no NVIDIA driver is installed (the CUDA runtime ", loaded,
                     " is); GPU tensors need a GPU and its driver"));
  }
  if (code != kCudaSuccess) {
    absl::Status s = rt->Check(code, "cudaGetDeviceCount", -1, {});
    return absl::Status(s.code(), absl::StrCat(s.message(), " (runtime ", loaded, ")"));
  }
  if (count <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA runtime ", loaded, " finds no GPU"));
  }
  rt->device_count_ = count;
  return rt;
}

absl::StatusOr<CudaRuntime*> CudaRuntime::Get() {
  static absl::StatusOr<CudaRuntime*>* const runtime = [] {
    absl::StatusOr<std::unique_ptr<CudaRuntime>> loaded = Load(DefaultCandidates());
    if (!loaded.ok()) return new absl::StatusOr<CudaRuntime*>(loaded.status());
    return new absl::StatusOr<CudaRuntime*>(loaded->release());  // lives as long as the process
  }();
  return *runtime;
}

absl::Status CudaRuntime::Check(int code, absl::string_view call, int device,
                                absl::string_view key) const {
  if (code == kCudaSuccess) return absl::OkStatus();
  const char* name = api_->GetErrorName(code);
  const char* text = api_->GetErrorString(code);
  return CudaErrorStatus(code, name != nullptr ? name : "", text != nullptr ? text : "unknown",
                         call, device, key);
}

absl::Status CudaRuntime::SetDevice(int device, absl::string_view call,
                                    absl::string_view key) const {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA ", call, ": there is no cuda:", device, " (", device_count_,
                     " GPUs here: cuda:0..cuda:", device_count_ - 1, ")",
                     key.empty() ? "" : absl::StrCat(" for '", key, "'")));
  }
  return Check(api_->SetDevice(device), "cudaSetDevice", device, key);
}

absl::StatusOr<CudaDeviceInfo> CudaRuntime::DeviceInfo(int device) const {
  if (absl::Status s = SetDevice(device, "DeviceInfo", {}); !s.ok()) return s;
  CudaDeviceInfo info;
  info.ordinal = device;
  std::vector<char> prop(kDevicePropBytes, 0);
  if (absl::Status s = Check(api_->GetDeviceProperties(prop.data(), device),
                             "cudaGetDeviceProperties", device, {});
      !s.ok()) {
    return s;
  }
  info.name = std::string(prop.data(), strnlen(prop.data(), 256));
  char bus[64] = {};
  if (api_->DeviceGetPCIBusId(bus, sizeof(bus), device) == kCudaSuccess) info.pci_bus_id = bus;
  api_->DeviceGetAttribute(&info.compute_major, kAttrComputeMajor, device);
  api_->DeviceGetAttribute(&info.compute_minor, kAttrComputeMinor, device);
  size_t free_bytes = 0, total = 0;
  if (api_->MemGetInfo(&free_bytes, &total) == kCudaSuccess) info.total_memory = total;
  return info;
}

absl::StatusOr<void*> CudaRuntime::Malloc(int device, size_t bytes, absl::string_view key) const {
  if (absl::Status s = SetDevice(device, "cudaMalloc", key); !s.ok()) return s;
  void* p = nullptr;
  if (absl::Status s =
          Check(api_->Malloc(&p, bytes), absl::StrCat("cudaMalloc(", bytes, ")"), device, key);
      !s.ok()) {
    return s;
  }
  return p;
}

absl::Status CudaRuntime::Free(int device, void* ptr) const {
  if (absl::Status s = SetDevice(device, "cudaFree", {}); !s.ok()) return s;
  return Check(api_->Free(ptr), "cudaFree", device, {});
}

absl::Status CudaRuntime::Memcpy(int device, void* dst, const void* src, size_t bytes,
                                 CopyKind kind, absl::string_view key) const {
  if (absl::Status s = SetDevice(device, "cudaMemcpy", key); !s.ok()) return s;
  return Check(api_->Memcpy(dst, src, bytes, KindValue(kind)),
               absl::StrCat("cudaMemcpy(", bytes, " bytes)"), device, key);
}

absl::StatusOr<void*> CudaRuntime::StreamCreate(int device) const {
  if (absl::Status s = SetDevice(device, "cudaStreamCreateWithFlags", {}); !s.ok()) return s;
  void* stream = nullptr;
  if (absl::Status s = Check(api_->StreamCreateWithFlags(&stream, kStreamNonBlocking),
                             "cudaStreamCreateWithFlags", device, {});
      !s.ok()) {
    return s;
  }
  return stream;
}

void CudaRuntime::StreamDestroy(int device, void* stream) const {
  if (SetDevice(device, "cudaStreamDestroy", {}).ok()) api_->StreamDestroy(stream);
}

absl::Status CudaRuntime::SynchronizeDefaultStream(int device, absl::string_view key) const {
  if (absl::Status s = SetDevice(device, "cudaStreamSynchronize", key); !s.ok()) return s;
  // The null stream is the legacy default stream (the default unless a program is built with
  // per-thread default streams, which names its own).
  return Check(api_->StreamSynchronize(nullptr), "cudaStreamSynchronize(legacy default stream)",
               device, key);
}

absl::Status CudaRuntime::MemcpyAsync(int device, void* dst, const void* src, size_t bytes,
                                      CopyKind kind, void* stream, absl::string_view key) const {
  if (absl::Status s = SetDevice(device, "cudaMemcpyAsync", key); !s.ok()) return s;
  return Check(api_->MemcpyAsync(dst, src, bytes, KindValue(kind), stream),
               absl::StrCat("cudaMemcpyAsync(", bytes, " bytes, ", CopyDirectionName(kind), ")"),
               device, key);
}

absl::StatusOr<void*> CudaRuntime::EventCreate(int device) const {
  if (absl::Status s = SetDevice(device, "cudaEventCreateWithFlags", {}); !s.ok()) return s;
  void* event = nullptr;
  if (absl::Status s = Check(api_->EventCreateWithFlags(&event, kEventDisableTiming),
                             "cudaEventCreateWithFlags", device, {});
      !s.ok()) {
    return s;
  }
  return event;
}

void CudaRuntime::EventDestroy(int device, void* event) const {
  if (SetDevice(device, "cudaEventDestroy", {}).ok()) api_->EventDestroy(event);
}

absl::Status CudaRuntime::EventRecord(int device, void* event, void* stream) const {
  if (absl::Status s = SetDevice(device, "cudaEventRecord", {}); !s.ok()) return s;
  return Check(api_->EventRecord(event, stream), "cudaEventRecord", device, {});
}

absl::Status CudaRuntime::EventQuery(int device, void* event, absl::string_view key) const {
  const int code = api_->EventQuery(event);
  if (code == kErrorNotReady) return absl::UnavailableError("not ready");
  return Check(code, "copy (cudaEventQuery)", device, key);
}

absl::Status CudaRuntime::LaunchHostFunc(int device, void* stream, void (*fn)(void*),
                                         void* arg) const {
  if (absl::Status s = SetDevice(device, "cudaLaunchHostFunc", {}); !s.ok()) return s;
  return Check(api_->LaunchHostFunc(stream, fn, arg), "cudaLaunchHostFunc", device, {});
}

absl::Status CudaRuntime::HostRegister(void* ptr, size_t bytes) const {
  return Check(api_->HostRegister(ptr, bytes, 0), absl::StrCat("cudaHostRegister(", bytes, ")"), -1,
               {});
}

absl::Status CudaRuntime::HostUnregister(void* ptr) const {
  return Check(api_->HostUnregister(ptr), "cudaHostUnregister", -1, {});
}

absl::StatusOr<std::string> CudaRuntime::IpcHandle(int device, void* ptr) const {
  if (absl::Status s = SetDevice(device, "cudaIpcGetMemHandle", {}); !s.ok()) return s;
  std::string handle(kIpcHandleBytes, '\0');
  if (absl::Status s =
          Check(api_->IpcGetMemHandle(handle.data(), ptr), "cudaIpcGetMemHandle", device, {});
      !s.ok()) {
    return s;
  }
  return handle;
}

absl::StatusOr<void*> CudaRuntime::IpcOpen(int device, absl::string_view handle) const {
  if (handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CUDA IPC handle is ", kIpcHandleBytes, " bytes, not ", handle.size()));
  }
  if (absl::Status s = SetDevice(device, "cudaIpcOpenMemHandle", {}); !s.ok()) return s;
  Api::IpcHandleBytes h;
  std::memcpy(h.bytes, handle.data(), kIpcHandleBytes);
  void* p = nullptr;
  if (absl::Status s = Check(api_->IpcOpenMemHandle(&p, h, kIpcLazyEnablePeerAccess),
                             "cudaIpcOpenMemHandle", device, {});
      !s.ok()) {
    return s;
  }
  return p;
}

absl::Status CudaRuntime::IpcClose(int device, void* ptr) const {
  if (absl::Status s = SetDevice(device, "cudaIpcCloseMemHandle", {}); !s.ok()) return s;
  return Check(api_->IpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle", device, {});
}

}  // namespace tensorverbs::device
