#include "src/protocol/message.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace tensorverbs::protocol {
namespace {

using ::testing::HasSubstr;

Message Request() {
  Message m;
  m.type = MessageType::kTensorRequest;
  m.name = "/job:ps/replica:0/task:0/device:CPU:0;00000000deadbeef;/job:worker/replica:0/task:1/device:CPU:0;w;0:0";
  m.step_id = -42;
  m.request_index = 0xFFFFFFFD;
  m.remote_addr = 0x7f0012345678;
  m.remote_key = std::string("\x01\x00\xff\x7f rkey", 9);
  m.meta.dtype = DataType::kFloat32;
  m.meta.shape = TensorShape::Of({2, 3, 4});
  m.meta.tensor_bytes = 2 * 3 * 4 * 4;
  return m;
}

std::vector<uint8_t> Encode(const Message& m) {
  std::vector<uint8_t> slot(kMessageSize, 0);
  absl::Status s = EncodeMessage(m, absl::MakeSpan(slot));
  EXPECT_TRUE(s.ok()) << s;
  return slot;
}

void ExpectSame(const Message& a, const Message& b) {
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.step_id, b.step_id);
  EXPECT_EQ(a.request_index, b.request_index);
  EXPECT_EQ(a.remote_addr, b.remote_addr);
  EXPECT_EQ(a.remote_key, b.remote_key);
  EXPECT_EQ(a.checksum, b.checksum);
  EXPECT_EQ(a.meta, b.meta);
  EXPECT_EQ(a.error, b.error);
  EXPECT_EQ(a.segment_bytes, b.segment_bytes);
  EXPECT_EQ(a.lane_keys, b.lane_keys);
  EXPECT_EQ(a.lane_shares, b.lane_shares);
}

TEST(MessageCodec, RoundTripsEveryType) {
  Message req = Request();
  Message meta;
  meta.type = MessageType::kMetaDataResponse;
  meta.request_index = 7;
  meta.checksum = 0xABCDEF0123456789;
  meta.meta.dtype = DataType::kString;
  meta.meta.shape = TensorShape::Of({5});
  meta.meta.tensor_bytes = 12345;  // serialized TensorProto size
  Message rereq = Request();
  rereq.type = MessageType::kTensorReRequest;
  Message err;
  err.type = MessageType::kErrorStatus;
  err.name = req.name;
  err.step_id = 9;
  err.request_index = 3;
  err.error = absl::AbortedError("the task was probably restarted");
  Message dead;
  dead.type = MessageType::kMetaDataResponse;
  dead.meta.is_dead = true;
  for (const Message& m : {req, meta, rereq, err, dead}) {
    absl::StatusOr<Message> back = DecodeMessage(Encode(m));
    ASSERT_TRUE(back.ok()) << MessageTypeName(m.type) << ": " << back.status();
    ExpectSame(m, *back);
  }
}

TEST(MessageCodec, LittleEndianVersionedAndZeroFilled) {
  std::vector<uint8_t> slot = Encode(Request());
  EXPECT_EQ(slot[0], kWireVersion);
  EXPECT_EQ(slot[1], 1) << "TENSOR_REQUEST";
  // step_id -42 at offset 8, little-endian two's complement.
  EXPECT_EQ(slot[8], 0xD6);
  EXPECT_EQ(slot[15], 0xFF);
  uint32_t used = slot[4] | slot[5] << 8 | slot[6] << 16 | static_cast<uint32_t>(slot[7]) << 24;
  for (size_t i = used; i < slot.size(); ++i) ASSERT_EQ(slot[i], 0) << "byte " << i;
}

TEST(MessageCodec, ShapesUpToTheMaximumRank) {
  for (int rank : {0, 1, 8, TensorShape::kMaxRank}) {
    Message m;
    m.type = MessageType::kMetaDataResponse;
    m.meta.dtype = DataType::kInt8;
    m.meta.shape = *TensorShape::Create(std::vector<int64_t>(rank, 1));
    m.meta.tensor_bytes = 1;
    absl::StatusOr<Message> back = DecodeMessage(Encode(m));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->meta.shape.rank(), rank);
  }
}

