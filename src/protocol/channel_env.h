// What every grpc+verbs channel of one transport shares: the worker, the fabric domain, the
// memory manager, the counters, the mode and settings, the channel table, and the transport
// that runs them (ChannelHost: post work later, deliver a user callback, quarantine memory,
// carry a new channel's handshake to its peer).
//
// The transport owns one ChannelEnv and outlives every channel; channels and the state machines
// (tensor_request.h, tensor_response.h, gdr_pull.h) read it on the progress thread only, except
// VerbsStats, which any thread may read. Also here: the helpers the state machines share
// (registration for one transfer, checksum verification, content writes in pieces).
#ifndef TENSORVERBS_PROTOCOL_CHANNEL_ENV_H_
#define TENSORVERBS_PROTOCOL_CHANNEL_ENV_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/verbs.pb.h"
#include "src/common/config.h"
#include "src/fabric/fabric.h"
#include "src/protocol/memory_mgr.h"
#include "src/protocol/progress_engine.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/rendezvous/transfer_settings.h"

namespace tensorverbs::protocol {

// Counters of one transport, readable from any thread.
struct VerbsStats {
  std::atomic<int64_t> requests{0};          // REQUEST messages sent
  std::atomic<int64_t> meta_cache_hits{0};   // ... of which carried a cached meta-data
  std::atomic<int64_t> indexed_requests{0};  // ... of which named the key by its index
  std::atomic<int64_t> pushed{0};            // ... of which asked for a key's next step ahead
  std::atomic<int64_t> push_hits{0};         // recvs that found their request already made
  std::atomic<int64_t> push_unused{0};       // pushed requests no recv took
  std::atomic<int64_t> meta_responses{0};    // META_DATA_RESPONSE messages sent
  std::atomic<int64_t> re_requests{0};       // RE_REQUEST messages sent
  std::atomic<int64_t> errors_sent{0};       // ERROR_STATUS messages sent
  std::atomic<int64_t> control_messages{0};  // control messages written, of every type
  std::atomic<int64_t> control_slots{0};     // ... in this many slot writes (batching)
  std::atomic<int64_t> content_writes{0};    // content transfers completed by this sender
  std::atomic<int64_t> content_bytes{0};
  std::atomic<int64_t> copies{0};        // tensor copies made by the transport (proxy,
  std::atomic<int64_t> copied_bytes{0};  //   copy strategy, unregistered sources)
  std::atomic<int64_t> transient_registrations{0};
  std::atomic<int64_t> in_place_recvs{0};    // destinations in the caller's memory (RecvArgs::into)
  std::atomic<int64_t> content_segments{0};  // content segments landed before a tensor's last
  std::atomic<int64_t> striped_requests{0};  // destinations asked for over several lanes
  std::atomic<int64_t> lanes_taken_out{0};   // lanes a channel went on without (TakeLanesOut)
  std::atomic<int64_t> channels_renewed_for_lanes{0};  // Channel::WantsLanesBack
  std::atomic<int64_t> dropped_imms{0};      // unknown or stale request indexes
  std::atomic<int64_t> channel_errors{0};
  std::atomic<int64_t> checksum_failures{0};
  std::atomic<int64_t> liveness_probes{0};  // sent by the peer watchdog

  // The counters a task reports, under their catalog names (common/counters.h).
  void AppendCounters(CounterList* out) const;

