#include "src/protocol/copy_mode.h"

#include <utility>

#include "src/common/status_macros.h"

namespace tensorverbs::protocol {

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

absl::StatusOr<const fabric::MemoryRegion*> EnsureCopyBuffer(RdmaMemoryMgr* memory, Tensor& buffer,
                                                             uint64_t bytes) {
  const fabric::MemoryRegion* region = nullptr;
  if (!buffer.IsInitialized() || buffer.TotalBytes() < bytes) {
    ASSIGN_OR_RETURN(buffer, memory->AllocateStaging(bytes, &region));
    return region;
  }
  ASSIGN_OR_RETURN(region, memory->FindRegistered(buffer.data(), buffer.TotalBytes()));
  if (region == nullptr)
    return absl::InternalError("the transport's pool memory is not registrable");
  return region;
}

Tensor CopyBuffers::Take(const std::string& name) {
  auto it = buffers_.find(name);
  if (it == buffers_.end()) return Tensor();
  Tensor buffer = std::move(it->second);
  buffers_.erase(it);
  return buffer;
}

void CopyBuffers::Return(const std::string& name, Tensor buffer) {
  if (buffers_.size() >= kMaxNames) buffers_.clear();
  Tensor& slot = buffers_[name];
  if (!slot.IsInitialized() || slot.TotalBytes() < buffer.TotalBytes()) slot = std::move(buffer);
}

absl::StatusOr<const fabric::MemoryRegion*> LayOutCopyPayload(RdmaMemoryMgr* memory,
                                                              const Tensor& tensor, bool is_dead,
                                                              Tensor* buffer, uint64_t* bytes) {
  CopyPayload payload(tensor, is_dead);
  *bytes = payload.Size();
  ASSIGN_OR_RETURN(const fabric::MemoryRegion* region, EnsureCopyBuffer(memory, *buffer, *bytes));
  payload.WriteTo(static_cast<uint8_t*>(buffer->data()));
  return region;
}

}  // namespace tensorverbs::protocol
