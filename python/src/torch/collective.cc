#include "python/src/torch/collective.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/torch/process_group.h"
#include "python/src/torch/same_host.h"
#include "python/src/torch/work.h"
#include "src/common/status_macros.h"

namespace tensorverbs::torch_backend {
namespace {

// Collectives of at least this many bytes (and elements for every rank) take a ring, whose
// bytes per rank stay near 2x the tensor whatever the group's size; smaller ones take binomial
// trees, whose log2(size) rounds cost less latency.
constexpr size_t kRingBytes = 64 * 1024;
// The most bytes of one ring message (see RingAllreduce).
constexpr size_t kSegmentBytes = 512 * 1024;

int LowestBit(int v) { return v & -v; }

}  // namespace

RecvOptions ExpectBytes(size_t bytes) {
  // Every message is a uint8 vector; saying its size spares a meta-data round trip per message
  // (each name is new, so the transport never has it cached).
  RecvOptions options;
  options.expected_dtype = DataType::kUInt8;
  options.expected_shape = TensorShape::Of({static_cast<int64_t>(bytes)});
  return options;
}

Collective::Collective(ProcessGroupTensorVerbs& group, TvWork& work, int64_t seq,
                       absl::Time deadline)
    : group_(group), work_(work), seq_(seq), deadline_(deadline) {}

int Collective::rank() const { return group_.getRank(); }
int Collective::size() const { return group_.getSize(); }

std::string Collective::NameOf(int src, int dst, int part) const {
  return absl::StrCat("c", seq_, "/", part, "/", src, ">", dst);
}

uint8_t* Collective::Scratch(size_t bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  uint8_t* data = t.data_ptr<uint8_t>();
  work_.Keep(std::move(t));
  return data;
}

absl::StatusOr<Tensor> Collective::Stage(const void* data, size_t bytes) {
  return group_.Stage(data, bytes);
}

absl::Status Collective::Send(int dst, int part, const void* data, size_t bytes) {
  absl::StatusOr<Tensor> staged = Stage(data, bytes);
  if (!staged.ok()) return staged.status();
  return Forward(dst, part, *staged);
}

absl::Status Collective::Forward(int dst, int part, const Tensor& message) {
  absl::Status s = group_.step_->Send(group_.peer_tasks_[dst], NameOf(rank(), dst, part), message);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("sending part ", part, " to ", group_.PeerName(dst),
                                               ": ", s.message()));
  }
  return s;
}

struct Collective::Pending {
  Event arrived;
  absl::StatusOr<Tensor> result;  // written before `arrived` is notified, read after
  int src = 0;
  int part = 0;
  size_t bytes = 0;
  const void* land_at = nullptr;
};

void Collective::Settle(const std::shared_ptr<LentState>& lent, CollectiveLanding& landing,
                        CollectiveLanding::Event event) {
  if (!landing.Settle(event)) return;
  std::lock_guard<std::mutex> lock(lent->mu);
  if (--lent->landings == 0) lent->cv.notify_all();
}

Collective::PendingRef Collective::Post(int src, int part, size_t bytes, void* land_at) {
  auto pending = std::make_shared<Pending>();
  pending->src = src;
  pending->part = part;
  pending->bytes = bytes;
  pending->land_at = land_at;
  RecvOptions options = ExpectBytes(bytes);
  // The callback only settles, stores and notifies: it runs on whichever thread drives the
  // task's progress, this operation's own thread (in Wait) most often.
  options.quick_callback = true;
  options.waiter_starts = true;  // Wait follows, on this thread
  std::shared_ptr<CollectiveLanding> landing;
  if (land_at != nullptr && group_.lend_from_ > 0 && bytes >= group_.lend_from_) {
    landing = std::make_shared<CollectiveLanding>();
    {
      std::lock_guard<std::mutex> lock(lent_->mu);
      ++lent_->outstanding;
      ++lent_->landings;
    }
    // The release comes on a transport thread (or at once on a refusal), as a lent message's:
    // it settles the landing, counts, and hands its reference to the work (which holds the
    // caller's tensor) to the completer's thread.
    absl::StatusOr<Tensor> into = group_.Adopt(
        land_at, bytes,
        [lent = lent_, landing, completer = group_.completer_,
         work = c10::intrusive_ptr<TvWork>::unsafe_reclaim_from_nonowning(&work_)]() mutable {
          Settle(lent, *landing, CollectiveLanding::Event::kReleased);
          completer->Drop(std::move(work));
          std::lock_guard<std::mutex> lock(lent->mu);
          if (--lent->outstanding == 0) lent->cv.notify_all();
        },
        /*count_as_lent=*/false);
    if (into.ok()) options.into = *std::move(into);
  }
  group_.step_->RecvAsync(group_.peer_tasks_[src], NameOf(src, rank(), part), options,
                          [pending, landing, lent = lent_](absl::StatusOr<Tensor> result) {
                            // Landed: the fabric writes no more into the caller's memory.
                            if (landing != nullptr && result.ok()) {
                              Settle(lent, *landing, CollectiveLanding::Event::kLanded);
                            }
                            pending->result = std::move(result);
                            pending->arrived.Notify();
                          });
  return pending;
}

