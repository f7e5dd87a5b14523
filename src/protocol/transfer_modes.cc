#include "src/protocol/transfer_modes.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/protocol/channel.h"
#include "src/protocol/copy_mode.h"
#include "src/protocol/receiving_side.h"
#include "src/protocol/sending_side.h"
#include "src/protocol/tensor_request.h"
#include "src/protocol/tensor_response.h"

namespace tensorverbs::protocol {

class ZeroCopyRequests final : public RequestMode {
 public:
  absl::StatusOr<const char*> Ask(RdmaTensorRequest& r, Message& m) const override {
    ChannelEnv* env = r.channel_->env();
    // With a cached meta-data the destination is allocated now and the sender writes at once
    // (zero round trips of meta-data); validation mode always takes the meta-data round trip
    // because the checksum travels with it.
    const TensorMetaData* cached = env->memory->CachedMeta(r.key_->key.full_key);
    // A large destination goes in REQUEST only while no other one does on this channel: the
    // rest wait for the sender's word that their tensor exists (RecvTensorMetaData).
    if (cached == nullptr || env->options.data_validation || cached->dtype == DataType::kString ||
        cached->is_dead || !r.side_->MayNameLargeDestination(r, cached->tensor_bytes)) {
      return "awaiting meta-data";
    }
    if (cached->tensor_bytes > 0) {
      RETURN_IF_ERROR(r.PrepareDestination(*cached, &m.remote_addr, &m.remote_key));
    }
    r.meta_ = *cached;
    m.meta = *cached;
    r.AskForSegments(m);
    env->stats->meta_cache_hits.fetch_add(1, std::memory_order_relaxed);
    return "awaiting content";  // the sender writes into what REQUEST names
  }

  absl::Status Answered(RdmaTensorRequest& r, const Message& m) const override {
    // The sender answered instead of writing into what REQUEST named: that destination (made
    // from cached meta-data that no longer holds) is never written now, and must not be
    // delivered for a tensor of another shape, such as an empty one. A destination in the
    // caller's memory goes back with it.
    if (r.LandsInCallersMemory()) r.into_.Clear();
    r.transient_.reset();
    r.result_.Clear();
    r.staging_.Clear();
    r.segment_bytes_ = 0;
    r.segments_left_ = 1;
    r.side_->ReleaseLargeSlot(r);
    // Meta-data this task would refuse is not remembered: the next recv of the name asks
    // afresh rather than failing on the cached word of a peer that may since have changed.
    if (!m.meta.is_dead && r.CheckAnnouncedSize(m.meta).ok()) {
      r.channel_->env()->memory->CacheMeta(r.key_->key.full_key, m.meta);
    }
    return absl::OkStatus();
  }

  bool TakesGrants() const override { return true; }

  absl::Status NameDestination(RdmaTensorRequest& r, Message& rr) const override {
    if (r.meta_.is_dead || r.meta_.tensor_bytes == 0) return absl::OkStatus();  // nothing to write
    return r.PrepareDestination(r.meta_, &rr.remote_addr, &rr.remote_key);
  }

