// ParsedKey: a rendezvous key in TensorFlow's form
//   src_device;src_incarnation;dst_device;tensor_name;frame_id:iter_id
// with the incarnation as 16 hex digits. Keys come from peers, so Parse validates every part
// and names the one that is wrong. Value type, any thread.
#ifndef TENSORVERBS_PUBLIC_PARSED_KEY_H_
#define TENSORVERBS_PUBLIC_PARSED_KEY_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tensorverbs/device_name.h"

namespace tensorverbs {

struct ParsedKey {
  // Longest key accepted, in bytes: the grpc+verbs REQUEST's bound, so that a key every
  // protocol can carry is refused at Send, not lost on the wire.
  static constexpr size_t kMaxKeyLength = 2048;

  std::string full_key;
  DeviceName src;
  uint64_t src_incarnation = 0;
  DeviceName dst;
  std::string edge_name;
  int64_t frame_id = 0;
  int64_t iter_id = 0;

  static absl::StatusOr<ParsedKey> Parse(absl::string_view key);

  // The key of `edge_name` between two devices already parsed, as Parse(Create(...)) would
  // give it (and the same error for a name no key can carry), without parsing the devices again.
  // `src_full` and `dst_full` are src.FullName() and dst.FullName(), which callers keep.
  static absl::StatusOr<ParsedKey> Make(const DeviceName& src, absl::string_view src_full,
                                        uint64_t src_incarnation, const DeviceName& dst,
                                        absl::string_view dst_full, absl::string_view edge_name);

  // Builds the canonical key string.
  static std::string Create(absl::string_view src_device, uint64_t src_incarnation,
                            absl::string_view dst_device, absl::string_view edge_name,
                            int64_t frame_id = 0, int64_t iter_id = 0);
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_PARSED_KEY_H_
