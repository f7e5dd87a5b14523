// Recv tracing: TENSORVERBS_TRACE=FILE writes a Chrome trace-event JSON file (the format
// chrome://tracing and ui.perfetto.dev load) of every remote recv's phases, one track per
// channel, so a user can see where a step's time went: queued, waiting for meta-data, waiting
// for content, delivering to the callback.
//
// Each recv is one async slice (ph "b"/"e", category "recv", a process-unique id) named by its
// rendezvous key's tensor name, with args naming the key, step, peer and protocol at its start
// and the status and bytes at its end; its phases are nested async slices with the same id, one
// after the other. "%p" in the file name becomes the process id, so every task of a cluster
// started with one setting writes a file of its own.
//
// Who calls it: the transports, where a recv's phases change (grpc+verbs' RdmaTensorRequest on
// the progress thread, the gRPC rendezvous on gRPC's and the executor's threads). RecvTrace is
// a value its owner moves along with the recv; when tracing is off it is empty and every call
// is one predictable branch. The writer is process-wide: events are appended under a mutex to
// a buffer that is written out when it grows, when a Server stops (FlushTrace) and at exit, when
// the array is closed so the file is valid JSON (a file cut short by a crash still loads in
// the trace viewers, which accept an unterminated array). A file that cannot be opened logs one
// warning naming the variable and turns tracing off.
#ifndef TENSORVERBS_COMMON_TRACE_H_
#define TENSORVERBS_COMMON_TRACE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

// Whether TENSORVERBS_TRACE names a file that could be opened (decided once per process).
bool TraceEnabled();

// A track of the trace (a "thread" of the viewer): one per channel, named once, such as
// "/job:ps/replica:0/task:0 <- /job:worker/replica:0/task:1 (grpc+verbs channel 3)". The same
// name gives the same track. 0 when tracing is off.
uint64_t TraceTrack(absl::string_view name);

// Names this process in the trace after the tasks it runs (Server::Start).
void NameTraceProcess(absl::string_view task_name);

// Writes buffered events to the file (any thread).
void FlushTrace();

class RecvTrace {
 public:
  RecvTrace() = default;
  RecvTrace(RecvTrace&& other) noexcept { *this = std::move(other); }
  RecvTrace& operator=(RecvTrace&& other) noexcept;
  RecvTrace(const RecvTrace&) = delete;
  RecvTrace& operator=(const RecvTrace&) = delete;
  ~RecvTrace();  // ends an unended recv as "abandoned"

  // Starts a recv's slice on `track` with `first_phase` open, or an empty trace when tracing is
  // off.
  static RecvTrace Begin(uint64_t track, absl::string_view key, int64_t step_id,
                         absl::string_view peer, absl::string_view protocol,
                         const char* first_phase);

  bool active() const { return id_ != 0; }
  // Ends the open phase and opens `phase` (a string literal). Repeating the open phase does
  // nothing.
  void Phase(const char* phase);
  // Ends the open phase and the recv's slice.
  void End(const absl::Status& status, uint64_t bytes);

 private:
  uint64_t id_ = 0;
  uint64_t track_ = 0;
  const char* phase_ = nullptr;
  int64_t phase_start_ns_ = 0;
  std::string name_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_TRACE_H_
