// The tensor types of NumPy arrays: the DataType an array's dtype is sent as, and the NumPy
// dtype a received tensor is viewed as.
//
// Called by Task (send, empty), Step (recv_into) and the pool views (a received tensor's
// array, a DeviceTensor's dtype), on the caller's thread with the GIL held. A dtype with no
// counterpart raises (tensorverbs' InvalidArgumentError) rather than guess.
#ifndef TENSORVERBS_PYTHON_DTYPES_H_
#define TENSORVERBS_PYTHON_DTYPES_H_

#include <pybind11/numpy.h>

#include "tensorverbs/types.h"

namespace tensorverbs::python {

// The tensor type of arrays of `dtype`, or raises for a kind or size tensors lack.
DataType DataTypeOf(const pybind11::dtype& dtype);

// NumPy's dtype for `dtype`, made once per type: parsing a dtype's name costs about a
// microsecond, a noticeable share of a small tensor's recv. With the GIL.
pybind11::dtype NumpyDtypeOf(DataType dtype);

}  // namespace tensorverbs::python

#endif  // TENSORVERBS_PYTHON_DTYPES_H_
