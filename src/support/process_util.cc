#include "src/support/process_util.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/config.h"

namespace tensorverbs::support {

namespace {

// Entries of a /proc directory, without "." and "..".
int CountEntries(const char* path) {
  DIR* dir = opendir(path);
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

}  // namespace

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

int64_t ProportionalBytes() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string key;
  while (rollup >> key) {
    if (key == "Pss:") {
      int64_t kib = 0;
      rollup >> kib;
      return kib * 1024;
    }
    std::string rest;
    std::getline(rollup, rest);
  }
  return -1;
}

int OpenDescriptors() { return CountEntries("/proc/self/fd"); }

int ThreadCount() { return CountEntries("/proc/self/task"); }

absl::StatusOr<std::string> SelfExecutable() {
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0)
    return absl::InternalError(absl::StrCat("readlink /proc/self/exe: ", std::strerror(errno)));
  return std::string(exe, static_cast<size_t>(n));
}

namespace {

// Forks and runs `exe` (a path) with `args`; the child gets SIGTERM if the parent dies.
absl::StatusOr<pid_t> Spawn(std::string exe_path, const std::vector<std::string>& args) {
  char* exe = exe_path.data();
  std::vector<char*> argv;
  argv.push_back(exe);
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(exe, argv.data());
    _exit(127);
  }
  return pid;
}

}  // namespace

absl::StatusOr<pid_t> SpawnSelf(const std::vector<std::string>& args) {
  absl::StatusOr<std::string> self = SelfExecutable();
  if (!self.ok()) return self.status();
  return Spawn(*std::move(self), args);
}

absl::StatusOr<std::string> FindOnPath(const std::string& program) {
  auto runnable = [](const std::string& file) {
    struct stat st;
    return stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(file.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {  // a path, as the shell takes it
    if (runnable(program)) return program;
    return absl::NotFoundError(absl::StrCat("'", program, "' is not an executable file"));
  }
  const std::map<std::string, std::string> env = EnvironmentVariables({"PATH"});
  const auto path = env.find("PATH");
  const std::string dirs = path != env.end() ? path->second : "/usr/local/bin:/usr/bin:/bin";
  for (absl::string_view dir : absl::StrSplit(dirs, ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", program);
    if (runnable(candidate)) return candidate;
  }
  return absl::NotFoundError(absl::StrCat("'", program, "' is not on PATH (", dirs, ")"));
}

absl::StatusOr<pid_t> SpawnProgram(const std::string& program,
                                   const std::vector<std::string>& args) {
  absl::StatusOr<std::string> path = FindOnPath(program);
  if (!path.ok()) return path.status();
  return Spawn(*std::move(path), args);
}

absl::StatusOr<ChildExit> WaitAnyChild(const std::vector<pid_t>& pids, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    for (pid_t pid : pids) {
      int status = 0;
      pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        ChildExit e;
        e.pid = pid;
        if (WIFSIGNALED(status)) {
          e.signaled = true;
          e.signal = WTERMSIG(status);
        } else {
          e.exit_code = WEXITSTATUS(status);
        }
        return e;
      }
    }
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("no child exited in time");
    absl::SleepFor(absl::Milliseconds(10));
  }
}

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForTerminationSignal(absl::Duration timeout) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  if (timeout == absl::InfiniteDuration()) {
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    return sig;
  }
  timespec ts = absl::ToTimespec(timeout);
  int sig = sigtimedwait(&set, nullptr, &ts);
  return sig > 0 ? sig : 0;
}

std::vector<std::string> EntriesStartingWith(const char* dir, absl::string_view prefix) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir)) {
    while (dirent* e = readdir(d)) {
      if (absl::StartsWith(e->d_name, prefix)) names.push_back(e->d_name);
    }
    closedir(d);
  }
  return names;
}

std::vector<std::string> ShmRegionsOf(pid_t pid) {
  return EntriesStartingWith("/dev/shm", absl::StrCat(pid, ":"));
}

void UnlinkShmRegionsOf(pid_t pid) {
  for (const std::string& name : ShmRegionsOf(pid)) shm_unlink(name.c_str());
}

}  // namespace tensorverbs::support
