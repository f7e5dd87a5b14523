// ScopedTempDir: a directory of the test's own, removed with everything in it when the test
// ends. Tests that write files (a tool's --json or --plot output, say) write them here, never to
// a fixed path: two test runs on one machine (two checkouts, two CI jobs, ctest -j) would
// otherwise overwrite and delete each other's files.
#ifndef TENSORVERBS_TESTS_SUPPORT_TEMP_DIR_H_
#define TENSORVERBS_TESTS_SUPPORT_TEMP_DIR_H_

#include <gtest/gtest.h>
#include <stdlib.h>  // mkdtemp

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace tensorverbs::testing {

class ScopedTempDir {
 public:
  // Under $TEST_TMPDIR where the test runner sets one (GoogleTest's TempDir()), else under
  // $TMPDIR (or /tmp). A test that cannot have its own directory must not write anywhere else,
  // so failing to create one aborts.
  ScopedTempDir() {
    const char* test_tmpdir = getenv("TEST_TMPDIR");
    const std::filesystem::path base = test_tmpdir != nullptr && *test_tmpdir != '\0'
                                           ? std::filesystem::path(::testing::TempDir())
                                           : std::filesystem::temp_directory_path();
    std::string name = (base / "tensorverbs-test-XXXXXX").string();
    if (mkdtemp(name.data()) == nullptr) {
      std::fprintf(stderr, "mkdtemp %s: %s\n", name.c_str(), std::strerror(errno));
      std::abort();
    }
    path_ = name;
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
  ~ScopedTempDir() {
    std::error_code error;
    std::filesystem::remove_all(path_, error);
    EXPECT_FALSE(error) << "removing " << path_ << ": " << error.message();
  }

  const std::string& path() const { return path_; }
  // `name` inside the directory.
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_TEMP_DIR_H_