  // One copy of `bytes` tensor bytes, counted here and in the worker's TransferStats (if any).
  void CountCopy(uint64_t bytes, TransferStats* worker) {
    copies.fetch_add(1, std::memory_order_relaxed);
    copied_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    if (worker != nullptr) {
      worker->copies.fetch_add(1, std::memory_order_relaxed);
      worker->copied_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    }
  }
};

// Which design a transport runs; the protocol string picks it.
enum class VerbsMode {
  kZeroCopy,  // grpc+verbs (seed 000): the content is written into the result tensor
  kCopy,      // grpc+verbs-copy (seed 002): per-name pre-registered buffers, a copy each side
  kGdr,       // grpc+gdr: meta-data over gRPC RecvTensor, the content pulled by one RDMA read
};
const char* VerbsModeProtocol(VerbsMode mode);
// The remote access (fabric::Access bits) a mode's registered memory needs, and nothing more:
// grpc+verbs and its copy mode only take remote writes (destinations, proxies, copy buffers);
// grpc+gdr only lends tensors to remote reads (its destinations are filled by local reads).
// So a peer can never read this task's memory over grpc+verbs, nor write it over grpc+gdr.
uint32_t RemoteAccessFor(VerbsMode mode);

class Channel;
class ChannelTable;
class LandedStore;
class LocalTensorInbox;

// What the channels need of the transport that runs them (VerbsTransport, or a test's
// harness), on the progress thread unless said otherwise. It outlives every channel.
class ChannelHost {
 public:
  virtual ~ChannelHost() = default;
  // Runs `task` on the progress thread later, never inline: called on the progress thread, at
  // the end of the completion or task being handled; from another thread, at the loop's next
  // turn. Any thread.
  virtual void Post(absl::AnyInvocable<void() &&> task) = 0;
  // Runs a recv's `done` with its outcome on the worker's callback executor; on the progress
  // thread, the recvs of one turn go to the executor together at the end of the turn.
  virtual void Deliver(ProgressEngine::RecvDelivery delivery) = 0;
  // Keeps memory a closed channel's peer may still write into alive until `until`.
  virtual void Quarantine(std::vector<Tensor> memory, absl::Time until) = 0;
  // grpc+gdr, sender side: `task` released the tensor it read under `tensor_key`.
  virtual void ReleaseLent(const std::string& task, uint32_t tensor_key) = 0;
  // True on the thread that owns the channels (the progress thread, or the thread that tears
  // the transport down after the loop ended). Any thread.
  virtual bool OnOwnerThread() const = 0;
  // Sends this task's end of a new owner channel (`request`, which names it by channel_id) to
  // `task` at `address` over the transport's set-up service (PeerChannels makes the channel and
  // reads the answer). `answered` runs later on the progress thread, never inline, once, with
  // the peer's answer or why the call failed; a call still in flight when the loop stops is
  // cancelled and its answer dropped, since every channel has closed by then.
  using ConnectAnswered = absl::AnyInvocable<void(absl::StatusOr<proto::ConnectResponse>) &&>;
  virtual void Connect(const std::string& task, const std::string& address,
                       const proto::ConnectRequest& request, ConnectAnswered answered) = 0;
};

// The settings of one transport's grpc+verbs channels. Each field that has a variable starts
// from its default (Config::Defaults(), declared once in common/config.h); the transport's
// VerbsOptions carries one, and tests set fields directly.
struct ChannelOptions {
  VerbsMode mode = VerbsMode::kZeroCopy;  // from the protocol's name
  // TENSORVERBS_REGISTRATION: how the memory a transfer touches is registered.
  Registration registration =
      ParseRegistration(Config::Defaults().registration).value_or(Registration::kPool);
  // TENSORVERBS_DATA_VALIDATION: a CRC-32C of every tensor rides its meta-data.
  bool data_validation = Config::Defaults().data_validation;
  int message_slots = Config::Defaults().message_slots;  // TENSORVERBS_MESSAGE_SLOTS
  int message_batch = Config::Defaults().message_batch;  // TENSORVERBS_MESSAGE_BATCH
  // A ready channel with nothing pending and no traffic for this long is given back
  // (TENSORVERBS_CHANNEL_IDLE_MS; zero: never): the owner closes its end, the acceptor closes
  // its own once a probe finds the owner's gone (Channel::NoteIdle).
  absl::Duration idle_close = Config::Defaults().channel_idle;
  // Owner side: ask for a key's next step as soon as a recv of it completes (TENSORVERBS_PUSH),
  // with at most this many such requests, and bytes of destinations, per channel
  // (TENSORVERBS_PUSH_MAX, TENSORVERBS_PUSH_MAX_MB). Only zero copy without data validation
  // pushes (pushes_ahead()).
  bool push = Config::Defaults().push;
  int push_max_destinations = Config::Defaults().push_max_destinations;
  uint64_t push_max_bytes = Config::Defaults().push_max_bytes;
  // Owner side: the most recvs and reads pending on one channel, ended ones the peer may still
  // write included (TENSORVERBS_MAX_PENDING_RECVS); beyond, a recv fails with ResourceExhausted.
  int max_pending_recvs = Config::Defaults().max_pending_recvs;
  // Owner side: destinations of `large_bytes` and more that one channel hands its sender at
  // once for tensors the sender has ready (TENSORVERBS_LARGE_IN_FLIGHT; 0: no limit). Beyond,
  // such a recv asks without a destination and names one, once an earlier large one has
  // landed, in its RE_REQUEST. The sender copies them one after another anyway, and a stream
  // that rotates over many large destinations copies at half the speed of one that reuses a
  // few (bench/copy_bench.cc). Only destinations for tensors the sender said it holds are
  // counted (plus one named in a REQUEST), so a recv whose tensor is produced later never
  // holds up one whose tensor exists: no order of sends can deadlock on the limit.
  int large_in_flight = Config::Defaults().large_in_flight;
  uint64_t large_bytes = uint64_t{4} << 20;
  // Owner side, on a channel with lanes: tensors of this many bytes and more are asked for in
  // segments spread over every lane (TENSORVERBS_STRIPE_KB; 0: never).
  uint64_t stripe_bytes = Config::Defaults().stripe_bytes;
  // Each lane's share of a spread tensor follows the rate the receiver measured it at
  // (TENSORVERBS_STRIPE_SHARES=rate); false: the segments go round the lanes evenly.
  bool stripe_by_rate = Config::Defaults().stripe_by_rate;

