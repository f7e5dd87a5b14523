// _tensorverbs: the C++ half of the `tensorverbs` Python package (python/tensorverbs/), over the
// public API of include/tensorverbs/ only.
//
// It exposes Task and Step as thin objects, the conversions between tensors and NumPy arrays,
// and the recv paths whole: a blocking recv, a batch of recvs and a RecvFuture are waited for
// and converted here, so a received tensor costs no Python frame, no Python future and no
// GIL hand-over between threads. The Python half adds context managers, asyncio and the
// exception classes. Received tensors become arrays without a copy: the array's base is a
// capsule that owns a Tensor, so the pooled buffer lives as long as any array viewing it, and
// while it does the buffer is found by address (PoolViews), so a PyTorch tensor viewing it is
// sent as the pool tensor it is. Arrays made by Task.empty() are pool tensors too and are sent
// as they are; any other array is staged once into the pool.
//
// Threads: every call that may wait (start, wait_for_peers, stop, ending a step, the recvs,
// send) releases the GIL while it is in the task, because a RecvFuture's Python done-callbacks
// run on the task's callback threads with the GIL, and a caller holding it while the task
// waits for them would deadlock. Without done-callbacks a completion takes no GIL at all: it
// stores the tensor and wakes the waiter, which converts it. Waits wake every 50 ms to let
// Ctrl-C (KeyboardInterrupt) through. Python objects held by C++ are released with the GIL
// held, or leaked if the interpreter is already finalizing.
//
// One file per object: binding_util (errors, timeouts, waits), dtypes, pool_views (arrays,
// DeviceTensor, the view table), task_binding (Task), futures (RecvFuture) and step_binding
// (Step); this file registers them, in the order their signatures name one another.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "absl/status/statusor.h"
#include "python/src/binding_util.h"
#include "python/src/futures.h"
#include "python/src/pool_views.h"
#include "python/src/step_binding.h"
#include "python/src/task_binding.h"
#include "tensorverbs/cluster_spec.h"
#include "tensorverbs/placement.h"
#include "tensorverbs/task.h"
#include "tensorverbs/version.h"

namespace py = pybind11;
namespace tvp = tensorverbs::python;

PYBIND11_MODULE(_tensorverbs, m) {
  m.doc() = "tensorverbs' C++ core; use the tensorverbs package";
  m.attr("__version__") = tensorverbs::Version();
  m.def("available_protocols", &tensorverbs::AvailableProtocols);
  m.def("tensor_buffer", &tvp::TensorBufferOf, py::arg("array"));
  m.def(
      "placement_from_environment",
      [](const std::string& source) {
        absl::StatusOr<tensorverbs::TaskPlacement> p =
            tensorverbs::PlacementFromEnvironment(source);
        if (!p.ok()) tvp::Raise(p.status());
        return py::make_tuple(p->cluster.ToString(), p->job, p->task);
      },
      py::arg("source"));
  m.def(
      "pick_free_ports",
      [](int count, const std::string& host) {
        return tvp::ValueOrRaise(tensorverbs::PickFreePorts(count, host));
      },
      py::arg("count"), py::arg("host"));
  m.def(
      "parse_cluster",
      [](const std::string& spec) {
        return tvp::ValueOrRaise(tensorverbs::ClusterSpec::Parse(spec)).ToString();
      },
      py::arg("spec"));

  tvp::BindTask(m);
  tvp::BindPoolViews(m);
  tvp::BindFutures(m);
  tvp::BindStep(m);
}
