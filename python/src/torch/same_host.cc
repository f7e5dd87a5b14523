#include "python/src/torch/same_host.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "python/src/torch/collective.h"
#include "src/common/shared_memory.h"
#include "src/common/spin.h"
#include "src/common/status_macros.h"
#include "src/common/unix_socket.h"

namespace tensorverbs::torch_backend {
namespace {

constexpr uint64_t kMagic = 0x74767368686f7374;  // "tvshhost"
// Each slot holds this much of a rank's input per turn; a larger tensor goes in several turns.
constexpr size_t kSlotBytes = size_t{4} << 20;
constexpr size_t kPage = 4096;
// A barrier is spun on this long before its waiter sleeps on the segment's futex.
constexpr absl::Duration kMeetSpin = absl::Microseconds(50);
// How often a sleeping waiter looks whether it is still wanted and its peers still live.
constexpr absl::Duration kMeetCheck = absl::Seconds(1);

// The process's pid namespace: a pid published by a rank means something here only if both
// share it.
uint64_t PidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? st.st_ino : 0;
}

// Whether process `pid` has exited: no such process, or one that is only a zombie now (its
// parent has not reaped it yet, as a test harness may not until the others are done).
bool ProcessGone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) S ...": the name may hold spaces and parentheses, so the state follows the last
  // ')'.
  const char* end = std::strrchr(buf, ')');
  return end != nullptr && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word lives in memory other processes map.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

sockaddr_un AbstractAddress(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  std::memcpy(addr.sun_path + 1, name.data(), n);  // sun_path[0] = 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return addr;
}

struct Hello {
  uint64_t magic;
  uint64_t bytes;
};

}  // namespace

struct alignas(64) Cell {
  std::atomic<uint64_t> phase[2];  // the last turn this rank reached each barrier of
  std::atomic<int64_t> pid;
  std::atomic<uint64_t> pid_ns;
  // What the rank's current operation reduces, written before its first arrival in each turn,
  // so that every rank can tell, after the first barrier, that they all reduce the same.
  std::atomic<uint64_t> op_bytes;
  std::atomic<int32_t> op_dtype;
};

struct SameHostGroup::Header {
  uint64_t magic;
  uint64_t ranks;
  uint64_t slot_bytes;
  // Bumped at every arrival; waiters sleep on it.
  alignas(64) std::atomic<uint32_t> futex;
  std::atomic<uint32_t> sleepers;
  Cell cells[kMaxRanks];
};

size_t SameHostGroup::HeaderBytes() { return (sizeof(Header) + kPage - 1) / kPage * kPage; }

SameHostGroup::SameHostGroup(void* base, size_t bytes, int rank, int size, size_t slot_bytes)
    : base_(base),
      bytes_(bytes),
      rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      header_(static_cast<Header*>(base)) {}

SameHostGroup::~SameHostGroup() { munmap(base_, bytes_); }

uint8_t* SameHostGroup::Slot(int rank) const {
  return static_cast<uint8_t*>(base_) + HeaderBytes() + static_cast<size_t>(rank) * slot_bytes_;
}

uint8_t* SameHostGroup::Result() const { return Slot(size_); }

