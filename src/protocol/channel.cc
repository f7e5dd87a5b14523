#include "src/protocol/channel.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/tensor.pb.h"
#include "src/common/checksum.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/protocol/copy_payload.h"
#include "src/tensor/tensor_codec.h"

namespace tensorverbs::protocol {
namespace {

// Content writes larger than this are split (the last piece carries the immediate), to stay
// within every provider's message size and keep single operations short.
constexpr uint64_t kMaxWriteBytes = uint64_t{1} << 30;

// Posts [0, total) in pieces of at most kMaxWriteBytes, calling post(offset, length, last) for
// each, and stops at the first refused post. Returns how many were posted, and that refusal.
template <typename PostPiece>
std::pair<int, absl::Status> PostInPieces(uint64_t total, PostPiece post) {
  const uint64_t pieces = (total + kMaxWriteBytes - 1) / kMaxWriteBytes;
  for (uint64_t i = 0; i < pieces; ++i) {
    const uint64_t offset = i * kMaxWriteBytes;
    absl::Status s = post(offset, std::min(kMaxWriteBytes, total - offset), i + 1 == pieces);
    if (!s.ok()) return {static_cast<int>(i), s};
  }
  return {static_cast<int>(pieces), absl::OkStatus()};
}

uint64_t Checksum(const void* data, uint64_t bytes) {
  return bytes == 0 ? 0 : Crc32c(data, bytes);
}

void CountCopy(const ChannelEnv* env, uint64_t bytes) {
  env->stats->CountCopy(bytes, env->worker->stats);
}

// Copy mode: keeps a name's `buffer` if it holds `bytes` (it grew, or this is the name's first
// transfer, otherwise) and returns its registered region.
absl::StatusOr<const fabric::MemoryRegion*> EnsureCopyBuffer(RdmaMemoryMgr* memory,
                                                            Tensor& buffer, uint64_t bytes) {
  const fabric::MemoryRegion* region = nullptr;
  if (!buffer.IsInitialized() || buffer.TotalBytes() < bytes) {
    ASSIGN_OR_RETURN(buffer, memory->AllocateStaging(bytes, &region));
    return region;
  }
  ASSIGN_OR_RETURN(region, memory->FindRegistered(buffer.data(), buffer.TotalBytes()));
  if (region == nullptr) return absl::InternalError("the transport's pool memory is not registrable");
  return region;
}

// Copy mode: REQUEST, META_DATA_RESPONSE and RE_REQUEST describe a name's buffer as a uint8
// tensor of its size, which keeps the codec's checks (bytes = elements x size) meaningful.
TensorMetaData BufferMeta(uint64_t bytes) {
  TensorMetaData meta;
  meta.dtype = DataType::kUInt8;
  meta.shape = TensorShape::Of({static_cast<int64_t>(bytes)});
  meta.tensor_bytes = bytes;
  return meta;
}

bool IsBufferMeta(const TensorMetaData& meta) {
  return meta.dtype == DataType::kUInt8 && meta.shape.rank() == 1 && !meta.is_dead &&
         meta.tensor_bytes >= kCopyPayloadHeaderBytes;
}

}  // namespace

const char* VerbsModeProtocol(VerbsMode mode) {
  switch (mode) {
    case VerbsMode::kZeroCopy:
      return "grpc+verbs";
    case VerbsMode::kCopy:
      return "grpc+verbs-copy";
    case VerbsMode::kGdr:
      return "grpc+gdr";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// RdmaTensorRequest

RdmaTensorRequest::RdmaTensorRequest(Channel* channel, uint32_t index, int64_t step_id,
                                     ParsedKey key, Allocator* allocator, absl::Time deadline,
                                     RecvDoneCallback done)
    : channel_(channel),
      index_(index),
      step_id_(step_id),
      key_(std::move(key)),
      allocator_(allocator),
      deadline_(deadline),
      done_(std::move(done)) {}

void RdmaTensorRequest::Start() {
  ChannelEnv* env = channel_->env();
  Message m;
  m.type = MessageType::kTensorRequest;
  m.name = key_.full_key;
  m.step_id = step_id_;
  m.request_index = index_;
  if (env->mode == VerbsMode::kCopy) {
    // Seed 002: offer the name's buffer from earlier steps; the sender asks for a new one
    // (META_DATA_RESPONSE as BUFFER_REQUEST) when the tensor does not fit. Validation mode
    // always asks, because the checksum rides the answer.
    staging_ = channel_->TakeCopyBuffer(key_.full_key);
    if (staging_.IsInitialized() && !env->data_validation) {
      absl::StatusOr<const fabric::MemoryRegion*> region =
          env->memory->FindRegistered(staging_.data(), staging_.TotalBytes());
      if (region.ok() && *region != nullptr) {
        m.remote_addr = reinterpret_cast<uint64_t>(staging_.data());
        m.remote_key = (*region)->PackRemoteKey();
        m.meta = BufferMeta(staging_.TotalBytes());
      }
    }
    state_ = State::kRequested;
    env->stats->requests.fetch_add(1, std::memory_order_relaxed);
    channel_->SendMessage(std::move(m));
    return;
  }
  // With a cached meta-data the destination is allocated now and the sender writes at once
  // (zero round trips of meta-data); validation mode always takes the meta-data round trip
  // because the checksum travels with it.
  const TensorMetaData* cached = env->memory->CachedMeta(key_.full_key);
  if (cached != nullptr && !env->data_validation && cached->dtype != DataType::kString &&
      !cached->is_dead) {
    if (cached->tensor_bytes > 0) {
      absl::Status s = PrepareDestination(*cached, &m.remote_addr, &m.remote_key);
      if (!s.ok()) {
        Fail(s);
        channel_->FinishRequest(index_);
        return;
      }
    }
    meta_ = *cached;
    m.meta = *cached;
    env->stats->meta_cache_hits.fetch_add(1, std::memory_order_relaxed);
  }
  state_ = State::kRequested;
  env->stats->requests.fetch_add(1, std::memory_order_relaxed);
  channel_->SendMessage(std::move(m));
}

absl::Status RdmaTensorRequest::PrepareDestination(const TensorMetaData& meta, uint64_t* addr,
                                                   std::string* key) {
  ChannelEnv* env = channel_->env();
  result_.Clear();
  staging_.Clear();
  transient_.reset();
  const fabric::MemoryRegion* region = nullptr;
  void* target = nullptr;
  if (meta.dtype != DataType::kString && env->registration != Registration::kCopy) {
    ASSIGN_OR_RETURN(result_, Tensor::Allocate(allocator_, meta.dtype, meta.shape));
    if (env->registration == Registration::kPerTransfer) {
      absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> mr =
          env->memory->RegisterTransient(result_.data(), meta.tensor_bytes);
      if (mr.ok()) {
        transient_ = *std::move(mr);
        region = transient_.get();
        env->stats->transient_registrations.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      ASSIGN_OR_RETURN(region, env->memory->FindRegistered(result_.data(), meta.tensor_bytes));
    }
    if (region != nullptr) target = result_.data();
  }
  if (target == nullptr) {
    // Strings, copy mode, or a destination the fabric cannot reach: a registered proxy.
    ASSIGN_OR_RETURN(staging_, env->memory->AllocateStaging(meta.tensor_bytes, &region));
    target = staging_.data();
  }
  *addr = reinterpret_cast<uint64_t>(target);
  *key = region->PackRemoteKey();
  return absl::OkStatus();
}

absl::Status RdmaTensorRequest::PrepareCopyBuffer(uint64_t bytes, uint64_t* addr,
                                                  std::string* key) {
  ASSIGN_OR_RETURN(const fabric::MemoryRegion* region,
                   EnsureCopyBuffer(channel_->env()->memory, staging_, bytes));
  *addr = reinterpret_cast<uint64_t>(staging_.data());
  *key = region->PackRemoteKey();
  return absl::OkStatus();
}

void RdmaTensorRequest::RecvTensorMetaData(const Message& m) {
  ChannelEnv* env = channel_->env();
  if (state_ != State::kRequested) {
    channel_->Close(absl::DataLossError(absl::StrCat(
        "META_DATA_RESPONSE for request ", index_, " that is not waiting for one")));
    return;
  }
  if (env->mode == VerbsMode::kCopy && !IsBufferMeta(m.meta)) {
    channel_->Close(absl::DataLossError(absl::StrCat(
        "task ", channel_->peer_task(), " asked for a copy-mode buffer it described as ",
        DataTypeName(m.meta.dtype), m.meta.shape.DebugString())));
    return;
  }
  meta_ = m.meta;
  checksum_ = m.checksum;
  const bool copy = env->mode == VerbsMode::kCopy;
  if (!copy && !m.meta.is_dead) env->memory->CacheMeta(key_.full_key, m.meta);
  Message rr;
  rr.type = MessageType::kTensorReRequest;
  rr.name = key_.full_key;
  rr.step_id = step_id_;
  rr.request_index = index_;
  rr.meta = m.meta;
  // A recv that already ended (abort, timeout) or cannot allocate still answers, with no
  // target: the sender then writes nothing but the immediate, and releases its tensor.
  if (!finished() && (copy || (!m.meta.is_dead && m.meta.tensor_bytes > 0))) {
    absl::Status s = copy ? PrepareCopyBuffer(m.meta.tensor_bytes, &rr.remote_addr, &rr.remote_key)
                          : PrepareDestination(m.meta, &rr.remote_addr, &rr.remote_key);
    if (!s.ok()) Fail(s);
  }
  state_ = State::kReRequested;
  env->stats->re_requests.fetch_add(1, std::memory_order_relaxed);
  channel_->SendMessage(std::move(rr));
}

void RdmaTensorRequest::RecvCopyContent() {
  ChannelEnv* env = channel_->env();
  if (!staging_.IsInitialized()) {
    Deliver(absl::DataLossError(absl::StrCat("recv of '", key_.full_key, "' from task ",
                                             channel_->peer_task(),
                                             ": content arrived for a request that named no buffer")),
            Tensor(), false);
    return;
  }
  if (env->data_validation) {
    const uint64_t bytes = std::min<uint64_t>(meta_.tensor_bytes, staging_.TotalBytes());
    const uint64_t sum = Checksum(staging_.data(), bytes);
    if (sum != checksum_) {
      env->stats->checksum_failures.fetch_add(1, std::memory_order_relaxed);
      Deliver(absl::DataLossError(absl::StrFormat(
                  "recv of '%s' from task %s: checksum mismatch (sent %08x, received %08x) over "
                  "%d bytes: the data was corrupted in transit",
                  key_.full_key, channel_->peer_task(), checksum_, sum, bytes)),
              Tensor(), false);
      return;
    }
  }
  absl::StatusOr<ReadPayload> payload = ReadCopyPayload(
      static_cast<const uint8_t*>(staging_.data()), staging_.TotalBytes(), allocator_);
  if (!payload.ok()) {
    Deliver(absl::Status(payload.status().code(),
                         absl::StrCat("recv of '", key_.full_key, "' from task ",
                                      channel_->peer_task(), ": ", payload.status().message())),
            Tensor(), false);
    return;
  }
  if (!payload->is_dead) CountCopy(env, payload->tensor.TotalBytes());
  // The buffer serves the name's next transfer.
  channel_->ReturnCopyBuffer(key_.full_key, std::move(staging_));
  staging_.Clear();
  Deliver(absl::OkStatus(), payload->tensor, payload->is_dead);
}

void RdmaTensorRequest::RecvTensorContent() {
  ChannelEnv* env = channel_->env();
  state_ = State::kDone;
  if (finished()) return;
  if (env->mode == VerbsMode::kCopy) {
    RecvCopyContent();
    return;
  }
  if (meta_.is_dead) {
    Deliver(absl::OkStatus(), Tensor(), true);
    return;
  }
  const void* landed = staging_.IsInitialized() ? staging_.data() : result_.data();
  if (env->data_validation) {
    const uint64_t sum = Checksum(landed, meta_.tensor_bytes);
    if (sum != checksum_) {
      env->stats->checksum_failures.fetch_add(1, std::memory_order_relaxed);
      Deliver(absl::DataLossError(absl::StrFormat(
                  "recv of '%s' from task %s: checksum mismatch (sent %08x, received %08x) over "
                  "%d bytes: the data was corrupted in transit",
                  key_.full_key, channel_->peer_task(), checksum_, sum, meta_.tensor_bytes)),
              Tensor(), false);
      return;
    }
  }
  if (meta_.dtype == DataType::kString) {
    proto::TensorProto tp;
    if (!tp.ParseFromArray(staging_.data(), static_cast<int>(meta_.tensor_bytes))) {
      Deliver(absl::DataLossError(absl::StrCat("recv of '", key_.full_key, "' from task ",
                                               channel_->peer_task(),
                                               ": the string tensor's TensorProto does not parse")),
              Tensor(), false);
      return;
    }
    absl::StatusOr<Tensor> t = TensorFromProto(tp, allocator_);
    if (!t.ok()) {
      Deliver(t.status(), Tensor(), false);
      return;
    }
    Deliver(absl::OkStatus(), *t, false);
    return;
  }
  if (!result_.IsInitialized()) {
    // No bytes (an empty tensor), or copy mode: allocate the result now.
    absl::StatusOr<Tensor> t = Tensor::Allocate(allocator_, meta_.dtype, meta_.shape);
    if (!t.ok()) {
      Deliver(t.status(), Tensor(), false);
      return;
    }
    result_ = *std::move(t);
  }
  if (staging_.IsInitialized() && meta_.tensor_bytes > 0) {
    std::memcpy(result_.data(), staging_.data(), meta_.tensor_bytes);
    CountCopy(env, meta_.tensor_bytes);
  }
  Tensor result = std::move(result_);
  staging_.Clear();
  transient_.reset();
  Deliver(absl::OkStatus(), result, false);
}

void RdmaTensorRequest::Fail(const absl::Status& status) {
  if (finished()) return;
  Deliver(status, Tensor(), false);
}

void RdmaTensorRequest::Deliver(const absl::Status& status, const Tensor& tensor, bool is_dead) {
  RecvDoneCallback done = std::move(done_);
  done_ = nullptr;
  channel_->env()->deliver([done = std::move(done), status, tensor, is_dead]() mutable {
    std::move(done)(status, tensor, is_dead);
  });
}

std::vector<Tensor> RdmaTensorRequest::TakeMemory() {
  std::vector<Tensor> memory;
  if (result_.IsInitialized()) memory.push_back(std::move(result_));
  if (staging_.IsInitialized()) memory.push_back(std::move(staging_));
  result_.Clear();
  staging_.Clear();
  return memory;
}

// ---------------------------------------------------------------------------------------------
// RdmaTensorResponse

RdmaTensorResponse::RdmaTensorResponse(Channel* channel, uint64_t serial, const Message& request)
    : channel_(channel), serial_(serial), request_(request) {}

void RdmaTensorResponse::Start(std::shared_ptr<RemoteRendezvous> rendezvous,
                               const ParsedKey& key) {
  rendezvous_ = std::move(rendezvous);
  ChannelEnv* env = channel_->env();
  const uint64_t channel_id = channel_->id(), serial = serial_;
  const uint32_t index = request_.request_index;
  auto post = env->post;
  auto find = env->find_channel;
  token_ = rendezvous_->RecvLocalAsync(
      key, [post, find, channel_id, serial, index](const absl::Status& s, const Tensor& t,
                                                  bool is_dead) {
        post([find, channel_id, serial, index, s, t, is_dead]() mutable {
          if (Channel* c = find(channel_id)) c->OnLocalTensor(serial, index, s, t, is_dead);
        });
      });
}

void RdmaTensorResponse::Cancel() {
  if (state_ == State::kWaitTensor && rendezvous_ != nullptr && token_ != 0) {
    rendezvous_->CancelLocalRecv(token_, absl::CancelledError("channel closed"));
  }
  state_ = State::kDone;
}

absl::Status RdmaTensorResponse::PrepareSource(const Tensor& tensor) {
  ChannelEnv* env = channel_->env();
  if (meta_.is_dead) return absl::OkStatus();
  if (tensor.dtype() == DataType::kString) {
    // Its TensorProto travels from registered staging.
    proto::TensorProto tp;
    TensorToProto(tensor, &tp);
    meta_.tensor_bytes = tp.ByteSizeLong();
    ASSIGN_OR_RETURN(staging_, env->memory->AllocateStaging(meta_.tensor_bytes, &source_region_));
    if (!tp.SerializeToArray(staging_.data(), static_cast<int>(meta_.tensor_bytes))) {
      return absl::InternalError("serializing the string tensor failed");
    }
    source_ = staging_.data();
    return absl::OkStatus();
  }
  if (meta_.tensor_bytes == 0) return absl::OkStatus();
  if (env->registration == Registration::kPool) {
    ASSIGN_OR_RETURN(source_region_, env->memory->FindRegistered(tensor.data(), meta_.tensor_bytes));
  } else if (env->registration == Registration::kPerTransfer) {
    absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> mr =
        env->memory->RegisterTransient(tensor.data(), meta_.tensor_bytes);
    if (mr.ok()) {
      transient_ = *std::move(mr);
      source_region_ = transient_.get();
      env->stats->transient_registrations.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (source_region_ != nullptr) {
    source_ = tensor.data();
    return absl::OkStatus();
  }
  // Copy mode, or a tensor outside the registered pool: stage it.
  ASSIGN_OR_RETURN(staging_,
                   env->memory->StageCopyOf(tensor.data(), meta_.tensor_bytes, &source_region_));
  CountCopy(env, meta_.tensor_bytes);
  source_ = staging_.data();
  return absl::OkStatus();
}

absl::Status RdmaTensorResponse::PrepareCopySource(const Tensor& tensor, bool is_dead) {
  ChannelEnv* env = channel_->env();
  CopyPayload payload(tensor, is_dead);
  const uint64_t bytes = payload.Size();
  staging_ = channel_->TakeCopyBuffer(request_.name);
  ASSIGN_OR_RETURN(source_region_, EnsureCopyBuffer(env->memory, staging_, bytes));
  payload.WriteTo(static_cast<uint8_t*>(staging_.data()));
  if (!is_dead) CountCopy(env, tensor.TotalBytes());
  source_ = staging_.data();
  meta_ = BufferMeta(bytes);
  return absl::OkStatus();
}

void RdmaTensorResponse::Resume(const absl::Status& status, const Tensor& tensor, bool is_dead) {
  ChannelEnv* env = channel_->env();
  if (state_ != State::kWaitTensor) return;
  if (!status.ok()) {
    SendError(status);
    return;
  }
  if (env->mode == VerbsMode::kCopy) {
    tensor_ = tensor;
    if (absl::Status s = PrepareCopySource(tensor, is_dead); !s.ok()) {
      SendError(absl::Status(s.code(), absl::StrCat("the sender cannot transfer the tensor: ",
                                                    s.message())));
      return;
    }
    // The receiver's buffer for this name is large enough: write at once (seed 002's
    // TENSOR_WRITE); else ask for a larger one (its BUFFER_REQUEST).
    if (!env->data_validation && request_.remote_addr != 0 && IsBufferMeta(request_.meta) &&
        request_.meta.tensor_bytes >= meta_.tensor_bytes) {
      WriteContent(request_.remote_addr, request_.remote_key);
      return;
    }
    SendMetaData();
    return;
  }
  tensor_ = tensor;
  meta_.dtype = tensor.dtype();
  meta_.shape = tensor.shape();
  meta_.is_dead = is_dead;
  // A string tensor's size is its TensorProto's, which PrepareSource serializes.
  meta_.tensor_bytes = is_dead ? 0 : tensor.TotalBytes();
  if (absl::Status s = PrepareSource(tensor); !s.ok()) {
    SendError(absl::Status(s.code(), absl::StrCat("the sender cannot transfer the tensor: ",
                                                  s.message())));
    return;
  }
  const bool can_write_now =
      !env->data_validation && request_.meta == meta_ && meta_.dtype != DataType::kString &&
      (meta_.tensor_bytes == 0 || request_.remote_addr != 0);
  if (can_write_now) {
    WriteContent(request_.remote_addr, request_.remote_key);
    return;
  }
  SendMetaData();
}

void RdmaTensorResponse::SendMetaData() {
  ChannelEnv* env = channel_->env();
  Message m;
  m.type = MessageType::kMetaDataResponse;
  m.name = request_.name;
  m.step_id = request_.step_id;
  m.request_index = request_.request_index;
  m.meta = meta_;
  if (env->data_validation) m.checksum = Checksum(source_, meta_.tensor_bytes);
  state_ = State::kWaitReRequest;
  env->stats->meta_responses.fetch_add(1, std::memory_order_relaxed);
  channel_->SendMessage(std::move(m));
}

void RdmaTensorResponse::RecvReRequest(const Message& m) {
  if (state_ != State::kWaitReRequest) {
    channel_->Close(absl::DataLossError(absl::StrCat(
        "RE_REQUEST for request ", m.request_index, " that is not waiting for one")));
    return;
  }
  if (m.remote_addr == 0 && meta_.tensor_bytes > 0 && !meta_.is_dead) {
    // The receiver gave up on this recv (or could not allocate): nothing to write but the
    // release, which the immediate alone carries.
    meta_.tensor_bytes = 0;
  }
  WriteContent(m.remote_addr, m.remote_key);
}

void RdmaTensorResponse::WriteContent(uint64_t addr, const std::string& key) {
  MessageBuffer* mb = channel_->message_buffer();
  fabric::Endpoint* ep = channel_->endpoint();
  state_ = State::kWriting;
  const uint64_t context = MakeContext(OpTag::kContent, request_.request_index);
  const uint32_t imm = request_.request_index;
  absl::Status s;
  if (meta_.is_dead || meta_.tensor_bytes == 0) {
    writes_left_ = 1;
    s = ep->PostWriteWithImm(mb->EmptyLocalSource(), mb->EmptyRemoteTarget(), imm, context);
  } else {
    // The last piece carries the immediate; pieces already posted when one is refused still
    // complete.
    auto* source = const_cast<uint8_t*>(static_cast<const uint8_t*>(source_));
    std::tie(writes_left_, s) =
        PostInPieces(meta_.tensor_bytes, [&](uint64_t offset, uint64_t len, bool last) {
          fabric::LocalBuffer local{source_region_, source + offset, len};
          fabric::RemoteBuffer remote{key, addr + offset, len};
          return last ? ep->PostWriteWithImm(local, remote, imm, context)
                      : ep->PostWrite(local, remote, context);
        });
  }
  if (!s.ok()) {
    // The target the receiver named is not writable (a bad key or range): report it to the
    // receiver rather than trusting the peer's description.
    if (writes_left_ > 0) {
      channel_->Close(absl::UnavailableError(absl::StrCat(
          "content write to task ", channel_->peer_task(), " failed midway: ", s.message())));
      return;
    }
    SendError(absl::InvalidArgumentError(absl::StrCat(
        "the sender could not write the tensor to the receiver's destination: ", s.message())));
  }
}

bool RdmaTensorResponse::OnWriteDone() {
  if (--writes_left_ > 0) return false;
  ChannelEnv* env = channel_->env();
  if (env->mode == VerbsMode::kCopy && staging_.IsInitialized()) {
    channel_->ReturnCopyBuffer(request_.name, std::move(staging_));
    staging_.Clear();
  }
  env->stats->content_writes.fetch_add(1, std::memory_order_relaxed);
  env->stats->content_bytes.fetch_add(static_cast<int64_t>(meta_.tensor_bytes),
                                      std::memory_order_relaxed);
  state_ = State::kDone;
  return true;
}

void RdmaTensorResponse::SendError(const absl::Status& status) {
  ChannelEnv* env = channel_->env();
  Message m;
  m.type = MessageType::kErrorStatus;
  m.name = request_.name;
  m.step_id = request_.step_id;
  m.request_index = request_.request_index;
  m.error = status.ok() ? absl::InternalError("unknown error") : status;
  state_ = State::kDone;
  env->stats->errors_sent.fetch_add(1, std::memory_order_relaxed);
  // A failed send closes the channel, which deletes this response: nothing of `this` after it.
  Channel* channel = channel_;
  const uint32_t index = request_.request_index;
  channel->SendMessage(std::move(m));
  channel->FinishResponse(index);
}

// ---------------------------------------------------------------------------------------------
// Channel

Channel::Channel(ChannelEnv* env, Role role, uint64_t id, std::string peer_task)
    : env_(env), role_(role), id_(id), peer_task_(std::move(peer_task)) {}

Channel::~Channel() {
  Close(absl::CancelledError(absl::StrCat("channel to task ", peer_task_, " destroyed")));
}

absl::Status Channel::Init() {
  ASSIGN_OR_RETURN(endpoint_, env_->domain->CreateEndpoint());
  ASSIGN_OR_RETURN(mb_, MessageBuffer::Create(
                            env_->domain, env_->message_slots, env_->message_batch,
                            {&env_->stats->control_slots, &env_->stats->control_messages}));
  return absl::OkStatus();
}

absl::Status Channel::Connect(const std::string& peer_address, uint64_t rx_addr,
                              std::string rx_key, int rx_slots, uint64_t peer_incarnation) {
  RETURN_IF_ERROR(endpoint_->Connect(peer_address));
  RETURN_IF_ERROR(mb_->Connect(endpoint_.get(), rx_addr, std::move(rx_key), rx_slots));
  peer_incarnation_ = peer_incarnation;
  state_ = State::kReady;
  std::vector<uint32_t> queued;
  queued.swap(queued_);
  for (uint32_t index : queued) {
    auto it = requests_.find(index);
    if (it == requests_.end()) continue;
    if (it->second->finished()) {
      FinishRequest(index);  // aborted while queued: never sent, nothing can land
      continue;
    }
    it->second->Start();
  }
  std::vector<uint32_t> pulls;
  pulls.swap(queued_pulls_);
  for (uint32_t index : pulls) IssuePull(index);
  return absl::OkStatus();
}

std::string Channel::Describe() const {
  const fabric::Capabilities& caps = env_->domain->capabilities();
  return absl::StrCat(role_ == Role::kOwner ? "recv channel from task " : "send channel to task ",
                      peer_task_, " over ", caps.backend, " (", caps.provider, "), endpoint ",
                      absl::BytesToHexString(endpoint_ ? endpoint_->LocalAddress() : "")
                          .substr(0, 32),
                      ", ", mb_ ? mb_->rx_slots() : 0, " message slots");
}

void Channel::StartRecv(int64_t step_id, const ParsedKey& key, Allocator* allocator,
                        absl::Time deadline, RecvDoneCallback done) {
  auto fail = [&](const absl::Status& s) {
    env_->worker->callback_executor->Schedule(
        [done = std::move(done), s]() mutable { std::move(done)(s, Tensor(), false); });
  };
  if (state_ == State::kClosed) {
    fail(absl::UnavailableError(absl::StrCat("channel to task ", peer_task_, " is closed")));
    return;
  }
  if (key.full_key.size() > kMaxNameLength) {
    fail(absl::InvalidArgumentError(absl::StrCat(
        "recv of a ", key.full_key.size(), "-byte rendezvous key over grpc+verbs: the protocol's "
        "limit is ", kMaxNameLength, " bytes; use shorter tensor names")));
    return;
  }
  absl::StatusOr<uint32_t> index = indexes_.Allocate();
  if (!index.ok()) {
    fail(absl::ResourceExhaustedError(absl::StrCat("too many pending recvs from task ", peer_task_)));
    return;
  }
  auto request = std::make_unique<RdmaTensorRequest>(this, *index, step_id, key, allocator,
                                                     deadline, std::move(done));
  RdmaTensorRequest* raw = request.get();
  requests_.emplace(*index, std::move(request));
  if (state_ == State::kReady) {
    raw->Start();
  } else {
    queued_.push_back(*index);
  }
}

void Channel::StartPull(const grpc_transport::RemoteTensorRef& ref, Tensor dest,
                        absl::Time deadline, PullDone done) {
  if (state_ == State::kClosed) {
    std::move(done)(absl::UnavailableError(absl::StrCat("channel to task ", peer_task_,
                                                        " is closed")));
    return;
  }
  absl::StatusOr<uint32_t> index = indexes_.Allocate();
  if (!index.ok()) {
    std::move(done)(absl::ResourceExhaustedError(absl::StrCat("too many pending reads from task ",
                                                              peer_task_)));
    return;
  }
  auto pull = std::make_unique<Pull>();
  pull->ref = ref;
  pull->dest = std::move(dest);
  pull->deadline = deadline;
  pull->done = std::move(done);
  pulls_.emplace(*index, std::move(pull));
  if (state_ == State::kReady) {
    IssuePull(*index);
  } else {
    queued_pulls_.push_back(*index);
  }
}

void Channel::IssuePull(uint32_t index) {
  auto it = pulls_.find(index);
  if (it == pulls_.end()) return;
  Pull& pull = *it->second;
  auto fail = [&](const absl::Status& s) {
    EndPull(pull, s);
    pulls_.erase(index);  // nothing was posted: nothing can land
    indexes_.Release(index);
  };
  if (pull.done == nullptr) {
    fail(absl::OkStatus());  // ended (deadline) before it was issued
    return;
  }
  const uint64_t bytes = pull.ref.bytes;
  if (bytes != pull.dest.TotalBytes()) {
    fail(absl::InvalidArgumentError("the destination does not match the lent tensor's size"));
    return;
  }
  absl::StatusOr<const fabric::MemoryRegion*> region =
      env_->memory->FindRegistered(pull.dest.data(), bytes);
  if (!region.ok()) {
    fail(region.status());
    return;
  }
  void* target = pull.dest.data();
  if (*region == nullptr) {
    // An unregistered destination: read into a registered proxy and copy.
    const fabric::MemoryRegion* staging_region = nullptr;
    absl::StatusOr<Tensor> staging = env_->memory->AllocateStaging(bytes, &staging_region);
    if (!staging.ok()) {
      fail(absl::InternalError("no registered memory to read the tensor into"));
      return;
    }
    pull.staging = *std::move(staging);
    region = staging_region;
    target = pull.staging.data();
  }
  const uint64_t context = MakeContext(OpTag::kRead, index);
  absl::Status s;
  std::tie(pull.reads_left, s) = PostInPieces(bytes, [&](uint64_t offset, uint64_t len, bool) {
    return endpoint_->PostRead(
        fabric::LocalBuffer{*region, static_cast<uint8_t*>(target) + offset, len},
        fabric::RemoteBuffer{pull.ref.key, pull.ref.addr + offset, len}, context);
  });
  if (s.ok()) return;
  if (pull.reads_left == 0) {
    fail(absl::InvalidArgumentError(absl::StrCat("task ", peer_task_,
                                                 " lent a tensor that cannot be read: ",
                                                 s.message())));
    return;
  }
  // The reads already posted still complete.
  Close(absl::UnavailableError(absl::StrCat("a read from task ", peer_task_,
                                            " failed midway: ", s.message())));
}

void Channel::OnReadDone(uint32_t index) {
  auto it = pulls_.find(index);
  if (it == pulls_.end()) return;
  Pull& pull = *it->second;
  if (--pull.reads_left > 0) return;
  // The sender may release the tensor now: a zero-byte write whose immediate names it.
  absl::Status release =
      endpoint_->PostWriteWithImm(mb_->EmptyLocalSource(), mb_->EmptyRemoteTarget(),
                                  pull.ref.tensor_key, MakeContext(OpTag::kAck, 0));
  if (pull.staging.IsInitialized()) {
    std::memcpy(pull.dest.data(), pull.staging.data(), pull.ref.bytes);
    CountCopy(env_, pull.ref.bytes);
  }
  env_->stats->content_bytes.fetch_add(static_cast<int64_t>(pull.ref.bytes),
                                       std::memory_order_relaxed);
  EndPull(pull, absl::OkStatus());
  pulls_.erase(it);
  indexes_.Release(index);
  if (!release.ok()) {
    Close(absl::UnavailableError(absl::StrCat("releasing a tensor of task ", peer_task_,
                                              " failed: ", release.message())));
  }
}

void Channel::EndPull(Pull& pull, const absl::Status& status) {
  if (pull.done == nullptr) return;
  PullDone done = std::move(pull.done);
  pull.done = nullptr;
  std::move(done)(status);
}

void Channel::AbortStep(int64_t step_id, const absl::Status& status) {
  std::vector<uint32_t> unsent;
  for (auto& [index, request] : requests_) {
    if (request->step_id() != step_id) continue;
    request->Fail(status);
    if (request->state() == RdmaTensorRequest::State::kQueued) unsent.push_back(index);
  }
  // Never sent: no late content can come, so the record goes now. Sent ones stay until the
  // sender answers (content or ERROR_STATUS) so their memory is not reused under a write.
  for (uint32_t index : unsent) {
    queued_.erase(std::remove(queued_.begin(), queued_.end(), index), queued_.end());
    FinishRequest(index);
  }
}

void Channel::ExpireRequests(absl::Time now) {
  for (auto& [index, request] : requests_) {
    if (request->finished() || request->deadline() > now) continue;
    if (state_ == State::kConnecting) {
      request->Fail(absl::UnavailableError(absl::StrCat(
          "recv of '", request->key(), "': the grpc+verbs channel to task ", peer_task_, " at ",
          peer_address_, " was not set up before the recv's deadline (is the task running?)")));
      continue;
    }
    request->Fail(absl::DeadlineExceededError(absl::StrCat(
        "recv of '", request->key(), "' from task ", peer_task_,
        " timed out; raise TENSORVERBS_RECV_TIMEOUT_MS if the producer is slow")));
  }
  for (auto& [index, pull] : pulls_) {
    if (pull->done == nullptr || pull->deadline > now) continue;
    // The record (and its memory) stays until the read completes or the channel closes.
    EndPull(*pull, absl::DeadlineExceededError(absl::StrCat(
                       "reading a tensor from task ", peer_task_,
                       " timed out; raise TENSORVERBS_RECV_TIMEOUT_MS if the network is slow")));
  }
}

size_t Channel::responses_in_progress() const {
  size_t n = 0;
  for (const auto& [index, response] : responses_) {
    n += response->state() == RdmaTensorResponse::State::kWriting ||
         response->state() == RdmaTensorResponse::State::kWaitReRequest;
  }
  return n;
}

size_t Channel::pending_requests() const {
  size_t n = 0;
  for (const auto& [index, request] : requests_) n += !request->finished();
  for (const auto& [index, pull] : pulls_) n += pull->done != nullptr;
  return n;
}

void Channel::SendMessage(Message m) {
  if (state_ == State::kClosed) return;
  absl::Status s = mb_->Send(std::move(m));
  if (!s.ok()) {
    Close(absl::UnavailableError(absl::StrCat("sending a control message to task ", peer_task_,
                                              " failed: ", s.message())));
  }
}

Tensor Channel::TakeCopyBuffer(const std::string& name) {
  auto it = copy_buffers_.find(name);
  if (it == copy_buffers_.end()) return Tensor();
  Tensor buffer = std::move(it->second);
  copy_buffers_.erase(it);
  return buffer;
}

void Channel::ReturnCopyBuffer(const std::string& name, Tensor buffer) {
  if (state_ == State::kClosed) return;
  // Bounded like the key cache: a model has a fixed set of names, a runaway peer does not.
  if (copy_buffers_.size() >= kMaxCachedKeys) copy_buffers_.clear();
  Tensor& slot = copy_buffers_[name];
  // Two transfers of one name overlapped (different steps): keep the larger buffer.
  if (!slot.IsInitialized() || slot.TotalBytes() < buffer.TotalBytes()) slot = std::move(buffer);
}

void Channel::FinishRequest(uint32_t index) {
  requests_.erase(index);
  indexes_.Release(index);
}

void Channel::FinishResponse(uint32_t index) { responses_.erase(index); }

void Channel::OnLocalTensor(uint64_t serial, uint32_t index, const absl::Status& status,
                            const Tensor& tensor, bool is_dead) {
  auto it = responses_.find(index);
  if (it == responses_.end() || it->second->serial() != serial) return;  // cancelled
  it->second->Resume(status, tensor, is_dead);
}

void Channel::OnCompletion(const fabric::Completion& c) {
  if (state_ == State::kClosed) return;
  if (!c.status.ok()) {
    Close(absl::UnavailableError(absl::StrCat("RDMA operation with task ", peer_task_,
                                              " failed: ", c.status.message())));
    return;
  }
  if (c.kind == fabric::CompletionKind::kRemoteWriteImm) {
    switch (ClassifyImm(c.imm)) {
      case ImmKind::kControlMessage: {
        OnControlMessage();
        // The ACK goes out after whatever the messages set off (a content write the peer is
        // waiting for is deferred to the end of this completion batch too), so it never
        // delays an answer; one ACK covers every slot that arrived in the meantime. An ACK task
        // is queued exactly while slots are unacknowledged (it acknowledges all of them), so
        // only the first slot since the last ACK queues one.
        if (state_ == State::kClosed || mb_->unacknowledged() != 1) return;
        auto find = env_->find_channel;
        const uint64_t id = id_;
        env_->post([find, id]() {
          if (Channel* c = find(id)) c->AcknowledgeMessages();
        });
        return;
      }
      case ImmKind::kAck:
        if (absl::Status s = mb_->OnAck(AckCount(c.imm)); !s.ok()) Close(s);
        return;
      case ImmKind::kRequest:
        OnContent(c.imm);
        return;
    }
    return;
  }
  const uint64_t value = ContextValue(c.context);
  switch (ContextTag(c.context)) {
    case OpTag::kMessage:
      if (absl::Status s = mb_->OnMessageWritten(value); !s.ok()) Close(s);
      return;
    case OpTag::kAck:
      return;
    case OpTag::kRead:
      OnReadDone(static_cast<uint32_t>(value));
      return;
    case OpTag::kContent: {
      auto it = responses_.find(static_cast<uint32_t>(value));
      if (it != responses_.end() && it->second->OnWriteDone()) responses_.erase(it);
      return;
    }
  }
}

absl::StatusOr<const ParsedKey*> Channel::ValidKey(const std::string& name) {
  if (auto it = valid_keys_.find(name); it != valid_keys_.end()) return &it->second;
  const WorkerEnv* worker = env_->worker;
  absl::StatusOr<ParsedKey> key = ParsedKey::Parse(name);
  if (!key.ok()) return absl::InvalidArgumentError(std::string(key.status().message()));
  if (key->src.TaskName() != worker->task_name) {
    return absl::InvalidArgumentError(absl::StrCat("key '", key->full_key,
                                                   "' names source task ", key->src.TaskName(),
                                                   ", not ", worker->task_name));
  }
  if (key->src_incarnation != worker->incarnation) {
    return absl::AbortedError(absl::StrFormat(
        "key '%s' was made for incarnation %016x of task %s, which now runs incarnation "
        "%016x: the task was probably restarted; rebuild keys from its new incarnation",
        key->full_key, key->src_incarnation, worker->task_name, worker->incarnation));
  }
  // A training loop asks for the same keys every step: parse each once. Bounded, so a peer
  // inventing names cannot grow it without limit.
  if (valid_keys_.size() >= kMaxCachedKeys) valid_keys_.clear();
  return &valid_keys_.emplace(name, *std::move(key)).first->second;
}

void Channel::AcknowledgeMessages() {
  if (state_ == State::kClosed) return;
  if (absl::Status s = mb_->Acknowledge(); !s.ok()) {
    Close(absl::UnavailableError(absl::StrCat("acknowledging a control message of task ",
                                              peer_task_, " failed: ", s.message())));
  }
}

void Channel::OnContent(uint32_t index) {
  if (role_ == Role::kAcceptor && env_->mode == VerbsMode::kGdr) {
    if (env_->release_lent) env_->release_lent(peer_task_, index);
    return;
  }
  auto it = role_ == Role::kOwner ? requests_.find(index) : requests_.end();
  if (it == requests_.end() || it->second->state() == RdmaTensorRequest::State::kQueued) {
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    VLOG(1) << "dropped immediate " << index << " from task " << peer_task_
            << ": no request with that index is waiting";
    return;
  }
  it->second->RecvTensorContent();
  FinishRequest(index);
}

void Channel::OnControlMessage() {
  std::vector<Message> batch;
  if (absl::Status s = mb_->OnControlMessage(&batch); !s.ok()) {
    Close(absl::DataLossError(
        absl::StrCat("control message from task ", peer_task_, ": ", s.message())));
    return;
  }
  for (Message& m : batch) {
    if (state_ == State::kClosed) return;
    HandleMessage(m);
  }
}

void Channel::HandleMessage(const Message& m) {
  const bool owner = role_ == Role::kOwner;
  switch (m.type) {
    case MessageType::kMetaDataResponse:
    case MessageType::kErrorStatus: {
      if (!owner) break;
      auto it = requests_.find(m.request_index);
      if (it == requests_.end()) {
        env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (m.type == MessageType::kMetaDataResponse) {
        it->second->RecvTensorMetaData(m);
      } else {
        it->second->Fail(absl::Status(
            m.error.code(), absl::StrCat("task ", peer_task_, " could not send '", m.name,
                                          "': ", m.error.message())));
        FinishRequest(m.request_index);
      }
      return;
    }
    case MessageType::kTensorRequest: {
      if (owner) break;
      if (responses_.contains(m.request_index)) {
        Close(absl::DataLossError(absl::StrCat("task ", peer_task_, " reused request index ",
                                               m.request_index, " while it was pending")));
        return;
      }
      auto response = std::make_unique<RdmaTensorResponse>(this, next_serial_++, m);
      RdmaTensorResponse* raw = response.get();
      responses_.emplace(m.request_index, std::move(response));
      absl::StatusOr<const ParsedKey*> key = ValidKey(m.name);
      absl::Status error = key.status();
      std::shared_ptr<RemoteRendezvous> rendezvous;
      if (error.ok()) {
        absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r =
            env_->rendezvous_mgr->Find(m.step_id);
        if (r.ok()) {
          rendezvous = *std::move(r);
        } else {
          error = r.status();
        }
      }
      if (!error.ok()) {
        raw->Resume(error, Tensor(), false);  // sends ERROR_STATUS and finishes
        return;
      }
      raw->Start(std::move(rendezvous), **key);
      return;
    }
    case MessageType::kTensorReRequest: {
      if (owner) break;
      auto it = responses_.find(m.request_index);
      if (it == responses_.end()) {
        Close(absl::DataLossError(absl::StrCat("RE_REQUEST from task ", peer_task_,
                                               " for unknown request ", m.request_index)));
        return;
      }
      it->second->RecvReRequest(m);
      return;
    }
  }
  Close(absl::DataLossError(absl::StrCat("task ", peer_task_, " sent ",
                                         MessageTypeName(m.type), " on a channel where ",
                                         owner ? "it sends tensors" : "it receives them")));
}

void Channel::Close(const absl::Status& status) {
  if (state_ == State::kClosed) return;
  state_ = State::kClosed;
  close_status_ = status.ok() ? absl::CancelledError("closed") : status;
  if (status.code() != absl::StatusCode::kCancelled) {
    env_->stats->channel_errors.fetch_add(1, std::memory_order_relaxed);
    LOG(WARNING) << Describe() << " closed: " << status.message();
  }
  std::vector<Tensor> memory;
  for (auto& [index, request] : requests_) {
    request->Fail(status);
    for (Tensor& t : request->TakeMemory()) memory.push_back(std::move(t));
  }
  requests_.clear();
  queued_.clear();
  for (auto& [index, pull] : pulls_) {
    EndPull(*pull, close_status_);
    if (pull->dest.IsInitialized()) memory.push_back(std::move(pull->dest));
    if (pull->staging.IsInitialized()) memory.push_back(std::move(pull->staging));
  }
  pulls_.clear();
  queued_pulls_.clear();
  for (auto& [index, response] : responses_) response->Cancel();
  // No more operations from this side. The endpoint goes first: on a NIC, writes in flight read
  // the responses' tensors and the message buffers until its queue pair is gone.
  endpoint_.reset();
  mb_.reset();
  responses_.clear();
  copy_buffers_.clear();
  if (!memory.empty() && env_->quarantine_memory) {
    // The peer may still be alive and writing into these destinations.
    env_->quarantine_memory(std::move(memory), absl::Now() + env_->quarantine);
  }
}

}  // namespace tensorverbs::protocol
