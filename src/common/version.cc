#include "tensorverbs/version.h"

#ifndef TENSORVERBS_VERSION
#error "TENSORVERBS_VERSION is defined by src/common/CMakeLists.txt from the project's version"
#endif

namespace tensorverbs {

const char* Version() { return TENSORVERBS_VERSION; }

}  // namespace tensorverbs
