// The demo's model: a two-layer perceptron (ReLU hidden layer, softmax cross-entropy) trained
// on synthetic data labelled by a fixed random "teacher", with hand-written gradients.
//
// The parameter server owns the weights; each worker draws its own batches (seeded by worker and
// step, so runs are reproducible), computes the loss and the gradients for the weights it was
// sent, and sends them back. Pure functions over Tensors; any thread.
#ifndef TENSORVERBS_TOOLS_DEMO_MODEL_H_
#define TENSORVERBS_TOOLS_DEMO_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tensorverbs/tensor.h"

namespace tensorverbs::demo {

struct ModelShape {
  int inputs = 64;
  int hidden = 256;
  int classes = 10;
  int batch = 64;
};

// Parameter names in a fixed order: W1, b1, W2, b2.
const std::vector<std::string>& ParameterNames();

// Fresh parameters (He-style init), deterministic for `seed`.
std::vector<Tensor> InitParameters(const ModelShape& shape, uint64_t seed);

struct Batch {
  Tensor x;                 // float32 [batch, inputs]
  std::vector<int> labels;  // batch entries in [0, classes)
};

// A batch for (worker, step), labelled by the teacher fixed for the whole run.
Batch MakeBatch(const ModelShape& shape, int worker, int64_t step);

// Mean cross-entropy of `params` on `batch`; fills `grads` (same shapes as params) when non-null.
float LossAndGradients(const ModelShape& shape, const std::vector<Tensor>& params,
                       const Batch& batch, std::vector<Tensor>* grads);

// params -= learning_rate * mean(grads over workers).
void ApplyMeanGradients(const std::vector<std::vector<Tensor>>& worker_grads,
                        float learning_rate, std::vector<Tensor>* params);

}  // namespace tensorverbs::demo

#endif  // TENSORVERBS_TOOLS_DEMO_MODEL_H_
