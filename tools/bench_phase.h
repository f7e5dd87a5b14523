// What `tensorverbs bench p2p` and `tensorverbs bench rate` share: one measured phase of recvs
// between the launcher and its peer process (PairBench), the raw fabric write measured as a
// ceiling in the same run, and the network namespace a --netns run puts the peer in.
//
// Everything here runs on the tool's main thread; RunPhase's recvs complete on the launcher's
// server callback threads inside RunRecvs (bench_cluster.h).
#ifndef TENSORVERBS_TOOLS_BENCH_PHASE_H_
#define TENSORVERBS_TOOLS_BENCH_PHASE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/parsed_key.h"
#include "tools/bench_cluster.h"
#include "tools/bench_fabric.h"
#include "tools/netns.h"

namespace tensorverbs::tools {

// The peer's network namespace for --netns, its link limited to `link_rate` where given (tc's
// terms); false (said on stderr, naming `command`) when it cannot be made.
bool MakeNetnsHost(const char* command, std::unique_ptr<NetnsHost>* out,
                   const std::string& link_rate = "", int rails = 1);

// The protocols that run over a fabric (all but plain grpc).
bool IsVerbsProtocol(const std::string& p);

// The raw fabric write the verbs protocols use here, per size, measured as a ceiling in the same
// run (`window` writes in flight); says on stdout why when it cannot be measured.
void MeasureCeiling(const std::vector<size_t>& sizes, int window, const NetnsHost* netns,
                    std::vector<FabricRow>* rows, std::string* name);

// The ceiling's row for `size`, or null.
const FabricRow* FindFabricRow(const std::vector<FabricRow>& rows, size_t size);

// A training loop keeps only a few steps alive; so does the benchmark: steps are pre-sent,
// received and cleaned up in batches, so that the rendezvous tables stay small.
inline constexpr int64_t kStepsPerBatch = 2048;

struct PhaseResult {
  std::vector<double> latency_us;
  absl::Duration elapsed;        // summed over the batches' recv streams
  PairBench::Usage local, peer;  // CPU and copies during those streams (when sampled)
};

// `count` recvs of `keys` (one step per keys.size() recvs), at most `window` outstanding, the
// peer sending each step's tensors of `size` bytes (pattern `seed`) before they are asked for.
// `usage` samples CPU and copies around the streams. Recvs land in `allocator` (null: the
// receiver's registered pool).
absl::StatusOr<PhaseResult> RunPhase(PairBench& bench, const std::string& prefix,
                                     const std::vector<ParsedKey>& keys, size_t size, uint32_t seed,
                                     int64_t count, int window, bool usage, int64_t* next_step,
                                     Allocator* allocator = nullptr);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_BENCH_PHASE_H_
