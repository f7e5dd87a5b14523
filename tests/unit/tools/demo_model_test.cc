#include "tools/demo_model.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tensorverbs::demo {
namespace {

TEST(DemoModel, AnalyticGradientsMatchFiniteDifferences) {
  ModelShape shape{.inputs = 6, .hidden = 5, .classes = 3, .batch = 4};
  std::vector<Tensor> params = InitParameters(shape, 1);
  Batch batch = MakeBatch(shape, 0, 0);
  std::vector<Tensor> grads;
  LossAndGradients(shape, params, batch, &grads);
  ASSERT_EQ(grads.size(), 4u);
  const float eps = 1e-3f;
  int checked = 0;
  for (size_t p = 0; p < params.size(); ++p) {
    for (int64_t i = 0; i < params[p].NumElements(); ++i) {
      float& w = params[p].flat<float>()[i];
      const float saved = w;
      w = saved + eps;
      float up = LossAndGradients(shape, params, batch, nullptr);
      w = saved - eps;
      float down = LossAndGradients(shape, params, batch, nullptr);
      w = saved;
      float numeric = (up - down) / (2 * eps);
      EXPECT_NEAR(grads[p].flat<float>()[i], numeric, 2e-3) << "param " << p << " index " << i;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6 * 5 + 5 + 5 * 3 + 3);
}

TEST(DemoModel, TrainingLowersTheLoss) {
  ModelShape shape;
  std::vector<Tensor> params = InitParameters(shape, 42);
  float first = 0, last = 0;
  for (int step = 0; step < 15; ++step) {
    std::vector<std::vector<Tensor>> all(2);
    float loss = 0;
    for (int w = 0; w < 2; ++w) loss += LossAndGradients(shape, params, MakeBatch(shape, w, step), &all[w]) / 2;
    ApplyMeanGradients(all, 0.2f, &params);
    if (step == 0) first = loss;
    last = loss;
  }
  EXPECT_LT(last, first * 0.8f);
}

TEST(DemoModel, BatchesAreDeterministicPerWorkerAndStep) {
  ModelShape shape;
  Batch a = MakeBatch(shape, 1, 3), b = MakeBatch(shape, 1, 3), c = MakeBatch(shape, 2, 3);
  EXPECT_TRUE(a.x.ContentEquals(b.x));
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_FALSE(a.x.ContentEquals(c.x));
}

}  // namespace
}  // namespace tensorverbs::demo
