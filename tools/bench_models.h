// The trainable variables of the models the seeds benchmarked (VGG16, ResNet-50, Inception v3,
// ImageNet with 1000 classes), with their real shapes, for `tensorverbs bench ps`: what a
// parameter server sends each worker every step (weights) and receives back (gradients).
//
// The shapes follow the published architectures in TF-slim's layout: convolution kernels as
// [h, w, in, out]; VGG16 convolutions and all fully connected layers have biases; ResNet-50
// (v1) convolutions have none and are each followed by batch norm (gamma, beta); Inception v3
// convolutions are followed by batch norm without scale (beta only), as TF-slim builds it, and
// the auxiliary head is included (it is trained). Pure functions.
#ifndef TENSORVERBS_TOOLS_BENCH_MODELS_H_
#define TENSORVERBS_TOOLS_BENCH_MODELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tensorverbs::tools {

struct ModelVariable {
  std::string name;
  std::vector<int64_t> shape;
  int64_t elements() const;
};

struct ModelSpec {
  std::string name;
  std::vector<ModelVariable> variables;  // in creation order (TF's round-robin ps placement)
  int64_t parameters() const;
  int64_t bytes() const;  // float32
};

// "vgg16", "resnet50", "inception3".
absl::StatusOr<ModelSpec> GetModel(const std::string& name);
std::vector<std::string> ModelNames();

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_BENCH_MODELS_H_
