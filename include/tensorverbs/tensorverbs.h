// tensorverbs: TensorFlow's grpc+verbs tensor transport as a library. Include this header and
// link tensorverbs::tensorverbs (CMake) or `pkg-config --libs tensorverbs`; start with Task in
// task.h. Everything under include/tensorverbs/ is the public API; nothing else is installed.
#ifndef TENSORVERBS_PUBLIC_TENSORVERBS_H_
#define TENSORVERBS_PUBLIC_TENSORVERBS_H_

#include "tensorverbs/allocator.h"     // IWYU pragma: export
#include "tensorverbs/cluster_spec.h"  // IWYU pragma: export
#include "tensorverbs/device_name.h"   // IWYU pragma: export
#include "tensorverbs/parsed_key.h"    // IWYU pragma: export
#include "tensorverbs/placement.h"     // IWYU pragma: export
#include "tensorverbs/task.h"          // IWYU pragma: export
#include "tensorverbs/tensor.h"        // IWYU pragma: export
#include "tensorverbs/tensor_shape.h"  // IWYU pragma: export
#include "tensorverbs/types.h"         // IWYU pragma: export
#include "tensorverbs/version.h"       // IWYU pragma: export

#endif  // TENSORVERBS_PUBLIC_TENSORVERBS_H_
