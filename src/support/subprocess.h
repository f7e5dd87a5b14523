// Subprocess: a child process whose stdout is read line by line under a timeout and whose stdin
// is a pipe. Used by the tools that run peers (bench) and by the multi-process tests. The
// destructor kills (SIGKILL) and reaps a child that is still running. One thread at a time.
#ifndef TENSORVERBS_SUPPORT_SUBPROCESS_H_
#define TENSORVERBS_SUPPORT_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tensorverbs::support {

class Subprocess {
 public:
  // Starts `path` with `args`; stdout is captured, stdin is a pipe, stderr is inherited.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const std::string& path,
                                                           const std::vector<std::string>& args);
  ~Subprocess();

  // The next stdout line, or DeadlineExceeded / OutOfRange (EOF).
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  // Reads lines until one starts with `prefix`; returns it.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix, absl::Duration timeout);
  // Everything written to stdout until EOF (or timeout).
  std::string ReadAll(absl::Duration timeout);

  void Signal(int sig);
  // Exit code (128+signal if killed), or DeadlineExceeded. Once reaped, the same code again at
  // once.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  pid_t pid() const { return pid_; }
  // The write end of the child's stdin.
  int stdin_fd() const { return stdin_fd_; }

 private:
  Subprocess(pid_t pid, int stdout_fd, int stdin_fd)
      : pid_(pid), stdout_fd_(stdout_fd), stdin_fd_(stdin_fd) {}
  pid_t pid_;
  int stdout_fd_;
  int stdin_fd_;
  bool reaped_ = false;
  int exit_code_ = 0;  // once reaped_
  std::string buffer_;
};

// Writes `line` and a newline to the child's stdin.
bool WriteLine(Subprocess& child, const std::string& line);

}  // namespace tensorverbs::support

#endif  // TENSORVERBS_SUPPORT_SUBPROCESS_H_