  // Pushing destinations ahead needs the meta-data cache of zero copy, and the checksum of
  // data validation rides the meta-data round trip that pushing skips.
  bool pushes_ahead() const { return push && mode == VerbsMode::kZeroCopy && !data_validation; }
};

// A further lane of the channels over one fabric: another domain of the same kind, on another
// device or interface (TENSORVERBS_RAILS), with the pool registered there too. A channel makes
// an endpoint on each, beside its own, and its peer agrees on them at set-up.
struct LaneEnv {
  fabric::Domain* domain = nullptr;
  RdmaMemoryMgr* memory = nullptr;
  std::string source;  // the address or interface it is bound to, for logs and stats
};

struct ChannelEnv {
  const WorkerEnv* worker = nullptr;
  RendezvousMgr* rendezvous_mgr = nullptr;  // serves requests (acceptor side)
  RdmaMemoryMgr* memory = nullptr;
  fabric::Domain* domain = nullptr;
  // Lanes 1, 2, ...: the domain above is lane 0, which carries control messages too.
  std::vector<LaneEnv> lanes;
  VerbsStats* stats = nullptr;
  // The settings every protocol shares (recv and peer timeouts, the slow-recv warning, the
  // bound on a peer's requests) and the channels' own.
  TransferSettings transfer;
  ChannelOptions options;
  // The fabric moves GPU memory directly (Capabilities::device_memory, with pool registration,
  // zero copy and no checksums, which would read the bytes on the CPU): a sender writes device
  // tensors from where they are, and device pools' regions are registered as device memory.
  bool device_direct = false;
  // How long a failed channel's memory is kept from reuse: its peer may write it until it
  // learns of the failure, which takes at most a peer timeout.
  absl::Duration quarantine() const { return transfer.peer_timeout; }
  // Acceptor side: how long a response that sent META_DATA_RESPONSE waits for the receiver's
  // RE_REQUEST before it drops the tensor. A receiver has given up on its recv by then; a
  // well-behaved one answers in a round trip.
  absl::Duration response_timeout() const { return transfer.recv_timeout + transfer.peer_timeout; }
  // The transport that runs the channels, their table (found by id) and, for pushed requests
  // whose channel closed, the landed store. All outlive every channel.
  ChannelHost* host = nullptr;
  ChannelTable* channels = nullptr;
  // Carries a sender's local tensors to the responses waiting for them (progress thread).
  LocalTensorInbox* local_tensors = nullptr;
  // Owner side, at a channel's close: tensors that fully landed in requests made ahead
  // (TENSORVERBS_PUSH) before any recv took them, kept for their recvs (null: dropped).
  LandedStore* landed = nullptr;

