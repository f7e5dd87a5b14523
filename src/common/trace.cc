#include "src/common/trace.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/config.h"
#include "src/common/logging.h"
#include "src/common/mutex.h"

namespace tensorverbs {
namespace {

// Written out once this much is buffered: the progress thread pays for a write a few times a
// second at most, even when every recv is traced.
constexpr size_t kFlushBytes = size_t{256} << 10;

void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (c < 0x20 || c >= 0x7f) {
          // Keys are bytes, not necessarily UTF-8: every other byte is escaped, so the file
          // stays valid JSON whatever a key holds.
          absl::StrAppendFormat(out, "\\u%04x", c);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

std::string Micros(int64_t ns) { return absl::StrFormat("%d.%03d", ns / 1000, ns % 1000); }

class Tracer {
 public:
  // The process's tracer, or null when TENSORVERBS_TRACE is unset or its file cannot be made.
  static Tracer* Get() {
    static Tracer* const tracer = Open();
    return tracer;
  }

  uint64_t NextId() { return next_id_.fetch_add(1, std::memory_order_relaxed); }

  uint64_t Track(absl::string_view name) {
    MutexLock lock(&mu_);
    auto [it, added] = tracks_.try_emplace(name, tracks_.size() + 1);
    if (added) {
      std::string event = absl::StrCat(R"({"ph":"M","name":"thread_name","pid":)", pid_,
                                       R"(,"tid":)", it->second, R"(,"args":{"name":)");
      AppendJsonString(&event, name);
      event.append("}}");
      AppendLocked(event);
    }
    return it->second;
  }

  // Viewers show the last process_name of a pid: it lists every task this process has run.
  void NameProcess(absl::string_view task) {
    MutexLock lock(&mu_);
    if (!tasks_.empty()) tasks_.append(", ");
    absl::StrAppend(&tasks_, task);
    AppendProcessNameLocked();
  }

  void Append(const std::string& event) {
    MutexLock lock(&mu_);
    AppendLocked(event);
  }

  int pid() const { return pid_; }

  void Flush() {
    MutexLock lock(&mu_);
    FlushLocked();
  }

  // At exit: the array is closed, so the file is valid JSON. Later events are dropped.
  void Close() {
    MutexLock lock(&mu_);
    if (file_ == nullptr) return;
    buffer_.append("\n]\n");
    FlushLocked();
    std::fclose(file_);
    file_ = nullptr;
  }

 private:
  Tracer(FILE* file, std::string path) : file_(file), path_(std::move(path)), pid_(getpid()) {
    buffer_ = "[\n";
    MutexLock lock(&mu_);
    AppendProcessNameLocked();
  }

  void AppendProcessNameLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string event =
        absl::StrCat(R"({"ph":"M","name":"process_name","pid":)", pid_, R"(,"args":{"name":)");
    AppendJsonString(&event, tasks_.empty() ? absl::StrCat("tensorverbs (pid ", pid_, ")")
                                            : absl::StrCat(tasks_, " (pid ", pid_, ")"));
    event.append("}}");
    AppendLocked(event);
  }

  static Tracer* Open() {
    const std::string& setting = Config::Get().trace_file;
    if (setting.empty()) return nullptr;
    const std::string path = absl::StrReplaceAll(setting, {{"%p", absl::StrCat(getpid())}});
    FILE* file = std::fopen(path.c_str(), "w");
    if (file == nullptr) {
      LOG(WARNING) << "TENSORVERBS_TRACE: cannot write '" << path << "': " << std::strerror(errno)
                   << "; recvs are not traced (name a file in a writable folder)";
      return nullptr;
    }
    LOG(INFO) << "TENSORVERBS_TRACE: writing recv phases to " << path
              << " (load it in ui.perfetto.dev or chrome://tracing)";
    auto* tracer = new Tracer(file, path);  // lives as long as the process
    std::atexit([] { Get()->Close(); });
    return tracer;
  }

  void AppendLocked(const std::string& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (file_ == nullptr) return;
    if (!first_) buffer_.append(",\n");
    first_ = false;
    buffer_.append(event);
    if (buffer_.size() >= kFlushBytes) FlushLocked();
  }

  void FlushLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (file_ == nullptr || buffer_.empty()) return;
    if (std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size() ||
        std::fflush(file_) != 0) {
      LOG(WARNING) << "TENSORVERBS_TRACE: writing '" << path_
                   << "' failed: " << std::strerror(errno) << "; tracing stops here";
      std::fclose(file_);
      file_ = nullptr;
    }
    buffer_.clear();
  }

