#include "python/src/binding_util.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tensorverbs/event.h"
#include "tensorverbs/task.h"

namespace py = pybind11;

namespace tensorverbs::python {

py::object ErrorOf(const absl::Status& status) {
  return py::module_::import("tensorverbs._errors")
      .attr("error_from_status")(static_cast<int>(status.code()), std::string(status.message()));
}

[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = ErrorOf(status);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

void OkOrRaise(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

absl::Duration Seconds(double seconds) {
  if (seconds < 0) throw py::value_error("a timeout must not be negative");
  if (seconds > 1e9) return absl::InfiniteDuration();
  return absl::Seconds(seconds);
}

absl::Time DeadlineAfter(const std::optional<double>& timeout) {
  return timeout.has_value() ? absl::Now() + Seconds(*timeout) : absl::InfiniteFuture();
}

bool WaitWithoutGil(Task& task, Event& event, absl::Time deadline) {
  while (true) {
    bool notified;
    {
      py::gil_scoped_release nogil;
      notified = task.Wait(event, std::min(deadline, absl::Now() + absl::Milliseconds(50)));
    }
    if (notified) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (absl::Now() >= deadline) return false;
  }
}

HeldObject::~HeldObject() {
  if (!object_) return;
  if (!Py_IsInitialized() || _Py_IsFinalizing()) {
    object_.release();  // the interpreter is going: nothing may touch it now
    return;
  }
  py::gil_scoped_acquire gil;
  object_ = py::object();
}

}  // namespace tensorverbs::python
