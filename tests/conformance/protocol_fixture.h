// The fixture of the protocol conformance suite: the tensor protocols between servers of one
// process, grpc+verbs, grpc+verbs-copy and grpc+gdr over every fabric that runs here (loopback,
// the shmem fabric, libfabric shm, libfabric tcp;ofi_rxm), and grpc, which has no fabric. Task 0
// receives; the other tasks send.
//
// Where the designs differ (copies per transfer, meta-data round trips, lent tensors), the
// difference is data in ProtocolDesign, so that one body states one property for every protocol
// and a design change is one edited row. A property that only one design has is a suite
// instantiated for the designs that have it. The suite is one binary, its tests in files by
// topic: protocol_conformance_test.cc (delivery, copies, limits, errors, aborts, stats),
// protocol_device_test.cc (GPU tensors), protocol_channel_test.cc (channel set-up, strategies,
// lending), protocol_push_test.cc (requests pushed ahead) and protocol_fault_test.cc (faults the
// loopback fabric injects). Multi-process behaviour (killed and restarted peers) is in
// tests/integration.
//
// Each test body runs on gtest's main thread; recvs complete on the servers' callback threads
// (PendingRecv waits for them).
#ifndef TENSORVERBS_TESTS_CONFORMANCE_PROTOCOL_FIXTURE_H_
#define TENSORVERBS_TESTS_CONFORMANCE_PROTOCOL_FIXTURE_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/verbs.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "src/common/mutex.h"
#include "src/fabric/loopback/loopback.h"
#include "src/fabric/shmem/shmem.h"
#include "src/server/server.h"
#include "tests/support/fixtures.h"
#include "tests/support/inprocess_cluster.h"
#include "tests/support/pending_recv.h"
#include "tests/support/stand_in_device.h"
#include "tests/support/stand_in_device_memory.h"