bool Collective::WaitForLandings(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(lent_->mu);
  return lent_->cv.wait_for(lock, limit, [this] { return lent_->landings == 0; });
}

template <typename Ready, typename What>
absl::Status Collective::AwaitOrFail(std::unique_lock<std::mutex>& lock,
                                     std::condition_variable& cv, Ready ready, What what) {
  while (!ready()) {
    const absl::Time now = absl::Now();
    if (now >= deadline_) {
      return absl::DeadlineExceededError(
          absl::StrCat(what(), " within the group's timeout (the timeout of init_process_group)"));
    }
    // Wakes once a second to see whether the work was abandoned or another rank failed.
    const absl::Time wake = std::min(deadline_, now + absl::Seconds(1));
    if (cv.wait_until(lock, absl::ToChronoTime(wake), ready)) break;
    lock.unlock();
    if (work_.done()) return absl::CancelledError("the operation was abandoned");
    absl::Status peers = group_.AbortFromPeers();
    if (!peers.ok()) return peers;
    lock.lock();
  }
  return absl::OkStatus();
}

SameHostGroup* Collective::same_host() const { return group_.same_host_.get(); }

std::string Collective::PeerName(int rank) const { return group_.PeerName(rank); }

void Collective::CountSameHost() { group_.counters_->Add<Counter::kTorchSameHostCollectives>(); }

absl::Status Collective::StillWanted(const std::string& waiting_for) {
  if (absl::Now() >= deadline_) {
    return absl::DeadlineExceededError(absl::StrCat(
        waiting_for,
        " did not come within the group's timeout (the timeout of init_process_group)"));
  }
  if (work_.done()) return absl::CancelledError("the operation was abandoned");
  return group_.AbortFromPeers();
}

template <typename What>
absl::Status Collective::AwaitArrival(Event& arrived, What what) {
  while (!arrived.HasBeenNotified()) {
    const absl::Time now = absl::Now();
    if (now >= deadline_) {
      return absl::DeadlineExceededError(
          absl::StrCat(what(), " within the group's timeout (the timeout of init_process_group)"));
    }
    // Lets go of the task's progress once a second to see whether the work was abandoned or
    // another rank failed.
    if (group_.task_->Wait(arrived, std::min(deadline_, now + absl::Seconds(1)))) break;
    if (work_.done()) return absl::CancelledError("the operation was abandoned");
    absl::Status peers = group_.AbortFromPeers();
    if (!peers.ok()) return peers;
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Collective::Wait(const PendingRef& pending) {
  auto from = [&] {
    return absl::StrCat("part ", pending->part, " from ", group_.PeerName(pending->src));
  };
  RETURN_IF_ERROR(
      AwaitArrival(pending->arrived, [&] { return absl::StrCat(from(), " did not come"); }));
  if (!pending->result.ok()) {
    const absl::Status& s = pending->result.status();
    // A rank that failed first (a peer of its died) may have ended since, failing this recv
    // with it: its word in the store names the rank that started it.
    absl::Status first = group_.AbortFromPeers();
    if (first.code() == absl::StatusCode::kAborted) {
      return absl::Status(first.code(),
                          absl::StrCat(first.message(), "; then ", from(), ": ", s.message()));
    }
    return absl::Status(s.code(), absl::StrCat(from(), ": ", s.message()));
  }
  if (pending->result->TotalBytes() != pending->bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        from(), " has ", pending->result->TotalBytes(), " bytes where this rank expects ",
        pending->bytes, ": do all ranks pass tensors of the same shape and dtype?"));
  }
  if (pending->land_at != nullptr && pending->result->data() == pending->land_at) {
    group_.counters_->Add<Counter::kTorchInPlaceRecvs>();
    group_.counters_->Add<Counter::kTorchInPlaceBytes>(static_cast<int64_t>(pending->bytes));
  }
  return *std::move(pending->result);
}

