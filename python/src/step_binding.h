// Step: one step of a Task as Python's tensorverbs.Step holds it, and the recv paths whole. A
// blocking recv, a recv into the caller's array, a batch of recvs and recv_async's RecvFuture
// are started, waited for and converted here, so a received tensor costs no Python frame, no
// Python future and no GIL hand-over between threads.
//
// Made and called by Python on the caller's thread with the GIL held; it shares its Task
// (shared_ptr), which outlives it. Every call that may wait (ending the step, the recvs, send)
// releases the GIL while it is in the task, because a RecvFuture's done-callbacks run on the
// task's callback threads with the GIL. The recv callbacks it gives the task run without the
// GIL: they store the tensor and wake the waiter, which converts it. A reference the task takes
// on a recv_into's `out` is given back through the interpreter's pending calls, so a progress
// thread never waits for the GIL.
#ifndef TENSORVERBS_PYTHON_STEP_BINDING_H_
#define TENSORVERBS_PYTHON_STEP_BINDING_H_

#include <pybind11/pybind11.h>

namespace tensorverbs::python {

// Registers Step with `m`; Task and RecvFuture must be registered first, as its signatures
// name them.
void BindStep(pybind11::module_& m);

}  // namespace tensorverbs::python

#endif  // TENSORVERBS_PYTHON_STEP_BINDING_H_
