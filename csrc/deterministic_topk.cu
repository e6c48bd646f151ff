// PyTorch binding of glm5::deterministic_topk_kernel (see deterministic_topk.cuh).
//
// The caller (glm5_core.backends.cuda.ext) passes the current CUDA stream as an integer and has made the
// scores' device current, so this file needs no c10/cuda headers and compiles against any torch build.
#include <cuda_runtime.h>
#include <torch/extension.h>

#include "deterministic_topk.cuh"

namespace {

// scores: fp32 [R, S] on the current CUDA device (last dim contiguous, no NaN); returns int32 [R, k], k <= S.
torch::Tensor deterministic_topk(torch::Tensor scores, int64_t k, int64_t stream_handle) {
  TORCH_CHECK(scores.is_cuda(), "scores: expected a CUDA tensor, got device ", scores.device());
  TORCH_CHECK(scores.dim() == 2, "scores: expected rank 2 [R, S], got shape ", scores.sizes());
  TORCH_CHECK(scores.scalar_type() == torch::kFloat32, "scores: expected float32, got ", scores.scalar_type());
  TORCH_CHECK(scores.stride(1) == 1, "scores: expected a contiguous last dim");
  TORCH_CHECK(k >= 1 && k <= scores.size(1) && k <= glm5::kTopkMaxK,
              "k: expected 1 <= k <= min(S, ", glm5::kTopkMaxK, ") with S=", scores.size(1), ", got ", k);
  TORCH_CHECK(scores.size(1) < (int64_t{1} << 31), "scores: expected fewer than 2^31 columns");
  auto out = torch::empty({scores.size(0), k}, scores.options().dtype(torch::kInt32));
  if (scores.size(0) == 0) return out;
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  glm5::deterministic_topk_kernel<<<static_cast<unsigned>(scores.size(0)), glm5::kTopkThreads, 0, stream>>>(
      scores.data_ptr<float>(), scores.size(1), scores.stride(0), static_cast<int>(k), out.data_ptr<int32_t>());
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, "deterministic_topk launch failed: ", cudaGetErrorString(status));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("deterministic_topk", &deterministic_topk,
        "Row-wise top-k of fp32 scores [R, S]: int32 [R, k], score descending, ties to the lower index");
}