namespace tensorverbs::protocol_conformance {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using testing::kMaxKeyBytes;
using testing::kVerbsWireVersion;
using testing::VerbsOptions;
using testing::VerbsStats;

// Tensor copies one transfer costs the sending and the receiving task, for a tensor above
// grpc+gdr's 1 KiB inline limit.
struct Copies {
  int sender;
  int receiver;
};

// When the receiver learns a tensor's dtype and shape in a round trip of its own
// (META_DATA_RESPONSE, answered by RE_REQUEST) before the content moves.
enum class MetaDataRoundTrip {
  kNever,           // the meta-data rides the RecvTensor response (grpc, grpc+gdr)
  kWhenItChanges,   // cached per name; asked for again when the dtype or shape differ
  kWhenItOutgrows,  // a buffer per name; a larger one when the payload outgrows it
};

// What a protocol's design says a test should observe.
struct ProtocolDesign {
  const char* protocol;
  const char* label;  // in test names
  // Runs on the grpc+verbs transport: channels, VerbsStats, the loopback fabric's faults.
  bool on_verbs_transport;
  // Requests travel as grpc+verbs control messages (REQUEST, ERROR_STATUS), which bound the key
  // length and carry the checksum of data validation; otherwise they are RecvTensor calls.
  bool requests_over_channel;
  // The content arrives by a write with immediate (which the loopback fabric can corrupt), not
  // by the receiver's read.
  bool content_by_write;
  // The content travels inside a framed payload (a header and the TensorProto meta-data), so
  // more bytes move than the tensor has.
  bool frames_content;
  bool lends_tensors;
  MetaDataRoundTrip meta_data;
  Copies pool_to_pool;  // the steady state: source and destination in registered pool memory
  Copies pool_to_heap;  // a destination the fabric never registered
  Copies heap_to_heap;  // a source outside the pool as well
  // A source outside the pool from kRegisterSourcesFrom bytes (memory adopted from its owner),
  // into the pool.
  Copies large_heap_to_pool;
  // Recvs per sending peer in ManyConcurrentRecvsFromThreePeers, and under TSan (which slows
  // libfabric's copies and gRPC tenfold).
  int concurrent_recvs_per_peer;
  int concurrent_recvs_per_peer_under_tsan;
  // Whether the 64 MiB fixture goes along under TSan.
  bool big_fixture_under_tsan;
};

// Seed 000: the content is written straight into the result tensor.
inline constexpr ProtocolDesign kGrpcVerbs = {
    .protocol = "grpc+verbs",
    .label = "GrpcVerbs",
    .on_verbs_transport = true,
    .requests_over_channel = true,
    .content_by_write = true,
    .frames_content = false,
    .lends_tensors = false,
    .meta_data = MetaDataRoundTrip::kWhenItChanges,
    .pool_to_pool = {0, 0},
    .pool_to_heap = {0, 1},        // a registered proxy, copied out of
    .heap_to_heap = {1, 1},        // and a registered staging copy of the source
    .large_heap_to_pool = {0, 0},  // the source registered for its write
    .concurrent_recvs_per_peer = 3334,
    .concurrent_recvs_per_peer_under_tsan = 3334,
    .big_fixture_under_tsan = true,
};

// Seed 002: a pre-registered buffer per tensor name on each side, a copy in and a copy out.
inline constexpr ProtocolDesign kGrpcVerbsCopy = {
    .protocol = "grpc+verbs-copy",
    .label = "GrpcVerbsCopy",
    .on_verbs_transport = true,
    .requests_over_channel = true,
    .content_by_write = true,
    .frames_content = true,
    .lends_tensors = false,
    .meta_data = MetaDataRoundTrip::kWhenItOutgrows,
    .pool_to_pool = {1, 1},
    .pool_to_heap = {1, 1},
    .heap_to_heap = {1, 1},
    .large_heap_to_pool = {1, 1},
    .concurrent_recvs_per_peer = 667,
    .concurrent_recvs_per_peer_under_tsan = 100,
    .big_fixture_under_tsan = false,
};

// TensorFlow's GDR: meta-data over the RecvTensor call, the bytes pulled by one RDMA read.
inline constexpr ProtocolDesign kGrpcGdr = {
    .protocol = "grpc+gdr",
    .label = "GrpcGdr",
    .on_verbs_transport = true,
    .requests_over_channel = false,
    .content_by_write = false,
    .frames_content = false,
    .lends_tensors = true,
    .meta_data = MetaDataRoundTrip::kNever,
    .pool_to_pool = {0, 0},
    .pool_to_heap = {0, 1},        // read into a registered proxy
    .heap_to_heap = {1, 1},        // and the sender lends a registered copy
    .large_heap_to_pool = {1, 0},  // the sender lends a registered copy
    .concurrent_recvs_per_peer = 667,
    .concurrent_recvs_per_peer_under_tsan = 100,
    .big_fixture_under_tsan = false,
};

// The baseline: the receiver parses the response into its tensor (one copy); the sender's
// response points into the tensor's buffer.
inline constexpr ProtocolDesign kGrpc = {
    .protocol = "grpc",
    .label = "Grpc",
    .on_verbs_transport = false,
    .requests_over_channel = false,
    .content_by_write = false,
    .frames_content = false,
    .lends_tensors = false,
    .meta_data = MetaDataRoundTrip::kNever,
    .pool_to_pool = {0, 1},
    .pool_to_heap = {0, 1},
    .heap_to_heap = {0, 1},
    .large_heap_to_pool = {0, 1},
    .concurrent_recvs_per_peer = 667,
    .concurrent_recvs_per_peer_under_tsan = 100,
    .big_fixture_under_tsan = false,
};

struct FabricChoice {
  const char* label;  // in test names
  const char* fabric;
  const char* provider;
  const char* description;
};

inline constexpr FabricChoice kLoopback = {"Loopback", "loopback", "", "the loopback fabric"};
inline constexpr FabricChoice kShmem = {"Shmem", "shmem", "", "the shmem fabric"};
inline constexpr FabricChoice kShm = {"Shm", "ofi", "shm", "libfabric shm"};
inline constexpr FabricChoice kTcp = {"Tcp", "ofi", "tcp;ofi_rxm", "libfabric tcp;ofi_rxm"};
// grpc moves tensors over gRPC's own TCP connections.
inline constexpr FabricChoice kNoFabric = {"NoFabric", "", "", "gRPC alone"};

struct Param {
  const ProtocolDesign* design;
  const FabricChoice* fabric;
};

// For test listings and failure messages (ctest shows it next to each test's name).
inline void PrintTo(const Param& p, std::ostream* os) {
  *os << p.design->protocol << " over " << p.fabric->description;
}

inline std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  return absl::StrCat(info.param.design->label, "_", info.param.fabric->label);
}

inline const std::vector<const ProtocolDesign*> kVerbsFamily = {&kGrpcVerbs, &kGrpcVerbsCopy,
                                                                &kGrpcGdr};