absl::StatusOr<Tensor> Collective::Lend(const void* data, size_t bytes) {
  if (group_.lend_from_ == 0 || bytes < group_.lend_from_) return Stage(data, bytes);
  {
    std::lock_guard<std::mutex> lock(lent_->mu);
    ++lent_->outstanding;
  }
  // The release comes on a transport thread (or at once on a refusal): it counts, and hands its
  // reference to the work (the last one, perhaps, and with it the caller's tensor) to the
  // completer's thread.
  return group_.Adopt(
      data, bytes,
      [lent = lent_, completer = group_.completer_,
       work = c10::intrusive_ptr<TvWork>::unsafe_reclaim_from_nonowning(&work_)]() mutable {
        completer->Drop(std::move(work));
        std::lock_guard<std::mutex> lock(lent->mu);
        if (--lent->outstanding == 0) lent->cv.notify_all();
      });
}

absl::Status Collective::WaitForLent() {
  std::unique_lock<std::mutex> lock(lent_->mu);
  return AwaitOrFail(
      lock, lent_->cv, [this] { return lent_->outstanding == 0; },
      [this] {
        return absl::StrCat(lent_->outstanding,
                            " message(s) lent from the caller's tensor were not taken");
      });
}

absl::Status Collective::DivideOut(c10::ScalarType dtype, void* data, int64_t count, int64_t n) {
  if (!work_.Write([&] { DivideBy(dtype, data, count, n); })) {
    return absl::CancelledError("the operation was abandoned");
  }
  return absl::OkStatus();
}

absl::Status Collective::WriteOut(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return absl::OkStatus();
  if (!work_.Write([&] { std::memcpy(dst, src, bytes); })) {
    return absl::CancelledError("the operation was abandoned");
  }
  group_.counters_->Add<Counter::kTorchLandedCopies>();
  group_.counters_->Add<Counter::kTorchLandedBytes>(static_cast<int64_t>(bytes));
  return absl::OkStatus();
}

absl::Status Collective::ReduceOut(c10::ScalarType dtype, RedOp op, void* acc, const void* in,
                                   int64_t count) {
  if (!work_.Write([&] { ReduceInto(dtype, op, acc, in, count); })) {
    return absl::CancelledError("the operation was abandoned");
  }
  return absl::OkStatus();
}