TEST(MessageCodec, NamesAtAndOverTheLimit) {
  Message m = Request();
  m.name = std::string(kMaxNameLength, 'k');
  ASSERT_TRUE(DecodeMessage(Encode(m)).ok());
  m.name.push_back('k');
  std::vector<uint8_t> slot(kMessageSize);
  absl::Status s = EncodeMessage(m, absl::MakeSpan(slot));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("longer than the 2048-byte limit"));
  m = Request();
  // A key longer than any fabric's cannot be held (it becomes the empty key every backend
  // refuses), so none ever reaches the wire.
  m.remote_key = std::string(kMaxRemoteKeyLength + 1, 'r');
  EXPECT_TRUE(m.remote_key.empty());
  m.remote_key = std::string(kMaxRemoteKeyLength, 'r');
  EXPECT_EQ(DecodeMessage(Encode(m))->remote_key, m.remote_key);
  const size_t size = *EncodedSize(Request());
  EXPECT_FALSE(EncodeMessage(Request(), absl::MakeSpan(slot).subspan(0, size - 8)).ok())
      << "too little room";
  EXPECT_TRUE(EncodeMessage(Request(), absl::MakeSpan(slot).subspan(0, size)).ok());
}

TEST(MessageCodec, EncodesExactlyItsPaddedSizeAndCarriesTheBatchCount) {
  const Message m = Request();
  const size_t size = *EncodedSize(m);
  EXPECT_EQ(size % 8, 0u);
  EXPECT_EQ(size, (72 + m.name.size() + m.remote_key.size() + 3 * 8 + 7) / 8 * 8);
  std::vector<uint8_t> slot(kMessageSize, 0xCC);
  ASSERT_TRUE(EncodeMessage(m, absl::MakeSpan(slot), /*more=*/5).ok());
  EXPECT_EQ(slot[size], 0xCC) << "nothing past the message is written";
  EXPECT_EQ(slot[size - 1], 0) << "padding is zero";
  EXPECT_EQ(EncodedLength(slot), size);
  uint16_t more = 0;
  absl::StatusOr<Message> back = DecodeMessage(slot, &more);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(more, 5);
  ExpectSame(m, *back);
  // A second message right after the first.
  Message second = Request();
  second.name = "k2";
  ASSERT_TRUE(EncodeMessage(second, absl::MakeSpan(slot).subspan(size), 0).ok());
  back = DecodeMessage(absl::MakeConstSpan(slot).subspan(size), &more);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->name, "k2");
  EXPECT_EQ(more, 0);
  Message unknown;
  unknown.type = static_cast<MessageType>(9);
  EXPECT_EQ(EncodedSize(unknown).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MessageCodec, LongErrorMessagesAreTruncatedNotRejected) {
  Message m;
  m.type = MessageType::kErrorStatus;
  m.name = "k";
  m.error = absl::InternalError(std::string(10000, 'e'));
  absl::StatusOr<Message> back = DecodeMessage(Encode(m));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->error.message().size(), kMaxErrorMessageLength);
}