  bool Land(RdmaTensorRequest& r) const override {
    ChannelEnv* env = r.channel_->env();
    if (r.meta_.is_dead) {
      r.Deliver(absl::OkStatus(), Tensor(), true);
      return false;
    }
    const void* landed = r.staging_.IsInitialized() ? r.staging_.data() : r.result_.data();
    if (env->options.data_validation) {
      if (absl::Status s = env->VerifyChecksum(r.key_->key.full_key, r.channel_->peer_task(),
                                               landed, r.meta_.tensor_bytes, r.checksum_);
          !s.ok()) {
        r.Deliver(s, Tensor(), false);
        return false;
      }
    }
    if (r.meta_.dtype == DataType::kString) {
      absl::StatusOr<Tensor> t = r.ParseStringContent();
      r.Deliver(t.status(), t.ok() ? *t : Tensor(), false);
      return false;
    }
    if (!r.result_.IsInitialized()) {
      // No bytes (an empty tensor), or copy registration: allocate the result now.
      absl::StatusOr<Tensor> t = Tensor::Allocate(r.allocator_, r.meta_.dtype, r.meta_.shape);
      if (!t.ok()) {
        r.Deliver(t.status(), Tensor(), false);
        return false;
      }
      r.result_ = *std::move(t);
    }
    if (r.staging_.IsInitialized() && r.meta_.tensor_bytes > 0) {
      std::memcpy(r.result_.data(), r.staging_.data(), r.meta_.tensor_bytes);
      env->CountCopy(r.meta_.tensor_bytes);
    }
    r.staging_.Clear();
    r.transient_.reset();
    if (r.LandsInCallersMemory()) {
      env->stats->in_place_recvs.fetch_add(1, std::memory_order_relaxed);
    }
    return true;
  }
};

class CopyRequests final : public RequestMode {
 public:
  absl::StatusOr<const char*> Ask(RdmaTensorRequest& r, Message& m) const override {
    ChannelEnv* env = r.channel_->env();
    // Seed 002: offer the name's buffer from earlier steps; the sender asks for a new one
    // (META_DATA_RESPONSE as BUFFER_REQUEST) when the tensor does not fit. Validation mode
    // always asks, because the checksum rides the answer.
    r.staging_ = r.side_->copy_buffers().Take(r.key_->key.full_key);
    if (!r.staging_.IsInitialized() || env->options.data_validation) return "awaiting meta-data";
    absl::StatusOr<const fabric::MemoryRegion*> region =
        env->memory->FindRegistered(r.staging_.data(), r.staging_.TotalBytes());
    if (!region.ok() || *region == nullptr) return "awaiting meta-data";
    absl::StatusOr<fabric::RemoteKey> key = r.channel_->OfferKey(**region);
    if (!key.ok()) return "awaiting meta-data";
    m.remote_addr = reinterpret_cast<uint64_t>(r.staging_.data());
    m.remote_key = *key;
    m.meta = BufferMeta(r.staging_.TotalBytes());
    return "awaiting meta-data";
  }

  absl::Status Answered(RdmaTensorRequest& r, const Message& m) const override {
    if (IsBufferMeta(m.meta)) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat(
        "task ", r.channel_->peer_task(), " asked for a copy-mode buffer it described as ",
        DataTypeName(m.meta.dtype), m.meta.shape.DebugString()));
  }

  bool TakesGrants() const override { return false; }

  absl::Status NameDestination(RdmaTensorRequest& r, Message& rr) const override {
    // The name's buffer, made to hold at least the tensor's bytes.
    ChannelEnv* env = r.channel_->env();
    const uint64_t bytes = r.meta_.tensor_bytes;
    if (absl::Status s = CheckReceivedTensorBytes(bytes, env->max_tensor_bytes()); !s.ok()) {
      return r.RecvError(s);
    }
    absl::StatusOr<const fabric::MemoryRegion*> buffer =
        EnsureCopyBuffer(env->memory, r.staging_, bytes);
    if (!buffer.ok()) return r.RecvError(buffer.status());
    ASSIGN_OR_RETURN(rr.remote_key, r.channel_->OfferKey(**buffer));
    rr.remote_addr = reinterpret_cast<uint64_t>(r.staging_.data());
    return absl::OkStatus();
  }