namespace {

// The binomial tree rooted at rank 0 of the relative ranks v = (rank - root) mod size: v's parent
// is v less its lowest set bit; its children are v + m for the powers of two m below that bit.
absl::Status TreeAllreduce(Collective& c, void* data, int64_t count, c10::ScalarType dtype,
                           RedOp op, int part_base) {
  const int n = c.size(), v = c.rank();
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
  ASSIGN_OR_RETURN(Tensor acc, c.Stage(data, bytes));
  const int low = v == 0 ? 1 << 30 : LowestBit(v);
  for (int m = 1; m < low && v + m < n; m <<= 1) {
    ASSIGN_OR_RETURN(Tensor child, c.Recv(v + m, part_base, bytes));
    ReduceInto(dtype, op, acc.data(), child.data(), count);
  }
  if (v != 0) {
    RETURN_IF_ERROR(c.Forward(v - low, part_base, acc));
    ASSIGN_OR_RETURN(Tensor result, c.Recv(v - low, part_base + 1, bytes));
    acc = std::move(result);
  } else if (op == RedOp::AVG) {
    DivideBy(dtype, acc.data(), count, n);
  }
  int top = 1;
  while (top < low && top < n) top <<= 1;
  for (int m = top >> 1; m >= 1; m >>= 1) {
    if (m < low && v + m < n) RETURN_IF_ERROR(c.Forward(v + m, part_base + 1, acc));
  }
  return c.WriteOut(data, acc.data(), bytes);
}

// Reduce-scatter then allgather around the ring; chunk i (count/n elements, the first count%n
// one more) ends reduced on rank i-1. Each chunk travels as segments of at most kSegmentBytes,
// every segment of a step asked for at once, so that a rank reduces and passes on one segment
// while the next is still being written: the ring is a pipeline, and a segment is still in the
// cache when it is reduced. While reducing, a rank reduces into its own memory and lends that
// to the next rank (no copy where the group lends): a chunk lent at step s is next changed when
// its final value arrives in the allgather, which it reached through the next rank, so that rank
// has read it by then. The allgather's messages are copied out and passed on as they are.
absl::Status RingAllreduce(Collective& c, char* data, int64_t count, c10::ScalarType dtype,
                           RedOp op, int part_base) {
  const int n = c.size(), r = c.rank();
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  auto elems = [&](int i) { return count / n + (i < count % n ? 1 : 0); };
  auto offset = [&](int i) { return (count / n) * i + std::min<int64_t>(i, count % n); };
  auto mod = [&](int i) { return ((i % n) + n) % n; };
  const int64_t seg_elems = std::max<int64_t>(1, static_cast<int64_t>(kSegmentBytes) / es);
  const int segs = static_cast<int>((elems(0) + seg_elems - 1) / seg_elems);
  // Segment j of chunk i: its first element and its length.
  auto seg_begin = [&](int i, int j) { return offset(i) + std::min(elems(i), j * seg_elems); };
  auto seg_len = [&](int i, int j) {
    return std::min(elems(i), (j + 1) * seg_elems) - std::min(elems(i), j * seg_elems);
  };
  auto ptr = [&](int64_t element) { return data + element * es; };
  auto part = [&](int step, int j) { return part_base + step * segs + j; };
  const int next = mod(r + 1), prev = mod(r - 1);
  for (int j = 0; j < segs; ++j) {
    ASSIGN_OR_RETURN(Tensor mine, c.Lend(ptr(seg_begin(r, j)), seg_len(r, j) * es));
    RETURN_IF_ERROR(c.Forward(next, part(0, j), mine));
  }
  std::vector<Collective::PendingRef> pending(segs);
  for (int s = 0; s < 2 * (n - 1); ++s) {
    // Steps 0..n-2 reduce chunk r-s-1; steps n-1.. gather chunk r-(s-n+1).
    const bool reducing = s < n - 1;
    const int i = reducing ? mod(r - s - 1) : mod(r - (s - n + 1));
    // The allgather's segments land in the caller's memory where the fabric can write it.
    for (int j = 0; j < segs; ++j) {
      pending[j] =
          c.Post(prev, part(s, j), seg_len(i, j) * es, reducing ? nullptr : ptr(seg_begin(i, j)));
    }
    for (int j = 0; j < segs; ++j) {
      ASSIGN_OR_RETURN(Tensor m, c.Wait(pending[j]));
      pending[j].reset();
      const int64_t len = seg_len(i, j);
      if (reducing) {
        RETURN_IF_ERROR(c.ReduceOut(dtype, op, ptr(seg_begin(i, j)), m.data(), len));
        // Chunk i = r+1 is complete at the last reducing step.
        if (s == n - 2 && op == RedOp::AVG) {
          RETURN_IF_ERROR(c.DivideOut(dtype, ptr(seg_begin(i, j)), len, n));
        }
        m.Clear();  // back to the pool before the next segment lands
        if (s == n - 2) {
          // The complete chunk is staged: no later message proves the next rank read it, so
          // lending it would hold this rank's completion until it did (WaitForLent).
          RETURN_IF_ERROR(c.Send(next, part(s + 1, j), ptr(seg_begin(i, j)), len * es));
          continue;
        }
        ASSIGN_OR_RETURN(Tensor reduced, c.Lend(ptr(seg_begin(i, j)), len * es));
        RETURN_IF_ERROR(c.Forward(next, part(s + 1, j), reduced));
        continue;
      }
      RETURN_IF_ERROR(c.WriteOut(ptr(seg_begin(i, j)), m.data(), len * es));
      if (s < 2 * n - 3) RETURN_IF_ERROR(c.Forward(next, part(s + 1, j), m));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AllreduceInPlace(Collective& c, void* data, int64_t count, c10::ScalarType dtype,
                              RedOp op, int part_base) {
  if (c.size() == 1) {
    return absl::OkStatus();  // AVG over one rank is the value itself
  }
  if (SameHostGroup* shared = c.same_host()) {
    c.CountSameHost();
    return shared->Allreduce(c, data, count, dtype, op);
  }
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
  if (bytes >= kRingBytes && count >= c.size()) {
    return RingAllreduce(c, static_cast<char*>(data), count, dtype, op, part_base);
  }
  return TreeAllreduce(c, data, count, dtype, op, part_base);
}

absl::Status BroadcastInPlace(Collective& c, void* data, size_t bytes, int root, int part_base) {
  SameHostGroup* shared = c.same_host();
  if (shared != nullptr && bytes <= SameHostGroup::kMaxCopyBytes) {
    c.CountSameHost();
    return shared->Broadcast(c, data, bytes, root);
  }
  const int n = c.size();
  const int v = ((c.rank() - root) % n + n) % n;
  auto real = [&](int u) { return (u + root) % n; };
  Tensor message;
  const int low = v == 0 ? 1 << 30 : LowestBit(v);
  if (v == 0) {
    ASSIGN_OR_RETURN(Tensor lent, c.Lend(data, bytes));
    message = std::move(lent);
  } else {
    ASSIGN_OR_RETURN(Tensor got, c.Recv(real(v - low), part_base, bytes, data));
    message = std::move(got);
  }
  int top = 1;
  while (top < low && top < n) top <<= 1;
  for (int m = top >> 1; m >= 1; m >>= 1) {
    if (m < low && v + m < n) RETURN_IF_ERROR(c.Forward(real(v + m), part_base, message));
  }
  if (v != 0) RETURN_IF_ERROR(c.WriteOut(data, message.data(), bytes));
  return absl::OkStatus();
}

absl::Status ReduceToRoot(Collective& c, const void* in, void* out, int64_t count,
                          c10::ScalarType dtype, RedOp op, int root) {
  const int n = c.size();
  const int v = ((c.rank() - root) % n + n) % n;
  auto real = [&](int u) { return (u + root) % n; };
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
  ASSIGN_OR_RETURN(Tensor acc, c.Stage(in, bytes));
  const int low = v == 0 ? 1 << 30 : LowestBit(v);
  for (int m = 1; m < low && v + m < n; m <<= 1) {
    ASSIGN_OR_RETURN(Tensor child, c.Recv(real(v + m), 0, bytes));
    ReduceInto(dtype, op, acc.data(), child.data(), count);
  }
  if (v != 0) return c.Forward(real(v - low), 0, acc);
  if (op == RedOp::AVG) DivideBy(dtype, acc.data(), count, n);
  return c.WriteOut(out, acc.data(), bytes);
}

absl::Status Allgather(Collective& c, const void* in, void* const* outs, size_t bytes) {
  const int n = c.size(), r = c.rank();
  auto mod = [&](int i) { return ((i % n) + n) % n; };
  if (n > 1 && bytes <= SameHostGroup::kMaxCopyBytes) {
    if (SameHostGroup* shared = c.same_host()) {
      c.CountSameHost();
      return shared->Allgather(c, in, outs, bytes);
    }
  }
  RETURN_IF_ERROR(c.WriteOut(outs[r], in, bytes));
  if (n == 1) return absl::OkStatus();
  RETURN_IF_ERROR(c.Send(mod(r + 1), 0, in, bytes));
  for (int s = 0; s < n - 1; ++s) {
    const int i = mod(r - 1 - s);
    ASSIGN_OR_RETURN(Tensor m, c.Recv(mod(r - 1), s, bytes, outs[i]));
    RETURN_IF_ERROR(c.WriteOut(outs[i], m.data(), bytes));
    if (s < n - 2) RETURN_IF_ERROR(c.Forward(mod(r + 1), s + 1, m));
  }
  return absl::OkStatus();
}

absl::Status ReduceScatter(Collective& c, const void* const* ins, void* out, int64_t count,
                           c10::ScalarType dtype, RedOp op) {
  const int n = c.size(), r = c.rank();
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
  auto mod = [&](int i) { return ((i % n) + n) % n; };
  if (n == 1) return c.WriteOut(out, ins[0], bytes);
  if (SameHostGroup* shared = c.same_host()) {
    c.CountSameHost();
    return shared->ReduceScatter(c, ins, out, count, dtype, op);
  }
  // Step s passes on the partial sum of block r-s-1; the last one received is block r's.
  RETURN_IF_ERROR(c.Send(mod(r + 1), 0, ins[mod(r - 1)], bytes));
  for (int s = 0; s < n - 1; ++s) {
    const int i = mod(r - s - 2);
    ASSIGN_OR_RETURN(Tensor m, c.Recv(mod(r - 1), s, bytes));
    ReduceInto(dtype, op, m.data(), ins[i], count);
    if (s < n - 2) {
      RETURN_IF_ERROR(c.Forward(mod(r + 1), s + 1, m));
    } else {
      if (op == RedOp::AVG) DivideBy(dtype, m.data(), count, n);
      RETURN_IF_ERROR(c.WriteOut(out, m.data(), bytes));
    }
  }
  return absl::OkStatus();
}

absl::Status Barrier(Collective& c) {
  if (SameHostGroup* shared = c.same_host()) {
    c.CountSameHost();
    return shared->Barrier(c);
  }
  const int n = c.size(), r = c.rank();
  const char token = 1;
  for (int k = 1, part = 0; k < n; k <<= 1, ++part) {
    RETURN_IF_ERROR(c.Send((r + k) % n, part, &token, 1));
    RETURN_IF_ERROR(c.Recv((r - k % n + n) % n, part, 1).status());
  }
  return absl::OkStatus();
}

}  // namespace tensorverbs::torch_backend
