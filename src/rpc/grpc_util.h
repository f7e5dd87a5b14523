// tv_rpc: conversions between gRPC and absl statuses, and the channel and server settings every
// tensorverbs gRPC endpoint uses (message limits, no SO_REUSEPORT so a port in use is detected).
// Pure functions, any thread.
#ifndef TENSORVERBS_RPC_GRPC_UTIL_H_
#define TENSORVERBS_RPC_GRPC_UTIL_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tensorverbs::rpc {

// Same code and message (the two code spaces are identical).
absl::Status FromGrpcStatus(const grpc::Status& s);
grpc::Status ToGrpcStatus(const absl::Status& s);

// `max_answer_bytes`: the largest answer the channel accepts (gRPC's limit is an int: larger
// values mean no limit below the 4 GiB its framing allows). With a `peer_timeout`, a connection
// with calls in flight is pinged every half of it and closed when a ping goes unanswered for
// the other half, failing those calls with UNAVAILABLE: a frozen or vanished peer costs about
// `peer_timeout`, not the call's whole deadline. Pings are never more frequent than
// kMinKeepaliveMs, so a peer timeout under twice that is enforced at 2 x kMinKeepaliveMs.
inline constexpr int kMinKeepaliveMs = 250;
// A connection attempt gets `peer_timeout` (at least kMinConnectTimeoutMs; without one,
// kDefaultMinConnectTimeoutMs) to be answered, however short the reconnect backoff between
// attempts is.
inline constexpr int64_t kMinConnectTimeoutMs = 1000;
inline constexpr int64_t kDefaultMinConnectTimeoutMs = 20000;
grpc::ChannelArguments ClientChannelArguments(uint64_t max_answer_bytes,
                                              absl::Duration peer_timeout = absl::ZeroDuration());
// What a WorkerService client accepts: a tensor of the task's limit plus its framing.
uint64_t TensorAnswerLimit(uint64_t max_tensor_bytes);
// Every other answer (status, channel set-up) is small.
inline constexpr uint64_t kMaxControlAnswerBytes = 1 << 20;
// The largest request a server accepts; larger ones fail with RESOURCE_EXHAUSTED in gRPC,
// before any service sees them.
inline constexpr int kMaxRequestBytes = 16 << 10;
// Message limits (requests kMaxRequestBytes, answers unbounded) and socket options. With a
// `peer_timeout`, the server also pings its callers while their calls are in flight, so a
// caller frozen mid-call (a receiver that stopped reading its tensor) is found within it and
// its call cancelled, letting go of what the call held.
void ConfigureServerBuilder(grpc::ServerBuilder* builder,
                            absl::Duration peer_timeout = absl::ZeroDuration());

// Keeps gRPC's process-wide callback completion queue alive for the life of the process. Call
// before creating any server or channel; idempotent and thread-safe. See grpc_util.cc.
void PinGrpcCallbackQueue();

}  // namespace tensorverbs::rpc

#endif  // TENSORVERBS_RPC_GRPC_UTIL_H_
