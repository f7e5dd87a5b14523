// The point-to-point operations of ProcessGroupTensorVerbs (send, recv, recvAnysource) and the
// messages they send and land in: a staged copy, or the caller's tensor lent to the task. They
// run on the caller's thread and complete on the task's callback threads or the completer's
// (process_group.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "python/src/torch/ops_util.h"
#include "python/src/torch/process_group.h"
#include "python/src/torch/work.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/tensor_shape.h"
#include "tensorverbs/types.h"

namespace tensorverbs::torch_backend {

absl::StatusOr<Tensor> ProcessGroupTensorVerbs::Stage(const void* data, size_t bytes) {
  absl::StatusOr<TensorShape> shape = TensorShape::Create({static_cast<int64_t>(bytes)});
  if (!shape.ok()) return shape.status();
  absl::StatusOr<Tensor> staged = task_->Empty(DataType::kUInt8, *shape);
  if (!staged.ok()) return staged.status();
  if (bytes > 0) std::memcpy(staged->data(), data, bytes);
  counters_->Add<Counter::kTorchStagedCopies>();
  counters_->Add<Counter::kTorchStagedBytes>(static_cast<int64_t>(bytes));
  return staged;
}

absl::StatusOr<Tensor> ProcessGroupTensorVerbs::Adopt(const void* data, size_t bytes,
                                                      std::function<void()> release,
                                                      bool count_as_lent) {
  absl::StatusOr<TensorShape> shape = TensorShape::Create({static_cast<int64_t>(bytes)});
  if (!shape.ok()) {
    release();
    return shape.status();
  }
  absl::StatusOr<Tensor> lent =
      task_->AdoptHostMemory(const_cast<void*>(data), DataType::kUInt8, *shape, std::move(release));
  if (!lent.ok() || !count_as_lent) return lent;
  counters_->Add<Counter::kTorchLentSends>();
  counters_->Add<Counter::kTorchLentBytes>(static_cast<int64_t>(bytes));
  return lent;
}

absl::StatusOr<Tensor> ProcessGroupTensorVerbs::Lend(const at::Tensor& t,
                                                     c10::intrusive_ptr<TvWork> work) {
  // The work holds `t`, so the memory lives until the release hands the work to the completer:
  // from a transport thread, which must neither complete it nor drop it. A refusal releases
  // before Adopt returns, unarmed: the caller completes the work with the error.
  auto armed = std::make_shared<std::atomic<bool>>(false);
  absl::StatusOr<Tensor> lent = Adopt(
      t.data_ptr(), t.nbytes(), [completer = completer_, work = std::move(work), armed]() mutable {
        if (armed->load(std::memory_order_acquire)) {
          completer->Push(std::move(work), absl::OkStatus());
        }
      });
  if (lent.ok()) armed->store(true, std::memory_order_release);
  return lent;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::send(std::vector<at::Tensor>& tensors,
                                                             int dst, int tag) {
  at::Tensor t = Single(tensors, "send");
  if (dst < 0 || dst >= getSize() || dst == getRank()) {
    Fail("send",
         absl::StrCat("destination rank ", dst, " is not another rank of a group of ", getSize()));
  }
  const int64_t seq = p2p_seq_.fetch_add(1, std::memory_order_relaxed);
  auto work = c10::make_intrusive<TvWork>(
      getRank(), c10d::OpType::SEND, nullptr, std::vector<at::Tensor>{t},
      absl::StrCat(What("send", seq), " to ", PeerName(dst), " with tag ", tag));
  const bool lend = lend_from_ > 0 && t.nbytes() >= lend_from_;
  absl::StatusOr<Tensor> message = lend ? Lend(t, work) : Stage(t.data_ptr(), t.nbytes());
  absl::Status status = message.status();
  if (message.ok()) {
    std::lock_guard<std::mutex> lock(send_mu_);
    const int64_t n = sent_[{dst, tag}]++;
    status = step_->Send(peer_tasks_[dst], P2pName(getRank(), dst, tag, n), *message);
  }
  // A lent message completes the work when the task lets go of it. One the step refused is let
  // go of as `message` goes, after the error below has completed the work: the release's OK
  // comes second and changes nothing.
  if (!lend || !status.ok()) {
    work->Complete(status);
  } else {
    // Before `message` goes, so the release (which unwatches) cannot come first.
    completer_->Watch(
        work, std::chrono::steady_clock::now() + timeout_,
        absl::StrCat(PeerName(dst), " did not take the message within the group's timeout of ",
                     timeout_.count(), " ms (a rank that died, or a recv never posted)"));
  }
  return work;
}

Tensor ProcessGroupTensorVerbs::LandingFor(const at::Tensor& t,
                                           const c10::intrusive_ptr<TvWork>& work,
                                           const std::shared_ptr<InPlaceLanding>& landing) {
  absl::StatusOr<TensorShape> shape = TensorShape::Create({static_cast<int64_t>(t.nbytes())});
  if (!shape.ok()) {
    landing->Released();  // nothing lent: the recv copies as before
    return Tensor();
  }
  // The work holds `t`, so its memory lives as long as the task may write into it. A refusal
  // releases before AdoptHostMemory returns, with nothing failed yet: the recv copies as before.
  // The release runs on a transport thread, which must not drop what may be the last reference
  // to the work (and with it a tensor whose Python object may be gone): the completer's thread
  // completes it or lets go of it.
  absl::StatusOr<Tensor> into = task_->AdoptHostMemory(
      t.data_ptr(), DataType::kUInt8, *shape, [completer = completer_, work, landing]() mutable {
        if (landing->Released() == InPlaceLanding::Action::kFail) {
          completer->Push(std::move(work), landing->failure());
        } else {
          completer->Drop(std::move(work));
        }
      });
  return into.ok() ? *std::move(into) : Tensor();
}

namespace {

// Completes a recv's work with `message`: landed in `t` itself, or copied into it.
void Land(TvWork& work, const at::Tensor& t, absl::StatusOr<Tensor> message, int src,
          const std::string& from, ProcessGroupTensorVerbs::Counters& counters) {
  if (!message.ok()) {
    work.Complete(absl::Status(message.status().code(),
                               absl::StrCat(from, ": ", message.status().message())));
    return;
  }
  if (message->TotalBytes() != t.nbytes()) {
    work.Complete(absl::InvalidArgumentError(
        absl::StrCat(from, " sent ", message->TotalBytes(), " bytes into a tensor of ", t.nbytes(),
                     ": do the ranks agree on the shape and dtype?")));
    return;
  }
  if (t.nbytes() > 0 && message->data() == t.data_ptr()) {
    // The fabric wrote it there (RecvOptions::into): nothing to copy.
    counters.Add<Counter::kTorchInPlaceRecvs>();
    counters.Add<Counter::kTorchInPlaceBytes>(static_cast<int64_t>(t.nbytes()));
  } else if (t.nbytes() > 0 &&
             work.Write([&] { std::memcpy(t.data_ptr(), message->data(), t.nbytes()); })) {
    counters.Add<Counter::kTorchLandedCopies>();
    counters.Add<Counter::kTorchLandedBytes>(static_cast<int64_t>(t.nbytes()));
  }
  work.set_source_rank(src);
  work.Complete(absl::OkStatus());
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::recv(std::vector<at::Tensor>& tensors,
                                                             int src, int tag) {
  at::Tensor t = Single(tensors, "recv");
  if (src < 0 || src >= getSize() || src == getRank()) {
    Fail("recv",
         absl::StrCat("source rank ", src, " is not another rank of a group of ", getSize()));
  }
  const int64_t seq = p2p_seq_.fetch_add(1, std::memory_order_relaxed);
  auto work = c10::make_intrusive<TvWork>(getRank(), c10d::OpType::RECV, nullptr,
                                          std::vector<at::Tensor>{t},
                                          absl::StrCat(What("recv", seq), " with tag ", tag));
  // Over grpc+verbs a message from the size sends lend at may land in `t` itself, where the fabric
  // can write it (tcp, ibverbs): the transport decides, the matcher says whether it may.
  std::shared_ptr<InPlaceLanding> landing;
  Tensor into;
  if (lend_from_ > 0 && t.nbytes() >= lend_from_) {
    landing = std::make_shared<InPlaceLanding>();
    into = LandingFor(t, work, landing);
  }
  matcher_->Recv(
      src, tag, t.nbytes(),
      [work, t, from = absl::StrCat("from ", PeerName(src)), counters = counters_, landing,
       completer = completer_, timeout = timeout_](absl::StatusOr<Tensor> message, int from_rank) {
        if (landing != nullptr) {
          const absl::Status ended =
              message.ok() ? absl::OkStatus()
                           : absl::Status(message.status().code(),
                                          absl::StrCat(from, ": ", message.status().message()));
          if (landing->RecvEnded(ended) == InPlaceLanding::Action::kWatch) {
            // The task lets go once the peer answers or the channel closes: at once when the
            // peer died. A live peer that never sends never answers, so the wait is bounded.
            const std::chrono::milliseconds grace = std::min(timeout, kLandingGrace);
            completer->Watch(work, std::chrono::steady_clock::now() + grace,
                             absl::StrCat(from, ": ", message.status().message(),
                                          "; the peer may still write the tensor (the task "
                                          "did not let go of it within ",
                                          grace.count(), " ms)"));
            return;  // completed when the task lets go of the tensor
          }
        }
        Land(*work, t, std::move(message), from_rank, from, *counters);
      },
      std::move(into));
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::recvAnysource(
    std::vector<at::Tensor>& tensors, int tag) {
  at::Tensor t = Single(tensors, "recvAnysource");
  if (getSize() < 2) Fail("recvAnysource", "a group of one rank has no one to receive from");
  const int64_t seq = p2p_seq_.fetch_add(1, std::memory_order_relaxed);
  auto work = c10::make_intrusive<TvWork>(
      getRank(), c10d::OpType::RECVANYSOURCE, nullptr, std::vector<at::Tensor>{t},
      absl::StrCat(What("recv from any source", seq), " with tag ", tag));
  matcher_->RecvAny(
      tag, t.nbytes(),
      [this_rank = getRank(), work, t, counters = counters_](absl::StatusOr<Tensor> message,
                                                             int from_rank) {
        Land(*work, t, std::move(message), from_rank,
             from_rank < 0 ? std::string("from any rank") : absl::StrCat("from rank ", from_rank),
             *counters);
      });
  return work;
}

}  // namespace tensorverbs::torch_backend