TEST(MessageCodec, EachMalformedFormIsDataLossNamingTheProblem) {
  const std::vector<uint8_t> good = Encode(Request());
  auto decode_with = [&](size_t offset, uint8_t value) {
    std::vector<uint8_t> slot = good;
    slot[offset] = value;
    return DecodeMessage(slot).status();
  };
  EXPECT_THAT(std::string(decode_with(0, 9).message()), HasSubstr("wire version 9"));
  EXPECT_THAT(std::string(decode_with(1, 0).message()), HasSubstr("unknown type 0"));
  EXPECT_THAT(std::string(decode_with(1, 5).message()), HasSubstr("unknown type 5"));
  EXPECT_THAT(std::string(decode_with(4, 0xFF).message()), HasSubstr("add up to"));
  EXPECT_THAT(std::string(decode_with(20, 4).message()), HasSubstr("unknown flags"));
  EXPECT_THAT(std::string(decode_with(21, 255).message()), HasSubstr("rank 255"));
  EXPECT_THAT(std::string(decode_with(40, 99).message()), HasSubstr("unknown data type"));
  EXPECT_THAT(std::string(decode_with(48, 1).message()), HasSubstr("tensor bytes for float32[2,3,4]"));
  EXPECT_THAT(std::string(decode_with(57, 0xFF).message()), HasSubstr("name length"));
  EXPECT_THAT(std::string(decode_with(44, 3).message()), HasSubstr("carries an error status"));
  EXPECT_EQ(DecodeMessage(absl::MakeConstSpan(good).subspan(0, 10)).status().code(),
            absl::StatusCode::kDataLoss);
  // A negative dimension.
  std::vector<uint8_t> negative = good;
  const size_t dims_at = 72 + Request().name.size() + Request().remote_key.size();
  negative[dims_at + 7] = 0x80;
  EXPECT_THAT(std::string(DecodeMessage(negative).status().message()), HasSubstr("negative"));
  // Error statuses need a real code and requests a key.
  Message err;
  err.type = MessageType::kErrorStatus;
  err.name = "k";
  err.error = absl::UnknownError("x");
  std::vector<uint8_t> e = Encode(err);
  e[44] = 17;
  EXPECT_THAT(std::string(DecodeMessage(e).status().message()), HasSubstr("code 17"));
  Message nameless = Request();
  nameless.name.clear();
  EXPECT_THAT(std::string(DecodeMessage(Encode(nameless)).status().message()),
              HasSubstr("without a rendezvous key"));
}

TEST(MessageCodec, ADestinationMayAskForTheContentInSegmentsOfAtLeastTheMinimum) {
  for (MessageType type : {MessageType::kTensorRequest, MessageType::kTensorReRequest}) {
    Message m = Request();
    m.type = type;
    for (uint32_t segment : {0u, kMinSegmentBytes, 4u << 20, 0xFFFFFFFFu}) {
      m.segment_bytes = segment;
      absl::StatusOr<Message> back = DecodeMessage(Encode(m));
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->segment_bytes, segment);
    }
  }
  // Fewer bytes a segment would let a peer cost the receiver an immediate per byte; answers
  // name no destination.
  Message small = Request();
  small.segment_bytes = kMinSegmentBytes - 1;
  std::vector<uint8_t> slot(kMessageSize);
  EXPECT_EQ(EncodeMessage(small, absl::MakeSpan(slot)).code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> good = Encode(Request());
  good[68] = 1;  // u32 segment_bytes at 68: 1 byte
  EXPECT_EQ(DecodeMessage(good).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(DecodeMessage(good).status().message()),
              HasSubstr("content segments of 1 bytes, under the 65536-byte minimum"));
  Message meta;
  meta.type = MessageType::kMetaDataResponse;
  meta.segment_bytes = kMinSegmentBytes;
  EXPECT_EQ(EncodeMessage(meta, absl::MakeSpan(slot)).code(), absl::StatusCode::kInvalidArgument);
  meta.segment_bytes = 0;
  std::vector<uint8_t> answer = Encode(meta);
  answer[70] = 1;  // 65536 bytes
  EXPECT_THAT(std::string(DecodeMessage(answer).status().message()),
              HasSubstr("RDMA_MESSAGE_META_DATA_RESPONSE carries a segment size"));
  // Both ends count a tensor's immediates alike.
  EXPECT_EQ(ContentSegments(0, 0), 1u);
  EXPECT_EQ(ContentSegments(100, 0), 1u);
  EXPECT_EQ(ContentSegments(kMinSegmentBytes, kMinSegmentBytes), 1u);
  EXPECT_EQ(ContentSegments(kMinSegmentBytes + 1, kMinSegmentBytes), 2u);
  EXPECT_EQ(ContentSegments(uint64_t{1} << 30, kMinSegmentBytes), 16384u);
}

