// The project's version, from the one place it is set: `project(tensorverbs VERSION ...)` in
// the top-level CMakeLists.txt, which compiles it into version.cc. Semantic versioning: the
// major number changes when the wire protocol or the public API breaks. Any thread.
#ifndef TENSORVERBS_PUBLIC_VERSION_H_
#define TENSORVERBS_PUBLIC_VERSION_H_

namespace tensorverbs {

// "MAJOR.MINOR.PATCH".
const char* Version();

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_VERSION_H_