absl::StatusOr<std::unique_ptr<SameHostGroup>> SameHostGroup::Join(
    const Store& store, const std::string& key, int rank, int size,
    std::chrono::milliseconds timeout) {
  if (size < 2 || size > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("a same-host group has 2 to ", kMaxRanks, " ranks, not ", size));
  }
  const size_t bytes = HeaderBytes() + static_cast<size_t>(size + 1) * kSlotBytes;
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  auto unavailable = [rank](const std::string& what) {
    return absl::UnavailableError(
        absl::StrCat("rank ", rank, ": the ranks' shared memory on this host: ", what,
                     " (TENSORVERBS_TORCH_SAME_HOST=0 on every rank keeps to the messages)"));
  };
  int fd = -1;
  if (rank == 0) {
    absl::StatusOr<std::unique_ptr<SharedMemory>> made =
        SharedMemory::Create(bytes, "tensorverbs-torch-same-host");
    if (!made.ok()) return unavailable(std::string(made.status().message()));
    fd = dup((*made)->fd());
    if (fd < 0) return unavailable(absl::StrCat("dup: ", std::strerror(errno)));
    // Only this end's mapping goes with `made`: the group maps its own below, like the others.
    std::random_device random;
    const std::string name =
        absl::StrCat("tensorverbs-torch-", absl::Hex(random(), absl::kZeroPad8),
                     absl::Hex(random(), absl::kZeroPad8));
    const int listener = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    socklen_t len = 0;
    const sockaddr_un addr = AbstractAddress(name, &len);
    if (listener < 0 || bind(listener, reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
        listen(listener, size) != 0) {
      const std::string why = std::strerror(errno);
      if (listener >= 0) close(listener);
      close(fd);
      return unavailable(absl::StrCat("listening on an abstract socket: ", why));
    }
    store.set(key, name);
    absl::Status handed;
    for (int served = 0; served < size - 1 && handed.ok();) {
      pollfd p{listener, POLLIN, 0};
      const int wait_ms =
          static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
      if (poll(&p, 1, wait_ms) <= 0) {
        handed = unavailable(
            absl::StrCat(size - 1 - served, " rank(s) did not come for the segment in time"));
        break;
      }
      const int conn = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      ucred cred{};
      if (!PeerCredentials(conn, &cred) || cred.uid != geteuid()) {
        close(conn);  // not one of ours: only this user's processes may map it
        continue;
      }
      const Hello hello{kMagic, bytes};
      if (SendWithFds(conn, &hello, sizeof(hello), &fd, 1)) ++served;
      close(conn);
    }
    close(listener);
    if (!handed.ok()) {
      close(fd);
      return handed;
    }
  } else {
    absl::StatusOr<std::string> name = store.get(key);
    if (!name.ok()) return unavailable(std::string(name.status().message()));
    socklen_t len = 0;
    const sockaddr_un addr = AbstractAddress(*name, &len);
    int conn = -1;
    while (true) {
      conn = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
      if (conn >= 0 && connect(conn, reinterpret_cast<const sockaddr*>(&addr), len) == 0) break;
      if (conn >= 0) close(conn);
      if (absl::Now() >= deadline) return unavailable("rank 0's socket did not answer in time");
      absl::SleepFor(absl::Milliseconds(10));
    }
    Hello hello{};
    int nfds = 0;
    const ssize_t n = RecvWithFds(conn, &hello, sizeof(hello), &fd, 1, &nfds);
    close(conn);
    if (n != static_cast<ssize_t>(sizeof(hello)) || nfds != 1 || hello.magic != kMagic ||
        hello.bytes != bytes) {
      if (nfds == 1) close(fd);
      return unavailable("rank 0 did not send a segment this rank can use");
    }
    // Mapped only if it can never shrink under this process (a fault past its end would kill
    // it): sealed against shrinking, and as large as agreed.
    struct stat st {};
    const int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes || seals < 0 ||
        (seals & F_SEAL_SHRINK) == 0) {
      close(fd);
      return unavailable("rank 0's segment is not a sealed memfd of the agreed size");
    }
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return unavailable(absl::StrCat("mmap: ", std::strerror(errno)));
  auto group =
      std::unique_ptr<SameHostGroup>(new SameHostGroup(base, bytes, rank, size, kSlotBytes));
  Header* h = group->header_;
  if (rank == 0) {
    h->magic = kMagic;
    h->ranks = static_cast<uint64_t>(size);
    h->slot_bytes = kSlotBytes;
  }
  // A fresh memfd reads as zeros: every barrier starts at turn 0, before the first turn.
  h->cells[rank].pid_ns.store(PidNamespace());
  h->cells[rank].pid.store(getpid());
  return group;
}