TEST(MessageCodec, ASegmentedRequestCarriesAKeyPerFurtherLane) {
  for (MessageType type : {MessageType::kTensorRequest, MessageType::kTensorReRequest}) {
    Message m = Request();
    m.type = type;
    m.segment_bytes = kMinSegmentBytes;
    for (size_t lanes = 1; lanes < kMaxLanes; ++lanes) {
      m.lane_keys.push_back(std::string(m.remote_key.size(), static_cast<char>('a' + lanes)));
      absl::StatusOr<Message> back = DecodeMessage(Encode(m));
      ASSERT_TRUE(back.ok()) << back.status();
      ExpectSame(m, *back);
      EXPECT_EQ(back->lane_keys.size(), lanes);
    }
  }
  std::vector<uint8_t> slot(kMessageSize);
  // Keys beside no segments, of another length, or for more lanes than a channel has.
  Message unsegmented = Request();
  unsegmented.lane_keys.push_back(unsegmented.remote_key);
  EXPECT_EQ(EncodeMessage(unsegmented, absl::MakeSpan(slot)).code(),
            absl::StatusCode::kInvalidArgument);
  Message uneven = Request();
  uneven.segment_bytes = kMinSegmentBytes;
  uneven.lane_keys.push_back("short");
  EXPECT_EQ(EncodeMessage(uneven, absl::MakeSpan(slot)).code(), absl::StatusCode::kInvalidArgument);
  Message many = Request();
  many.segment_bytes = kMinSegmentBytes;
  many.lane_keys.assign(kMaxLanes, many.remote_key);
  EXPECT_EQ(EncodeMessage(many, absl::MakeSpan(slot)).code(), absl::StatusCode::kInvalidArgument);
  // From the wire: the count at byte 59 must match the lengths, stay under the bound and come
  // with segments.
  Message two = Request();
  two.segment_bytes = kMinSegmentBytes;
  two.lane_keys.push_back(two.remote_key);
  std::vector<uint8_t> good = Encode(two);
  ASSERT_EQ(good[59], 1);
  good[59] = 2;
  EXPECT_THAT(std::string(DecodeMessage(good).status().message()), HasSubstr("add up to"));
  good[59] = kMaxLanes;
  EXPECT_THAT(std::string(DecodeMessage(good).status().message()),
              HasSubstr("more than the 3 a channel may use"));
  std::vector<uint8_t> plain = Encode(Request());
  plain[59] = 1;
  EXPECT_THAT(std::string(DecodeMessage(plain).status().message()),
              HasSubstr("lane keys without content segments"));
}

