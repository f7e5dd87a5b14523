#include "src/rpc/grpc_util.h"

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "proto/worker.grpc.pb.h"

namespace tensorverbs::rpc {

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

uint64_t TensorAnswerLimit(uint64_t max_tensor_bytes) {
  // The response's own fields, and a string tensor's per-element framing.
  constexpr uint64_t kFraming = 64 << 10;
  return max_tensor_bytes > UINT64_MAX - kFraming ? UINT64_MAX : max_tensor_bytes + kFraming;
}

grpc::ChannelArguments ClientChannelArguments(uint64_t max_answer_bytes,
                                              absl::Duration peer_timeout) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(
      max_answer_bytes > static_cast<uint64_t>(INT_MAX) ? -1 : static_cast<int>(max_answer_bytes));
  args.SetMaxSendMessageSize(-1);
  // Reconnect quickly to a task that is starting up; the default backoff reaches 120 s.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // gRPC gives each connection attempt until its backoff or this, whichever is later, to get
  // the server's first SETTINGS frame. Bounded by the backoff alone (1 s), a peer that answers
  // a new connection slower than that (hundreds of tasks on a few cores) was never reached: each
  // attempt timed out and the next one started over. A refused connection still retries at the
  // backoff; one under way is waited for as long as a peer may be silent (the peer timeout), or
  // gRPC's own 20 s without one. An unanswered SYN (a partition) is waited for as long, which
  // after a heal costs at most the kernel's next SYN retry, a few seconds.
  const int64_t connect_ms = peer_timeout > absl::ZeroDuration()
                                 ? absl::ToInt64Milliseconds(peer_timeout)
                                 : kDefaultMinConnectTimeoutMs;
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::clamp<int64_t>(connect_ms, kMinConnectTimeoutMs, INT_MAX)));
  // Large tensors: let HTTP/2 flow control open up to the full window at once.
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 1);
  // Each peer gets its own subchannel so two tasks in one process do not share a connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (peer_timeout > absl::ZeroDuration()) {
    // Half the timeout to the ping and half to its answer, so a frozen peer is found within
    // the peer timeout; never more often than kMinKeepaliveMs (a timeout shorter than twice
    // that is found in 2 x kMinKeepaliveMs), which servers accept (ConfigureServerBuilder).
    const int half_ms = static_cast<int>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(peer_timeout) / 2, kMinKeepaliveMs, INT_MAX));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, half_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, half_ms);
    // Only while calls are in flight (a RecvTensor waiting for its tensor sends no data), and
    // as often as that takes.
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  return args;
}

void ConfigureServerBuilder(grpc::ServerBuilder* builder, absl::Duration peer_timeout) {
  // Every request a task serves is small (a key, a task name, endpoint addresses); only
  // answers carry tensors. A bound on requests keeps a stranger from making a server buffer
  // and parse megabytes before any check.
  builder->SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder->SetMaxSendMessageSize(INT_MAX);
  // gRPC sets SO_REUSEPORT by default, which would let two servers share a port silently.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Peers ping a connection whose calls wait for tensors (ClientChannelArguments), at most
  // every kMinKeepaliveMs; by default a server answers pings more frequent than every 5
  // minutes without data with GOAWAY. Pings faster than half that still count as strikes
  // (gRPC's default of two), so a client flooding pings is cut off.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              kMinKeepaliveMs / 2);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
  if (peer_timeout > absl::ZeroDuration()) {
    // As the clients do (ClientChannelArguments): half the timeout to the ping, half to its
    // answer, only while calls are in flight. A RecvTensor whose caller froze after the tensor
    // was handed over would otherwise hold it until the call's deadline (the recv timeout).
    const int half_ms = static_cast<int>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(peer_timeout) / 2, kMinKeepaliveMs, INT_MAX));
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, half_ms);
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, half_ms);
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
    builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
}

void PinGrpcCallbackQueue() {
  // On Linux, gRPC 1.51 runs every callback-API server method and client call through one
  // process-wide completion queue (the "callback alternative" queue), created on first use and
  // destroyed when the last server or channel using it is gone. When servers and channels come
  // and go within one process, that teardown races with the next creation and frees the queue
  // twice (seen under ASan as a double free in grpc_cq_internal_unref). A port-less server with
  // a callback service holds a reference until the process exits, so the queue is created once.
  static auto* service = new proto::WorkerService::CallbackService();
  static grpc::Server* anchor = [] {
    grpc::ServerBuilder builder;
    builder.RegisterService(service);
    grpc::Server* server = builder.BuildAndStart().release();
    // Registered after gRPC's own initialization, so it runs before gRPC's static teardown.
    std::atexit([] {
      anchor->Shutdown();
      delete anchor;
      delete service;
    });
    return server;
  }();
}

}  // namespace tensorverbs::rpc
