#include "tools/demo_model.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "src/common/logging.h"

namespace tensorverbs::demo {
namespace {

constexpr uint64_t kTeacherSeed = 0x7e4c4e5ULL;

Tensor Zeros(const TensorShape& shape) {
  Tensor t = Tensor::Make(DataType::kFloat32, shape);
  std::fill_n(t.flat<float>(), t.NumElements(), 0.0f);
  return t;
}

Tensor Normal(const TensorShape& shape, float stddev, std::mt19937_64& rng) {
  Tensor t = Tensor::Make(DataType::kFloat32, shape);
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i = 0; i < t.NumElements(); ++i) t.flat<float>()[i] = dist(rng);
  return t;
}

}  // namespace

const std::vector<std::string>& ParameterNames() {
  static const std::vector<std::string> names = {"W1", "b1", "W2", "b2"};
  return names;
}

std::vector<Tensor> InitParameters(const ModelShape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return {
      Normal(TensorShape::Of({s.inputs, s.hidden}), std::sqrt(2.0f / s.inputs), rng),
      Zeros(TensorShape::Of({s.hidden})),
      Normal(TensorShape::Of({s.hidden, s.classes}), std::sqrt(1.0f / s.hidden), rng),
      Zeros(TensorShape::Of({s.classes})),
  };
}

Batch MakeBatch(const ModelShape& s, int worker, int64_t step) {
  // The teacher is the same for every worker and step.
  std::mt19937_64 teacher_rng(kTeacherSeed);
  std::normal_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> teacher(static_cast<size_t>(s.inputs) * s.classes);
  for (float& v : teacher) v = unit(teacher_rng);

  std::mt19937_64 rng(0x9e3779b97f4a7c15ULL * (worker + 1) + static_cast<uint64_t>(step));
  Batch b;
  b.x = Tensor::Make(DataType::kFloat32, TensorShape::Of({s.batch, s.inputs}));
  float* x = b.x.flat<float>();
  for (int64_t i = 0; i < b.x.NumElements(); ++i) x[i] = unit(rng);
  b.labels.resize(s.batch);
  for (int n = 0; n < s.batch; ++n) {
    int best = 0;
    float best_score = -1e30f;
    for (int c = 0; c < s.classes; ++c) {
      float score = 0;
      for (int i = 0; i < s.inputs; ++i) score += x[n * s.inputs + i] * teacher[i * s.classes + c];
      if (score > best_score) {
        best_score = score;
        best = c;
      }
    }
    b.labels[n] = best;
  }
  return b;
}

float LossAndGradients(const ModelShape& s, const std::vector<Tensor>& params, const Batch& batch,
                       std::vector<Tensor>* grads) {
  CHECK(params.size() == 4);
  const float* w1 = params[0].flat<float>();
  const float* b1 = params[1].flat<float>();
  const float* w2 = params[2].flat<float>();
  const float* b2 = params[3].flat<float>();
  const float* x = batch.x.flat<float>();
  const int B = s.batch, I = s.inputs, H = s.hidden, C = s.classes;

  std::vector<float> h(static_cast<size_t>(B) * H);
  for (int n = 0; n < B; ++n) {
    for (int j = 0; j < H; ++j) {
      float a = b1[j];
      for (int i = 0; i < I; ++i) a += x[n * I + i] * w1[i * H + j];
      h[n * H + j] = a > 0 ? a : 0;
    }
  }
  std::vector<float> dlogits(static_cast<size_t>(B) * C);
  double loss = 0;
  for (int n = 0; n < B; ++n) {
    float logits[256];
    CHECK(C <= 256);
    float max_logit = -1e30f;
    for (int c = 0; c < C; ++c) {
      float a = b2[c];
      for (int j = 0; j < H; ++j) a += h[n * H + j] * w2[j * C + c];
      logits[c] = a;
      max_logit = std::max(max_logit, a);
    }
    double sum = 0;
    for (int c = 0; c < C; ++c) sum += std::exp(logits[c] - max_logit);
    const int label = batch.labels[n];
    loss += -(logits[label] - max_logit - std::log(sum));
    for (int c = 0; c < C; ++c) {
      double p = std::exp(logits[c] - max_logit) / sum;
      dlogits[n * C + c] = static_cast<float>((p - (c == label ? 1.0 : 0.0)) / B);
    }
  }
  if (grads == nullptr) return static_cast<float>(loss / B);

  grads->clear();
  for (const Tensor& p : params) grads->push_back(Zeros(p.shape()));
  float* gw1 = (*grads)[0].flat<float>();
  float* gb1 = (*grads)[1].flat<float>();
  float* gw2 = (*grads)[2].flat<float>();
  float* gb2 = (*grads)[3].flat<float>();
  std::vector<float> dh(static_cast<size_t>(H));
  for (int n = 0; n < B; ++n) {
    for (int c = 0; c < C; ++c) {
      const float d = dlogits[n * C + c];
      gb2[c] += d;
      for (int j = 0; j < H; ++j) gw2[j * C + c] += h[n * H + j] * d;
    }
    for (int j = 0; j < H; ++j) {
      float a = 0;
      if (h[n * H + j] > 0) {
        for (int c = 0; c < C; ++c) a += dlogits[n * C + c] * w2[j * C + c];
      }
      dh[j] = a;
      gb1[j] += a;
    }
    for (int i = 0; i < I; ++i) {
      const float xv = x[n * I + i];
      for (int j = 0; j < H; ++j) gw1[i * H + j] += xv * dh[j];
    }
  }
  return static_cast<float>(loss / B);
}

void ApplyMeanGradients(const std::vector<std::vector<Tensor>>& worker_grads,
                        float learning_rate, std::vector<Tensor>* params) {
  const float scale = learning_rate / static_cast<float>(worker_grads.size());
  for (size_t p = 0; p < params->size(); ++p) {
    float* w = (*params)[p].flat<float>();
    for (const auto& grads : worker_grads) {
      const float* g = grads[p].flat<float>();
      for (int64_t i = 0; i < (*params)[p].NumElements(); ++i) w[i] -= scale * g[i];
    }
  }
}

}  // namespace tensorverbs::demo