TEST(MessageCodec, ARequestOverLanesGivesEachLaneItsShare) {
  Message m = Request();
  m.segment_bytes = kMinSegmentBytes;
  m.lane_keys.push_back(m.remote_key);
  m.lane_keys.push_back(m.remote_key);
  m.lane_shares = {11, 3, kMaxLaneShare, 0};
  std::vector<uint8_t> wire = Encode(m);
  EXPECT_EQ(wire[22], 0x3B) << "lane k's share in bits 4k..4k+3";
  EXPECT_EQ(wire[23], 0x0F);
  absl::StatusOr<Message> back = DecodeMessage(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(m, *back);

  // A share of 0 or beyond the lanes, or shares without lane keys.
  std::vector<uint8_t> slot(kMessageSize);
  Message zero = m;
  zero.lane_shares = {11, 0, 4, 0};
  EXPECT_THAT(std::string(EncodeMessage(zero, absl::MakeSpan(slot)).message()),
              HasSubstr("lane 1's share is 0, not 1..15 of 3 lanes"));
  Message beyond = m;
  beyond.lane_shares = {1, 1, 1, 1};
  EXPECT_THAT(std::string(EncodeMessage(beyond, absl::MakeSpan(slot)).message()),
              HasSubstr("a share for lane 3 of a request over 3 lanes"));
  Message plain = Request();
  plain.lane_shares = {1, 1, 0, 0};
  EXPECT_THAT(std::string(EncodeMessage(plain, absl::MakeSpan(slot)).message()),
              HasSubstr("lane shares without lane keys"));
  // From the wire alike.
  wire[23] = 0x1F;
  EXPECT_THAT(std::string(DecodeMessage(wire).status().message()), HasSubstr("a share for lane 3"));
  wire[23] = 0x0F;
  wire[22] = 0x0B;
  EXPECT_THAT(std::string(DecodeMessage(wire).status().message()),
              HasSubstr("lane 1's share is 0"));
  std::vector<uint8_t> unspread = Encode(Request());
  unspread[22] = 0x11;
  EXPECT_THAT(std::string(DecodeMessage(unspread).status().message()),
              HasSubstr("lane shares without lane keys"));
}

TEST(MessageCodec, ARequestNamesItsKeyByIndexOrDefinesTheIndex) {
  Message define = Request();
  define.name_index = 7;
  absl::StatusOr<Message> back = DecodeMessage(Encode(define));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->name, define.name);
  EXPECT_EQ(back->name_index, 7u);
  Message refer = Request();
  refer.name.clear();
  refer.name_index = 7;
  back = DecodeMessage(Encode(refer));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->name.empty());
  EXPECT_EQ(back->name_index, 7u);
  EXPECT_LT(EncodedSize(refer).value(), EncodedSize(define).value())
      << "the index replaces the key's bytes";
  // Without the flag the index field must be zero, and only REQUESTs carry one.
  std::vector<uint8_t> stray = Encode(Request());
  stray[64] = 5;
  EXPECT_THAT(std::string(DecodeMessage(stray).status().message()),
              HasSubstr("name index 5 without its flag"));
  Message answer;
  answer.type = MessageType::kMetaDataResponse;
  answer.name_index = 1;
  EXPECT_EQ(EncodedSize(answer).status().code(), absl::StatusCode::kInvalidArgument);
  answer.name_index = kNoNameIndex;
  std::vector<uint8_t> flagged = Encode(answer);
  flagged[20] |= 2;
  EXPECT_THAT(std::string(DecodeMessage(flagged).status().message()),
              HasSubstr("carries a name index"));
  EXPECT_EQ(DecodeMessage(Encode(Request())).value().name_index, kNoNameIndex);
}

TEST(MessageCodec, EveryTruncationAndBitFlipIsHandled) {
  const std::vector<uint8_t> good = Encode(Request());
  const size_t used = good[4] | good[5] << 8;
  ASSERT_GT(used, 72u);
  for (size_t n = 0; n < used; ++n) {
    absl::StatusOr<Message> m = DecodeMessage(absl::MakeConstSpan(good).subspan(0, n));
    EXPECT_FALSE(m.ok()) << "truncated to " << n;
  }
  ASSERT_TRUE(DecodeMessage(absl::MakeConstSpan(good).subspan(0, used)).ok())
      << "exactly the used bytes are a whole message";
  for (size_t byte = 0; byte < used; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<uint8_t> slot = good;
      slot[byte] ^= static_cast<uint8_t>(1 << bit);
      absl::StatusOr<Message> m = DecodeMessage(slot);
      if (!m.ok()) {
        EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
      }
    }
  }
}

TEST(MessageCodec, RandomSlotsNeverCrash) {
  std::mt19937 rng(3);
  std::vector<uint8_t> slot(kMessageSize);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    for (size_t j = 0; j < 128; ++j) slot[j] = static_cast<uint8_t>(rng());
    slot[0] = kWireVersion;  // get past the version check most of the time
    accepted += DecodeMessage(slot).ok();
  }
  EXPECT_LT(accepted, 20000);
}

}  // namespace
}  // namespace tensorverbs::protocol