  Mutex mu_;
  FILE* file_ ABSL_GUARDED_BY(mu_);
  const std::string path_;
  const int pid_;
  std::string buffer_ ABSL_GUARDED_BY(mu_);
  bool first_ ABSL_GUARDED_BY(mu_) = true;
  std::string tasks_ ABSL_GUARDED_BY(mu_);  // the tasks run here, for the process's name
  absl::flat_hash_map<std::string, uint64_t> tracks_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> next_id_{1};
};

// The tensor name of a rendezvous key "src;incarnation;dst;name;frame:iter", or the key.
absl::string_view TensorName(absl::string_view key) {
  std::vector<absl::string_view> parts = absl::StrSplit(key, ';');
  return parts.size() >= 4 ? parts[3] : key;
}

std::string AsyncEvent(char ph, absl::string_view name, uint64_t id, uint64_t track, int64_t ns) {
  std::string event =
      absl::StrCat(R"({"ph":")", absl::string_view(&ph, 1), R"(","cat":"recv","id":"0x)",
                   absl::Hex(id), R"(","pid":)", Tracer::Get()->pid(), R"(,"tid":)", track,
                   R"(,"ts":)", Micros(ns), R"(,"name":)");
  AppendJsonString(&event, name);
  return event;
}

}  // namespace

bool TraceEnabled() { return Tracer::Get() != nullptr; }

uint64_t TraceTrack(absl::string_view name) {
  Tracer* tracer = Tracer::Get();
  return tracer != nullptr ? tracer->Track(name) : 0;
}

void NameTraceProcess(absl::string_view task_name) {
  if (Tracer* tracer = Tracer::Get()) tracer->NameProcess(task_name);
}

void FlushTrace() {
  if (Tracer* tracer = Tracer::Get()) tracer->Flush();
}

RecvTrace& RecvTrace::operator=(RecvTrace&& other) noexcept {
  if (this != &other) {
    if (active()) End(absl::CancelledError("replaced"), 0);
    id_ = std::exchange(other.id_, 0);
    track_ = other.track_;
    phase_ = other.phase_;
    phase_start_ns_ = other.phase_start_ns_;
    name_ = std::move(other.name_);
  }
  return *this;
}

RecvTrace::~RecvTrace() {
  if (active()) End(absl::CancelledError("the recv was dropped before it ended"), 0);
}

RecvTrace RecvTrace::Begin(uint64_t track, absl::string_view key, int64_t step_id,
                           absl::string_view peer, absl::string_view protocol,
                           const char* first_phase) {
  RecvTrace t;
  Tracer* tracer = Tracer::Get();
  if (tracer == nullptr) return t;
  t.id_ = tracer->NextId();
  t.track_ = track;
  t.name_ = std::string(TensorName(key));
  t.phase_ = first_phase;
  t.phase_start_ns_ = absl::GetCurrentTimeNanos();
  std::string event = AsyncEvent('b', t.name_, t.id_, track, t.phase_start_ns_);
  event.append(R"(,"args":{"key":)");
  AppendJsonString(&event, key);
  absl::StrAppend(&event, R"(,"step":)", step_id, R"(,"peer":)");
  AppendJsonString(&event, peer);
  event.append(R"(,"protocol":)");
  AppendJsonString(&event, protocol);
  event.append("}}");
  tracer->Append(event);
  return t;
}

void RecvTrace::Phase(const char* phase) {
  if (!active() || phase == phase_) return;
  const int64_t now = absl::GetCurrentTimeNanos();
  Tracer* tracer = Tracer::Get();
  if (phase_ != nullptr) {
    std::string events = AsyncEvent('b', phase_, id_, track_, phase_start_ns_);
    events.append("},\n");
    events.append(AsyncEvent('e', phase_, id_, track_, now));
    events.push_back('}');
    tracer->Append(events);
  }
  phase_ = phase;
  phase_start_ns_ = now;
}

void RecvTrace::End(const absl::Status& status, uint64_t bytes) {
  if (!active()) return;
  if (phase_ != nullptr) {
    Phase(nullptr);  // ends the open phase now
  } else {
    phase_start_ns_ = absl::GetCurrentTimeNanos();
  }
  std::string event = AsyncEvent('e', name_, id_, track_, phase_start_ns_);
  event.append(R"(,"args":{"status":)");
  AppendJsonString(&event, status.ok() ? "OK" : absl::StatusCodeToString(status.code()));
  if (!status.ok()) {
    event.append(R"(,"error":)");
    AppendJsonString(&event, status.message());
  }
  absl::StrAppend(&event, R"(,"bytes":)", bytes, "}}");
  Tracer::Get()->Append(event);
  id_ = 0;
}

}  // namespace tensorverbs