absl::Status SameHostGroup::Meet(Collective& c, int which, uint64_t turn) {
  Header* h = header_;
  h->cells[rank_].phase[which].store(turn);
  h->futex.fetch_add(1);
  if (h->sleepers.load() > 0) Futex(&h->futex, FUTEX_WAKE, INT_MAX, nullptr);
  auto missing = [&] {
    for (int r = 0; r < size_; ++r) {
      if (h->cells[r].phase[which].load() < turn) return r;
    }
    return -1;
  };
  const absl::Time spin_end = absl::Now() + (YieldsAreCostly() ? kSpinWhileCostly : kMeetSpin);
  while (missing() >= 0 && absl::Now() < spin_end) SpinYield();
  absl::Time next_check = absl::Now() + kMeetCheck;
  const uint64_t my_ns = h->cells[rank_].pid_ns.load();
  while (true) {
    const uint32_t seen = h->futex.load();
    const int r = missing();
    if (r < 0) return absl::OkStatus();
    h->sleepers.fetch_add(1);
    if (h->futex.load() == seen) {
      const timespec nap{0, 10 * 1000 * 1000};
      Futex(&h->futex, FUTEX_WAIT, seen, &nap);
    }
    h->sleepers.fetch_sub(1);
    if (absl::Now() < next_check) continue;
    next_check = absl::Now() + kMeetCheck;
    const int late = missing();
    if (late < 0) return absl::OkStatus();
    const std::string waited = absl::StrCat("the shared-memory part from ", c.PeerName(late));
    RETURN_IF_ERROR(c.StillWanted(waited));
    const int64_t pid = h->cells[late].pid.load();
    if (pid > 0 && h->cells[late].pid_ns.load() == my_ns && ProcessGone(pid)) {
      return absl::UnavailableError(absl::StrCat(waited, ": its process (pid ", pid, ") is gone"));
    }
  }
}

absl::Status SameHostGroup::Agree(Collective& c, uint64_t bytes, c10::ScalarType dtype) {
  for (int r = 0; r < size_; ++r) {
    const uint64_t theirs = header_->cells[r].op_bytes.load();
    const auto their_dtype = static_cast<c10::ScalarType>(header_->cells[r].op_dtype.load());
    if (theirs != bytes || their_dtype != dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat(c.PeerName(r), " reduces ", theirs, " bytes of ", c10::toString(their_dtype),
                       " where this rank reduces ", bytes, " bytes of ", c10::toString(dtype),
                       ": do all ranks pass tensors of the same shape and dtype?"));
    }
  }
  return absl::OkStatus();
}

void SameHostGroup::Announce(uint64_t bytes, c10::ScalarType dtype) {
  header_->cells[rank_].op_bytes.store(bytes);
  header_->cells[rank_].op_dtype.store(static_cast<int32_t>(dtype));
}

absl::Status SameHostGroup::Allreduce(Collective& c, void* data, int64_t count,
                                      c10::ScalarType dtype, RedOp op) {
  const size_t es = c10::elementSize(dtype);
  const uint64_t total = static_cast<uint64_t>(count) * es;
  const int64_t per_turn = static_cast<int64_t>(slot_bytes_ / es);
  char* bytes = static_cast<char*>(data);
  for (int64_t off = 0; off < count; off += per_turn) {
    const int64_t n = std::min(per_turn, count - off);
    const uint64_t turn = next_turn_++;
    std::memcpy(Slot(rank_), bytes + off * es, static_cast<size_t>(n) * es);
    Announce(total, dtype);
    RETURN_IF_ERROR(Meet(c, 0, turn));
    RETURN_IF_ERROR(Agree(c, total, dtype));
    // This rank's share of the turn's elements, reduced out of every rank's slot in rank order
    // (every element's sum is taken in the same order, whichever rank takes it).
    const int64_t lo = n * rank_ / size_, hi = n * (rank_ + 1) / size_;
    if (hi > lo) {
      uint8_t* acc = Result() + lo * es;
      std::memcpy(acc, Slot(0) + lo * es, static_cast<size_t>(hi - lo) * es);
      for (int k = 1; k < size_; ++k) ReduceInto(dtype, op, acc, Slot(k) + lo * es, hi - lo);
      if (op == RedOp::AVG) DivideBy(dtype, acc, hi - lo, size_);
    }
    RETURN_IF_ERROR(Meet(c, 1, turn));
    RETURN_IF_ERROR(c.WriteOut(bytes + off * es, Result(), static_cast<size_t>(n) * es));
  }
  return absl::OkStatus();
}

