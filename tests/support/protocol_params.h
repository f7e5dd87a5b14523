// What tests parameterized by protocol name share: a gtest-safe name for each protocol
// ("grpc+verbs-copy" -> "grpc_verbs_copy") and whether a libfabric provider runs here (tests
// that need one skip without it). Header-only; any thread.
#ifndef TENSORVERBS_TESTS_SUPPORT_PROTOCOL_PARAMS_H_
#define TENSORVERBS_TESTS_SUPPORT_PROTOCOL_PARAMS_H_

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "src/fabric/fabric.h"

namespace tensorverbs::testing {

// For INSTANTIATE_TEST_SUITE_P over protocol names.
inline std::string ProtocolTestName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

// Whether libfabric offers `provider` ("tcp;ofi_rxm", "shm") with what the fabric needs.
inline bool OfiProviderAvailable(absl::string_view provider) {
  for (const std::string& p : fabric::ListOfiProviders()) {
    if (p == provider || absl::StartsWith(p, absl::StrCat(provider, " ("))) return true;
  }
  return false;
}

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_PROTOCOL_PARAMS_H_
