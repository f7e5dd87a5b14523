#include "tensorverbs/parsed_key.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

constexpr char kSrc[] = "/job:ps/replica:0/task:0/device:CPU:0";
constexpr char kDst[] = "/job:worker/replica:0/task:3/device:GPU:1";

TEST(ParsedKey, ParsesTheCanonicalForm) {
  std::string key = ParsedKey::Create(kSrc, 0xdeadbeef12345678ULL, kDst, "layer/weights", 2, 7);
  EXPECT_EQ(key, std::string(kSrc) + ";deadbeef12345678;" + kDst + ";layer/weights;2:7");
  absl::StatusOr<ParsedKey> k = ParsedKey::Parse(key);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->full_key, key);
  EXPECT_EQ(k->src.job, "ps");
  EXPECT_EQ(k->src.task, 0);
  EXPECT_EQ(k->src.type, "CPU");
  EXPECT_EQ(k->src_incarnation, 0xdeadbeef12345678ULL);
  EXPECT_EQ(k->dst.job, "worker");
  EXPECT_EQ(k->dst.task, 3);
  EXPECT_EQ(k->dst.type, "GPU");
  EXPECT_EQ(k->dst.id, 1);
  EXPECT_EQ(k->dst.TaskName(), "/job:worker/replica:0/task:3");
  EXPECT_EQ(k->edge_name, "layer/weights");
  EXPECT_EQ(k->frame_id, 2);
  EXPECT_EQ(k->iter_id, 7);
}

// Make builds from parsed devices what Parse(Create(...)) gives, and refuses the same names.
TEST(ParsedKey, MakeMatchesParseOfCreateAndRefusesTheSameNames) {
  const DeviceName src = *DeviceName::Parse(kSrc);
  const DeviceName dst = *DeviceName::Parse(kDst);
  for (uint64_t incarnation : {uint64_t{0}, uint64_t{7}, uint64_t{0xdeadbeef12345678}}) {
    absl::StatusOr<ParsedKey> made = ParsedKey::Make(src, kSrc, incarnation, dst, kDst, "a/b:0");
    absl::StatusOr<ParsedKey> parsed =
        ParsedKey::Parse(ParsedKey::Create(kSrc, incarnation, kDst, "a/b:0"));
    ASSERT_TRUE(made.ok()) << made.status();
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(made->full_key, parsed->full_key);
    EXPECT_EQ(made->src.FullName(), parsed->src.FullName());
    EXPECT_EQ(made->dst.FullName(), parsed->dst.FullName());
    EXPECT_EQ(made->src_incarnation, parsed->src_incarnation);
    EXPECT_EQ(made->edge_name, parsed->edge_name);
    EXPECT_EQ(made->frame_id, 0);
    EXPECT_EQ(made->iter_id, 0);
  }
  for (const std::string& bad :
       {std::string(), std::string("a;b"), std::string(ParsedKey::kMaxKeyLength, 'x')}) {
    absl::StatusOr<ParsedKey> made = ParsedKey::Make(src, kSrc, 1, dst, kDst, bad);
    absl::StatusOr<ParsedKey> parsed = ParsedKey::Parse(ParsedKey::Create(kSrc, 1, kDst, bad));
    ASSERT_FALSE(made.ok()) << bad;
    EXPECT_EQ(made.status(), parsed.status());
  }
}

TEST(ParsedKey, AcceptsLegacyDeviceForm) {
  absl::StatusOr<ParsedKey> k =
      ParsedKey::Parse("/job:ps/replica:0/task:1/cpu:0;1;/job:worker/replica:0/task:0/gpu:2;x;0:0");
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->src.type, "CPU");
  EXPECT_EQ(k->dst.type, "GPU");
  EXPECT_EQ(k->dst.id, 2);
  EXPECT_EQ(k->src_incarnation, 1u);
}

struct BadKey {
  std::string key;
  std::string why;
};

TEST(ParsedKey, EachMalformedFormGetsAClearError) {
  const std::string src = kSrc, dst = kDst;
  const std::vector<BadKey> cases = {
      {"", "parts"},
      {"a;b;c;d", "4 ';'-separated parts"},
      {src + ";1;" + dst + ";x;0:0;extra", "6 ';'-separated parts"},
      {"job:ps/replica:0/task:0/device:CPU:0;1;" + dst + ";x;0:0", "source device"},
      {"/job:ps/replica:0/task:0;1;" + dst + ";x;0:0", "source device"},
      {"/job:ps/replica:x/task:0/device:CPU:0;1;" + dst + ";x;0:0", "replica"},
      {"/job:ps/replica:0/task:-1/device:CPU:0;1;" + dst + ";x;0:0", "task"},
      {"/job:1ps/replica:0/task:0/device:CPU:0;1;" + dst + ";x;0:0", "job"},
      {"/job:ps/replica:0/task:0/device:CPU;1;" + dst + ";x;0:0", "device component"},
      {src + ";;" + dst + ";x;0:0", "incarnation"},
      {src + ";xyz;" + dst + ";x;0:0", "incarnation"},
      {src + ";11112222333344445;" + dst + ";x;0:0", "incarnation"},
      {src + ";-1;" + dst + ";x;0:0", "incarnation"},
      {src + ";1;/job:w;x;0:0", "destination device"},
      {src + ";1;" + dst + ";;0:0", "tensor name is empty"},
      {src + ";1;" + dst + ";x;0", "frame_id:iter_id"},
      {src + ";1;" + dst + ";x;a:0", "frame_id:iter_id"},
      {src + ";1;" + dst + ";x;0:-3", "frame_id:iter_id"},
      {src + ";1;" + dst + ";" + std::string(5000, 'n') + ";0:0", "longer than"},
  };
  for (const BadKey& c : cases) {
    absl::StatusOr<ParsedKey> k = ParsedKey::Parse(c.key);
    ASSERT_FALSE(k.ok()) << c.key;
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_THAT(k.status().message(), HasSubstr(c.why)) << c.key;
    EXPECT_THAT(k.status().message(), HasSubstr("malformed rendezvous key"));
  }
}

TEST(ParsedKey, IsOnTaskAgreesWithTaskNameWithoutBuildingIt) {
  absl::StatusOr<DeviceName> d = DeviceName::Parse(kDst);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->IsOnTask(d->TaskName()));
  EXPECT_TRUE(d->IsOnTask("/job:worker/replica:0/task:3"));
  for (const char* other :
       {"/job:worker/replica:0/task:31",
        "/job:worker/replica:0/task:", "/job:worke/replica:0/task:3",
        "/job:workers/replica:0/task:3", "/job:worker/replica:1/task:3",
        "/job:worker/replica:0/task:3/device:GPU:1", "", "/job:ps/replica:0/task:3"}) {
    EXPECT_FALSE(d->IsOnTask(other)) << other;
  }
}

}  // namespace
}  // namespace tensorverbs