inline const std::vector<const FabricChoice*> kEveryFabric = {&kLoopback, &kShmem, &kShm, &kTcp};

inline std::vector<Param> Combine(const std::vector<const ProtocolDesign*>& designs,
                                  const std::vector<const FabricChoice*>& fabrics) {
  std::vector<Param> out;
  for (const ProtocolDesign* d : designs) {
    for (const FabricChoice* f : fabrics) out.push_back({d, f});
  }
  return out;
}

// The verbs-family designs that have `property`.
inline std::vector<const ProtocolDesign*> With(bool ProtocolDesign::*property) {
  std::vector<const ProtocolDesign*> out;
  for (const ProtocolDesign* d : kVerbsFamily) {
    if (d->*property) out.push_back(d);
  }
  return out;
}

// Every protocol: the verbs family over every fabric, and grpc once.
inline std::vector<Param> EveryProtocol() {
  std::vector<Param> out = Combine(kVerbsFamily, kEveryFabric);
  out.push_back({&kGrpc, &kNoFabric});
  return out;
}

// META_DATA_RESPONSEs (each answered by one RE_REQUEST) and REQUESTs that carried cached
// meta-data, for one name whose tensors are `sent` in turn, without data validation.
struct MetaDataCounts {
  int64_t round_trips = 0;
  int64_t cache_hits = 0;
};

inline MetaDataCounts ExpectedMetaData(MetaDataRoundTrip rule, const std::vector<Tensor>& sent) {
  MetaDataCounts out;
  for (size_t i = 0; i < sent.size(); ++i) {
    const Tensor* previous = i > 0 ? &sent[i - 1] : nullptr;
    switch (rule) {
      case MetaDataRoundTrip::kNever:
        break;
      case MetaDataRoundTrip::kWhenItChanges:
        out.round_trips += previous == nullptr || previous->dtype() != sent[i].dtype() ||
                           previous->shape() != sent[i].shape();
        out.cache_hits += previous != nullptr;
        break;
      case MetaDataRoundTrip::kWhenItOutgrows: {
        // The framing is the same size for every tensor of one test's sequence, so the payload
        // outgrows the buffer exactly when the tensor outgrows every earlier one.
        size_t largest = 0;
        for (size_t j = 0; j < i; ++j) largest = std::max(largest, sent[j].TotalBytes());
        out.round_trips += i == 0 || sent[i].TotalBytes() > largest;
        break;
      }
    }
  }
  return out;
}

// What tasks copied so far: the server's counters (every protocol) and the transport's.
struct CopyCounts {
  int64_t server[2] = {0, 0};
  int64_t transport[2] = {0, 0};
};

// For tests that count the REQUEST protocol's own messages: grpc+verbs pushes one request
// ahead per key after each recv (PushTest covers that), which these counts leave out.
inline void NoPush(ServerOptions& o) { o.verbs.channel.push = false; }

class ProtocolTest : public testing::ClusterTest<Param> {
 protected:
  const ProtocolDesign& design() const { return *GetParam().design; }

  // `n` tasks in this process; `tune` adjusts every server's options, `protocols`
  // overrides the protocol per task.
  void StartCluster(int n, std::function<void(ServerOptions&)> tune = nullptr,
                    std::vector<std::string> protocols = {}) {
    testing::ClusterOptions o;
    o.protocol = design().protocol;
    o.fabric = GetParam().fabric->fabric;
    o.provider = GetParam().fabric->provider;
    o.recv_timeout = recv_timeout_;
    o.max_tensor_bytes = max_tensor_bytes_;
    o.max_peer_steps = max_peer_steps_;
    o.device_copier = device_copier_;
    o.device_memory = device_memory_;
    o.device_pool_factory = device_pool_factory_;
    o.tune = std::move(tune);
    o.protocols = std::move(protocols);
    StartWith(n, o);
  }

  // The transport's counters, or zeros for a protocol without one (whose designs expect none
  // of what they count).
  const VerbsStats& verbs_stats(int task) {
    static const VerbsStats kNone;
    return design().on_verbs_transport ? transport(task).stats() : kNone;
  }

