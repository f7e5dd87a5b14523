// The CUDA runtime loader without a GPU: error mapping, a library that is not there, and what
// this host offers (on a machine with a GPU, the `gpu` tests go further).
#include "src/device/cuda_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tensorverbs::device {
namespace {

using ::testing::HasSubstr;

TEST(CudaErrorStatus, OutOfMemoryIsResourceExhaustedNamingCallDeviceAndKey) {
  absl::Status s = CudaErrorStatus(2, "cudaErrorMemoryAllocation", "out of memory",
                                   "cudaMalloc(1073741824)", 1, "w/grad");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("cudaMalloc(1073741824) on cuda:1 for 'w/grad'"));
  EXPECT_THAT(s.message(), HasSubstr("out of memory (cudaErrorMemoryAllocation)"));
}

TEST(CudaErrorStatus, NoDriverOrDeviceIsAFailedPreconditionPointingAtInfo) {
  for (int code : {35, 100}) {
    absl::Status s = CudaErrorStatus(code, "cudaErrorX", "no", "cudaGetDeviceCount", -1, "");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("tensorverbs info"));
    EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("cuda:")));
  }
}

TEST(CudaErrorStatus, ABadOrdinalIsInvalidArgumentAndOthersAreInternal) {
  EXPECT_EQ(CudaErrorStatus(101, "cudaErrorInvalidDevice", "invalid device ordinal",
                            "cudaSetDevice", 7, "")
                .code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status s = CudaErrorStatus(999, "", "unknown error", "cudaMemcpy", 0, "k");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("(error 999)"));
}

TEST(CudaRuntime, NoLibraryIsUnavailableNamingWhatWasTriedAndTheVariable) {
  absl::StatusOr<std::unique_ptr<CudaRuntime>> rt =
      CudaRuntime::Load({"libcudart-not-here.so.99", "/nonexistent/libcudart.so"});
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(rt.status().message(), HasSubstr("libcudart-not-here.so.99"));
  EXPECT_THAT(rt.status().message(), HasSubstr("/nonexistent/libcudart.so"));
  EXPECT_THAT(rt.status().message(), HasSubstr("TENSORVERBS_CUDA_RUNTIME"));
}

TEST(CudaRuntime, ALibraryThatIsNotTheRuntimeIsRefusedByItsMissingEntryPoints) {
  absl::StatusOr<std::unique_ptr<CudaRuntime>> rt = CudaRuntime::Load({"libz.so.1"});
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(rt.status().message(), HasSubstr("lacks cudaGetDeviceCount"));
}

// Whatever this host has, Get answers the same every time: a runtime with GPUs, or why not.
TEST(CudaRuntime, GetAnswersOnceEitherWithGpusOrWithTheReason) {
  absl::StatusOr<CudaRuntime*> first = CudaRuntime::Get();
  absl::StatusOr<CudaRuntime*> again = CudaRuntime::Get();
  EXPECT_EQ(first.ok(), again.ok());
  if (first.ok()) {
    EXPECT_EQ(*first, *again);
    EXPECT_GT((*first)->device_count(), 0);
    EXPECT_GT((*first)->runtime_version(), 0);
  } else {
    EXPECT_EQ(first.status(), again.status());
    EXPECT_TRUE(first.status().code() == absl::StatusCode::kUnavailable ||
                first.status().code() == absl::StatusCode::kFailedPrecondition)
        << first.status();
    EXPECT_FALSE(first.status().message().empty());
  }
}

}  // namespace
}  // namespace tensorverbs::device
