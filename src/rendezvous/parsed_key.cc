#include "tensorverbs/parsed_key.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "src/common/split_exact.h"
#include "src/common/status_macros.h"

namespace tensorverbs {
namespace {

absl::Status BadKey(absl::string_view key, absl::string_view why) {
  std::string shown(key.substr(0, 200));
  if (key.size() > 200) shown += "...";
  return absl::InvalidArgumentError(absl::StrCat(
      "malformed rendezvous key '", shown, "': ", why,
      " (expected src_device;src_incarnation;dst_device;tensor_name;frame_id:iter_id)"));
}

}  // namespace

absl::StatusOr<ParsedKey> ParsedKey::Parse(absl::string_view key) {
  if (key.size() > kMaxKeyLength) {
    return BadKey(key, absl::StrCat("it is ", key.size(), " bytes, longer than ", kMaxKeyLength));
  }
  absl::string_view parts[5];
  if (!SplitExact(key, ';', parts, 5)) {
    return BadKey(key, absl::StrCat("it has ", std::count(key.begin(), key.end(), ';') + 1,
                                    " ';'-separated parts, not 5"));
  }
  ParsedKey k;
  k.full_key = std::string(key);
  absl::StatusOr<DeviceName> src = DeviceName::Parse(parts[0]);
  if (!src.ok()) return BadKey(key, absl::StrCat("source device: ", src.status().message()));
  k.src = *std::move(src);
  if (parts[1].empty() || parts[1].size() > 16 ||
      !absl::SimpleHexAtoi(parts[1], &k.src_incarnation)) {
    return BadKey(key, "source incarnation is not a 64-bit hex number");
  }
  for (char c : parts[1]) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      return BadKey(key, "source incarnation is not a 64-bit hex number");
    }
  }
  absl::StatusOr<DeviceName> dst = DeviceName::Parse(parts[2]);
  if (!dst.ok()) return BadKey(key, absl::StrCat("destination device: ", dst.status().message()));
  k.dst = *std::move(dst);
  if (parts[3].empty()) return BadKey(key, "tensor name is empty");
  k.edge_name = std::string(parts[3]);
  absl::string_view frame_iter[2];
  if (!SplitExact(parts[4], ':', frame_iter, 2) || !absl::SimpleAtoi(frame_iter[0], &k.frame_id) ||
      !absl::SimpleAtoi(frame_iter[1], &k.iter_id) || k.frame_id < 0 || k.iter_id < 0) {
    return BadKey(key, "frame_id:iter_id is not two non-negative integers");
  }
  return k;
}

absl::StatusOr<ParsedKey> ParsedKey::Make(const DeviceName& src, absl::string_view src_full,
                                          uint64_t src_incarnation, const DeviceName& dst,
                                          absl::string_view dst_full, absl::string_view edge_name) {
  ParsedKey k;
  k.full_key = Create(src_full, src_incarnation, dst_full, edge_name);
  // The checks Parse makes of what the devices do not already guarantee.
  if (k.full_key.size() > kMaxKeyLength || edge_name.empty() ||
      edge_name.find(';') != absl::string_view::npos) {
    return Parse(k.full_key);  // fails, naming what is wrong
  }
  k.src = src;
  k.src_incarnation = src_incarnation;
  k.dst = dst;
  k.edge_name = std::string(edge_name);
  return k;
}

std::string ParsedKey::Create(absl::string_view src_device, uint64_t src_incarnation,
                              absl::string_view dst_device, absl::string_view edge_name,
                              int64_t frame_id, int64_t iter_id) {
  return absl::StrCat(src_device, ";", absl::Hex(src_incarnation, absl::kZeroPad16), ";",
                      dst_device, ";", edge_name, ";", frame_id, ":", iter_id);
}

}  // namespace tensorverbs
