// The c10d::ProcessGroup operations of ProcessGroupTensorVerbs: each checks its arguments on
// the caller's thread (a bad call raises and sends nothing), then runs as a p2p message or a
// queued collective (see process_group.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "python/src/torch/collective.h"
#include "python/src/torch/process_group.h"
#include "python/src/torch/work.h"

namespace tensorverbs::torch_backend {
namespace {

[[noreturn]] void Fail(const char* op, const std::string& message) {
  throw std::invalid_argument(absl::StrCat("tensorverbs ", op, ": ", message));
}

bool Carried(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Char:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Bool:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
      return true;
    default:
      return false;
  }
}

void CheckTensor(const at::Tensor& t, const char* op) {
  if (!t.defined()) Fail(op, "a tensor is undefined");
  if (!t.device().is_cpu()) {
    Fail(op, absl::StrCat("takes CPU tensors; this one is on ", t.device().str(),
                          " (this PyTorch build has no CUDA support for the backend)"));
  }
  if (t.layout() != c10::kStrided) Fail(op, "takes dense tensors; this one is sparse");
  if (!t.is_contiguous()) Fail(op, "takes contiguous tensors; call .contiguous() first");
  if (!Carried(t.scalar_type())) {
    Fail(op, absl::StrCat("does not carry dtype ", c10::toString(t.scalar_type())));
  }
}

at::Tensor& Single(std::vector<at::Tensor>& tensors, const char* op) {
  if (tensors.size() != 1) {
    Fail(op, absl::StrCat("takes one tensor per call, got ", tensors.size()));
  }
  CheckTensor(tensors[0], op);
  return tensors[0];
}

void CheckLike(const at::Tensor& t, const at::Tensor& like, int64_t numel, const char* op) {
  CheckTensor(t, op);
  if (t.scalar_type() != like.scalar_type() || t.numel() != numel) {
    Fail(op,
         absl::StrCat("a tensor of ", c10::toString(t.scalar_type()), "[", t.numel(), "] where ",
                      c10::toString(like.scalar_type()), "[", numel, "] is needed"));
  }
}

int CheckRoot(int64_t root, int size, const char* op) {
  if (root < 0 || root >= size) {
    Fail(op, absl::StrCat("root rank ", root, " is not in a group of size ", size));
  }
  return static_cast<int>(root);
}

RedOp CheckOp(const c10d::ReduceOp& reduce_op, const at::Tensor& t, const char* op) {
  const RedOp red = reduce_op.op_;
  absl::Status s = CheckReducible(t.scalar_type(), red);
  if (!s.ok()) Fail(op, std::string(s.message()));
  return red;
}

char* Bytes(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

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

namespace {

// Every rank sends block i of its input to rank i and receives rank i's into block i of its
// output; all sends go first, so no rank waits on another's order.
absl::Status Exchange(Collective& c, const std::vector<const char*>& in,
                      const std::vector<size_t>& in_bytes, const std::vector<char*>& out,
                      const std::vector<size_t>& out_bytes) {
  const int n = c.size(), r = c.rank();
  for (int k = 1; k < n; ++k) {
    const int dst = (r + k) % n;
    absl::Status s = c.Send(dst, 0, in[dst], in_bytes[dst]);
    if (!s.ok()) return s;
  }
  if (in_bytes[r] != out_bytes[r]) {
    return absl::InvalidArgumentError("this rank's own input and output blocks differ in size");
  }
  absl::Status s = c.WriteOut(out[r], in[r], in_bytes[r]);
  if (!s.ok()) return s;
  for (int k = 1; k < n; ++k) {
    const int src = (r - k + n) % n;
    absl::StatusOr<Tensor> m = c.Recv(src, 0, out_bytes[src], out[src]);
    if (!m.ok()) return m.status();
    s = c.WriteOut(out[src], m->data(), out_bytes[src]);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Block sizes in bytes of `t` split along dim 0 by `splits` (equal blocks when empty).
std::vector<size_t> Blocks(const at::Tensor& t, const std::vector<int64_t>& splits, int n,
                           const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row_bytes = rows == 0 ? 0 : t.nbytes() / rows;
  std::vector<size_t> bytes(n);
  if (splits.empty()) {
    if (rows % n != 0) {
      Fail("alltoall_base", absl::StrCat("the ", what, " has ", rows, " rows, not a multiple of ",
                                         n, "; pass split sizes"));
    }
    for (int i = 0; i < n; ++i) bytes[i] = row_bytes * (rows / n);
    return bytes;
  }
  if (static_cast<int>(splits.size()) != n) {
    Fail("alltoall_base", absl::StrCat(splits.size(), " ", what, " split sizes for ", n, " ranks"));
  }
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    if (splits[i] < 0) Fail("alltoall_base", "a split size is negative");
    total += splits[i];
    bytes[i] = row_bytes * splits[i];
  }
  if (total != rows) {
    Fail("alltoall_base",
         absl::StrCat("the ", what, " split sizes add up to ", total, ", not ", rows, " rows"));
  }
  return bytes;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  CheckTensor(input, "alltoall_base");
  CheckTensor(output, "alltoall_base");
  if (input.scalar_type() != output.scalar_type()) {
    Fail("alltoall_base", "input and output dtypes differ");
  }
  const int n = getSize();
  std::vector<size_t> in_bytes = Blocks(input, input_splits, n, "input");
  std::vector<size_t> out_bytes = Blocks(output, output_splits, n, "output");
  at::Tensor in = input, out = output;
  return Enqueue(c10d::OpType::ALLTOALL_BASE, "alltoall_base", {out}, opts.timeout,
                 [in, out, in_bytes, out_bytes](Collective& c) {
                   std::vector<const char*> ins;
                   std::vector<char*> outs;
                   size_t a = 0, b = 0;
                   for (int i = 0; i < c.size(); ++i) {
                     ins.push_back(Bytes(in) + a);
                     outs.push_back(Bytes(out) + b);
                     a += in_bytes[i];
                     b += out_bytes[i];
                   }
                   return Exchange(c, ins, in_bytes, outs, out_bytes);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::alltoall(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  const int n = getSize();
  if (static_cast<int>(inputs.size()) != n || static_cast<int>(outputs.size()) != n) {
    Fail("alltoall", absl::StrCat("takes ", n, " input and ", n, " output tensors"));
  }
  for (int i = 0; i < n; ++i) {
    CheckTensor(inputs[i], "alltoall");
    CheckTensor(outputs[i], "alltoall");
    if (inputs[i].scalar_type() != inputs[0].scalar_type() ||
        outputs[i].scalar_type() != inputs[0].scalar_type()) {
      Fail("alltoall", "every input and output tensor must have one dtype");
    }
  }
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return Enqueue(c10d::OpType::ALLTOALL, "alltoall", outs, opts.timeout,
                 [ins, outs](Collective& c) {
                   std::vector<const char*> in;
                   std::vector<char*> out;
                   std::vector<size_t> in_bytes, out_bytes;
                   for (int i = 0; i < c.size(); ++i) {
                     in.push_back(Bytes(ins[i]));
                     out.push_back(Bytes(outs[i]));
                     in_bytes.push_back(ins[i].nbytes());
                     out_bytes.push_back(outs[i].nbytes());
                   }
                   return Exchange(c, in, in_bytes, out, out_bytes);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::barrier(const c10d::BarrierOptions& opts) {
  return Enqueue(c10d::OpType::BARRIER, "barrier", {}, opts.timeout,
                 [](Collective& c) { return Barrier(c); });
}

absl::StatusOr<Tensor> ProcessGroupTensorVerbs::Stage(const void* data, size_t bytes) {
  absl::StatusOr<TensorShape> shape = TensorShape::Create({static_cast<int64_t>(bytes)});
  if (!shape.ok()) return shape.status();
  absl::StatusOr<Tensor> staged = task_->Empty(DataType::kUInt8, *shape);
  if (!staged.ok()) return staged.status();
  if (bytes > 0) std::memcpy(staged->data(), data, bytes);
  counters_->staged_copies.fetch_add(1, std::memory_order_relaxed);
  counters_->staged_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
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
  counters_->lent_sends.fetch_add(1, std::memory_order_relaxed);
  counters_->lent_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
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

// A recv whose message may land in the caller's tensor itself (RecvOptions::into): what the
// task's release of that memory (on a transport thread) and the recv's end (on a callback thread)
// share. A recv that fails while the task still holds the tensor, which its peer may then still
// write, completes only once the task lets go of it: nothing writes into a failed recv's tensor.
struct InPlaceLanding {
  std::mutex mu;
  bool released = false;  // the task let go of the tensor
  bool failed = false;    // the recv failed before that: `failure` waits for the release
  absl::Status failure;
};

Tensor ProcessGroupTensorVerbs::LandingFor(const at::Tensor& t,
                                           const c10::intrusive_ptr<TvWork>& work,
                                           const std::shared_ptr<InPlaceLanding>& landing) {
  absl::StatusOr<TensorShape> shape = TensorShape::Create({static_cast<int64_t>(t.nbytes())});
  if (!shape.ok()) {
    std::lock_guard<std::mutex> lock(landing->mu);
    landing->released = true;  // nothing lent: the recv copies as before
    return Tensor();
  }
  // The work holds `t`, so its memory lives as long as the task may write into it. A refusal
  // releases before AdoptHostMemory returns, with nothing failed yet: the recv copies as before.
  // The release runs on a transport thread, which must not drop what may be the last reference
  // to the work (and with it a tensor whose Python object may be gone): the completer's thread
  // completes it or lets go of it.
  absl::StatusOr<Tensor> into = task_->AdoptHostMemory(
      t.data_ptr(), DataType::kUInt8, *shape, [completer = completer_, work, landing]() mutable {
        absl::Status failure;
        bool failed;
        {
          std::lock_guard<std::mutex> lock(landing->mu);
          landing->released = true;
          failed = landing->failed;
          failure = landing->failure;
        }
        if (failed) {
          completer->Push(std::move(work), failure);
        } else {
          completer->Drop(std::move(work));
        }
      });
  return into.ok() ? *std::move(into) : Tensor();
}

namespace {

// Completes a recv's work with `message`: landed in `t` itself, or copied into it.
void Land(TvWork& work, const at::Tensor& t, absl::StatusOr<Tensor> message, int src,
          const std::string& from, std::atomic<int64_t>& copies, std::atomic<int64_t>& bytes,
          std::atomic<int64_t>& in_place, std::atomic<int64_t>& in_place_bytes) {
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
    in_place.fetch_add(1, std::memory_order_relaxed);
    in_place_bytes.fetch_add(static_cast<int64_t>(t.nbytes()), std::memory_order_relaxed);
  } else if (t.nbytes() > 0 &&
             work.Write([&] { std::memcpy(t.data_ptr(), message->data(), t.nbytes()); })) {
    copies.fetch_add(1, std::memory_order_relaxed);
    bytes.fetch_add(static_cast<int64_t>(t.nbytes()), std::memory_order_relaxed);
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
        if (landing != nullptr && !message.ok()) {
          std::lock_guard<std::mutex> lock(landing->mu);
          if (!landing->released) {
            landing->failed = true;
            landing->failure = absl::Status(message.status().code(),
                                            absl::StrCat(from, ": ", message.status().message()));
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
        Land(*work, t, std::move(message), from_rank, from, counters->landed_copies,
             counters->landed_bytes, counters->in_place_recvs, counters->in_place_bytes);
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
             counters->landed_copies, counters->landed_bytes, counters->in_place_recvs,
             counters->in_place_bytes);
      });
  return work;
}

}  // namespace tensorverbs::torch_backend
