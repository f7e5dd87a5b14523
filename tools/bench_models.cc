#include "tools/bench_models.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tensorverbs::tools {
namespace {

class Builder {
 public:
  explicit Builder(std::string model) { spec_.name = std::move(model); }

  void Add(std::string name, std::vector<int64_t> shape) {
    spec_.variables.push_back({std::move(name), std::move(shape)});
  }
  // A convolution kernel and its bias.
  void ConvBias(const std::string& scope, int64_t kh, int64_t kw, int64_t in, int64_t out) {
    Add(scope + "/weights", {kh, kw, in, out});
    Add(scope + "/biases", {out});
  }
  // A convolution without bias, then batch norm: gamma and beta, or beta alone (scale=False).
  void ConvBn(const std::string& scope, int64_t kh, int64_t kw, int64_t in, int64_t out,
              bool scale) {
    Add(scope + "/weights", {kh, kw, in, out});
    if (scale) Add(scope + "/BatchNorm/gamma", {out});
    Add(scope + "/BatchNorm/beta", {out});
  }
  void Dense(const std::string& scope, int64_t in, int64_t out) {
    Add(scope + "/weights", {in, out});
    Add(scope + "/biases", {out});
  }
  ModelSpec Take() { return std::move(spec_); }

 private:
  ModelSpec spec_;
};

ModelSpec Vgg16() {
  Builder b("vgg16");
  int64_t in = 3;
  const std::pair<int64_t, int> blocks[] = {{64, 2}, {128, 2}, {256, 3}, {512, 3}, {512, 3}};
  for (int blk = 0; blk < 5; ++blk) {
    for (int i = 0; i < blocks[blk].second; ++i) {
      b.ConvBias(absl::StrCat("vgg_16/conv", blk + 1, "/conv", blk + 1, "_", i + 1), 3, 3, in,
                 blocks[blk].first);
      in = blocks[blk].first;
    }
  }
  b.Dense("vgg_16/fc6", 7 * 7 * 512, 4096);
  b.Dense("vgg_16/fc7", 4096, 4096);
  b.Dense("vgg_16/fc8", 4096, 1000);
  return b.Take();
}

ModelSpec Resnet50() {
  Builder b("resnet50");
  b.ConvBn("resnet_v1_50/conv1", 7, 7, 3, 64, /*scale=*/true);
  int64_t in = 64;
  const std::pair<int64_t, int> stages[] = {{64, 3}, {128, 4}, {256, 6}, {512, 3}};
  for (int s = 0; s < 4; ++s) {
    const int64_t width = stages[s].first, out = 4 * width;
    for (int u = 0; u < stages[s].second; ++u) {
      const std::string unit =
          absl::StrCat("resnet_v1_50/block", s + 1, "/unit_", u + 1, "/bottleneck_v1");
      if (u == 0) b.ConvBn(unit + "/shortcut", 1, 1, in, out, true);
      b.ConvBn(unit + "/conv1", 1, 1, in, width, true);
      b.ConvBn(unit + "/conv2", 3, 3, width, width, true);
      b.ConvBn(unit + "/conv3", 1, 1, width, out, true);
      in = out;
    }
  }
  b.Dense("resnet_v1_50/logits", 2048, 1000);
  return b.Take();
}

ModelSpec Inception3() {
  Builder b("inception3");
  auto conv = [&b](const std::string& scope, int64_t kh, int64_t kw, int64_t in, int64_t out) {
    b.ConvBn("InceptionV3/" + scope, kh, kw, in, out, /*scale=*/false);
  };
  conv("Conv2d_1a_3x3", 3, 3, 3, 32);
  conv("Conv2d_2a_3x3", 3, 3, 32, 32);
  conv("Conv2d_2b_3x3", 3, 3, 32, 64);
  conv("Conv2d_3b_1x1", 1, 1, 64, 80);
  conv("Conv2d_4a_3x3", 3, 3, 80, 192);
  auto mixed5 = [&conv](const std::string& m, int64_t in, int64_t pool_proj) {
    conv(m + "/Branch_0/Conv2d_0a_1x1", 1, 1, in, 64);
    conv(m + "/Branch_1/Conv2d_0a_1x1", 1, 1, in, 48);
    conv(m + "/Branch_1/Conv2d_0b_5x5", 5, 5, 48, 64);
    conv(m + "/Branch_2/Conv2d_0a_1x1", 1, 1, in, 64);
    conv(m + "/Branch_2/Conv2d_0b_3x3", 3, 3, 64, 96);
    conv(m + "/Branch_2/Conv2d_0c_3x3", 3, 3, 96, 96);
    conv(m + "/Branch_3/Conv2d_0b_1x1", 1, 1, in, pool_proj);
  };
  mixed5("Mixed_5b", 192, 32);
  mixed5("Mixed_5c", 256, 64);
  mixed5("Mixed_5d", 288, 64);
  conv("Mixed_6a/Branch_0/Conv2d_1a_1x1", 3, 3, 288, 384);
  conv("Mixed_6a/Branch_1/Conv2d_0a_1x1", 1, 1, 288, 64);
  conv("Mixed_6a/Branch_1/Conv2d_0b_3x3", 3, 3, 64, 96);
  conv("Mixed_6a/Branch_1/Conv2d_1a_1x1", 3, 3, 96, 96);
  auto mixed6 = [&conv](const std::string& m, int64_t c) {
    conv(m + "/Branch_0/Conv2d_0a_1x1", 1, 1, 768, 192);
    conv(m + "/Branch_1/Conv2d_0a_1x1", 1, 1, 768, c);
    conv(m + "/Branch_1/Conv2d_0b_1x7", 1, 7, c, c);
    conv(m + "/Branch_1/Conv2d_0c_7x1", 7, 1, c, 192);
    conv(m + "/Branch_2/Conv2d_0a_1x1", 1, 1, 768, c);
    conv(m + "/Branch_2/Conv2d_0b_7x1", 7, 1, c, c);
    conv(m + "/Branch_2/Conv2d_0c_1x7", 1, 7, c, c);
    conv(m + "/Branch_2/Conv2d_0d_7x1", 7, 1, c, c);
    conv(m + "/Branch_2/Conv2d_0e_1x7", 1, 7, c, 192);
    conv(m + "/Branch_3/Conv2d_0b_1x1", 1, 1, 768, 192);
  };
  mixed6("Mixed_6b", 128);
  mixed6("Mixed_6c", 160);
  mixed6("Mixed_6d", 160);
  mixed6("Mixed_6e", 192);
  conv("AuxLogits/Conv2d_1b_1x1", 1, 1, 768, 128);
  conv("AuxLogits/Conv2d_2a_5x5", 5, 5, 128, 768);
  b.ConvBias("InceptionV3/AuxLogits/Conv2d_2b_1x1", 1, 1, 768, 1000);
  conv("Mixed_7a/Branch_0/Conv2d_0a_1x1", 1, 1, 768, 192);
  conv("Mixed_7a/Branch_0/Conv2d_1a_3x3", 3, 3, 192, 320);
  conv("Mixed_7a/Branch_1/Conv2d_0a_1x1", 1, 1, 768, 192);
  conv("Mixed_7a/Branch_1/Conv2d_0b_1x7", 1, 7, 192, 192);
  conv("Mixed_7a/Branch_1/Conv2d_0c_7x1", 7, 1, 192, 192);
  conv("Mixed_7a/Branch_1/Conv2d_1a_3x3", 3, 3, 192, 192);
  auto mixed7 = [&conv](const std::string& m, int64_t in) {
    conv(m + "/Branch_0/Conv2d_0a_1x1", 1, 1, in, 320);
    conv(m + "/Branch_1/Conv2d_0a_1x1", 1, 1, in, 384);
    conv(m + "/Branch_1/Conv2d_0b_1x3", 1, 3, 384, 384);
    conv(m + "/Branch_1/Conv2d_0b_3x1", 3, 1, 384, 384);
    conv(m + "/Branch_2/Conv2d_0a_1x1", 1, 1, in, 448);
    conv(m + "/Branch_2/Conv2d_0b_3x3", 3, 3, 448, 384);
    conv(m + "/Branch_2/Conv2d_0c_1x3", 1, 3, 384, 384);
    conv(m + "/Branch_2/Conv2d_0d_3x1", 3, 1, 384, 384);
    conv(m + "/Branch_3/Conv2d_0b_1x1", 1, 1, in, 192);
  };
  mixed7("Mixed_7b", 1280);
  mixed7("Mixed_7c", 2048);
  b.ConvBias("InceptionV3/Logits/Conv2d_1c_1x1", 1, 1, 2048, 1000);
  return b.Take();
}

}  // namespace

int64_t ModelVariable::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t ModelSpec::parameters() const {
  int64_t n = 0;
  for (const ModelVariable& v : variables) n += v.elements();
  return n;
}

int64_t ModelSpec::bytes() const { return parameters() * 4; }

std::vector<std::string> ModelNames() { return {"vgg16", "resnet50", "inception3"}; }

absl::StatusOr<ModelSpec> GetModel(const std::string& name) {
  if (name == "vgg16") return Vgg16();
  if (name == "resnet50") return Resnet50();
  if (name == "inception3") return Inception3();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model '", name, "'; known: ", absl::StrJoin(ModelNames(), ", ")));
}

}  // namespace tensorverbs::tools
