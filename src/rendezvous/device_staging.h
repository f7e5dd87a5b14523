// Device staging: how GPU tensors cross between tasks through host memory (the proxy path),
// for RemoteRendezvous and so for every protocol. A device tensor a peer asks for is copied
// device-to-host into a pool tensor (whole, or in chunks whose progress a protocol can write
// from); a recv into GPU memory lands in a pool tensor and is copied host-to-device, each part
// as soon as the transport says it landed.
//
// Who calls it: RemoteRendezvous, from any thread. Every copy goes through env->device_copier,
// whose completions run on the copier's thread; each copy is counted in flight
// (TransferStats::device_copies_in_flight) until its completion returns, so a stopping task can
// wait for them. Every `done` runs exactly once; `on_staged` and RecvArgs::on_landed as said
// below. Each direction's copy of a tensor counts once in TransferStats, however many parts it
// went in.
#ifndef TENSORVERBS_RENDEZVOUS_DEVICE_STAGING_H_
#define TENSORVERBS_RENDEZVOUS_DEVICE_STAGING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "src/common/state_table.h"
#include "src/rendezvous/remote_rendezvous.h"

namespace tensorverbs::device_staging {

// Copies the device tensor `value` (taken from this task's table for a peer) into a pool tensor
// and runs `done` with it, on the copier's thread, or here when the pool tensor cannot be
// allocated. The caller checked that env's copier handles `value`'s device.
void StageToHost(const WorkerEnv* env, const std::string& key, const Tensor& value,
                 RecvDoneCallback done);

// RecvLocalAsync's `done`, with device tensors staged to host memory first.
RecvDoneCallback StagingDevice(const WorkerEnv* env, std::string key, RecvDoneCallback done);

// A remote recv's `done` into memory of `device_allocator`: the tensor that arrived in the pool
// (the proxy) is copied host-to-device and `done` runs on the callback executor; one that
// arrived on that device already (the direct path) passes through. With `args` (the recv's, on
// the proxy path) it asks the transport for progress in chunks of env->proxy_chunk_bytes
// (RecvArgs::progress_bytes, on_landed), and copies each landed part at once.
RecvDoneCallback CopyingToDevice(const WorkerEnv* env, std::string key, Allocator* device_allocator,
                                 RecvDoneCallback done, RecvArgs* args = nullptr);

// RemoteRendezvous::StageToHostInChunks.
absl::StatusOr<Tensor> StageToHostInChunks(const WorkerEnv* env, const std::string& key,
                                           const Tensor& value, uint64_t chunk_bytes,
                                           RemoteRendezvous::StagedCallback on_staged);

// The machines inside, for the diagrams and the tests (docs/architecture/state-machines.md):
// CopyingToDevice's recv into device memory, whose events (a part landed, the recv ended, a copy
// completed) come from three threads and are posted to the recv's own loop; and
// StageToHostInChunks' chunks, whose completions are posted to the staging's loop.
enum class ProxyState { kLanding, kDraining, kDone };
enum class ProxyEvent { kLanded, kRecvEnded, kCopyDone };
StateTableView ProxyStateTable();
enum class StagingState { kStaging, kStaged, kFailed };
enum class StagingEvent { kChunkDone };
StateTableView StagingStateTable();

}  // namespace tensorverbs::device_staging

#endif  // TENSORVERBS_RENDEZVOUS_DEVICE_STAGING_H_
