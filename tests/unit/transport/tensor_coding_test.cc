#include "src/transport/grpc/tensor_coding.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "proto/worker.pb.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/tensor/tensor_codec.h"
#include "tests/support/recording_allocator.h"

namespace tensorverbs::grpc_transport {
namespace {

using ::testing::HasSubstr;

Tensor Filled(DataType d, const TensorShape& shape) {
  Tensor t = Tensor::Make(d, shape);
  std::mt19937 rng(11);
  if (t.CanMemCopy()) {
    auto* p = static_cast<unsigned char*>(t.data());
    for (size_t i = 0; i < t.TotalBytes(); ++i) p[i] = static_cast<unsigned char>(rng());
  } else {
    for (int64_t i = 0; i < t.NumElements(); ++i) t.strings()[i] = std::string(i % 50, 'q');
  }
  return t;
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer FromString(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

TEST(TensorCoding, RoundTripsEveryDtypeAndSize) {
  for (DataType d : AllDataTypes()) {
    for (const TensorShape& shape :
         {TensorShape(), TensorShape::Of({0}), TensorShape::Of({3, 5}), TensorShape::Of({700}),
          TensorShape::Of({2, 1, 1, 1, 1, 1, 1, 3})}) {
      Tensor t = Filled(d, shape);
      grpc::ByteBuffer buffer;
      EncodeRecvTensorResponse(t, false, 123, &buffer);
      // It is a valid protobuf message too.
      proto::RecvTensorResponse generic;
      ASSERT_TRUE(generic.ParseFromString(Flatten(buffer)));
      EXPECT_EQ(generic.send_start_micros(), 123);
      ParsedResponse parsed;
      absl::Status s =
          ParseRecvTensorResponse(&buffer, CpuAllocator(), kDefaultMaxTensorBytes, &parsed);
      ASSERT_TRUE(s.ok()) << s << " " << t.DebugString();
      EXPECT_TRUE(parsed.tensor.ContentEquals(t)) << t.DebugString();
      EXPECT_FALSE(parsed.is_dead);
      EXPECT_EQ(parsed.send_start_micros, 123);
    }
  }
}

TEST(TensorCoding, LargeTensorsLeaveWithoutACopy) {
  Tensor t = Filled(DataType::kFloat32, TensorShape::Of({1 << 20}));
  grpc::ByteBuffer buffer;
  EncodeRecvTensorResponse(t, false, 0, &buffer);
  EXPECT_EQ(t.buffer().use_count(), 2) << "the response slice holds a reference";
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(slices[1].begin(), static_cast<const uint8_t*>(t.data()))
      << "slice points into the tensor";
  ParsedResponse parsed;
  ASSERT_TRUE(
      ParseRecvTensorResponse(&buffer, CpuAllocator(), kDefaultMaxTensorBytes, &parsed).ok());
  EXPECT_TRUE(parsed.tensor.ContentEquals(t));
  slices.clear();
  buffer.Clear();
  EXPECT_EQ(t.buffer().use_count(), 1) << "released once gRPC is done";
}

TEST(TensorCoding, DeadTensors) {
  grpc::ByteBuffer buffer;
  EncodeRecvTensorResponse(Tensor(), true, 0, &buffer);
  ParsedResponse parsed;
  ASSERT_TRUE(
      ParseRecvTensorResponse(&buffer, CpuAllocator(), kDefaultMaxTensorBytes, &parsed).ok());
  EXPECT_TRUE(parsed.is_dead);
  EXPECT_FALSE(parsed.tensor.IsInitialized());
}

TEST(TensorCoding, MalformedResponsesAreDataLoss) {
  proto::RecvTensorResponse good;
  Tensor t = Filled(DataType::kInt16, TensorShape::Of({10}));
  TensorToProto(t, good.mutable_meta());
  good.mutable_meta()->clear_tensor_content();
  good.set_tensor_content(std::string(20, 'x'));

  auto parse = [](const std::string& bytes) {
    grpc::ByteBuffer b = FromString(bytes);
    ParsedResponse parsed;
    return ParseRecvTensorResponse(&b, CpuAllocator(), kDefaultMaxTensorBytes, &parsed);
  };
  ASSERT_TRUE(parse(good.SerializeAsString()).ok());

  proto::RecvTensorResponse wrong_size = good;
  wrong_size.set_tensor_content(std::string(19, 'x'));
  absl::Status s = parse(wrong_size.SerializeAsString());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("19 content bytes"));

  proto::RecvTensorResponse no_meta;
  no_meta.set_tensor_content("abcd");
  EXPECT_THAT(parse(no_meta.SerializeAsString()).message(), HasSubstr("no meta-data"));

  proto::RecvTensorResponse bad_dtype = good;
  bad_dtype.mutable_meta()->set_dtype(77);
  EXPECT_EQ(parse(bad_dtype.SerializeAsString()).code(), absl::StatusCode::kDataLoss);

  proto::RecvTensorResponse missing_content = good;
  missing_content.clear_tensor_content();
  EXPECT_THAT(parse(missing_content.SerializeAsString()).message(), HasSubstr("no content"));

  proto::RecvTensorResponse dead_with_content = good;
  dead_with_content.set_is_dead(true);
  EXPECT_EQ(parse(dead_with_content.SerializeAsString()).code(), absl::StatusCode::kDataLoss);

  std::string truncated = good.SerializeAsString();
  truncated.resize(truncated.size() - 5);
  EXPECT_EQ(parse(truncated).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(parse(std::string("\xff\xff\xff\xff\xff\xff", 6)).code(), absl::StatusCode::kDataLoss);

  // Huge declared shapes must not allocate.
  proto::RecvTensorResponse huge = good;
  huge.mutable_meta()->mutable_tensor_shape()->mutable_dim(0)->set_size(int64_t{1} << 62);
  EXPECT_FALSE(parse(huge.SerializeAsString()).ok());
}

TEST(TensorCoding, ARemoteTensorCarriesWhereToReadItAndNoContent) {
  Tensor t = Filled(DataType::kFloat32, TensorShape::Of({64, 64}));
  protocol::RemoteTensorRef ref;
  ref.addr = 0x7f0000001000;
  ref.key = "opaque-key";
  ref.tensor_key = 42;
  ref.bytes = t.TotalBytes();
  grpc::ByteBuffer buffer;
  EncodeRecvTensorResponse(t, false, 7, &buffer, &ref);
  EXPECT_LT(buffer.Length(), 256u) << "no element bytes travel";
  ParsedResponse parsed;
  ASSERT_TRUE(
      ParseRecvTensorResponse(&buffer, CpuAllocator(), kDefaultMaxTensorBytes, &parsed).ok());
  ASSERT_TRUE(parsed.has_remote);
  EXPECT_EQ(parsed.remote.addr, ref.addr);
  EXPECT_EQ(parsed.remote.key, ref.key);
  EXPECT_EQ(parsed.remote.tensor_key, 42u);
  EXPECT_EQ(parsed.tensor.dtype(), DataType::kFloat32);
  EXPECT_EQ(parsed.tensor.shape(), t.shape()) << "the destination is allocated to its shape";

  auto parse = [](const proto::RecvTensorResponse& r) {
    grpc::ByteBuffer b = FromString(r.SerializeAsString());
    ParsedResponse out;
    return ParseRecvTensorResponse(&b, CpuAllocator(), kDefaultMaxTensorBytes, &out);
  };
  proto::RecvTensorResponse good;
  TensorToProto(t, good.mutable_meta());
  good.mutable_meta()->clear_tensor_content();
  good.mutable_remote()->set_addr(ref.addr);
  good.mutable_remote()->set_key(ref.key);
  good.mutable_remote()->set_tensor_key(3);
  good.mutable_remote()->set_bytes(t.TotalBytes());
  ASSERT_TRUE(parse(good).ok());
  proto::RecvTensorResponse wrong_size = good;
  wrong_size.mutable_remote()->set_bytes(t.TotalBytes() + 1);
  EXPECT_EQ(parse(wrong_size).code(), absl::StatusCode::kDataLoss);
  proto::RecvTensorResponse no_key = good;
  no_key.mutable_remote()->clear_key();
  EXPECT_EQ(parse(no_key).code(), absl::StatusCode::kDataLoss);
  proto::RecvTensorResponse reserved_imm = good;
  reserved_imm.mutable_remote()->set_tensor_key(0xFFFFFFFF);
  EXPECT_EQ(parse(reserved_imm).code(), absl::StatusCode::kDataLoss) << "not a release immediate";
  proto::RecvTensorResponse both = good;
  both.set_tensor_content(std::string(t.TotalBytes(), 'x'));
  EXPECT_EQ(parse(both).code(), absl::StatusCode::kDataLoss);
  proto::RecvTensorResponse dead = good;
  dead.set_is_dead(true);
  EXPECT_EQ(parse(dead).code(), absl::StatusCode::kDataLoss);
  proto::RecvTensorResponse strings = good;
  strings.mutable_meta()->set_dtype(static_cast<int>(DataType::kString));
  EXPECT_EQ(parse(strings).code(), absl::StatusCode::kDataLoss);
}

// A peer's announced shape costs nothing until the bytes that came with it match it, and a
// tensor above the receiver's limit is refused before it is allocated.
TEST(TensorCoding, AnnouncedSizesAreCheckedBeforeAnythingIsAllocated) {
  testing::RecordingAllocator allocator;
  auto parse = [&allocator](const proto::RecvTensorResponse& r, uint64_t max_bytes) {
    grpc::ByteBuffer b = FromString(r.SerializeAsString());
    ParsedResponse out;
    return ParseRecvTensorResponse(&b, &allocator, max_bytes, &out);
  };
  // float32[2^29] (2 GiB) with 4 content bytes.
  proto::RecvTensorResponse liar;
  TensorToProto(Filled(DataType::kFloat32, TensorShape::Of({1})), liar.mutable_meta());
  liar.mutable_meta()->clear_tensor_content();
  liar.mutable_meta()->mutable_tensor_shape()->mutable_dim(0)->set_size(int64_t{1} << 29);
  liar.set_tensor_content("abcd");
  absl::Status s = parse(liar, kDefaultMaxTensorBytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("4 content bytes"));
  EXPECT_EQ(allocator.largest(), 0u) << "allocated for a size the response did not carry";

  // The same lie told in the encoding: the content's length field says 2 GiB, as the shape
  // does, and 4 bytes follow. The length is believed only as far as the response goes.
  {
    proto::RecvTensorResponse meta_only = liar;
    meta_only.clear_tensor_content();
    std::string forged = meta_only.SerializeAsString();
    {
      google::protobuf::io::StringOutputStream stream(&forged);
      google::protobuf::io::CodedOutputStream coded(&stream);
      coded.WriteTag(google::protobuf::internal::WireFormatLite::MakeTag(
          proto::RecvTensorResponse::kTensorContentFieldNumber,
          google::protobuf::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
      coded.WriteVarint64(uint64_t{4} << 29);
      coded.WriteRaw("abcd", 4);
    }
    grpc::ByteBuffer b = FromString(forged);
    ParsedResponse out;
    s = ParseRecvTensorResponse(&b, &allocator, kDefaultMaxTensorBytes, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(s.message(), HasSubstr("left in the response"));
    EXPECT_EQ(allocator.largest(), 0u) << "allocated for a length the response did not carry";
  }

  // The same shape with no content at all, and as a remote tensor of the wrong size.
  proto::RecvTensorResponse empty = liar;
  empty.clear_tensor_content();
  EXPECT_EQ(parse(empty, kDefaultMaxTensorBytes).code(), absl::StatusCode::kDataLoss);
  proto::RecvTensorResponse remote = empty;
  remote.mutable_remote()->set_addr(4096);
  remote.mutable_remote()->set_key("key");
  remote.mutable_remote()->set_tensor_key(1);
  remote.mutable_remote()->set_bytes(4);
  EXPECT_EQ(parse(remote, kDefaultMaxTensorBytes).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(allocator.largest(), 0u);

  // Honest tensors above the limit: refused, naming the variable, with nothing allocated.
  proto::RecvTensorResponse honest;
  TensorToProto(Filled(DataType::kInt32, TensorShape::Of({1024})), honest.mutable_meta());
  honest.set_tensor_content(honest.meta().tensor_content());
  honest.mutable_meta()->clear_tensor_content();
  s = parse(honest, 4095);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("TENSORVERBS_MAX_TENSOR_MB"));
  proto::RecvTensorResponse honest_remote = remote;
  honest_remote.mutable_remote()->set_bytes(uint64_t{4} << 29);
  EXPECT_EQ(parse(honest_remote, uint64_t{1} << 30).code(), absl::StatusCode::kResourceExhausted);
  proto::RecvTensorResponse strings;
  Tensor names = Tensor::Make(DataType::kString, TensorShape::Of({100}));
  TensorToProto(names, strings.mutable_meta());
  EXPECT_EQ(parse(strings, 100).code(), absl::StatusCode::kResourceExhausted)
      << "100 string objects are more than 100 bytes";
  EXPECT_EQ(allocator.largest(), 0u);
  // At the limit it is received.
  EXPECT_TRUE(parse(honest, 4096).ok());
  EXPECT_EQ(allocator.largest(), 4096u);
}

// A string tensor whose meta-data names one element and carries 200,000 empty ones (two bytes
// each on the wire, a string object each once parsed): the elements are counted against the
// limit before the meta-data is parsed, and against the shape after.
TEST(TensorCoding, StringElementsAreCountedBeforeTheMetaDataIsParsed) {
  testing::RecordingAllocator allocator;
  proto::RecvTensorResponse liar;
  liar.mutable_meta()->set_dtype(static_cast<int32_t>(DataType::kString));
  liar.mutable_meta()->mutable_tensor_shape()->add_dim()->set_size(1);
  for (int i = 0; i < 200000; ++i) liar.mutable_meta()->add_string_val("");
  grpc::ByteBuffer b = FromString(liar.SerializeAsString());
  ParsedResponse out;
  absl::Status s = ParseRecvTensorResponse(&b, &allocator, uint64_t{1} << 20, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("TENSORVERBS_MAX_TENSOR_MB"));
  b = FromString(liar.SerializeAsString());
  s = ParseRecvTensorResponse(&b, &allocator, kDefaultMaxTensorBytes, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(allocator.largest(), 0u);
  // Meta-data twice (which a parse would merge) is refused.
  proto::RecvTensorResponse one;
  TensorToProto(Filled(DataType::kString, TensorShape::Of({2})), one.mutable_meta());
  const std::string twice = one.SerializeAsString() + one.SerializeAsString();
  b = FromString(twice);
  EXPECT_EQ(ParseRecvTensorResponse(&b, &allocator, kDefaultMaxTensorBytes, &out).code(),
            absl::StatusCode::kDataLoss);
  b = FromString(one.SerializeAsString());
  s = ParseRecvTensorResponse(&b, &allocator, kDefaultMaxTensorBytes, &out);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(out.tensor.NumElements(), 2);
}

TEST(TensorCoding, RandomBytesNeverCrash) {
  std::mt19937 rng(5);
  for (int i = 0; i < 2000; ++i) {
    std::string bytes(rng() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    grpc::ByteBuffer b = FromString(bytes);
    ParsedResponse parsed;
    (void)ParseRecvTensorResponse(&b, CpuAllocator(), kDefaultMaxTensorBytes, &parsed);
  }
}

}  // namespace
}  // namespace tensorverbs::grpc_transport
