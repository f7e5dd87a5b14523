// tv_rpc: conversions between gRPC and absl statuses, and the channel and server settings every
// tensorverbs gRPC endpoint uses (no message size limit, no SO_REUSEPORT so a port in use is
// detected). Pure functions, any thread.
#ifndef TENSORVERBS_RPC_GRPC_UTIL_H_
#define TENSORVERBS_RPC_GRPC_UTIL_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tensorverbs::rpc {

// Same code and message (the two code spaces are identical).
absl::Status FromGrpcStatus(const grpc::Status& s);
grpc::Status ToGrpcStatus(const absl::Status& s);

grpc::ChannelArguments ClientChannelArguments();
// The largest request a server accepts; larger ones fail with RESOURCE_EXHAUSTED in gRPC,
// before any service sees them.
inline constexpr int kMaxRequestBytes = 16 << 10;
// Message limits (requests kMaxRequestBytes, answers unbounded) and socket options.
void ConfigureServerBuilder(grpc::ServerBuilder* builder);

// Keeps gRPC's process-wide callback completion queue alive for the life of the process. Call
// before creating any server or channel; idempotent and thread-safe. See grpc_util.cc.
void PinGrpcCallbackQueue();

}  // namespace tensorverbs::rpc

#endif  // TENSORVERBS_RPC_GRPC_UTIL_H_
