// _tensorverbs_torch: the Python face of the torch.distributed backend. tensorverbs/torch.py
// registers create_process_group with torch.distributed.Backend; stats() reads a group's
// counters. Both release the GIL while they run C++ that may wait.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <stdexcept>

#include "absl/strings/strip.h"
#include "python/src/torch/process_group.h"
#include "tensorverbs/version.h"

namespace py = pybind11;
using tensorverbs::torch_backend::ProcessGroupTensorVerbs;

PYBIND11_MODULE(_tensorverbs_torch, m) {
  // torch registers ProcessGroup and Store with pybind11 here; this module's signatures use them.
  py::module::import("torch.distributed");
  m.attr("__version__") = tensorverbs::Version();
  m.def(
      "create_process_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         std::chrono::milliseconds timeout) -> c10::intrusive_ptr<c10d::ProcessGroup> {
        return ProcessGroupTensorVerbs::Create(store, rank, size, timeout);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>(),
      "The tensorverbs process group of `rank` in a group of `size`, meeting its peers through "
      "`store` (torch.distributed's creator signature).");
  m.def(
      "drain_all",
      [](std::chrono::milliseconds limit) { tensorverbs::torch_backend::DrainAllGroups(limit); },
      py::arg("limit"), py::call_guard<py::gil_scoped_release>(),
      "Waits until every tensorverbs group's peers took what it sent (at most `limit` each).");
  m.def(
      "stats",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        auto* tv = dynamic_cast<ProcessGroupTensorVerbs*>(group.get());
        if (tv == nullptr) {
          throw std::invalid_argument("tensorverbs.torch.stats: the group's backend is " +
                                      group->getBackendName() + ", not tensorverbs");
        }
        py::dict d;
        d["protocol"] = tv->protocol();
        // The catalog's names without their scope's prefix: torch_staged_copies is
        // staged_copies here.
        constexpr absl::string_view kPrefix = "torch_";
        for (const auto& [name, value] : tv->stats()) {
          const absl::string_view key = absl::StripPrefix(name, kPrefix);
          d[py::str(key.data(), key.size())] = value;
        }
        return d;
      },
      py::arg("group"), "A tensorverbs group's counters: copies made, collectives run and failed.");
}