absl::Status SameHostGroup::ReduceScatter(Collective& c, const void* const* ins, void* out,
                                          int64_t count, c10::ScalarType dtype, RedOp op) {
  const size_t es = c10::elementSize(dtype);
  const uint64_t total = static_cast<uint64_t>(count) * es;
  // Each turn carries a piece of every rank's block in the slot, one after the other.
  const int64_t per_turn = static_cast<int64_t>(slot_bytes_ / es / static_cast<size_t>(size_));
  char* dst = static_cast<char*>(out);
  for (int64_t off = 0; off < count; off += per_turn) {
    const int64_t n = std::min(per_turn, count - off);
    const size_t piece = static_cast<size_t>(n) * es;
    const uint64_t turn = next_turn_++;
    for (int i = 0; i < size_; ++i) {
      std::memcpy(Slot(rank_) + i * piece, static_cast<const char*>(ins[i]) + off * es, piece);
    }
    Announce(total, dtype);
    RETURN_IF_ERROR(Meet(c, 0, turn));
    RETURN_IF_ERROR(Agree(c, total, dtype));
    RETURN_IF_ERROR(c.WriteOut(dst + off * es, Slot(0) + rank_ * piece, piece));
    for (int k = 1; k < size_; ++k) {
      RETURN_IF_ERROR(c.ReduceOut(dtype, op, dst + off * es, Slot(k) + rank_ * piece, n));
    }
    if (op == RedOp::AVG) RETURN_IF_ERROR(c.DivideOut(dtype, dst + off * es, n, size_));
    RETURN_IF_ERROR(Meet(c, 1, turn));
  }
  return absl::OkStatus();
}

absl::Status SameHostGroup::Broadcast(Collective& c, void* data, size_t bytes, int root) {
  char* buf = static_cast<char*>(data);
  for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += slot_bytes_) {
    const size_t n = std::min(slot_bytes_, bytes - off);
    const uint64_t turn = next_turn_++;
    if (rank_ == root) std::memcpy(Slot(root), buf + off, n);
    Announce(bytes, c10::kByte);
    RETURN_IF_ERROR(Meet(c, 0, turn));
    RETURN_IF_ERROR(Agree(c, bytes, c10::kByte));
    if (rank_ != root) RETURN_IF_ERROR(c.WriteOut(buf + off, Slot(root), n));
    RETURN_IF_ERROR(Meet(c, 1, turn));
    if (bytes == 0) break;
  }
  return absl::OkStatus();
}

absl::Status SameHostGroup::Allgather(Collective& c, const void* in, void* const* outs,
                                      size_t bytes) {
  const char* src = static_cast<const char*>(in);
  for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += slot_bytes_) {
    const size_t n = std::min(slot_bytes_, bytes - off);
    const uint64_t turn = next_turn_++;
    std::memcpy(Slot(rank_), src + off, n);
    Announce(bytes, c10::kByte);
    RETURN_IF_ERROR(Meet(c, 0, turn));
    RETURN_IF_ERROR(Agree(c, bytes, c10::kByte));
    for (int r = 0; r < size_; ++r) {
      RETURN_IF_ERROR(c.WriteOut(static_cast<char*>(outs[r]) + off, Slot(r), n));
    }
    RETURN_IF_ERROR(Meet(c, 1, turn));
    if (bytes == 0) break;
  }
  return absl::OkStatus();
}

absl::Status SameHostGroup::Barrier(Collective& c) {
  const uint64_t turn = next_turn_++;
  Announce(0, c10::kByte);
  RETURN_IF_ERROR(Meet(c, 0, turn));
  return Meet(c, 1, turn);
}

}  // namespace tensorverbs::torch_backend
