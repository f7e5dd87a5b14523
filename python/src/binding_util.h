// What every object of _tensorverbs shares: tensorverbs' errors raised as the exceptions of
// tensorverbs._errors, timeouts in seconds, the wait that lets the GIL and Ctrl-C through, and
// a Python object that C++ may let go of on a thread without the GIL.
//
// Called by the module's objects (Task, Step, RecvFuture, the pool views) on the caller's
// thread with the GIL held, except where a declaration says otherwise. A wait in the task
// releases the GIL, because a RecvFuture's done-callbacks run on the task's callback threads
// with the GIL, and a caller holding it while the task waits for them would deadlock.
#ifndef TENSORVERBS_PYTHON_BINDING_UTIL_H_
#define TENSORVERBS_PYTHON_BINDING_UTIL_H_

#include <pybind11/pybind11.h>

#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tensorverbs/event.h"
#include "tensorverbs/task.h"

namespace tensorverbs::python {

// The Python exception tensorverbs._errors maps `status` to (its code and message).
pybind11::object ErrorOf(const absl::Status& status);

// Raises ErrorOf(status) as the pending Python exception.
[[noreturn]] void Raise(const absl::Status& status);

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

void OkOrRaise(const absl::Status& status);

// A timeout given in seconds; ValueError if negative, no limit past 1e9 s.
absl::Duration Seconds(double seconds);

// When a wait of `timeout` seconds (None: no limit) started now ends.
absl::Time DeadlineAfter(const std::optional<double>& timeout);

// Waits, without the GIL, until `event` is notified or `deadline` passes; returns whether it
// was. Meanwhile the thread drives `task`'s progress (Task::Wait), so the recvs it waits for
// complete on it. Every 50 ms it lets progress go and takes the GIL to let signals through:
// Ctrl-C raises KeyboardInterrupt here (the recvs it waits for stay asked for, and another
// thread drives the task from then on).
bool WaitWithoutGil(Task& task, Event& event, absl::Time deadline);

// A Python object held by C++ code that may drop it on a thread without the GIL.
class HeldObject {
 public:
  explicit HeldObject(pybind11::object object) : object_(std::move(object)) {}
  HeldObject(const HeldObject&) = delete;
  HeldObject& operator=(const HeldObject&) = delete;
  ~HeldObject();
  // With the GIL held.
  const pybind11::object& get() const { return object_; }
  void Reset() { object_ = pybind11::object(); }

 private:
  pybind11::object object_;
};

}  // namespace tensorverbs::python

#endif  // TENSORVERBS_PYTHON_BINDING_UTIL_H_
