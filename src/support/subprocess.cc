#include "src/support/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/support/process_util.h"

namespace tensorverbs::support {

bool WriteLine(Subprocess& child, const std::string& line) {
  std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(child.stdin_fd(), data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(
    const std::string& path, const std::vector<std::string>& args) {
  int fds[2], in[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(std::strerror(errno));
  if (pipe2(in, O_CLOEXEC) != 0) {
    const int err = errno;
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(std::strerror(err));
  }
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(path.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    for (int fd : {fds[0], fds[1], in[0], in[1]}) close(fd);
    return absl::InternalError(std::strerror(err));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(fds[1], STDOUT_FILENO);
    dup2(in[0], STDIN_FILENO);
    execv(path.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  close(in[0]);
  return std::unique_ptr<Subprocess>(new Subprocess(pid, fds[0], in[1]));
}

Subprocess::~Subprocess() {
  if (!reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    // A tensorverbs child killed before it closed its endpoints leaves libfabric shm regions.
    UnlinkShmRegionsOf(pid_);
  }
  close(stdout_fd_);
  close(stdin_fd_);
}

absl::StatusOr<std::string> Subprocess::ReadLine(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("no line in time");
    pollfd p{stdout_fd_, POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[4096];
    ssize_t n = read(stdout_fd_, buf, sizeof(buf));
    if (n <= 0) return absl::OutOfRangeError(absl::StrCat("EOF; partial: ", buffer_));
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

absl::StatusOr<std::string> Subprocess::WaitForLine(const std::string& prefix,
                                                    absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<std::string> line = ReadLine(deadline - absl::Now());
    if (!line.ok()) return line.status();
    if (absl::StartsWith(*line, prefix)) return line;
  }
}

std::string Subprocess::ReadAll(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  std::string out;
  while (true) {
    absl::StatusOr<std::string> line = ReadLine(deadline - absl::Now());
    if (!line.ok()) {
      out += buffer_;
      buffer_.clear();
      return out;
    }
    out += *line + "\n";
  }
}

void Subprocess::Signal(int sig) {
  if (!reaped_) kill(pid_, sig);
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  // A second wait would find no child (ECHILD) and, before this, spun out its whole timeout.
  if (reaped_) return exit_code_;
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      exit_code_ = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      return exit_code_;
    }
    if (r < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("waiting for child ", pid_, ": ", strerror(errno)));
    }
    if (absl::Now() > deadline) return absl::DeadlineExceededError("child still running");
    absl::SleepFor(absl::Milliseconds(5));
  }
}

}  // namespace tensorverbs::support
