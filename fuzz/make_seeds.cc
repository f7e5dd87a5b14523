// Writes the seed corpus of every fuzz target (fuzz/corpus/<target>/) from the project's own
// encoders, so the fuzzers start from well-formed inputs of each kind: tensors of several
// dtypes, ranks and deadness, every control-message type and a batch, copy-mode payloads,
// RecvTensor answers with bytes and with a RemoteTensor descriptor, keys, cluster specs and
// settings. Run by hand after an encoding changes: make_seeds fuzz/corpus
// (regression inputs saved from crashes live beside these files and are kept).
#include <grpcpp/support/byte_buffer.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/verbs.pb.h"
#include "src/protocol/copy_payload.h"
#include "src/protocol/message.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/parsed_key.h"
#include "src/tensor/tensor_codec.h"
#include "src/transport/grpc/tensor_coding.h"

namespace {

using namespace tensorverbs;

std::filesystem::path g_root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::filesystem::path dir = g_root / target;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / ("seed-" + name), std::ios::binary) << bytes;
}

std::vector<std::pair<std::string, Tensor>> Tensors() {
  std::vector<std::pair<std::string, Tensor>> out;
  auto pod = [&](const std::string& name, DataType dtype, std::vector<int64_t> dims) {
    Tensor t = *Tensor::Allocate(CpuAllocator(), dtype, *TensorShape::Create(dims));
    auto* bytes = static_cast<uint8_t*>(t.data());
    for (size_t i = 0; i < t.TotalBytes(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 1);
    out.emplace_back(name, t);
  };
  pod("float32", DataType::kFloat32, {2, 3});
  pod("int8-empty", DataType::kInt8, {0, 7});
  pod("int64-scalar", DataType::kInt64, {});
  pod("bool-rank8", DataType::kBool, {1, 2, 1, 2, 1, 2, 1, 2});
  Tensor s = *Tensor::Allocate(CpuAllocator(), DataType::kString, *TensorShape::Create({3}));
  s.strings()[0] = "";
  s.strings()[1] = "a";
  s.strings()[2] = std::string(40, 'x');
  out.emplace_back("string", s);
  return out;
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  std::string out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

std::string Encode(const protocol::Message& m, uint16_t more = 0) {
  absl::StatusOr<size_t> size = protocol::EncodedSize(m);
  if (!size.ok()) {
    std::fprintf(stderr, "make_seeds: %s\n", size.status().ToString().c_str());
    std::exit(1);
  }
  std::string out(*size, '\0');
  (void)protocol::EncodeMessage(
      m, absl::MakeSpan(reinterpret_cast<uint8_t*>(out.data()), out.size()), more);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR (fuzz/corpus)\n");
    return 2;
  }
  g_root = argv[1];
  const std::string key = ParsedKey::Create(CpuDeviceName("worker", 1), 0x1234abcd,
                                            CpuDeviceName("worker", 0), "layer_1/weights:0");
  for (const auto& [name, tensor] : Tensors()) {
    proto::TensorProto p;
    TensorToProto(tensor, &p);
    Write("tensor_proto", name, p.SerializeAsString());
    for (bool dead : {false, true}) {
      protocol::CopyPayload payload(tensor, dead);
      std::string bytes(payload.Size(), '\0');
      payload.WriteTo(reinterpret_cast<uint8_t*>(bytes.data()));
      Write("copy_payload", name + (dead ? "-dead" : ""), bytes);
    }
    grpc::ByteBuffer response;
    grpc_transport::EncodeRecvTensorResponse(tensor, false, 17, &response);
    Write("recv_tensor_response", name, std::string(1, '\x10') + Flatten(response));
  }
  {
    const Tensor t = Tensors().front().second;
    protocol::RemoteTensorRef remote{0x7f0000001000, std::string(16, '\x42'), 9, t.TotalBytes()};
    grpc::ByteBuffer response;
    grpc_transport::EncodeRecvTensorResponse(t, false, 17, &response, &remote);
    Write("recv_tensor_response", "remote", std::string(1, '\x08') + Flatten(response));
  }

  protocol::Message request;
  request.type = protocol::MessageType::kTensorRequest;
  request.name = key;
  request.name_index = 0;
  request.step_id = 42;
  request.request_index = 3;
  request.remote_addr = 0x7f0000002000;
  request.remote_key = std::string(16, '\x17');
  request.meta.dtype = DataType::kFloat32;
  request.meta.shape = *TensorShape::Create({2, 3});
  request.meta.tensor_bytes = 24;
  protocol::Message by_index = request;
  by_index.name.clear();
  protocol::Message meta = request;
  meta.type = protocol::MessageType::kMetaDataResponse;
  meta.name.clear();
  meta.name_index = protocol::kNoNameIndex;
  meta.checksum = 0xdeadbeef;
  protocol::Message re_request = by_index;
  re_request.type = protocol::MessageType::kTensorReRequest;
  re_request.name_index = protocol::kNoNameIndex;
  protocol::Message error;
  error.type = protocol::MessageType::kErrorStatus;
  error.request_index = 3;
  error.error = absl::NotFoundError("no such tensor");
  Write("control_message", "request", Encode(request));
  Write("control_message", "request-by-index", Encode(by_index));
  Write("control_message", "meta-data", Encode(meta));
  Write("control_message", "re-request", Encode(re_request));
  Write("control_message", "error", Encode(error));
  {
    std::string batch;
    const std::vector<const protocol::Message*> parts = {&by_index, &re_request, &error};
    for (size_t i = 0; i < parts.size(); ++i) {
      batch += Encode(*parts[i], static_cast<uint16_t>(parts.size() - 1 - i));
    }
    Write("control_message", "batch", batch);
  }

  Write("rendezvous_key", "key", key);
  Write("rendezvous_key", "frame",
        ParsedKey::Create(CpuDeviceName("ps", 0), 1, CpuDeviceName("worker", 3), "x", 2, 5));
  Write("cluster_spec", "text",
        std::string(1, '\0') + "ps=host0:2222;worker=host1:2222,[::1]:2223");
  Write("cluster_spec", "json",
        "\x01{\"ps\": [\"host0:2222\"], \"worker\": [\"host1:2222\", \"10.0.0.2:2222\"]}");
  // Config lines: a byte picking the variable (by its index in the known list), then the value.
  Write("config", "numbers",
        "\x01"
        "600000\n\x03"
        "64\n\x0f"
        "-1\n\x13"
        "0x10\n");
  Write("config", "words",
        std::string(1, '\0') +
            "info\n\x08"
            "shmem\n\x0d"
            "busy\n\x10"
            "per-transfer\n");
  Write("verbs_service", "connect",
        std::string("\x01\x00\x01\x01\x01\x01", 6) + std::string(40, '\x02') + "address");
  Write("verbs_service", "check", std::string("\x00\x01", 2) + std::string(8, '\x05'));
  return 0;
}