  // A stand-in for `devices` GPUs that every task started afterwards uses. It and the GPUs'
  // allocators (StandInGpu) outlive the tasks, whose callbacks may drop the last reference to
  // a tensor after the test saw it.
  testing::StandInDeviceCopier& UseStandInGpus(int devices) {
    stand_in_copier_ = std::make_unique<testing::StandInDeviceCopier>(devices);
    for (int d = 0; d < devices; ++d) {
      stand_in_gpus_.push_back(std::make_unique<testing::StandInDeviceAllocator>(d));
    }
    device_copier_ = stand_in_copier_.get();
    return *stand_in_copier_;
  }
  testing::StandInDeviceAllocator& StandInGpu(int d) { return *stand_in_gpus_[d]; }
  // Sends `sent` as `name` in `step` from task 1 and receives it on task 0 with `args`: it
  // arrives once, with `host`'s bytes, on cuda:0 unless empty (then counted in *transfers).
  void DeviceRecv(int64_t step, const std::string& name, const Tensor& sent, const Tensor& host,
                  const RecvArgs& args, int64_t* transfers);
  std::vector<std::unique_ptr<testing::StandInDeviceAllocator>> stand_in_gpus_;
  std::unique_ptr<testing::StandInDeviceCopier> stand_in_copier_;

  // Task 1 sends, task 0 receives.
  CopyCounts CountCopies() {
    CopyCounts c;
    for (int t : {0, 1}) {
      c.server[t] = server(t).stats().copies.load();
      c.transport[t] = verbs_stats(t).copies.load();
    }
    return c;
  }

  // `transfers` from task 1 to task 0 since `before` cost `per_transfer` copies each.
  void ExpectCopies(const Copies& per_transfer, int transfers, const CopyCounts& before) {
    const CopyCounts now = CountCopies();
    EXPECT_EQ(now.server[1] - before.server[1], per_transfer.sender * transfers)
        << "sender copies (the server's count)";
    EXPECT_EQ(now.server[0] - before.server[0], per_transfer.receiver * transfers)
        << "receiver copies (the server's count)";
    if (!design().on_verbs_transport) return;
    EXPECT_EQ(now.transport[1] - before.transport[1], per_transfer.sender * transfers)
        << "sender copies (the transport's count)";
    EXPECT_EQ(now.transport[0] - before.transport[0], per_transfer.receiver * transfers)
        << "receiver copies (the transport's count)";
  }

  // Task 1 sent `sent` under one name to task 0 since the counters read `before`.
  void ExpectMetaDataRoundTrips(const std::vector<Tensor>& sent, const MetaDataCounts& before) {
    const MetaDataCounts want = ExpectedMetaData(design().meta_data, sent);
    EXPECT_EQ(verbs_stats(1).meta_responses.load() - before.round_trips, want.round_trips)
        << "META_DATA_RESPONSEs";
    EXPECT_EQ(verbs_stats(0).re_requests.load(), verbs_stats(1).meta_responses.load())
        << "every META_DATA_RESPONSE is answered by one RE_REQUEST";
    EXPECT_EQ(verbs_stats(0).meta_cache_hits.load() - before.cache_hits, want.cache_hits)
        << "REQUESTs that carried cached meta-data";
  }
  MetaDataCounts CountMetaData() {
    return {verbs_stats(1).meta_responses.load(), verbs_stats(0).meta_cache_hits.load()};
  }

  // Every tensor a sender lent has been released (the release immediate can trail the
  // receiver's completion a little). Trivially true where nothing is lent.
  void ExpectNothingLent(int task) {
    if (!design().on_verbs_transport) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (transport(task).NumLentTensors() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(transport(task).NumLentTensors(), 0u) << "every lent tensor was released";
  }

  // Sends `t` from task 1 at `step` and receives it on task 0 into `got` (if given). Callers
  // wrap it in ASSERT_NO_FATAL_FAILURE: after a recv that never came, the next would wait too.
  void SendAndRecv(int64_t step, const std::string& name, const Tensor& t, Tensor* got = nullptr,
                   RecvArgs args = RecvArgs()) {
    ASSERT_TRUE(Step(1, step)->Send(Key(1, name), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, name), args);
    ASSERT_TRUE(recv.Wait()) << name << " at step " << step;
    ASSERT_TRUE(recv.status().ok()) << name << " at step " << step << ": " << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t))
        << name << " at step " << step << ": got " << recv.tensor().DebugString();
    EXPECT_EQ(recv.calls(), 1);
    if (got != nullptr) *got = recv.tensor();
  }
};

}  // namespace tensorverbs::protocol_conformance

#endif  // TENSORVERBS_TESTS_CONFORMANCE_PROTOCOL_FIXTURE_H_
