// The collectives of ProcessGroupTensorVerbs but all-to-all (ops_alltoall.cc): broadcast, the
// reductions (allreduce and its coalesced form, reduce, reduce_scatter and its base form), the
// gathers (allgather and its coalesced and base forms, gather), scatter and barrier. Each checks
// its arguments on the caller's thread and queues its body, which runs on the group's worker
// (process_group.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "python/src/torch/collective.h"
#include "python/src/torch/ops_util.h"
#include "python/src/torch/process_group.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::torch_backend {
c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::broadcast(
    std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  at::Tensor t = Single(tensors, "broadcast");
  const int root = CheckRoot(opts.rootRank, getSize(), "broadcast");
  if (opts.rootTensor != 0) Fail("broadcast", "rootTensor must be 0 (one tensor per call)");
  return Enqueue(c10d::OpType::BROADCAST, "broadcast", {t}, opts.timeout, [t, root](Collective& c) {
    return BroadcastInPlace(c, Bytes(t), t.nbytes(), root, 0);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::allreduce(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  at::Tensor t = Single(tensors, "allreduce");
  const RedOp op = CheckOp(opts.reduceOp, t, "allreduce");
  return Enqueue(c10d::OpType::ALLREDUCE, "allreduce", {t}, opts.timeout, [t, op](Collective& c) {
    return AllreduceInPlace(c, t.data_ptr(), t.numel(), t.scalar_type(), op, 0);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  if (tensors.empty()) Fail("allreduce_coalesced", "takes at least one tensor");
  RedOp op = RedOp::SUM;
  for (const at::Tensor& t : tensors) {
    CheckTensor(t, "allreduce_coalesced");
    op = CheckOp(opts.reduceOp, t, "allreduce_coalesced");
  }
  // Tensors of one dtype (as gloo requires of them all) travel as one: packed into one buffer,
  // reduced in one operation, unpacked; mixed dtypes go one tensor at a time.
  const bool one_dtype = std::all_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) {
    return t.scalar_type() == tensors[0].scalar_type();
  });
  const int parts = 2 * getSize();
  return Enqueue(
      c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, opts.timeout,
      [tensors, op, parts, one_dtype](Collective& c) {
        if (!one_dtype || tensors.size() == 1) {
          for (size_t i = 0; i < tensors.size(); ++i) {
            const at::Tensor& t = tensors[i];
            absl::Status s = AllreduceInPlace(c, t.data_ptr(), t.numel(), t.scalar_type(), op,
                                              static_cast<int>(i) * parts);
            if (!s.ok()) return s;
          }
          return absl::OkStatus();
        }
        size_t total = 0;
        int64_t count = 0;
        for (const at::Tensor& t : tensors) {
          total += t.nbytes();
          count += t.numel();
        }
        uint8_t* packed = c.Scratch(total);
        size_t at = 0;
        for (const at::Tensor& t : tensors) {
          if (t.nbytes() > 0) std::memcpy(packed + at, t.data_ptr(), t.nbytes());
          at += t.nbytes();
        }
        absl::Status s = AllreduceInPlace(c, packed, count, tensors[0].scalar_type(), op, 0);
        at = 0;
        for (const at::Tensor& t : tensors) {
          if (s.ok()) s = c.WriteOut(t.data_ptr(), packed + at, t.nbytes());
          at += t.nbytes();
        }
        return s;
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::reduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::ReduceOptions& opts) {
  at::Tensor t = Single(tensors, "reduce");
  const RedOp op = CheckOp(opts.reduceOp, t, "reduce");
  const int root = CheckRoot(opts.rootRank, getSize(), "reduce");
  return Enqueue(c10d::OpType::REDUCE, "reduce", {t}, opts.timeout, [t, op, root](Collective& c) {
    return ReduceToRoot(c, t.data_ptr(), t.data_ptr(), t.numel(), t.scalar_type(), op, root);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  at::Tensor in = Single(inputs, "allgather");
  if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != getSize()) {
    Fail("allgather", absl::StrCat("takes one list of ", getSize(), " output tensors"));
  }
  for (const at::Tensor& o : outputs[0]) CheckLike(o, in, in.numel(), "allgather");
  std::vector<at::Tensor> outs = outputs[0];
  return Enqueue(c10d::OpType::ALLGATHER, "allgather", outs, opts.timeout,
                 [in, outs](Collective& c) {
                   std::vector<void*> ptrs;
                   for (const at::Tensor& o : outs) ptrs.push_back(o.data_ptr());
                   return Allgather(c, in.data_ptr(), ptrs.data(), in.nbytes());
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (inputs.empty()) Fail("allgather_coalesced", "takes at least one input tensor");
  for (const at::Tensor& in : inputs) CheckTensor(in, "allgather_coalesced");
  if (static_cast<int>(outputs.size()) != getSize()) {
    Fail("allgather_coalesced", absl::StrCat("takes one list of output tensors per rank: ",
                                             getSize(), " lists, not ", outputs.size()));
  }
  for (const std::vector<at::Tensor>& list : outputs) {
    if (list.size() != inputs.size()) {
      Fail("allgather_coalesced",
           absl::StrCat("each rank's list of outputs has one tensor per input: ", inputs.size(),
                        ", not ", list.size()));
    }
    for (size_t j = 0; j < inputs.size(); ++j) {
      CheckLike(list[j], inputs[j], inputs[j].numel(), "allgather_coalesced");
    }
  }
  std::vector<at::Tensor> outs;
  for (const std::vector<at::Tensor>& list : outputs)
    outs.insert(outs.end(), list.begin(), list.end());
  // Every rank's inputs travel as one message: packed, gathered, unpacked into the outputs.
  return Enqueue(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", outs, opts.timeout,
                 [inputs, outputs](Collective& c) {
                   size_t bytes = 0;
                   for (const at::Tensor& in : inputs) bytes += in.nbytes();
                   uint8_t* packed = c.Scratch(bytes * (c.size() + 1));
                   uint8_t* mine = packed + bytes * c.size();
                   size_t at = 0;
                   for (const at::Tensor& in : inputs) {
                     if (in.nbytes() > 0) std::memcpy(mine + at, in.data_ptr(), in.nbytes());
                     at += in.nbytes();
                   }
                   std::vector<void*> ptrs;
                   for (int r = 0; r < c.size(); ++r) ptrs.push_back(packed + r * bytes);
                   absl::Status s = Allgather(c, mine, ptrs.data(), bytes);
                   for (int r = 0; r < c.size() && s.ok(); ++r) {
                     at = 0;
                     for (size_t j = 0; j < inputs.size() && s.ok(); ++j) {
                       s = c.WriteOut(outputs[r][j].data_ptr(), packed + r * bytes + at,
                                      inputs[j].nbytes());
                       at += inputs[j].nbytes();
                     }
                   }
                   return s;
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  CheckTensor(input, "_allgather_base");
  CheckLike(output, input, input.numel() * getSize(), "_allgather_base");
  at::Tensor in = input, out = output;
  return Enqueue(c10d::OpType::_ALLGATHER_BASE, "_allgather_base", {out}, opts.timeout,
                 [in, out](Collective& c) {
                   std::vector<void*> ptrs;
                   for (int i = 0; i < c.size(); ++i) ptrs.push_back(Bytes(out) + i * in.nbytes());
                   return Allgather(c, in.data_ptr(), ptrs.data(), in.nbytes());
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  at::Tensor in = Single(inputs, "gather");
  const int root = CheckRoot(opts.rootRank, getSize(), "gather");
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != getSize()) {
      Fail("gather", absl::StrCat("the root takes one list of ", getSize(), " output tensors"));
    }
    for (const at::Tensor& o : outputs[0]) CheckLike(o, in, in.numel(), "gather");
    outs = outputs[0];
  } else if (!outputs.empty() && !outputs[0].empty()) {
    Fail("gather", "only the root rank passes output tensors");
  }
  return Enqueue(c10d::OpType::GATHER, "gather", outs, opts.timeout,
                 [in, outs, root](Collective& c) -> absl::Status {
                   if (c.rank() != root) return c.Send(root, 0, in.data_ptr(), in.nbytes());
                   for (int src = 0; src < c.size(); ++src) {
                     if (src == root) {
                       absl::Status s =
                           c.WriteOut(outs[src].data_ptr(), in.data_ptr(), in.nbytes());
                       if (!s.ok()) return s;
                       continue;
                     }
                     absl::StatusOr<Tensor> m = c.Recv(src, 0, in.nbytes(), outs[src].data_ptr());
                     if (!m.ok()) return m.status();
                     absl::Status s = c.WriteOut(outs[src].data_ptr(), m->data(), in.nbytes());
                     if (!s.ok()) return s;
                   }
                   return absl::OkStatus();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  at::Tensor out = Single(outputs, "scatter");
  const int root = CheckRoot(opts.rootRank, getSize(), "scatter");
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != getSize()) {
      Fail("scatter", absl::StrCat("the root takes one list of ", getSize(), " input tensors"));
    }
    for (const at::Tensor& i : inputs[0]) CheckLike(i, out, out.numel(), "scatter");
    ins = inputs[0];
  } else if (!inputs.empty() && !inputs[0].empty()) {
    Fail("scatter", "only the root rank passes input tensors");
  }
  return Enqueue(c10d::OpType::SCATTER, "scatter", {out}, opts.timeout,
                 [ins, out, root](Collective& c) -> absl::Status {
                   if (c.rank() != root) {
                     absl::StatusOr<Tensor> m = c.Recv(root, 0, out.nbytes(), out.data_ptr());
                     if (!m.ok()) return m.status();
                     return c.WriteOut(out.data_ptr(), m->data(), out.nbytes());
                   }
                   for (int dst = 0; dst < c.size(); ++dst) {
                     absl::Status s =
                         dst == root ? c.WriteOut(out.data_ptr(), ins[dst].data_ptr(), out.nbytes())
                                     : c.Send(dst, 0, ins[dst].data_ptr(), out.nbytes());
                     if (!s.ok()) return s;
                   }
                   return absl::OkStatus();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = Single(outputs, "reduce_scatter");
  const RedOp op = CheckOp(opts.reduceOp, out, "reduce_scatter");
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != getSize()) {
    Fail("reduce_scatter", absl::StrCat("takes one list of ", getSize(), " input tensors"));
  }
  for (const at::Tensor& i : inputs[0]) CheckLike(i, out, out.numel(), "reduce_scatter");
  std::vector<at::Tensor> ins = inputs[0];
  return Enqueue(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {out}, opts.timeout,
                 [ins, out, op](Collective& c) {
                   std::vector<const void*> ptrs;
                   for (const at::Tensor& i : ins) ptrs.push_back(i.data_ptr());
                   return ReduceScatter(c, ptrs.data(), out.data_ptr(), out.numel(),
                                        out.scalar_type(), op);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  CheckTensor(output, "_reduce_scatter_base");
  CheckLike(input, output, output.numel() * getSize(), "_reduce_scatter_base");
  const RedOp op = CheckOp(opts.reduceOp, output, "_reduce_scatter_base");
  at::Tensor in = input, out = output;
  return Enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base", {out}, opts.timeout,
                 [in, out, op](Collective& c) {
                   std::vector<const void*> ptrs;
                   for (int i = 0; i < c.size(); ++i) ptrs.push_back(Bytes(in) + i * out.nbytes());
                   return ReduceScatter(c, ptrs.data(), out.data_ptr(), out.numel(),
                                        out.scalar_type(), op);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::barrier(const c10d::BarrierOptions& opts) {
  return Enqueue(c10d::OpType::BARRIER, "barrier", {}, opts.timeout,
                 [](Collective& c) { return Barrier(c); });
}

}  // namespace tensorverbs::torch_backend