  // True on the thread that owns the channels (DCHECKed by their methods).
  bool OnOwnerThread() const { return host == nullptr || host->OnOwnerThread(); }
  void CountCopy(uint64_t bytes) const { stats->CountCopy(bytes, worker->stats); }
  // The largest tensor this task accepts from a peer.
  uint64_t max_tensor_bytes() const {
    return worker != nullptr ? worker->max_tensor_bytes : kDefaultMaxTensorBytes;
  }
  // A recv's outcome in the worker's TransferStats, on each path that runs its `done`.
  void CountRecv(const absl::Status& status, const Tensor& tensor) const {
    if (worker != nullptr && worker->stats != nullptr) worker->stats->CountRecv(status, tensor);
  }
  // Ends a recv that never reached a request with `status`: counted, and `done` run on the
  // worker's callback executor (never inline: the caller may hold channel state).
  void FailRecv(RecvDoneCallback done, const absl::Status& status) const {
    CountRecv(status, Tensor());
    worker->callback_executor->Schedule(
        [done = std::move(done), status]() mutable { std::move(done)(status, Tensor(), false); });
  }

  // The region through which the fabric reaches [data, data+bytes) for one transfer, under the
  // registration strategy: the pool's registered region (kPool), a registration made for this
  // transfer and kept in `*transient` (kPerTransfer), or null (kCopy, or memory the fabric
  // cannot reach: the caller stages it). An error only when the fabric refused a pool region.
  absl::StatusOr<const fabric::MemoryRegion*> TransferRegion(
      const void* data, uint64_t bytes, std::unique_ptr<fabric::MemoryRegion>* transient) const;

  // OK when CRC-32C of `bytes` at `data` is `expected`; otherwise counts the failure and returns
  // DataLoss naming the key and the peer.
  absl::Status VerifyChecksum(const std::string& key, const std::string& peer_task,
                              const void* data, uint64_t bytes, uint64_t expected) const;
};

// CRC-32C of `bytes` at `data`; 0 for no bytes.
uint64_t ContentChecksum(const void* data, uint64_t bytes);

// Content writes and reads larger than this are split (the last write carries the immediate),
// to stay within every provider's message size and keep single operations short.
inline constexpr uint64_t kMaxTransferPiece = uint64_t{1} << 30;

// Posts [0, total) in pieces of at most kMaxTransferPiece, calling post(offset, length, last)
// for each, and stops at the first refused post. Returns how many were posted, and that refusal.
template <typename PostPiece>
std::pair<int, absl::Status> PostInPieces(uint64_t total, PostPiece post) {
  const uint64_t pieces = (total + kMaxTransferPiece - 1) / kMaxTransferPiece;
  for (uint64_t i = 0; i < pieces; ++i) {
    const uint64_t offset = i * kMaxTransferPiece;
    absl::Status s = post(offset, std::min(kMaxTransferPiece, total - offset), i + 1 == pieces);
    if (!s.ok()) return {static_cast<int>(i), s};
  }
  return {static_cast<int>(pieces), absl::OkStatus()};
}

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_CHANNEL_ENV_H_