  bool Land(RdmaTensorRequest& r) const override {
    ChannelEnv* env = r.channel_->env();
    if (!r.staging_.IsInitialized()) {
      r.Deliver(
          r.RecvError(absl::DataLossError("content arrived for a request that named no buffer")),
          Tensor(), false);
      return false;
    }
    if (env->options.data_validation) {
      const uint64_t bytes = std::min<uint64_t>(r.meta_.tensor_bytes, r.staging_.TotalBytes());
      if (absl::Status s = env->VerifyChecksum(r.key_->key.full_key, r.channel_->peer_task(),
                                               r.staging_.data(), bytes, r.checksum_);
          !s.ok()) {
        r.Deliver(s, Tensor(), false);
        return false;
      }
    }
    absl::StatusOr<ReadPayload> payload =
        ReadCopyPayload(static_cast<const uint8_t*>(r.staging_.data()), r.staging_.TotalBytes(),
                        r.allocator_, env->max_tensor_bytes());
    if (!payload.ok()) {
      r.Deliver(r.RecvError(payload.status()), Tensor(), false);
      return false;
    }
    if (!payload->is_dead) env->CountCopy(payload->tensor.TotalBytes());
    // The buffer serves the name's next transfer.
    r.side_->copy_buffers().Return(r.key_->key.full_key, std::move(r.staging_));
    r.staging_.Clear();
    r.Deliver(absl::OkStatus(), payload->tensor, payload->is_dead);
    return false;
  }
};

const RequestMode& RequestMode::Of(VerbsMode mode) {
  static const ZeroCopyRequests kZeroCopy;
  static const CopyRequests kCopy;
  if (mode == VerbsMode::kCopy) return kCopy;
  return kZeroCopy;
}

class ZeroCopyResponses final : public ResponseMode {
 public:
  bool SendsFromWhereItLies() const override { return true; }

  absl::Status Prepare(RdmaTensorResponse& r, const Tensor& tensor, bool is_dead) const override {
    r.meta_.dtype = tensor.dtype();
    r.meta_.shape = tensor.shape();
    r.meta_.is_dead = is_dead;
    // A string tensor's size is its TensorProto's, which PrepareSource serializes.
    r.meta_.tensor_bytes = is_dead ? 0 : tensor.TotalBytes();
    return r.PrepareSource(tensor);
  }

  bool Fits(const RdmaTensorResponse& r) const override {
    return r.request_.meta == r.meta_ && r.meta_.dtype != DataType::kString &&
           (r.meta_.tensor_bytes == 0 || r.request_.remote_addr != 0);
  }

  void Written(RdmaTensorResponse& r) const override {}
};

class CopyResponses final : public ResponseMode {
 public:
  bool SendsFromWhereItLies() const override { return false; }

  absl::Status Prepare(RdmaTensorResponse& r, const Tensor& tensor, bool is_dead) const override {
    ChannelEnv* env = r.channel_->env();
    r.staging_ = r.side_->copy_buffers().Take(r.name());
    uint64_t bytes = 0;
    absl::StatusOr<const fabric::MemoryRegion*> region =
        LayOutCopyPayload(env->memory, tensor, is_dead, &r.staging_, &bytes);
    if (!region.ok()) return region.status();
    r.source_region_ = *region;
    if (!is_dead) env->CountCopy(tensor.TotalBytes());
    r.source_ = r.staging_.data();
    r.meta_ = BufferMeta(bytes);
    return absl::OkStatus();
  }

  bool Fits(const RdmaTensorResponse& r) const override {
    // The receiver's buffer for this name is large enough (seed 002's TENSOR_WRITE); else it is
    // asked for a larger one (its BUFFER_REQUEST).
    return r.request_.remote_addr != 0 && IsBufferMeta(r.request_.meta) &&
           r.request_.meta.tensor_bytes >= r.meta_.tensor_bytes;
  }

  void Written(RdmaTensorResponse& r) const override {
    if (!r.staging_.IsInitialized()) return;
    // The buffer serves the name's next transfer.
    r.side_->copy_buffers().Return(r.name(), std::move(r.staging_));
    r.staging_.Clear();
  }
};

const ResponseMode& ResponseMode::Of(VerbsMode mode) {
  static const ZeroCopyResponses kZeroCopy;
  static const CopyResponses kCopy;
  if (mode == VerbsMode::kCopy) return kCopy;
  return kZeroCopy;
}

}  // namespace tensorverbs::protocol
