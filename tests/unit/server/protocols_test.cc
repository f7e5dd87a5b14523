#include "src/server/protocols.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/server/server.h"

namespace tensorverbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Protocols, BestFirstAndTheSameListEverywhere) {
  EXPECT_THAT(AvailableProtocols(),
              ElementsAre("grpc+verbs", "grpc+gdr", "grpc+verbs-copy", "grpc"));
  ASSERT_EQ(Protocols().size(), AvailableProtocols().size());
}

// The transport names its mode on the wire (ConnectRequest.protocol) and in traces by
// protocol::VerbsModeProtocol; the table and that name must agree.
TEST(Protocols, EachTransportModeIsNamedAsItsProtocol) {
  int with_transport = 0;
  for (const ProtocolSpec& spec : Protocols()) {
    if (!spec.verbs_mode.has_value()) continue;
    ++with_transport;
    EXPECT_EQ(protocol::VerbsModeProtocol(*spec.verbs_mode), spec.name);
  }
  EXPECT_EQ(with_transport, 3);
}

TEST(Protocols, WhatEachServesOverRecvTensor) {
  for (const ProtocolSpec& spec : Protocols()) {
    SCOPED_TRACE(std::string(spec.name));
    // Without a transport, RecvTensor is how tensors move at all.
    if (!spec.verbs_mode.has_value()) {
      EXPECT_TRUE(spec.serves_recv_tensor);
    }
    // Lending is grpc+gdr's: meta-data over RecvTensor, the content read over the transport.
    if (spec.lends_tensors) {
      EXPECT_TRUE(spec.serves_recv_tensor);
      EXPECT_EQ(spec.verbs_mode, protocol::VerbsMode::kGdr);
    }
  }
  EXPECT_FALSE((*FindProtocol("grpc+verbs"))->serves_recv_tensor);
  EXPECT_FALSE((*FindProtocol("grpc+verbs-copy"))->serves_recv_tensor);
  EXPECT_TRUE((*FindProtocol("grpc+gdr"))->lends_tensors);
}

TEST(Protocols, AnUnknownNameIsRefusedListingTheKnownOnes) {
  for (const char* name : {"verbs", "GRPC", "grpc+verbs ", ""}) {
    absl::StatusOr<const ProtocolSpec*> spec = FindProtocol(name);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(spec.status().message(), HasSubstr("unknown protocol '"));
    EXPECT_THAT(spec.status().message(),
                HasSubstr("available: grpc+verbs, grpc+gdr, grpc+verbs-copy, grpc"));
  }
}

}  // namespace
}  // namespace tensorverbs
